"""The Weights & Biases sink: a run's records and config in one wandb run, across preemptions.

``--config.wandb.project=NAME`` (``pip install 'dtx[wandb]'``) makes :class:`dtx.run.metrics.MetricWriter`
hand every record it writes to metrics.jsonl to :class:`WandbSink` as well: the same keys, at dtx's step
(``run.log(record, step=step)``), and the config dtx writes as config.json as the wandb run's config. Only the
process that writes the records (process 0 of a multi-process job) opens a wandb run.

**Resume.** The wandb run's id and the last step logged to it are kept in ``WORKDIR/wandb_run.json``; a
resumed dtx run (after SIGTERM, or a crash) continues that wandb run (``wandb.init(id=..., resume="allow")``).
wandb's steps only go forward: online, a record at a step the run has passed is dropped with a warning
(offline, where the earlier attempt is unknown to wandb, nothing would stop it). So the sink logs nothing at
or below the last logged step of an earlier attempt:

- a preempted run saves its checkpoint at the step it stopped, which is also its last record: the resumed
  run's first record (``resumed_from``, at that step) is the only one left out;
- a run resumed from a checkpoint older than its last record (a killed process, ``checkpoint.resume_step``)
  redoes steps wandb already holds: those records stay in metrics.jsonl (and the first attempt's in
  metrics.superseded.jsonl), but wandb keeps the first attempt's values up to that step and gets the
  resumed run's from the next one on; a note on stderr names the range. wandb's own way to erase them,
  ``resume_from="ID?_step=N"`` ("rewind"), needs the server to have it enabled, so dtx does not use it.

A stored run in another project or entity is not continued: the run starts a new wandb run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping

from dtx.config import ConfigError, register_check

STATE_FILE = "wandb_run.json"  # {"id", "project", "entity", "last_step"}: what a resume continues
MODES = ("", "online", "offline", "disabled")
INSTALL = "pip install 'dtx[wandb]'"


def available() -> bool:
    """Whether ``import wandb`` can find the package (without importing it: that takes a second)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):  # a stub in sys.modules without a spec
        return False


def _missing(project: str) -> str:
    return (f"wandb.project={project!r} logs to Weights & Biases, but the wandb package is not installed; "
            f"install it ({INSTALL}) or turn the sink off (--config.wandb.project='')")


@register_check
def check_wandb(config) -> None:
    """``wandb.mode`` is known, and the package is there when ``wandb.project`` asks for it: refused at
    load time, before anything is compiled."""
    if "wandb" not in config:
        return
    block = config.wandb
    mode = block.get("mode", "")
    if mode not in MODES:
        raise ConfigError(f"wandb.mode={mode!r} is unknown; choose one of {list(MODES)} "
                          "(''/unset: wandb's default, or $WANDB_MODE), e.g. --config.wandb.mode=offline")
    project = block.get("project", "")
    if project and not available():
        raise ConfigError(_missing(project))


def _import_wandb(project: str):
    try:
        import wandb
    except ImportError as e:  # installed but broken, or hidden: the same fix
        raise ConfigError(f"{_missing(project)} ({e})") from None
    return wandb


def read_state(workdir: str | os.PathLike) -> dict:
    """The stored wandb run of ``workdir`` (``{}``: none)."""
    try:
        with open(os.path.join(os.fspath(workdir), STATE_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):  # none yet, or torn by a killed process: a new wandb run
        return {}


class WandbSink:
    """One wandb run fed by :class:`dtx.run.metrics.MetricWriter` (see the module docstring).

    Args:
      workdir: the dtx run's directory (holds :data:`STATE_FILE`; wandb's files go to ``WORKDIR/wandb``
        unless ``$WANDB_DIR`` says otherwise).
      settings: the config's ``wandb`` block (``project``, ``entity``, ``name``, ``mode``).
      run_config: what the wandb run's config shows (dtx passes the dict of config.json).
      resumed_from: the checkpoint step a resumed run starts from (``None``: a new run, a new wandb run).
    """

    def __init__(self, workdir: str | os.PathLike, settings: Mapping, run_config: Mapping | None = None,
                 resumed_from: int | None = None):
        project, entity = settings["project"], settings.get("entity", "")
        wandb = _import_wandb(project)
        self.workdir = os.fspath(workdir)
        stored = read_state(self.workdir) if resumed_from is not None else {}
        if stored and (stored.get("project"), stored.get("entity")) != (project, entity):
            print(f"dtx: wandb.project/entity changed ({stored.get('project')!r}/{stored.get('entity')!r} -> "
                  f"{project!r}/{entity!r}); starting a new wandb run", file=sys.stderr)
            stored = {}
        self.last_step = int(stored.get("last_step", -1))  # an earlier attempt's last logged step
        self.skipped = 0  # records left out (at or below a step wandb has passed)
        self._open_step = None  # the step of this attempt's row still open (equal steps join it)
        self.run = wandb.init(
            project=project, entity=entity or None, name=settings.get("name") or os.path.basename(
                os.path.abspath(self.workdir)), mode=settings.get("mode") or None,
            dir=None if os.environ.get("WANDB_DIR") else self.workdir,
            id=stored.get("id"), resume="allow", config=dict(run_config or {}),
            reinit="create_new")  # beside, never instead of, a wandb run the caller has open
        self.persist = not self.run.disabled  # a disabled run has nothing to continue
        self._state = {"id": self.run.id, "project": project, "entity": entity, "last_step": self.last_step}
        self._save()
        if resumed_from is not None and self.last_step > resumed_from:
            print(f"dtx: wandb run {self.run.id} already holds steps up to {self.last_step}; this run resumes from "
                  f"step {resumed_from}, so wandb keeps the earlier values of steps {resumed_from + 1}.."
                  f"{self.last_step} (metrics.jsonl has the resumed run's) and logs from step "
                  f"{self.last_step + 1} on", file=sys.stderr)

    def write(self, step: int, record: Mapping) -> bool:
        """Log ``record`` (a metrics.jsonl line: ``step`` and values) at ``step``; ``False``: left out
        because wandb has passed that step."""
        step = int(step)
        if step <= self.last_step and step != self._open_step:
            self.skipped += 1
            return False
        self.run.log({k: _value(v) for k, v in record.items() if k != "step"}, step=step)
        if step != self._open_step:
            self._open_step = self.last_step = step
            self._state["last_step"] = step
            self._save()
        return True

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def _save(self) -> None:
        if not self.persist:
            return
        path = os.path.join(self.workdir, STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self._state, f)
        os.replace(path + ".tmp", path)  # a kill never leaves half a file


def _value(value):
    """metrics.jsonl's value as wandb takes it: non-finite numbers back from the strings JSON needed
    (so charts show them); numbers, strings and lists as they are (wandb keeps lists as JSON)."""
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value
