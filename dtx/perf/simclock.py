"""A simulated clock: the modelled time of a run on a real cluster, step by step.

On the emulated mesh wall-clock time says nothing about a network (eight "devices"
share the host's cores), so a technique that saves bytes or waiting cannot show what
it saves. With ``--config.cluster.name=NAME`` (a preset of ``dtx simulate``,
:mod:`dtx.perf.clusters`; ``--config.cluster=NAME`` for short) every training record carries
``sim_time_s``, the time the run so far would have taken on that cluster:

* **compute** — each worker's forward + backward from the perf model's per-layer
  roofline (:func:`dtx.perf.model.layer_cost`, the function ``dtx simulate``'s plans are
  made of: ``max(FLOPs / (peak · efficiency), bytes / memory bandwidth)`` per Dense or
  Conv layer, attention projection and product at the worker's batch, :func:`dtx.perf.layers.matmuls`;
  element-wise layers are not counted). Modelled, never measured on this machine — unless ``cluster.compute_s``
  gives the step's compute in seconds as measured on the real node (your model on
  your GPU, at the run's per-worker batch): the clock then uses that figure for every
  worker and step, before stragglers.
* **communication** — from what the step actually sent, the accountant's
  ``comm_bytes`` and ``comm_rounds`` per worker (:mod:`dtx.comm`), the metric averages
  of the records included where the step runs them (every step of a synchronous strategy,
  riding in its gradient all-reduce; only the record steps of workers with their own models,
  :func:`dtx.step.body.records_collective`): the α-β model of
  :mod:`dtx.comm.costmodel`, ``α·rounds + bytes/bandwidth``, plus the reduction's
  ``γ = 3/memory bandwidth`` per reduced byte (the configured algorithm's reduced ÷
  sent ratio, :func:`dtx.comm.costmodel.cost_terms`). The link is the one ``p`` workers
  share: a preset's NVLink when they fit in one machine (``p`` divides ``local_size``),
  else the inter-node network for every byte — an upper bound where a hierarchical
  allreduce would send most bytes locally.
* **overlap** — ``cluster.overlap = f ∈ [0, 1]``: communication hides behind a
  fraction ``f`` of the backward pass (2/3 of the compute by the FLOP convention):
  ``T = c + m − f·min(m, 2c/3)``. ``f = 0`` is ``dtx simulate``'s ``overlap=none``.
* **stragglers** — worker ``i``'s compute at step ``t`` is ``c·s_i(t)``, ``s`` drawn by
  :mod:`dtx.strategies.stragglers` from the run's seed. Who waits for whom is the strategy's
  declaration (:class:`dtx.comm.Capabilities`), never its name:

  - synchronous (the default, and every strategy that declares nothing): the step ends
    when the slowest worker's gradient is in: ``t_k = t_{k−1} + max_i T_i``;
  - ``local_models`` (local SGD, DiLoCo, EASGD, gossip, Streaming DiLoCo): each worker
    computes on from its own finish time, ``F_i(k) = F_i(k−1) + c·s_i(k)``; a step that
    exchanges anything ends for every worker at ``max_i F_i(k)`` plus the exchange
    (stragglers average out over the steps between exchanges). Gossip's neighbour
    exchange is charged as a barrier of all workers: an upper bound. With ``overlaps = τ``
    (Streaming DiLoCo) nobody waits for an exchange sent at step ``k``: it starts when
    the last worker has sent and ends ``E`` later; step ``k + τ`` ends for each worker no
    earlier than that (exchanges in flight do not share the link: modelled);
  - ``drops = b`` (backup workers, Chen et al. 2016): the step ends with the
    ``N = p − b``-th arrival, ``t_k = t_{k−1} + T_(N)`` (the N-th order statistic);
  - ``runs_ahead = s`` (async, ssp): a worker starts step ``k`` as soon as its own
    step ``k−1`` is done and every worker has finished step ``k−1−s`` (its gradient is
    then at most ``s`` updates stale): ``F_i(k) = max(F_i(k−1), max_j F_j(k−1−s)) +
    T_i(k)``; update ``k`` is applied when the last gradient of step ``k`` arrives,
    ``t_k = max_j F_j(k)``. Workers never wait beyond the bound and never for less;
    the strategies' own delays (async's fixed ``τ``) are what they compute with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dtx.comm import algorithms, costmodel
from dtx.perf import model as perfmodel
from dtx.perf import layers as layers_lib
from dtx.perf import clusters
from dtx.perf.clusters import Cluster
from dtx.strategies.stragglers import SETTINGS as STRAGGLER_SETTINGS
from dtx.strategies.stragglers import Stragglers
from dtx.config import ConfigError, base_config, register_check

class ClockError(ValueError):
    """A cluster block or a model the clock cannot use; the message names the config key and the fix."""


class ClusterSpec(NamedTuple):
    """The modelled cluster a run is timed on: what ``config.cluster`` describes (the run's set-up reads it,
    :func:`dtx.run.setup.cluster_spec`), nothing of the run itself."""

    cluster: Cluster
    stragglers: Stragglers = Stragglers()
    overlap: float = 0.0  # fraction of the backward pass communication hides behind, in [0, 1]
    compute_s: float = 0.0  # one worker's compute per step measured on your node; 0: the perf model's roofline


def compute_seconds(layers: Sequence[layers_lib.Layer], cluster: Cluster, nodes: int, global_batch: int, *,
                    accum_steps: int = 1, group: int = 1, sharded: Sequence[str] = ()) -> float:
    """One worker's forward + backward per step: the per-layer roofline of :func:`dtx.perf.model.layer_cost`.

    ``accum_steps`` micro-batches of ``global_batch / accum_steps`` each; layers named in
    ``sharded`` are split in groups of ``group`` (model parallel), as in a plan.
    """
    micro = global_batch / accum_steps
    return accum_steps * sum(
        perfmodel.layer_cost(layer, cluster, nodes, micro, group, layer.name in sharded).compute for layer in layers)


def link(cluster: Cluster, workers: int) -> tuple[float, float]:
    """``(α, bandwidth)`` of the link ``workers`` workers talk over (module docstring)."""
    if cluster.local_size > 1 and workers <= cluster.local_size and cluster.local_size % workers == 0:
        return cluster.local_latency, cluster.local_bandwidth
    return cluster.latency, cluster.bandwidth


class CommTime(NamedTuple):
    """A step's communication seconds by term of the α-β-γ model."""

    latency_s: float  # α · rounds
    bandwidth_s: float  # bytes / bandwidth
    reduce_s: float  # γ · reduced bytes

    @property
    def total(self) -> float:
        return self.latency_s + self.bandwidth_s + self.reduce_s


class ClockModel(NamedTuple):
    """What the clock needs to time one step (host-side, static for a run).

    Attributes:
      compute_s: one worker's compute per step without noise.
      latency / bandwidth: the link's α (s) and bandwidth (bytes/s).
      reduce_s_per_byte: γ times the reduced ÷ sent bytes ratio of the allreduce algorithm.
      overlap: fraction of the backward pass communication hides behind, in [0, 1].
      workers: ``p``, the data-parallel workers.
      stragglers: the noise model (:mod:`dtx.strategies.stragglers`).
      drops: gradients of the slowest ``drops`` workers a step does not wait for (backup workers).
      runs_ahead: steps a worker may run ahead of the slowest (async, ssp); 0: waits every step.
      local_models: workers hold their own models (local SGD, DiLoCo, EASGD, gossip): they wait for each
        other only at the steps that exchange something.
      overlaps: with ``local_models``, an exchange sent at step ``k`` is awaited only at the end of step
        ``k + overlaps`` (Streaming DiLoCo's ``τ``); 0: at once.
    """

    compute_s: float
    latency: float
    bandwidth: float
    reduce_s_per_byte: float
    overlap: float
    workers: int
    stragglers: Stragglers = Stragglers()
    drops: int = 0
    runs_ahead: int = 0
    local_models: bool = False
    overlaps: int = 0

    def comm(self, comm_bytes: float, comm_rounds: float) -> CommTime:
        """Seconds of sending ``comm_bytes`` in ``comm_rounds`` rounds (one worker, one step)."""
        return CommTime(self.latency * comm_rounds, comm_bytes / self.bandwidth, comm_bytes * self.reduce_s_per_byte)

    def worker_times(self, step: int, comm_s: float) -> np.ndarray:
        """``T_i`` of each worker at ``step``: its noisy compute, plus ``comm_s`` less what overlap hides."""
        compute = self.compute_s * self.stragglers.multipliers(step, self.workers)
        return compute + comm_s - self.overlap * np.minimum(comm_s, 2 * compute / 3)


def make_model(cluster: Cluster, layers: Sequence[layers_lib.Layer], *, workers: int, global_batch: int,
               nodes: int | None = None, accum_steps: int = 1, algorithm: str = "psum", overlap: float = 0.0,
               stragglers: Stragglers = Stragglers(), drops: int = 0, runs_ahead: int = 0, group: int = 1,
               sharded: Sequence[str] = (), compute_s: float = 0.0, local_models: bool = False,
               overlaps: int = 0) -> ClockModel:
    """The :class:`ClockModel` of a run: ``workers`` data-parallel workers (``nodes`` devices, default the same).

    ``compute_s > 0`` is one worker's measured compute per step and replaces the roofline's.
    """
    if not 0 <= overlap <= 1:
        raise ClockError(f"cluster.overlap={overlap!r} must be in [0, 1] (fraction of the backward pass "
                         "communication hides behind; 0: none, as dtx simulate's overlap=none)")
    if not 0 <= compute_s < np.inf:
        raise ClockError(f"cluster.compute_s={compute_s!r} must be >= 0 seconds (0: the perf model's roofline)")
    if drops and runs_ahead:
        raise ClockError("a strategy either drops late gradients or lets workers run ahead, not both")
    if not 0 <= drops < workers:
        raise ClockError(f"strategy.backup_workers={drops} must be < the {workers} workers (N = p - b >= 1)")
    nodes = nodes or workers
    alpha, bandwidth = link(cluster, workers)
    # Only the ratio of reduced to sent bytes matters here; a two-level algorithm is priced by the ring's.
    declared = algorithms.get_algorithm(algorithm)
    terms = costmodel.cost_terms(declared if declared.levels == 1 else "ring", 1.0, max(workers, 2))
    gamma = 3.0 / cluster.memory_bandwidth * terms.reduced_bytes / terms.path_bytes
    compute = float(compute_s) or compute_seconds(layers, cluster, nodes, global_batch, accum_steps=accum_steps,
                                                   group=group, sharded=sharded)
    return ClockModel(compute, alpha, bandwidth, gamma, float(overlap), workers, stragglers, int(drops),
                      int(runs_ahead), bool(local_models), int(overlaps))


class SimClock:
    """The run's simulated time, advanced once per step on the host (module docstring for the rules)."""

    def __init__(self, model: ClockModel, saved: dict | None = None):
        self.model = model
        saved = saved or {}
        self.time = float(saved.get("time", 0.0))
        # runs_ahead: each worker's finish times of the last s+1 steps, oldest first
        self.finish = [list(map(float, row)) for row in saved.get("finish", [])]
        # overlaps: exchanges in flight, (step whose end awaits it, time it completes)
        self.pending = [(int(due), float(done)) for due, done in saved.get("pending", [])]

    def step_time(self, step: int, comm_bytes: float, comm_rounds: float) -> float:
        """Seconds step ``step`` adds under synchronous waiting (all, or the first ``p − drops``)."""
        times = np.sort(self.model.worker_times(step, self.model.comm(comm_bytes, comm_rounds).total))
        return float(times[self.model.workers - self.model.drops - 1])

    def advance(self, step: int, comm_bytes: float, comm_rounds: float) -> float:
        """Account step ``step`` (0-based) that sent ``comm_bytes`` in ``comm_rounds``; the time after it."""
        if self.model.local_models:
            return self._advance_local(step, comm_bytes, comm_rounds)
        s = self.model.runs_ahead
        if not s:
            self.time += self.step_time(step, comm_bytes, comm_rounds)
            return self.time
        p = self.model.workers
        times = self.model.worker_times(step, self.model.comm(comm_bytes, comm_rounds).total)
        mine = np.array(self.finish[-1]) if self.finish else np.zeros(p)
        # step k may start once every worker finished step k-1-s: the oldest of the s+1 rows kept
        gate = max(self.finish[0]) if len(self.finish) == s + 1 else 0.0
        done = np.maximum(mine, gate) + times
        self.finish = (self.finish + [done.tolist()])[-(s + 1):]
        self.time = float(done.max())
        return self.time

    def _advance_local(self, step: int, comm_bytes: float, comm_rounds: float) -> float:
        """Own models: each worker computes on from its own finish time; a step that exchanges anything
        ends for all when the last is ready, plus the exchange (less what overlap hides) — or, with
        ``overlaps = τ``, the exchange runs while the workers compute and step ``k + τ`` ends no
        earlier than it does."""
        m = self.model
        compute = m.compute_s * m.stragglers.multipliers(step, m.workers)
        ready = (np.array(self.finish[-1]) if self.finish else np.zeros(m.workers)) + compute
        if comm_bytes or comm_rounds:
            comm_s = m.comm(comm_bytes, comm_rounds).total
            if m.overlaps:  # it starts once the last worker has sent its share
                self.pending.append((step + m.overlaps, float(ready.max() + comm_s)))
            else:
                ready = np.full(m.workers, ready.max() + comm_s - m.overlap * min(comm_s, 2 * m.compute_s / 3))
        for done in [done for due, done in self.pending if due == step]:
            ready = np.maximum(ready, done)
        self.pending = [(due, done) for due, done in self.pending if due > step]
        self.finish = [ready.tolist()]
        self.time = float(ready.max())
        return self.time

    def saved(self) -> dict:
        """The clock's state for a checkpoint (a resume continues the same history)."""
        return {"time": self.time, "finish": self.finish, "pending": self.pending}


class Recorder:
    """``sim_time_s`` for the train loop's records: a :class:`dtx.run.steplog.StepLog` extra.

    Called with each record, it advances the clock over the steps since the previous
    record, each charged its own bytes and rounds as the program ran them (the record's
    ``comm_steps``, :class:`dtx.run.steplog.CommTotals`), the records' averages included
    where they ran: exact for any ``log_every``. Steps without their own figures (records
    written before ``comm_steps``; the steps between a resumed checkpoint and the record
    before it) share what the totals (``comm_bytes_total``, ``comm_rounds_per_step``) leave:
    each the mean where waiting is synchronous, and for workers with their own models, who
    wait only where they exchange, all at the last of them. :meth:`saved` goes into a
    checkpoint, so a resume continues.
    """

    def __init__(self, model: ClockModel, saved: dict | None = None):
        saved = saved or {}
        self.clock = SimClock(model, saved.get("clock"))
        self.step = int(saved.get("step", 0))
        self.bytes, self.rounds = float(saved.get("bytes", 0.0)), float(saved.get("rounds", 0.0))

    def __call__(self, step: int, record: dict) -> dict:
        if step > self.step:
            sent = float(record.get("comm_bytes_total", 0.0))
            rounds = float(record.get("comm_rounds_per_step", 0.0)) * step
            n = step - self.step
            own = [(float(b), float(r)) for b, r in record.get("comm_steps", [])][-n:]  # the window's last steps
            gap = n - len(own)  # the steps before them, known by their totals only
            sent_here = max(sent - self.bytes - sum(b for b, _ in own), 0.0)
            rounds_here = max(rounds - self.rounds - sum(r for _, r in own), 0.0)
            for k in range(self.step, step):  # step k's stragglers are those the strategy drew at state.step = k
                if k >= self.step + gap:
                    self.clock.advance(k, *own[k - self.step - gap])
                elif self.clock.model.local_models:  # the gap's exchanges, at its end
                    last = k == self.step + gap - 1
                    self.clock.advance(k, sent_here if last else 0.0, rounds_here if last else 0.0)
                else:
                    self.clock.advance(k, sent_here / gap, rounds_here / gap)
            self.step, self.bytes, self.rounds = step, sent, rounds
        return {"sim_time_s": self.clock.time}

    def saved(self) -> dict:
        return {"clock": self.clock.saved(), "step": self.step, "bytes": self.bytes, "rounds": self.rounds}


def recorder_for_run(spec: ClusterSpec | None, model: Any, input_shape: Sequence[int], dtype: Any, *,
                     workers: int, global_batch: int, accum_steps: int = 1, algorithm: str = "psum", caps: Any,
                     saved: dict | None = None) -> Recorder | None:
    """The run's :class:`Recorder` (``None`` without a cluster).

    ``model``'s matrix products (:func:`dtx.perf.layers.matmuls`) on examples of ``input_shape``;
    ``workers`` is the data-parallel size; ``caps`` the strategy's
    :class:`dtx.comm.Capabilities` (who waits for whom). Compute is timed as data parallel
    (every worker computes its share of every layer, as in ``dtx simulate --plan data``).
    """
    if spec is None:
        return None
    return Recorder(model_for_run(spec, model, input_shape, dtype, workers=workers, global_batch=global_batch,
                                  accum_steps=accum_steps, algorithm=algorithm, caps=caps), saved)


def model_for_run(spec: ClusterSpec, model: Any, input_shape: Sequence[int], dtype: Any, *, workers: int,
                  global_batch: int, accum_steps: int = 1, algorithm: str = "psum", caps: Any) -> ClockModel:
    """The :class:`ClockModel` of a run on ``spec``'s cluster (arguments as :func:`recorder_for_run`'s)."""
    try:  # a measured compute needs no roofline, so any model works with it
        layers = () if spec.compute_s else layers_lib.matmuls(model, input_shape, dtype=dtype)
    except (layers_lib.PerfModelError, TypeError, ValueError) as e:
        raise ClockError(f"cluster.name={spec.cluster.name!r}: the simulated clock times compute with the perf "
                         f"model's per-layer roofline, which cannot analyse this model ({e}); give the step's "
                         "compute measured on your node (--config.cluster.compute_s=SECONDS) or run without "
                         "--config.cluster") from None
    return make_model(spec.cluster, layers, workers=workers, global_batch=global_batch, accum_steps=accum_steps,
                      algorithm=algorithm, overlap=spec.overlap, stragglers=spec.stragglers, drops=caps.drops,
                      runs_ahead=caps.runs_ahead, compute_s=spec.compute_s, local_models=caps.local_models,
                      overlaps=caps.overlaps)


def retime(records: Sequence[dict], model: ClockModel) -> dict[int, float]:
    """``step -> sim_time_s`` of a run's training records on another clock (cluster, overlap, stragglers).

    The run's bytes and rounds do not depend on the cluster, so its records re-timed by a
    fresh :class:`Recorder` are what the run would have recorded there (its updates must not
    depend on the straggler model either: backup's do, so train it once per model).
    A step logged twice (a resumed run) counts once, its last record.
    """
    by_step = {r["step"]: r for r in records if "comm_bytes_total" in r or "loss" in r}
    recorder = Recorder(model)
    return {step: recorder(step, by_step[step])["sim_time_s"] for step in sorted(by_step) if step > 0}


@register_check
def check_config(config) -> None:
    """The clock's block (``config.cluster``): a known cluster, physical numbers, a straggler model; no clock
    setting without a cluster, no straggler setting its model does not take."""
    block, defaults = config.cluster, base_config().cluster
    changed = [key for key in block if block[key] != defaults[key]]
    if not block.name:  # the straggler model stays: backup workers draw their arrival order from it
        for key in changed:
            if key not in ("straggler", *{k for keys in STRAGGLER_SETTINGS.values() for k in keys}):
                raise ConfigError(f"cluster.{key}={block[key]!r} is a setting of the simulated clock, which is off "
                                  "(cluster.name=''); set --config.cluster=NAME (a dtx simulate preset, or custom) "
                                  f"or leave cluster.{key} at its default {defaults[key]!r}")
    for model, keys in STRAGGLER_SETTINGS.items():
        for key in keys:
            if key in changed and key not in STRAGGLER_SETTINGS.get(block.straggler, keys):
                raise ConfigError(f"cluster.{key}={block[key]!r} applies to cluster.straggler={model} only, not "
                                  f"{block.straggler!r}; set --config.cluster.straggler={model} or leave cluster.{key} "
                                  f"at its default {defaults[key]!r}")
    clusters.from_settings(block.name, node_flops=block.node_flops, memory_bandwidth=block.memory_bandwidth,
                           bandwidth=block.bandwidth, latency=block.latency)
    Stragglers(block.straggler, 0, block.sigma, block.slow_fraction, block.slow_factor).check()
    if not 0 <= block.overlap <= 1:
        raise ConfigError(f"cluster.overlap={block.overlap!r} must be in [0, 1] (fraction of the backward "
                          "pass communication hides behind; 0: none)")
    if not (block.compute_s >= 0 and block.compute_s < float("inf")):
        raise ConfigError(f"cluster.compute_s={block.compute_s!r} must be >= 0 seconds: one worker's "
                          "compute per step measured on your node (0: the perf model's roofline)")
