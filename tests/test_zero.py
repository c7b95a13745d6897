"""ZeRO-1/2 under the shard_map driver (dtx.parallel.zero): explicit reduce-scatter and all-gather.

The same parameters as data parallelism after 20 steps, for an elementwise optimizer and
for LAMB (whose trust ratio needs every tensor's global norm); the compiled program's
collectives are the ones ZeRO names, with the bytes dtx.parallel.zero.traffic counts.
"""

import jax
import numpy as np
import pytest

from dtx.data import datasets
from dtx.comm import hlo
from dtx import models, optim
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader
from dtx.parallel import get_layout
from dtx.step.state import abstract_train_state, init_train_state
from dtx.step import StepError, StepSpec, make_train_step

MODEL = dict(features=(64, 32), num_classes=10)  # the output layer's 10-wide bias divides by no 8: kept whole
STEPS = 20


def _parts(name, mesh, tx, example):
    model = models.build_model("mlp", **MODEL)
    return model, get_layout(name).place(abstract_train_state(model, tx, example), mesh)


@pytest.fixture(scope="module")
def runs():
    digits = datasets.load_dataset("digits")
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = mesh_lib.make_mesh([("data", 4), ("model", 2)])  # ZeRO splits over both axes: 8 workers
    loader = TrainLoader(digits.train, 64, mesh, seed=0)
    out = {}
    for opt in ("momentum", "lamb"):
        tx = optim.make_optimizer(opt, 1e-2, momentum=0.9, weight_decay=1e-4 if opt == "lamb" else 0.0)
        for name in ("data", "zero1", "zero2"):
            model, placement = _parts(name, mesh, tx, example)
            state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
            step = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", accum_steps=2, placement=placement))
            compiled = step.lower(state, loader.batch(0)).compile()
            for s in range(STEPS):
                state, metrics = step(state, loader.batch(s))
                jax.block_until_ready(metrics)
            out[opt, name] = state, jax.device_get(metrics), compiled
    return out


@pytest.mark.parametrize("opt", ["momentum", "lamb"])
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_under_shard_map_trains_like_data_parallel(runs, opt, name):
    """Reduce-scatter + update of 1/8 + all-gather == all-reduce + full update. XLA sums a
    reduce-scatter's and an all-reduce's terms in different orders, and stage 2 divides each
    micro-batch before summing: held to 1e-6 (measured <= 1.2e-7). LAMB with a per-slice norm is
    off by up to sqrt(8) in every update's trust ratio and fails by far."""
    state, metrics, _ = runs[opt, name]
    reference, reference_metrics, _ = runs[opt, "data"]
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(reference.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
        assert a.sharding.is_fully_replicated
    assert metrics["loss"] == pytest.approx(reference_metrics["loss"], abs=1e-6)
    for leaf in jax.tree.leaves(state.opt_state):  # the momentum buffers: 1/8 of a divisible tensor per device
        if any(d % 8 == 0 for d in leaf.shape):
            assert {s.data.size for s in leaf.addressable_shards} == {leaf.size // 8}


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_collectives_are_reduce_scatter_and_all_gather_as_counted(runs, name):
    """The compiled program's collectives: one reduce-scatter per divisible tensor (inside the
    micro-batch loop for stage 2, once after it for stage 1), one all-gather of each updated slice,
    all-reduces only for the tensors kept whole, the metrics and LAMB's norms -- no gradient-sized
    all-reduce. Their bytes, loops counted k times, equal the step's comm_bytes."""
    state, metrics, compiled = runs["lamb", name]
    ops = hlo.collectives(compiled)
    scatters = [c for c in ops if c.kind == "reduce-scatter"]
    divisible = [leaf for leaf in jax.tree.leaves(state.params) if any(d % 8 == 0 for d in leaf.shape)]
    assert len(scatters) <= len(divisible) and sum(c.operand_bytes for c in scatters) == sum(
        leaf.nbytes for leaf in divisible)
    assert {c.context for c in scatters} == {"loop" if name == "zero2" else "entry"}
    gathered = sum(c.operand_bytes * 8 for c in ops if c.kind == "all-gather")
    assert gathered == sum(leaf.nbytes for leaf in divisible)
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params) if all(d % 8 for d in leaf.shape))
    biggest_all_reduce = max(c.operand_bytes for c in ops if c.kind == "all-reduce")
    assert biggest_all_reduce <= whole + 64  # the kept-whole output layer (and scalars), nothing bigger
    loops = 2 if name == "zero2" else 1
    counted = sum(c.bytes_sent * (loops if c.context == "loop" else 1) for c in ops)
    # LAMB's norms are XLA's scalar all-reduces, outside what ZeRO itself sends
    norms = sum(c.bytes_sent for c in ops if c.kind == "all-reduce" and c.operand_bytes <= 8
                and c.context == "entry")
    assert counted - norms == pytest.approx(metrics["comm_bytes"], rel=0.02)


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_records_carry_every_shard_map_steps_fields(runs, name):
    """One body: ZeRO's records have data parallelism's fields, in its order and dtypes (counts int32),
    and comm_bytes_logging is what the one all-reduce of loss and accuracy sends. ZeRO's gradients travel
    by reduce-scatter, but this model's 10-wide output bias is kept whole and all-reduced after the loop
    (zero1; zero2 with its 2 micro-batches inside it): under zero1 the averages ride in that op (no rounds
    of their own), under zero2 they run alone."""
    from dtx.comm import context as comm_lib

    _, metrics, _ = runs["momentum", name]
    _, reference, _ = runs["momentum", "data"]
    assert [(k, np.asarray(v).dtype) for k, v in metrics.items()] == [
        (k, np.asarray(v).dtype) for k, v in reference.items()]
    assert {"comm_bytes_logging", "comm_rounds_logging"} <= set(metrics)
    assert np.asarray(metrics["comm_bytes"]).dtype == np.int32
    averaged = comm_lib.pmean_traffic(np.zeros(2, np.float32), 8)  # loss and accuracy, 8 workers
    assert int(metrics["comm_bytes_logging"]) == int(reference["comm_bytes_logging"]) == averaged.bytes_sent > 0
    assert averaged.messages == 2 * 7
    assert int(metrics["comm_rounds_logging"]) == (0 if name == "zero1" else averaged.messages)


def test_zero_under_shard_map_refuses_what_it_cannot_run():
    digits_example = jax.ShapeDtypeStruct((64, 64), np.float32)
    mesh = mesh_lib.make_mesh([("data", 8)])
    tx = optim.make_optimizer("adam", 1e-2)
    model, placement = _parts("zero1", mesh, tx, digits_example)
    with pytest.raises(StepError, match="allreduce 'psum'"):
        make_train_step(model, tx, mesh, StepSpec(driver="shard_map", placement=placement, allreduce="ring"))


def test_zero_under_shard_map_skips_an_overflowing_step_everywhere():
    """float16 compute with dynamic loss scaling: a scale that overflows the gradients skips the step
    (parameters and optimizer state bit-unchanged, the scale halved); a sane scale applies it."""
    from dtx import precision

    digits = datasets.load_dataset("digits")
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = mesh_lib.make_mesh([("data", 8)])
    policy = precision.parse_policy("p=f32,c=f16")
    tx = optim.make_optimizer("momentum", 1e-2, momentum=0.9)
    batch = TrainLoader(digits.train, 64, mesh, seed=0).batch(0)
    for scale, skipped in ((2.0**60, 1), (2.0**8, 0)):
        scaler = precision.LossScaler(enabled=True, initial_scale=scale)
        records = {}
        for name in ("data", "zero1"):
            model, placement = _parts(name, mesh, tx, example)
            model = model.clone(dtype=policy.compute)
            state = init_train_state(model, tx, example, 0, mesh, loss_scaler=scaler, shardings=placement.state)
            before = jax.device_get((state.params, state.opt_state))
            step = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", placement=placement, policy=policy,
                                                             loss_scaler=scaler, donate=False, grad_norm=True))
            new, metrics = step(state, batch)
            records[name] = [(k, np.asarray(v).dtype) for k, v in jax.device_get(metrics).items()]
        # the same records as data parallelism's, loss scaling's and grad_norm included
        assert records["zero1"] == records["data"]
        assert {"loss_scale", "skipped", "skipped_steps", "grad_norm"} <= {k for k, _ in records["zero1"]}
        assert int(metrics["skipped"]) == skipped
        after = jax.device_get((new.params, new.opt_state))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
        assert same == bool(skipped)
        assert float(new.loss_scale.scale) == (scale / 2 if skipped else scale)
