"""Tensor (Megatron) and sequence parallelism, one package: kernels split over the ``model`` mesh axis.

Shoeybi et al., *Megatron-LM* (arXiv 1909.08053, §3) and Korthikanti et al. (arXiv 2205.05198, §4.2.2):

* :mod:`~dtx.parallel.tensor.megatron` — the per-device regions written once (attention by heads, column,
  row), each parameterised by its copy/reduce pair; the jit-level layout here and the pipeline's stages
  (:mod:`dtx.parallel.pipeline.tensor_stages`) both run them;
* :mod:`~dtx.parallel.tensor.layout` — the ``parallel.name=tensor`` layout under the ``jit`` driver: its
  partitioning rules, the ``tensor.*`` settings and their checks, ZeRO over the data axes;
* :mod:`~dtx.parallel.tensor.costs` — its collectives, parameters and activations by formula (what the
  cost model and the planner charge, held to the compiled program by the tests).

The ``model`` axis itself is declared in :mod:`dtx.parallel.layouts` (the model-parallel families share it).
"""
