"""Per-rank progress files: what each process of a ``dtx launch`` job last got through, so the
launcher can name the rank that stopped first without parsing any log.

Each rank rewrites ``<dir>/progress_<rank>.json`` (``{"phase", "step", "time"}`` and the run's
``watchdog_seconds`` and ``startup_seconds``, which bound the launcher's own wait) at every start-up
phase, every completed step, and every second of a pause between steps (an evaluation, the last
save); the directory comes from ``DTX_PROGRESS_DIR``, which ``dtx launch`` sets (``WORKDIR/logs``).
Outside a launch nothing is written.
"""

from __future__ import annotations

import json
import os
import time

ENV_DIR = "DTX_PROGRESS_DIR"
# In the order a rank goes through them; "spawned" is the launcher's own mark (no file yet).
PHASES = ("spawned", "started", "initialized", "compiled", "training")


class Progress:
    """Writes this rank's progress file (a no-op when ``directory`` is empty)."""

    def __init__(self, directory: str | None, rank: int, limits: dict | None = None):
        self.path = os.path.join(directory, f"progress_{rank}.json") if directory else None
        self.limits = dict(limits or {})  # the run's own bounds (watchdog_seconds, startup_seconds): the launcher's
        self.step = self.dispatched = 0  # the last marked

    @classmethod
    def from_env(cls, rank: int, limits: dict | None = None) -> Progress:
        return cls(os.environ.get(ENV_DIR), rank, limits)

    def mark(self, phase: str, step: int = 0, dispatched: int | None = None) -> None:
        """Record ``phase`` (one of :data:`PHASES`), ``step``, the steps completed so far, and ``dispatched``, the
        steps handed to the devices (default ``step``): of two ranks that completed as many steps, the one that
        dispatched fewer is the one the other waits for in a collective."""
        if self.path is None:
            return
        self.step, self.dispatched = int(step), max(int(step), self.dispatched if dispatched is None else int(dispatched))
        # Written aside, then renamed: the launcher never reads half a file.
        partial = self.path + ".tmp"
        with open(partial, "w") as f:
            json.dump({"phase": phase, "step": int(step), "dispatched": self.dispatched, "time": time.time(),
                       **self.limits}, f)
        os.replace(partial, self.path)


def read(directory: str, rank: int, spawned_at: float) -> dict:
    """Rank ``rank``'s last progress; ``{"phase": "spawned", ...}`` before it wrote any."""
    try:
        with open(os.path.join(directory, f"progress_{rank}.json")) as f:
            record = json.load(f)
        if record.get("phase") in PHASES:
            return record
    except (OSError, ValueError):
        pass
    return {"phase": "spawned", "step": 0, "time": spawned_at}


def behind(records: dict[int, dict]) -> list[int]:
    """Ranks ordered from the one that got least far (phase, then steps completed, then steps dispatched) and,
    at a tie, stopped advancing earliest: the first is the rank that stopped making progress first."""
    return sorted(records, key=lambda r: (PHASES.index(records[r]["phase"]), records[r]["step"],
                                          records[r].get("dispatched", records[r]["step"]), records[r]["time"]))


def describe(record: dict) -> str:
    """``step 12`` once training, else ``no step (initialized)``: the start-up phase it reached."""
    if record["phase"] == "training":
        return f"step {record['step']}"
    return f"no step ({record['phase']})"


def stall_bound(record: dict, margin: float) -> float | None:
    """Seconds a rank at ``record`` may go without a new mark before the launcher calls it stalled (``None``:
    unbounded, the run turned its watchdog off). Training: ``watchdog_seconds`` -- every step and every second
    of a pause renews the mark, and the rank's own watchdog fires first when a peer holds it up. Start-up
    (joining, loading, restoring, compiling): ``startup_seconds`` + ``watchdog_seconds``. Plus ``margin``.
    Before a rank's first file the defaults (300 s each) apply."""
    watchdog = float(record.get("watchdog_seconds", 300.0))
    startup = float(record.get("startup_seconds", 300.0))
    if watchdog <= 0:
        return None
    return (watchdog if record["phase"] == "training" else startup + watchdog) + margin
