"""What a step is built from besides the model, the optimizer and the mesh: one settings object.

:func:`dtx.step.make_train_step` and :func:`dtx.step.make_eval_step` take a :class:`StepSpec`;
every technique in it is a plug-in object chosen by name elsewhere (a config, or your code) and
known to the step only by what it declares: the driver (:mod:`dtx.step.drivers`), the allreduce
algorithm (:mod:`dtx.comm.algorithms`), the strategy, the compressor, the task and the layout's
placement of the state.
"""

from __future__ import annotations

import dataclasses

from dtx.compress import Compressor
from dtx.data.tasks import Task
from dtx.parallel import Placement
from dtx.precision import LossScaler, Policy
from dtx.strategies import Strategy


class StepError(ValueError):
    """A step configuration that cannot work (unknown driver, batch not splittable, ...)."""


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The settings of a train or eval step (every field has the plain data-parallel default).

    Attributes:
      driver: ``"shard_map"`` ("pmap-style": explicit collectives) or ``"jit"`` ("pjit-style": XLA
        places them) — :data:`dtx.step.drivers.DRIVERS`.
      policy: dtypes for compute, output and gradient communication (:class:`dtx.precision.Policy`).
      loss_scaler: dynamic loss scaling (float16); disabled by default.
      accum_steps: micro-batches per step; gradients are summed into one accumulator and reduced
        once. The per-device batch must divide by it.
      allreduce: ``shard_map``: the algorithm that averages gradients over the batch axes
        (:data:`dtx.comm.algorithms.ALGORITHMS`); ``psum`` is XLA's own.
      bucket_bytes: ``shard_map``: fuse gradients into buckets of this many bytes per allreduce
        (Horovod's fusion threshold); 0 reduces leaf by leaf.
      strategy: how workers synchronise (:mod:`dtx.strategies`); ``None``: synchronous SGD.
      compressor: gradient compression around the allreduce (:mod:`dtx.compress`); ``None``: none.
      task: the loss and metrics (:mod:`dtx.data.tasks`); ``None``: classification.
      placement: where the state, the reduced gradients and the activations live — a layout's
        :meth:`dtx.parallel.Layout.place`; ``None``: everything replicated (data parallelism).
      communicate: ``False`` builds the same step with every collective of the gradient path
        removed (each worker applies its own gradient): a yardstick for ``dtx bench step``.
      grad_norm: also report ``grad_norm``, the global L2 norm of the reduced gradient.
      clip_norm: ``c > 0`` scales the reduced gradient by ``min(1, c / ‖g‖)`` before the update, ``‖g‖`` the whole
        model's L2 norm in every layout (Pascanu et al. 2013, arXiv 1211.5063, §3.2), and reports ``grad_norm``
        and ``grad_clipped`` (1 on a step it scaled); 0: off.
      donate: donate the input state's buffers to the output state.
      record: the step reports the records (``loss`` and the task's metrics averaged over the workers).
        ``False`` builds the step a loop runs between records: for workers with their own models (local
        SGD, DiLoCo, EASGD, gossip) it holds no all-reduce of the averages, so it runs only the
        strategy's own collectives (:func:`dtx.step.body.records_collective`); other strategies' steps
        are the same either way.
    """

    driver: str = "shard_map"
    policy: Policy = Policy()
    loss_scaler: LossScaler = LossScaler()
    accum_steps: int = 1
    allreduce: str = "psum"
    bucket_bytes: int = 0
    strategy: Strategy | None = None
    compressor: Compressor | None = None
    task: Task | None = None
    placement: Placement | None = None
    communicate: bool = True
    grad_norm: bool = False
    clip_norm: float = 0.0
    donate: bool = True
    record: bool = True

    def replace(self, **changes) -> StepSpec:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)
