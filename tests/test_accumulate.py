"""Gradient accumulation's communication, read from the compiled program (dtx.step.accumulate, dtx.comm.hlo).

Accumulating k micro-batches exists to send the gradient once per step. For every layout, both
drivers where they apply, and k = 1, 2, 4 on 8 devices (a 64-32-10 MLP, compiled only):

- the bytes a run records equal the compiled program's collectives, each counted once per trip of
  its loop (under ``jit`` the records *are* the compiled program's; under ``shard_map`` they are the
  accountant's, counted while tracing, and must match);
- where a device can hold its own whole gradient (data, ZeRO-1) the step reduces once, after the
  micro-batch loop, under ``jit`` as under ``shard_map``: its bytes do not grow with k (they were k×
  under ``jit``, XLA reducing every micro-batch's gradient inside the loop);
- the model-parallel layouts (model, hybrid, rules) map the loss over model groups: a split layer's
  gradient is reduced across the groups once, after the loop (k× fewer all-reduce bytes than before at
  k = 4 when every layer is split); a data-parallel layer among them is summed inside its group per
  micro-batch (the group's devices split its examples) and across the groups once;
- ZeRO-2 reduce-scatters each micro-batch's gradient (its definition) and ZeRO-1 does not, so they
  are different programs under ``jit`` too; FSDP reduces per micro-batch (each device holds only its
  shard of the gradient: an unreduced whole one would be the memory FSDP exists to save) and its
  records say so (k trips).

And the values: the per-shard accumulation under ``jit`` trains a batch-norm CNN exactly as
``shard_map``'s synchronised batch norm does (statistics of each whole micro-batch).
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.perf import flops as flops_lib
from dtx.comm import hlo
from dtx.data import TrainLoader
from dtx.parallel import get_layout
from dtx.step import StepSpec, make_train_step
from dtx.step.state import abstract_train_state, init_train_state

BATCH = 64
KS = (1, 2, 4)
CASES = [("data", "shard_map"), ("zero1", "shard_map"), ("zero2", "shard_map"),
         ("data", "jit"), ("zero1", "jit"), ("zero2", "jit"), ("fsdp", "jit"), ("fsdp:once", "jit"), ("model", "jit"),
         ("hybrid", "jit"), ("rules", "jit")]
RULES = (("Dense_0/kernel", (None, "model")),)  # the hidden layer split, the output layer data parallel
GRADIENT_KINDS = ("all-reduce", "reduce-scatter")


def _mesh(layout):
    return mesh_lib.make_mesh([("data", 4), ("model", 2)] if layout in ("model", "hybrid", "rules")
                              else [("data", 8)])


def _layout(layout):
    """A layout by name, ``fsdp:once`` being FSDP with ``parallel.reduce=once``."""
    name, _, reduce = layout.partition(":")
    return dataclasses.replace(get_layout(name), reduce=reduce) if reduce else get_layout(name)


def _place(layout, model, tx, example, mesh):
    return _layout(layout).place(abstract_train_state(model, tx, example), mesh, RULES if layout == "rules" else ())


@pytest.fixture(scope="module")
def programs(digits):
    """(layout, driver, k) -> (compiled step, the bytes one run of it records)."""
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    tx = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    model = models.build_model("mlp", features=(32,))
    out = {}
    for layout, driver in CASES:
        mesh = _mesh(layout)
        placement = _place(layout, model, tx, example, mesh)
        # Only shard_map's steps run (its records are counted while tracing): jit's are lowered from the state's
        # shapes and shardings, the same program without compiling an init for it.
        state = (init_train_state(model, tx, example, 0, mesh, shardings=placement.state) if driver == "shard_map"
                 else _sharded_shapes(abstract_train_state(model, tx, example), placement.state))
        batch = TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0)
        for k in KS if layout != "fsdp:once" else KS[1:]:  # (refused at k = 1, where it would be fsdp's program)
            step = make_train_step(model, tx, mesh, StepSpec(driver=driver, accum_steps=k, placement=placement,
                                                             donate=False))
            compiled = flops_lib.compile_to_read(step.lower(state, batch))
            if driver == "shard_map":  # the accountant's count (a constant of the trace) from one run of that program
                _, metrics = compiled(state, batch)
                recorded = int(metrics["comm_bytes"])
            else:  # what dtx train records under jit: the compiled program's (dtx.run.setup.program_figures)
                recorded = hlo.total(compiled).bytes_sent
            out[layout, driver, k] = compiled, recorded
    return out


def _sharded_shapes(abstract, shardings):
    """The state's shapes and dtypes with its shardings: what lowering a step needs, allocating nothing."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _gradient_collectives(compiled, kinds=GRADIENT_KINDS):
    """The collectives that carry more than the averages' few scalars: the gradients' (and a model-parallel
    layer's input gradient, a reduce-scatter: pass ``kinds=("all-reduce",)`` to leave it out)."""
    return [c for c in hlo.collectives(compiled) if c.kind in kinds and c.operand_bytes > 64]


def _bytes(collectives):
    return sum(c.bytes_sent * c.trips for c in collectives)


@pytest.mark.parametrize("layout,driver,k", [(layout, driver, k) for layout, driver in CASES for k in KS
                                              if (layout, k) != ("fsdp:once", 1)])
def test_recorded_bytes_are_the_compiled_bytes_times_trips(programs, layout, driver, k):
    compiled, recorded = programs[layout, driver, k]
    totals = hlo.total(compiled)
    assert totals.unknown_trips == 0
    assert totals.bytes_sent == sum(c.bytes_sent * c.trips for c in hlo.collectives(compiled))
    assert recorded == totals.bytes_sent > 0


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("layout,driver", [c for c in CASES if c[0] in ("data", "zero1")])
def test_whole_gradients_are_reduced_once_per_step(programs, layout, driver, k):
    """Data parallelism and ZeRO-1: the gradient collectives run once (none inside the loop), with
    the bytes of k = 1 — under jit k× fewer than when XLA reduced inside the loop."""
    compiled, _ = programs[layout, driver, k]
    gradients = _gradient_collectives(compiled)
    assert gradients and all(c.trips == 1 for c in gradients), gradients
    assert _bytes(gradients) == _bytes(_gradient_collectives(programs[layout, driver, 1][0]))
    if layout == "zero1" and driver == "shard_map":  # reduced once straight to the optimizer state's split
        # (under jit XLA:CPU writes that reduce-scatter as an all-reduce and a slice, at k = 1 too)
        assert {c.kind for c in gradients} == {"reduce-scatter"}


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_zero2_reduce_scatters_every_micro_batch_and_zero1_once(programs, driver):
    zero1 = _gradient_collectives(programs["zero1", driver, 4][0])
    zero2 = _gradient_collectives(programs["zero2", driver, 4][0])
    # (under jit XLA:CPU writes ZeRO-2's reduce-scatter as an all-reduce and a slice: inside the loop)
    assert [c for c in zero2 if c.trips == 4]
    assert not [c for c in zero1 if c.trips != 1]
    assert _bytes(zero2) > 3 * _bytes(zero1)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("layout", ["model", "hybrid"])
def test_split_layers_gradients_are_reduced_once_per_step(programs, layout, k):
    """Every layer of the MLP split over ``model`` (model; hybrid splits every Dense): the gradients'
    all-reduce runs once, after the loop, with the bytes of k = 1 (give or take the loss's two scalars
    riding in it) — k× fewer than when XLA reduced every micro-batch's gradient (4 × 4,820 B at k = 4)."""
    gradients = _gradient_collectives(programs[layout, "jit", k][0], ("all-reduce",))
    assert gradients and all(c.trips == 1 for c in gradients), gradients
    across = [c for c in gradients if c.group_size == 4]  # over the 4 model groups
    once = [c for c in _gradient_collectives(programs[layout, "jit", 1][0], ("all-reduce",)) if c.group_size == 4]
    operands = lambda cs: sum(c.operand_bytes * c.trips for c in cs)  # noqa: E731
    assert across and 0 <= operands(across) - operands(once) <= 8


def test_fsdp_reduce_once_reduces_the_gradient_once_per_step(programs):
    """``parallel.reduce=once`` ("no sync" accumulation): each device sums its own whole gradient over the
    micro-batches, and the gradient's one reduction (XLA:CPU writes the reduce-scatter as an all-reduce of the
    whole and a slice) runs once, after the loop: the bytes of k = 1 at any k, 1/k of ``per_microbatch``'s
    (the same all-reduce, k trips). The weights' and activations' gathers stay per micro-batch."""
    once_k1 = _bytes(_gradient_collectives(programs["fsdp", "jit", 1][0]))
    for k in (2, 4):
        once = _gradient_collectives(programs["fsdp:once", "jit", k][0])
        per = _gradient_collectives(programs["fsdp", "jit", k][0])
        assert once and all(c.trips == 1 for c in once), once
        assert _bytes(once) == once_k1 and _bytes(per) == k * once_k1


@pytest.mark.parametrize("overrides,message", [
    (["parallel.name=zero2", "grad_accum_steps=2"], r"parallel.reduce='once' applies to parallel.name=fsdp only, "
                                                    r"not 'zero2' \(ZeRO-2 .* is parallel.name=zero1\)"),
    (["parallel.name=data", "grad_accum_steps=2"], r"parallel.reduce='once' applies to parallel.name=fsdp only, "
                                                   r"not 'data'"),
    (["parallel.name=fsdp", "driver=jit"], r"grad_accum_steps=1 has one: set --config.grad_accum_steps"),
])
def test_parallel_reduce_once_is_refused_where_it_does_not_apply(overrides, message):
    from dtx import config as config_lib

    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.load("digits_mlp", ["parallel.reduce=once"] + overrides)
    with pytest.raises(config_lib.ConfigError, match=r"parallel.reduce='never' is unknown; choose one of "
                                                     r"per_microbatch, once"):
        config_lib.load("digits_mlp", ["parallel.name=fsdp", "driver=jit", "grad_accum_steps=2",
                                       "parallel.reduce=never"])


def test_rules_reduce_split_layers_once_and_data_parallel_layers_in_their_group(programs):
    """``rules`` splitting the hidden layer only: the gradient crossing the model groups is reduced once
    (trips 1); inside the loop only the data-parallel output layer's gradient (32·10 + 10 floats) is summed,
    over its model group of 2."""
    collectives = _gradient_collectives(programs["rules", "jit", 4][0], ("all-reduce",))
    across = [c for c in collectives if c.group_size > 2]
    inside = [c for c in collectives if c.trips == 4]
    assert across and all(c.trips == 1 for c in across), collectives
    assert inside and all(c.group_size == 2 and c.operand_bytes <= (32 * 10 + 10) * 4 + 8 for c in inside)
    assert set(collectives) == set(across) | set(inside)


@pytest.mark.parametrize("layout", ["zero2", "fsdp"])
def test_per_micro_batch_reductions_are_recorded_k_times(programs, layout):
    """Layouts that reduce each micro-batch's gradient: the loop's gradient collectives (those whose size
    does not shrink with the micro-batch) count k times, so their bytes at k = 4 are twice those at k = 2."""
    loops = {k: [c for c in _gradient_collectives(programs[layout, "jit", k][0]) if c.trips == k] for k in (2, 4)}
    sizes = {k: sorted(c.operand_bytes for c in loops[k]) for k in (2, 4)}
    gradients = {k: [c for c in loops[k] if c.operand_bytes in sizes[2] and c.operand_bytes in sizes[4]]
                 for k in (2, 4)}
    assert gradients[2] and _bytes(gradients[4]) == 2 * _bytes(gradients[2])


def _bn_lenet():
    return models.build_model("lenet", conv_features=(4,), dense_features=(16,)), optim.make_optimizer("sgd", 0.1)


@pytest.fixture(scope="module")
def synchronised_batch_norm(digits):
    """The batch-norm tests' reference: LeNet with batch norm, data parallel under shard_map (synchronised batch
    norm), 2 micro-batches; {steps: (params, model state, loss)} after 2 and 3 steps (one compiled step, one run)."""
    model, tx = _bn_lenet()
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = _mesh("data")
    placement = _place("data", model, tx, example, mesh)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", accum_steps=2, placement=placement))
    loader = TrainLoader(digits.train, BATCH, mesh, seed=0)
    finals = {}
    for s in range(3):
        state, metrics = step(state, loader.batch(s))
        finals[s + 1] = jax.device_get((state.params, state.model_state, metrics["loss"]))
    return finals


def test_jit_accumulation_with_batch_norm_trains_as_shard_map(digits, synchronised_batch_norm):
    """LeNet with batch norm, 2 micro-batches: under jit each shard's forward runs in the per-shard map
    and averages its statistics over all shards (by name), so each micro-batch is normalised with its
    global statistics — the shard_map driver's synchronised batch norm, step for step. Without the
    name, each shard would normalise its 4 examples alone (a different model: the test fails by far).
    Held to 1e-5 (float32 sums in different orders over 3 steps)."""
    mesh = mesh_lib.make_mesh([("data", 8)])
    model, tx = _bn_lenet()
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    loader = TrainLoader(digits.train, BATCH, mesh, seed=0)
    state = init_train_state(model, tx, example, 0, mesh)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", accum_steps=2))
    for s in range(3):
        state, metrics = step(state, loader.batch(s))
        jax.block_until_ready(metrics)
    final = jax.device_get((state.params, state.model_state, metrics["loss"]))
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(synchronised_batch_norm[3])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    assert not np.allclose(jax.tree.leaves(final[1])[0], 0.0)  # the statistics moved


@pytest.mark.parametrize("layout", ["data", "zero1", "hybrid", "model"])
def test_a_conv_nets_micro_batch_loop_computes_each_shards_examples_once(digits, layout):
    """A conv net under jit (whole gradients per device, or per model group), k = 2: a trip of the micro-batch loop costs half a
    k = 1 step's FLOPs (cost_analysis counts a loop's body once) and gathers no more than k = 1. The loss
    mapped over the shards by a vmap made XLA gather the convolutions' activations (4 more all-gathers) and
    compute them over again: a trip cost 2.9x its half of a k = 1 step (VGG-A at 1/16 width: 3.4x, under hybrid
    too); the shard_map map does not. (FSDP reducing once keeps the vmap, and that cost: module docstring of
    dtx.step.accumulate.)"""
    model = models.build_model("lenet", conv_features=(4, 8), dense_features=(16,))
    tx = optim.make_optimizer("sgd", 0.1)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = _mesh(layout)
    batch = TrainLoader(digits.train, BATCH, mesh, seed=0).batch(0)
    figures = {}
    placement = _place(layout, model, tx, example, mesh)
    state = _sharded_shapes(abstract_train_state(model, tx, example), placement.state)  # compiled only: no init
    for k in (1, 2):
        step = make_train_step(model, tx, mesh, StepSpec(driver="jit", accum_steps=k, placement=placement,
                                                         donate=False))
        compiled = flops_lib.compile_to_read(step.lower(state, batch))
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        figures[k] = cost["flops"], _distinct_gathers(compiled.as_text())
    assert figures[2][0] == pytest.approx(figures[1][0] / 2, rel=0.05)
    assert len(figures[2][1]) <= len(figures[1][1])  # (ZeRO and FSDP gather parameters; k = 2 no more of them)
    assert layout == "data" or figures[1][1]  # the model groups' activations, ZeRO-1's parameters: gathers read


def _distinct_gathers(text):
    """The program's all-gathers, one per distinct operation (its operand, groups and dimension): jax 0.11's XLA
    issues one gather of a micro-batch's labels over the model group twice, the same operand to the same groups
    under two channel ids (a CSE it misses; jax 0.10's XLA issues it once), which gathers nothing more. The
    activations a vmap made XLA gather are other operands, each counted."""
    found = set()
    for line in text.splitlines():
        gather = re.search(r"= (\S+) all-gather(?:-start)?\((.*)$", line)
        if gather:
            found.add((gather.group(1), re.sub(r"channel_id=\d+, |, (metadata|frontend_attributes)=\{.*$", "",
                                               gather.group(2))))
    return found


@pytest.mark.parametrize("layout", ["model", "hybrid", "rules", "fsdp:once"])
def test_model_parallel_accumulation_equals_one_device(digits, one_device_mlp, layout):
    """The MLP under a model-parallel layout, 4 micro-batches mapped over the model groups, 2 steps of
    momentum: the parameters and loss of one device's whole-batch steps (no batch norm: k does not change
    the mathematics); FSDP reducing once likewise (each device's whole gradient summed over the micro-batches).
    Held to 1e-6 (float32 sums in another order)."""
    got = _two_momentum_steps(digits, _mesh(layout), layout, 4)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one_device_mlp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-6)


def _two_momentum_steps(digits, mesh, layout, k):
    """The MLP's parameters and loss after 2 momentum steps of ``layout`` with k micro-batches, on batches 0, 1."""
    tx = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    model = models.build_model("mlp", features=(32,))
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    placement = _place(layout, model, tx, example, mesh)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", accum_steps=k, placement=placement))
    loader = TrainLoader(digits.train, BATCH, mesh, seed=0)
    for s in range(2):
        state, metrics = step(state, loader.batch(s))
    return jax.device_get((state.params, metrics["loss"]))


@pytest.fixture(scope="module")
def one_device_mlp(digits):
    """The reference of the model-parallel cases: one device's whole-batch steps (computed once for all four)."""
    return _two_momentum_steps(digits, mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1]), "data", 1)


def test_hybrid_accumulation_with_batch_norm_trains_as_shard_map(digits, synchronised_batch_norm):
    """LeNet with batch norm under hybrid (convolutions data parallel, Dense layers split over model
    groups of 2), 2 micro-batches: each group's shard normalises with the whole micro-batch's statistics
    (its own devices' by the layout, the other groups' by name), as data parallelism under shard_map
    does with synchronised batch norm. Held to 1e-5 over 2 steps."""
    model, tx = _bn_lenet()
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    mesh = _mesh("hybrid")
    placement = _place("hybrid", model, tx, example, mesh)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", accum_steps=2, placement=placement))
    loader = TrainLoader(digits.train, BATCH, mesh, seed=0)
    for s in range(2):
        state, metrics = step(state, loader.batch(s))
    final = jax.device_get((state.params, state.model_state, metrics["loss"]))
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(synchronised_batch_norm[2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_a_dtx_train_run_with_fsdp_reducing_once_records_and_charges_what_the_program_sends(programs, tmp_path):
    """``dtx train`` with ``parallel.reduce=once`` (FSDP, k = 4, the fixture's MLP, batch and optimizer): every
    record's bytes and rounds are the compiled program's (collectives times trips: one gradient reduction), and
    the simulated clock charges exactly them, step after step (a per-micro-batch run's records are 2.8x these)."""
    from dtx import config as config_lib
    from dtx import strategies
    from dtx.perf import clusters, simclock
    from dtx.run import metrics as metrics_lib
    from dtx.run.trainer import train

    overrides = ["parallel.name=fsdp", "driver=jit", "grad_accum_steps=4", "parallel.reduce=once", "num_steps=2",
                 "log_every=1", "model.features=(32,)", f"global_batch_size={BATCH}", "optimizer.name=momentum",
                 "optimizer.learning_rate=0.1", "cluster.name=cloud_10gbe", "progress=False"]
    train(config_lib.load("digits_mlp", overrides), tmp_path)
    records = [r for r in metrics_lib.read_metrics(str(tmp_path)) if "sim_time_s" in r]
    compiled, recorded = programs["fsdp:once", "jit", 4]
    sent = hlo.total(compiled)
    assert recorded == sent.bytes_sent < programs["fsdp", "jit", 4][1] / 2
    assert [(r["comm_bytes"], r["comm_rounds"]) for r in records] == [(sent.bytes_sent, sent.rounds)] * 2
    clock = simclock.SimClock(simclock.model_for_run(
        simclock.ClusterSpec(clusters.get_cluster("cloud_10gbe")), models.build_model("mlp", features=(32,)),
        (64,), np.float32, workers=8, global_batch=BATCH, accum_steps=4, caps=strategies.sync().caps))
    for step, r in enumerate(records):
        assert r["sim_time_s"] == pytest.approx(clock.advance(step, sent.bytes_sent, sent.rounds), rel=1e-12)
