"""Pipeline schedules as tables: which micro-batch each stage runs forward and backward at each tick.

All stages run in lock step (one SPMD program): a **tick** has a forward slot and a backward slot, each
followed by one ``ppermute`` — activations to the next stage after the forward slot, their gradients to
the previous stage after the backward slot. A schedule is a run of **phases**, each a loop of ticks
with only the slots some stage uses in it, so the compiled program runs a slot's ``ppermute`` exactly
as many times as the phase has ticks (:mod:`dtx.comm.hlo` reads the trip counts):

* ``gpipe`` (Huang et al. 2019, arXiv 1811.06965, §2.3): every micro-batch forward, then every one
  backward. Two phases of ``M + P - 1`` ticks; stage ``s`` runs micro-batch ``m`` forward at tick
  ``s + m`` and backward at tick ``(M + P - 1) + (P - 1 - s) + m``. It keeps all ``M`` micro-batches'
  stage inputs.
* ``1f1b`` (PipeDream-Flush: Narayanan et al. 2021, arXiv 2006.09503, §3; the Megatron-LM schedule of
  Narayanan et al. 2021, arXiv 2104.04473, §2.2.1): a micro-batch goes backward as soon as the last stage
  has run it forward — stage ``s`` runs ``m`` forward at tick ``s + m`` and backward at ``2(P-1) - s + m``
  (the last stage both in one tick) — so in the steady phase every stage alternates one forward and one
  backward. Three phases: ``P - 1`` ticks forward only, ``M`` ticks both, ``P - 1`` backward only.
  Stage ``s`` holds at most ``2(P - s) - 1`` micro-batches' inputs at once (never more than ``M``): it
  grows with ``P``, not ``M``. (In the paper's timing a forward and a backward are separate time units and
  the bound is ``P - s``; here they share a tick, so the round trip takes ``2(P - s) - 1`` ticks.)

* ``interleaved`` (Narayanan et al. 2021, arXiv 2104.04473, §2.2.2): each device holds ``V`` chunks of
  layers (virtual stages ``c·P + s``, ``pipeline.virtual_stages``), and a micro-batch goes round the ring of
  devices ``V`` times. Here in GPipe's order (every forward, then every backward; the paper interleaves
  1F1B): in forward tick ``t`` device ``s`` runs ``i = t - s``, chunk ``(i // P) mod V`` of micro-batch
  ``(i // PV)·P + i mod P`` — groups of ``P`` micro-batches, so ``M`` must divide by ``P``. A slot's table
  entry is ``c·M + m``. Each tick does ``1/V`` of a stage's work, and the bubble shrinks to
  ``(P - 1) / (VM + P - 1)``; the device keeps ``V·M`` (smaller) inputs and sends ``V`` times the messages.

Both run the forward slots on ``M + P - 1`` ticks and the backward slots on ``M + P - 1`` ticks, of which
each stage is busy on ``M``: the bubble is ``(P - 1) / (M + P - 1)`` of the step (GPipe §2.3), the same
for both; 1F1B saves memory, not time. A slot's ``ppermute`` runs on every tick of its phase where some
stage with a neighbour to send to is at work — all but the last forward and the last backward tick — so a
stage sends ``2 (M + P - 2)`` messages per step: the ``2M`` that carry its activations and gradients
(``2M - 2`` on the first and last stage, which send one way only), and ``2(P - 2)`` bubble messages of
zeros that lock-step SPMD cannot leave out. With two stages that is exactly ``2M``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

IDLE = -1  # no micro-batch in this slot


class ScheduleError(ValueError):
    """An unknown schedule, or a pipeline it cannot run."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """A loop of ticks: ``forward[t, s]`` / ``backward[t, s]`` is the micro-batch stage ``s`` runs in that slot
    at the phase's tick ``t`` (``IDLE``: none); ``None``: the phase has no such slot. ``send_forward`` /
    ``send_backward``: whether the slot ends in its ``ppermute`` — not where the only stages at work have no
    neighbour to send to (the last stage forward, the first backward)."""

    forward: np.ndarray | None
    backward: np.ndarray | None
    send_forward: bool = False
    send_backward: bool = False

    @property
    def ticks(self) -> int:
        return len(self.forward if self.forward is not None else self.backward)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule's phases for ``stages`` stages and ``micro`` micro-batches."""

    name: str
    stages: int
    micro: int
    phases: tuple[Phase, ...]
    chunks: int = 1  # V: the layer chunks (virtual stages) per device; an entry is chunk·micro + micro-batch

    @property
    def ticks(self) -> int:
        return sum(phase.ticks for phase in self.phases)

    def slot_ticks(self, kind: str) -> int:
        """Ticks that hold a ``kind`` (``forward``/``backward``) slot."""
        return sum(phase.ticks for phase in self.phases if getattr(phase, kind) is not None)

    def sends(self, kind: str) -> int:
        """Ticks whose ``kind`` slot ends in a ``ppermute``: the trips of that slot's ``collective-permute``."""
        return sum(phase.ticks for phase in self.phases if getattr(phase, "send_" + kind))

    @property
    def messages(self) -> int:
        """``ppermute`` messages one stage sends per step: ``2(M + P - 2)`` (``2M`` for two stages)."""
        return self.sends("forward") + self.sends("backward")

    @property
    def bubble(self) -> float:
        """Fraction of a stage's slots with nothing to run: ``(P - 1) / (M + P - 1)``."""
        slots = self.slot_ticks("forward") + self.slot_ticks("backward")
        return 1.0 - 2 * self.micro * self.chunks / slots

    def timeline(self, kind: str) -> np.ndarray:
        """``(ticks, stages)`` micro-batches of every ``kind`` slot over the whole step (``IDLE`` where a phase
        has no such slot)."""
        parts = [getattr(p, kind) if getattr(p, kind) is not None else np.full((p.ticks, self.stages), IDLE)
                 for p in self.phases]
        return np.concatenate(parts)

    def held(self) -> tuple[int, ...]:
        """The most micro-batches whose inputs each stage holds at once (forward run, backward not yet)."""
        forward, backward = self.timeline("forward"), self.timeline("backward")
        most = []
        for s in range(self.stages):
            done_f = np.cumsum(forward[:, s] != IDLE)
            done_b = np.concatenate([[0], np.cumsum(backward[:, s] != IDLE)[:-1]])  # freed after the tick
            most.append(int((done_f - done_b).max()))
        return tuple(most)

    @property
    def slots(self) -> int:
        """Stage-input buffer entries: the most any stage holds (micro-batch ``m`` uses entry ``m % slots``)."""
        return max(self.held())


def _table(ticks: int, stages: int, tick_of) -> np.ndarray:
    table = np.full((ticks, stages), IDLE, np.int32)
    for s in range(stages):
        for m, t in tick_of(s):
            table[t, s] = m
    return table


def _phases(forward: np.ndarray, backward: np.ndarray, send_f: np.ndarray, send_b: np.ndarray) -> tuple[Phase, ...]:
    """The ticks grouped into loops: consecutive ticks with the same slots and the same sends share one.
    ``send_f``/``send_b``: where a stage at work has a neighbour to send to (its table's shape)."""
    def signature(t):
        return ((forward[t] != IDLE).any(), send_f[t].any(), (backward[t] != IDLE).any(), send_b[t].any())

    phases, start = [], 0
    for t in range(1, len(forward) + 1):
        if t == len(forward) or signature(t) != signature(start):
            has_f, sends_f, has_b, sends_b = signature(start)
            phases.append(Phase(forward[start:t] if has_f else None, backward[start:t] if has_b else None,
                                bool(sends_f), bool(sends_b)))
            start = t
    return tuple(phases)


def _line_phases(forward: np.ndarray, backward: np.ndarray) -> tuple[Phase, ...]:
    """Phases of a line of stages: the last sends nothing forward, the first nothing back."""
    stage = np.arange(forward.shape[1])
    return _phases(forward, backward, (forward != IDLE) & (stage < forward.shape[1] - 1),
                   (backward != IDLE) & (stage > 0))


def gpipe(stages: int, micro: int, chunks: int = 1) -> Schedule:
    """All forward, then all backward (module docstring)."""
    n = micro + stages - 1
    forward = _table(2 * n, stages, lambda s: [(m, s + m) for m in range(micro)])
    backward = _table(2 * n, stages, lambda s: [(m, n + stages - 1 - s + m) for m in range(micro)])
    return Schedule("gpipe", stages, micro, _line_phases(forward, backward))


def one_f_one_b(stages: int, micro: int, chunks: int = 1) -> Schedule:
    """Each micro-batch backward as soon as the last stage has run it (module docstring)."""
    p = stages
    n = micro + 2 * (p - 1)
    forward = _table(n, p, lambda s: [(m, s + m) for m in range(micro)])
    backward = _table(n, p, lambda s: [(m, 2 * (p - 1) - s + m) for m in range(micro)])
    return Schedule("1f1b", p, micro, _line_phases(forward, backward))


def interleaved(stages: int, micro: int, chunks: int = 2) -> Schedule:
    """``chunks`` virtual stages per device, micro-batches round the ring in groups of ``stages`` (module
    docstring)."""
    p, v = stages, chunks
    if micro % p:
        raise ScheduleError(f"the interleaved schedule sends micro-batches round the ring in groups of the {p} "
                            f"stages: pipeline.microbatches={micro} must be a multiple of {p}")
    n = v * micro + p - 1

    def entry(i, chunk):  # the i-th forward (backward) of a device: its table entry chunk·M + micro-batch
        return chunk * micro + (i // (p * v)) * p + i % p

    forward = _table(2 * n, p, lambda s: [(entry(i, (i // p) % v), s + i) for i in range(v * micro)])
    backward = _table(2 * n, p, lambda s: [(entry(j, v - 1 - (j // p) % v), n + p - 1 - s + j)
                                           for j in range(v * micro)])
    stage = np.arange(p)
    last = (stage == p - 1) & (forward // micro == v - 1)  # the last virtual stage sends nothing on
    first = (stage == 0) & (backward // micro == 0) & (backward != IDLE)  # the first nothing back
    return Schedule("interleaved", p, micro, _phases(forward, backward, (forward != IDLE) & ~last,
                                                     (backward != IDLE) & ~first), v)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}
CHUNKED = ("interleaved",)  # the schedules that take pipeline.virtual_stages > 1


def make_schedule(name: str, stages: int, micro: int, chunks: int = 1) -> Schedule:
    """The schedule ``name`` (:data:`SCHEDULES`) for ``stages`` stages, ``micro`` micro-batches and ``chunks``
    virtual stages per device (``interleaved`` only)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline.schedule {name!r}; choose one of {list(SCHEDULES)}")
    if stages < 1 or micro < 1 or chunks < 1:
        raise ScheduleError(f"a pipeline needs >= 1 stage, micro-batch and chunk (got {stages}, {micro}, {chunks})")
    if (chunks > 1) != (name in CHUNKED):
        raise ScheduleError(f"pipeline.virtual_stages={chunks} with pipeline.schedule={name!r}: the chunks per device "
                            f"are for {' or '.join(CHUNKED)} (at least 2 there); set --config.pipeline.schedule="
                            f"{CHUNKED[0] if chunks > 1 else name} or --config.pipeline.virtual_stages="
                            f"{1 if chunks > 1 else 2}")
    return SCHEDULES[name](stages, micro, chunks)


def diagram(schedule: Schedule) -> str:
    """The schedule as text, one row per stage, one column per slot: ``F3`` forward of micro-batch 3,
    ``B3`` backward (interleaved: ``F3.1``, of chunk 1), ``..`` idle; phases separated by ``|``."""
    rows = []
    for s in range(schedule.stages):
        cells = []
        for phase in schedule.phases:
            for t in range(phase.ticks):
                for kind, table in (("F", phase.forward), ("B", phase.backward)):
                    if table is not None:
                        m = table[t, s]
                        label = f"{m % schedule.micro}.{m // schedule.micro}" if schedule.chunks > 1 else f"{m}"
                        cells.append(f"{kind}{label}" if m != IDLE else ".." + ".." * (schedule.chunks > 1))
            cells.append("|")
        rows.append(f"stage {s}: " + " ".join(cells[:-1]))
    return "\n".join(rows)
