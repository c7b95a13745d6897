"""Train and eval step factories: one per-device body, two drivers, each declared once.

A driver builds both steps of a :class:`~dtx.step.spec.StepSpec` and declares whether it places
the collectives itself (one per-device body, two drivers, tested equal):

* ``shard_map`` ("pmap-style", :mod:`dtx.step.shard_map`): ``jax.jit(jax.shard_map(body))``; the
  gradients go through an explicit all-reduce over the batch axes, which allreduce algorithms,
  compressors and strategies replace (Das et al., arXiv 1602.06709, §2; the Hitchhiker's Guide,
  arXiv 1810.11787, §3.1).
* ``jit`` ("pjit-style", :mod:`dtx.step.jit`): ``jax.jit`` with ``NamedSharding``; the body sees the
  global batch and XLA inserts the collectives the layout implies.

Both compute the same numbers as one device running the global batch; the tests hold them to it.
The body (:mod:`dtx.step.body`) applies the precision policy, dynamic loss scaling and gradient
accumulation over micro-batches (one accumulator, one reduction per step). A new driver is one
module and one line of :data:`DRIVERS`.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from dtx import compress, strategies
from dtx.models import remat
from dtx import mesh as mesh_lib
from dtx.comm.algorithms import get_algorithm
from dtx.config import ConfigError, register_check
from dtx.data.loader import Batch
from dtx.precision import LossScaler
from dtx.step.jit import JitDriver
from dtx.step.shard_map import ShardMapDriver
from dtx.step.body import Metrics
from dtx.step.spec import StepError, StepSpec
from dtx.step.state import TrainState

TrainStep = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
EvalStep = Callable[[TrainState, Batch], Metrics]

DRIVERS = {driver.name: driver for driver in (ShardMapDriver(), JitDriver())}


def get_driver(name: str):
    """The registered driver ``name``."""
    if name not in DRIVERS:
        raise StepError(f"unknown driver {name!r}; choose one of {list(DRIVERS)} (--config.driver, or "
                        "StepSpec(driver=...))")
    return DRIVERS[name]


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                    spec: StepSpec | None = None) -> TrainStep:
    """Build the jitted ``(state, batch) -> (state, metrics)`` training step.

    Args:
      model: flax module returning logits, called as ``model(inputs, train=True)``.
      tx: optax optimizer; its state is ``state.opt_state``.
      mesh: device mesh; the batch is split over :func:`dtx.mesh.batch_axes`.
      spec: everything else (:class:`~dtx.step.spec.StepSpec`); default synchronous data
        parallelism under the ``shard_map`` driver, float32, no accumulation.

    Returns:
      The step. Metrics are global-batch averages, replicated on every device: ``loss``, the task's
      metrics (``accuracy``), under ``shard_map`` ``comm_bytes`` and ``comm_rounds`` (what each worker
      sent this step, :mod:`dtx.comm.costmodel`'s accountant, the averages' all-reduce included) and
      ``comm_bytes_logging``/``comm_rounds_logging`` (that all-reduce alone; under ``jit`` the bytes are
      read from the compiled program, :func:`dtx.comm.hlo.total`), the strategy's own metrics, and with
      loss scaling ``loss_scale`` (the scale this step used), ``skipped`` (1 when this step was skipped)
      and ``skipped_steps``. A step built with ``spec.record=False`` for a strategy whose workers keep
      their own models runs no averages' all-reduce and reports no ``loss`` or task metrics: the loop
      runs it between records (:func:`dtx.step.body.records_collective`).
    """
    spec = spec or StepSpec()
    driver = get_driver(spec.driver)
    if spec.accum_steps < 1:
        raise StepError(f"accum_steps={spec.accum_steps} must be >= 1 (config: --config.grad_accum_steps)")
    check_combination(driver.name, spec.strategy or strategies.sync(), spec.compressor or compress.none(),
                      spec.loss_scaler)
    if not driver.explicit:
        if not get_algorithm(spec.allreduce).native or spec.bucket_bytes:
            raise StepError(f"allreduce={spec.allreduce!r} / bucket_bytes={spec.bucket_bytes} need a driver that "
                            "places its own collectives (--config.driver=shard_map; StepSpec(driver='shard_map')); "
                            f"under {driver.name!r} XLA chooses the collectives")
        if not spec.communicate:
            raise StepError(f"communicate=False needs driver='shard_map' (under {driver.name!r} XLA places the "
                            "collectives)")
    _check_placement(driver, spec)
    step = driver.train_step(model, tx, mesh, spec)
    options = remat.compiler_options(getattr(model, "remat", "none"), mesh.devices.flat[0].platform)
    if options:  # the model recomputes blocks (remat.policy): a compiler that would undo it is told not to
        step = jax.jit(step, donate_argnums=(0,) if spec.donate else (), compiler_options=options)
    return step


def make_eval_step(model: nn.Module, mesh: Mesh, spec: StepSpec | None = None) -> EvalStep:
    """Build the jitted ``(state, batch) -> sums`` evaluation step.

    It returns *sums* over the examples whose ``batch["mask"]`` is true and, within them, the
    elements the task scores (:func:`dtx.data.tasks.eval_sums`: ``loss_sum``, ``count``, ``examples``,
    ``<metric>_sum``, e.g. ``accuracy_sum``) — so a padded last batch contributes exactly its real
    examples, padded tokens nothing, and the host's totals are exact (:func:`dtx.data.tasks.summarize`).
    The parameters evaluated are the strategy's global model (``strategy.eval_params``: the
    synchronous parameters, the workers' average, the elastic center, ...). ``spec`` is the train
    step's (its driver, policy, strategy, task and placement are used).
    """
    spec = spec or StepSpec()
    driver = get_driver(spec.driver)
    _check_placement(driver, spec)
    return driver.eval_step(model, mesh, spec)


def _check_placement(driver, spec: StepSpec) -> None:
    """The layout declares the drivers that run it."""
    placement = spec.placement
    if placement is not None and driver.name not in placement.layout.drivers:
        kernels = getattr(placement.activations, "kernels", None)
        what = (f"its model-parallel layers ({', '.join(sorted(kernels))})" if kernels
                else "its activations' split" if placement.activations is not None else "its partitioning")
        raise StepError(f"parallel.name={placement.layout.name!r} runs under driver "
                        f"{' or '.join(placement.layout.drivers)}, not {driver.name!r}: XLA places the collectives of "
                        f"{what}; use --config.driver={placement.layout.drivers[0]} "
                        f"(StepSpec(driver={placement.layout.drivers[0]!r}))")


def check_combination(driver: str, strategy: strategies.Strategy, compressor: compress.Compressor,
                      loss_scaler: LossScaler) -> None:
    """Refuse strategy / compression / driver / loss-scaling combinations that cannot work."""
    if not get_driver(driver).explicit and not (strategy.caps.identity and compressor.caps.identity):
        raise StepError(
            f"strategy.name={strategy.name!r} / compression.name={compressor.name!r} need "
            "driver='shard_map' (--config.driver=shard_map; StepSpec(driver='shard_map')): they place "
            f"their own collectives, and under {driver!r} XLA chooses them")
    if strategy.caps.local_models and not compressor.caps.identity:
        raise StepError(
            f"compression.name={compressor.name!r} compresses the gradient allreduce, which strategy "
            f"{strategy.name!r} does not run every step; use strategy.name=sync, async or ssp with compression")
    if not strategy.caps.reduces_once and loss_scaler.enabled:
        raise StepError(
            f"dynamic loss scaling needs one verdict for all workers, but strategy {strategy.name!r} does not "
            "reduce the gradients once per step; use compute=bfloat16 (no loss scaling) or strategy.name=sync")


def check_accumulation(global_batch_size: int, accum_steps: int, mesh: Mesh) -> None:
    """Fail early when the per-device batch does not split into ``accum_steps`` micro-batches."""
    local = global_batch_size // mesh_lib.data_parallel_size(mesh)
    if accum_steps < 1 or local % accum_steps:
        raise StepError(
            f"grad_accum_steps={accum_steps} must divide the per-device batch {local} "
            f"(global_batch_size={global_batch_size} over {mesh_lib.data_parallel_size(mesh)} devices); "
            f"choose one of {[d for d in range(1, local + 1) if local % d == 0]}"
        )


@register_check
def check_config(config) -> None:
    """``driver`` is a registered driver and ``allreduce`` a registered algorithm."""
    if config.driver not in DRIVERS:
        raise ConfigError(f"driver={config.driver!r} is unknown; set --config.driver to one of {list(DRIVERS)}")
    get_algorithm(config.allreduce)
