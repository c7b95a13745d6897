"""dtx.step.batchnorm: your own batch norm is synchronised under shard_map, so both drivers give the same run;
an axis_name the mesh does not split is refused naming the fix.

Tolerances as in tests/test_step.py: parameters ``atol=1e-6, rtol=1e-5``, batch statistics
``atol=rtol=1e-5`` (float32 sums in another order); SGD-momentum, not Adam (see there).
"""

import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dtx.step import StepSpec, batchnorm
from dtx import mesh as mesh_lib
from dtx.step.state import init_train_state
from dtx.step import make_train_step

PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
STATS_TOL = dict(atol=1e-5, rtol=1e-5)


class BNNet(nn.Module):
    """A user's module: batch norm with no ``norm_axis_name`` field and no ``axis_name``."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(32)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


def _sorted_batch(digits, mesh):
    """64 examples, device d holding 8 of digit d: each device's statistics are far from the global batch's."""
    labels = digits.train.labels
    rows = np.concatenate([np.flatnonzero(labels == d)[:8] for d in range(8)])
    return jax.device_put({"inputs": digits.train.inputs[rows], "labels": labels[rows]},
                          mesh_lib.batch_sharding(mesh))


TX = optax.sgd(0.1, momentum=0.9)


@pytest.fixture(scope="module")
def bn_state(digits, mesh):
    """One initial state for every batch-norm test (``axis_name`` changes no variable)."""
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    return init_train_state(BNNet(), TX, example, seed=0, mesh=mesh)


def _three_steps(model, mesh, driver, state, batch):
    step = make_train_step(model, TX, mesh, StepSpec(driver=driver, donate=False))  # the shared start state stays
    for _ in range(3):
        state, out = step(state, batch)
        jax.block_until_ready(out)
    return jax.device_get((state.params, state.model_state))


def test_your_batchnorm_gives_the_same_run_under_both_drivers(digits, mesh, bn_state):
    batch = _sorted_batch(digits, mesh)
    x = np.asarray(batch["inputs"]).reshape(64, -1)
    # The premise: pixel means per device differ from the global batch's by up to most of the range [0, 1].
    assert np.abs(x.reshape(8, 8, -1).mean(1) - x.mean(0)).max() > 0.5
    params_jit, stats_jit = _three_steps(BNNet(), mesh, "jit", bn_state, batch)
    params_sm, stats_sm = _three_steps(BNNet(), mesh, "shard_map", bn_state, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **PARAM_TOL), params_sm, params_jit)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **STATS_TOL), stats_sm, stats_jit)


def test_a_batchnorm_axis_name_the_mesh_does_not_split_is_refused(digits, mesh, bn_state):
    step = make_train_step(BNNet(axis_name="batch"), TX, mesh, StepSpec(driver="shard_map"))
    with pytest.raises(batchnorm.NormSyncError, match=r"BatchNorm_0.*axis_name='batch'.*leave axis_name unset.*driver=jit"):
        step.lower(bn_state, _sorted_batch(digits, mesh))  # refused while tracing, before compiling


# ------------------------------------------------------------------ the statistics' messages are counted

@pytest.mark.parametrize("case", ["user", "lenet", "lenet k=2", "lenet zero1", "resnet"])
def test_the_statistics_collectives_are_counted(digits, mesh, case):
    """The step's records (``comm_bytes``/``comm_rounds``, counted while tracing) equal what the compiled
    program runs, batch norm's all-reduces included: one per layer forward and one backward, once per
    micro-batch. Without them a LeNet step reads 14 rounds where it runs 70. (Under ``jit`` the records
    are the compiled program's by construction: dtx.run.setup.program_figures.)

    Where two batch-norm layers run side by side (a ResNet block's projection shortcut beside its second
    convolution) XLA's combiner merges their independent all-reduces into one op, forward and backward;
    the accountant groups independent sums alike (it counted a layer's own only: 182 rounds where 154
    run). XLA also merges some backward sums into pieces of the gradients' psum, which leaves the ops
    and rounds unchanged but pads the rings' chunks otherwise: the ResNet's bytes are held to 0.1 %."""
    from dtx import models
    from dtx.comm import hlo
    from dtx.data import TrainLoader
    from dtx.parallel import get_layout
    from dtx.step.state import abstract_train_state

    model = {"user": lambda: BNNet(),
             "resnet": lambda: models.build_model("resnet18", width=4, stage_sizes=(1, 1))}.get(
        case, lambda: models.build_model("lenet", conv_features=(4, 8), dense_features=(16,)))()
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    placement = get_layout("zero1").place(abstract_train_state(model, TX, example), mesh) if "zero1" in case else None
    state = init_train_state(model, TX, example, 0, mesh, shardings=placement.state if placement else None)
    batch = TrainLoader(digits.train, 64, mesh, seed=0).batch(0)
    spec = StepSpec(driver="shard_map", accum_steps=2 if "k=2" in case or "zero1" in case else 1,
                    placement=placement, donate=False)
    step = make_train_step(model, TX, mesh, spec)
    compiled = step.lower(state, batch).compile()
    _, metrics = step(state, batch)
    statistics = [c for c in hlo.collectives(compiled) if re.search(r"batchnorm|bn", c.op_name, re.I)]
    assert statistics, "the step should all-reduce batch-norm statistics"
    totals = hlo.total(compiled)
    if case == "resnet":
        assert int(metrics["comm_bytes"]) == pytest.approx(totals.bytes_sent, rel=1e-3)
        assert int(metrics["comm_rounds"]) == totals.rounds == 11 * 14  # 5 merged ops each way + the gradients'

    else:
        assert (int(metrics["comm_bytes"]), int(metrics["comm_rounds"])) == (totals.bytes_sent, totals.rounds)
