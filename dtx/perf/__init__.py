"""The performance model (Das et al. §3): per-layer costs read off a model (:mod:`dtx.perf.layers`),
FLOPs of a step (:mod:`dtx.perf.flops`), cluster presets (:mod:`dtx.perf.clusters`), the iteration-time
model and planner (:mod:`dtx.perf.model`), scaling studies that print and plot (:mod:`dtx.perf.report`), memory per device (:mod:`dtx.perf.memory`) and the simulated
cluster clock (:mod:`dtx.perf.simclock`)."""

from dtx.perf import clusters, flops, layers, memory, model, report, simclock  # noqa: F401
