"""Pipeline parallelism, one package: the ``stage`` mesh axis and everything that runs on it.

GPipe (Huang et al. 2019, arXiv 1811.06965), 1F1B / PipeDream-Flush (Narayanan et al. 2021, arXiv 2006.09503)
and interleaved stages; the layer-wise model parallelism of Ben-Nun & Hoefler's survey (arXiv 1802.09941, §7)
and the Hitchhiker's Guide (arXiv 1810.11787, §4.2). Its parts, by what they declare:

* :mod:`~dtx.parallel.pipeline.stages` — the ``stage`` axis (declared on :data:`dtx.mesh.AXES`: no batch,
  no replicas), the cut of a model into stages and each stage's parameters as one row;
* :mod:`~dtx.parallel.pipeline.schedules` — the tick tables (GPipe, 1F1B, interleaved) the step runs and
  ``diagram()`` draws;
* :mod:`~dtx.parallel.pipeline.positions` and :mod:`~dtx.parallel.pipeline.tensor_stages` — the ``model``
  axis inside stages: Megatron's regions from :mod:`dtx.parallel.tensor.megatron`, with sequence parallelism;
* :mod:`~dtx.parallel.pipeline.zero` and :mod:`~dtx.parallel.pipeline.optim` — the rows' optimizer state
  split over ``fsdp`` (ZeRO-1/3) and the optimizer over rows;
* :mod:`~dtx.parallel.pipeline.step` — the schedule runner: one SPMD program whose per-device work is
  :mod:`dtx.step.body`'s (reduction, averages, loss scaling, finish);
* :mod:`~dtx.parallel.pipeline.check` — the settings it takes and refuses, before anything compiles;
* :mod:`~dtx.parallel.pipeline.relayout` — checkpoints between stage layouts and the model's own tree;
* :mod:`~dtx.parallel.pipeline.costs`, :mod:`~dtx.parallel.pipeline.plan` and
  :mod:`~dtx.parallel.pipeline.lm_costs` — its time, bytes and memory terms and the planner's rows.

Tensor parallelism never imports this package; the pipeline runs it inside its stages.
"""
