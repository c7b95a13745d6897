"""Megatron tensor and sequence parallelism (``parallel.name=tensor``): equal to one device, and what the compiled
program does equals Megatron's formulas (:mod:`dtx.parallel.tensor.layout`, :mod:`dtx.parallel.tensor.costs`).

Tolerance: a row-split layer sums its partial products over the ``model`` axis in another order than one device,
so float32 parameters differ in the last bits; after 20 steps of SGD-momentum the measured gap is 1.2e-7; they
are held to the suite's parameter tolerance, rtol=1e-5, atol=1e-6 (tests/test_parallel.py).
"""

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models
from dtx.comm import hlo
from dtx.data import TrainLoader, tasks
from dtx.data.datasets import Split
from dtx.parallel import PartitionError, get_layout, make_rules, param_specs
from dtx.parallel.tensor import costs as tensor_model
from dtx.precision import parse_policy
from dtx.step import StepError, StepSpec, make_train_step
from dtx.step.state import INIT_COMPILER_OPTIONS, abstract_train_state, init_train_state

S, H, HEADS, LAYERS, VOCAB, BATCH, STEPS = 16, 32, 4, 2, 64, 16, 20
MESH = [("data", 2), ("model", 4)]
T, D = 4, 2
TX = optax.sgd(0.1, momentum=0.9)
TOL = dict(rtol=1e-5, atol=1e-6)
BF16 = parse_policy("params=float32,compute=bfloat16,output=float32,reduce=float32")  # experiments/gpt2_small.py's
BLOCK = re.compile(r"Transformer\)\)?/Block_(\d+)/")  # a block's own collectives (not the merged gradient ones)


def _model(**kw):
    return models.build_model("transformer", **{**dict(num_layers=LAYERS, d_model=H, num_heads=HEADS, mlp_ratio=4,
                                                       max_len=S, num_classes=VOCAB), **kw})


@pytest.fixture(scope="module")
def text():
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(256, S + 1)).astype(np.int32)
    return Split(tokens[:, :-1], tokens[:, 1:])


def _run(text, name, mesh, accum_steps=1, tied=False, policy=None, **settings):
    model = _model(tie_embeddings=tied, **({"dtype": policy.compute} if policy else {}))
    example = jax.ShapeDtypeStruct(text.inputs.shape, text.inputs.dtype)
    abstract = abstract_train_state(model, TX, example)
    placement = get_layout(name).place(abstract, mesh, **settings)
    state = init_train_state(model, TX, example, 0, mesh, shardings=placement.state)
    loader = TrainLoader(text, BATCH, mesh, seed=0)
    step = make_train_step(model, TX, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token(),
                                                     donate=False, accum_steps=accum_steps,
                                                     **({"policy": policy} if policy else {})))
    lowered = step.lower(state, loader.batch(0))
    compiled = lowered.compile()
    start, losses = state, []
    for s in range(STEPS):
        state, metrics = compiled(state, loader.batch(s))
        losses.append(float(metrics["loss"]))
    return dict(params=jax.device_get(state.params), state=start, losses=losses, compiled=compiled, step=step,
                mesh=mesh, placement=placement, abstract=abstract, lowered=lowered if policy else None)


@pytest.fixture(scope="module")
def runs(text):
    one = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    return {"one": _run(text, "data", one), "tp": _run(text, "tensor", mesh_lib.make_mesh(MESH)),
            "sp": _run(text, "tensor", mesh_lib.make_mesh(MESH), sequence_parallel=True),
            "tp_zero1": _run(text, "tensor", mesh_lib.make_mesh(MESH), zero_stage=1),
            "sp_fsdp": _run(text, "tensor", mesh_lib.make_mesh(MESH), sequence_parallel=True, zero_stage=3),
            "sp_accum2": _run(text, "tensor", mesh_lib.make_mesh(MESH), accum_steps=2, sequence_parallel=True),
            "sp_bf16": _run(text, "tensor", mesh_lib.make_mesh(MESH), sequence_parallel=True, policy=BF16),
            "tied_one": _run(text, "data", one, tied=True),
            "tied_data": _run(text, "data", mesh_lib.make_mesh([("data", 8)]), tied=True)}


@pytest.mark.parametrize("run", ["tp", "sp", "tp_zero1", "sp_fsdp", "sp_accum2", "tied_data"])
def test_tensor_parallel_trains_like_one_device(runs, run):
    """20 steps on ``data 2 × model 4`` (data parallelism on the other axis; ZeRO-1 or FSDP over it; 2
    micro-batches per step, each data group's gradient summed apart and reduced once) equal one device's; and a
    tied embedding under data parallelism on 8 devices (its two uses' gradients summed before the reduction)."""
    one = runs["tied_one" if run.startswith("tied") else "one"]
    np.testing.assert_allclose(runs[run]["losses"], one["losses"], rtol=1e-5)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(one["params"]),
                                                          jax.tree.leaves(jax.device_get(one["state"].params))))
    assert moved > 1e-2  # it trained: a stale gradient would also "agree"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(runs[run]["params"]),
                            jax.tree.leaves(one["params"])):
        np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))


def test_heads_and_mlp_pairs_split_and_a_device_holds_its_share(runs):
    """Megatron's split read from the parameters: Q/K/V by heads, the output projection by its input rows, the
    MLP's up-projection by columns and its down-projection by rows; the rest whole. A device holds ``1/T`` of
    each split parameter, and in all what :func:`dtx.parallel.tensor.costs.param_bytes` says."""
    placement, state = runs["tp"]["placement"], runs["tp"]["state"]
    specs = {jax.tree_util.keystr(p, simple=True, separator="/"): s.spec
             for p, s in jax.tree_util.tree_leaves_with_path(placement.state.params)}
    P = jax.sharding.PartitionSpec
    attention = "Block_0/MultiHeadDotProductAttention_0"
    assert specs[f"{attention}/query/kernel"] == P(None, "model", None)
    assert specs[f"{attention}/value/bias"] == P("model", None)
    assert specs[f"{attention}/out/kernel"] == P("model", None, None)
    assert specs[f"{attention}/out/bias"] == P()
    assert specs["Block_1/Dense_0/kernel"] == P(None, "model") and specs["Block_1/Dense_0/bias"] == P("model")
    assert specs["Block_1/Dense_1/kernel"] == P("model", None) and specs["Block_1/Dense_1/bias"] == P()
    assert specs["Dense_0/kernel"] == P() and specs["Embed_0/embedding"] == P()  # the head and embedding whole
    held = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        share = leaf.addressable_shards[0].data.nbytes
        assert share * (T if any(specs[name]) else 1) == leaf.nbytes, name
        held += share
    abstract = runs["tp"]["abstract"].params
    assert held == tensor_model.param_bytes(abstract, jax.tree.map(lambda s: s.spec, placement.state.params), T)


def test_zero_over_the_data_axes_splits_the_rest(runs):
    """``tensor.zero_stage``: ZeRO-1 keeps each parameter's ``1/T`` and splits its momentum over the data axes too
    (``1/(T·D)``) where a dimension not split over ``model`` takes them (every one here but the column layers'
    biases, whose one dimension is); stage 3 splits the parameters alike."""
    for run in ("tp_zero1", "sp_fsdp"):
        state = runs[run]["state"]  # the specs without ZeRO: the tp run's
        specs = jax.tree.leaves(jax.tree.map(lambda s: s.spec, runs["tp"]["placement"].state.params),
                                is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        for spec, leaf, trace in zip(specs, jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state[0].trace)):
            model = T if "model" in tuple(spec) else 1
            data = D if len(spec) < leaf.ndim or None in tuple(spec) else 1
            assert trace.addressable_shards[0].data.size * model * data == trace.size, spec
            kept = model * (data if run == "sp_fsdp" else 1)
            assert leaf.addressable_shards[0].data.size * kept == leaf.size, spec


def _collectives(compiled):
    return [c for c in hlo.collectives(compiled)]


@pytest.mark.parametrize("run", ["tp", "sp"])
def test_compiled_collectives_equal_megatron(runs, run):
    """Per block: TP 4 all-reduces of B·S·H (2 forward, 2 backward); SP 4 reduce-scatters and 4 all-gathers (the
    same bytes) and 2 gathers again of the column inputs; all over the ``model`` group. Per step: the blocks, the
    ends and the gradient reductions within 5 % of :func:`dtx.parallel.tensor.costs.step_bytes`."""
    sp = run == "sp"
    examples = BATCH // D
    expected = tensor_model.block_collectives(examples, S, H, T, sp)
    found = {}
    for c in _collectives(runs[run]["compiled"]):
        block = BLOCK.search(c.op_name)
        if block:
            assert c.group_size == T and c.trips == 1, c
            found.setdefault(int(block.group(1)), {}).setdefault(c.kind, []).append(c.operand_bytes)
    assert sorted(found) == list(range(LAYERS))
    for block in found.values():
        assert {k: sorted(v) for k, v in block.items()} == {k: sorted(v) for k, v in expected.items()}
    sent = sum(c.bytes_sent for c in _collectives(runs[run]["compiled"]) if BLOCK.search(c.op_name))
    megatron = LAYERS * tensor_model.block_bytes(examples, S, H, T, sp)
    assert abs(sent - megatron) <= 0.05 * megatron
    if sp:  # reduce-scatter + all-gather carry the all-reduce's bytes; the second gathers add 2 of 8 halves
        assert megatron == LAYERS * (tensor_model.block_bytes(examples, S, H, T, False) * 10 // 8)
    placement = runs[run]["placement"]
    step = tensor_model.step_bytes(runs[run]["abstract"].params, jax.tree.map(lambda s: s.spec, placement.state.params),
                                   dict(zip(("data", "model"), (D, T))), examples=examples, positions=S, width=H,
                                   layers=LAYERS, sequence_parallel=sp)
    total = hlo.total(runs[run]["compiled"]).bytes_sent
    assert abs(total - sum(step.values())) <= 0.05 * sum(step.values()), (total, step)


SCALARS = 8  # the loss and the accuracy, float32, reduced in the gradients' all-reduce


def test_a_tied_embedding_crosses_the_data_axes_once(runs):
    """Data parallelism over 8 devices (jit) with the output layer tied to the embedding (GPT-2's): each device sums
    the table's two gradients (the lookup's and the output layer's) before the step's one all-reduce, whose
    operand is the parameters' bytes (and two scalars), not the table twice (reduced apart, XLA sent 7 % more
    here and 31 % more for GPT-2 small: tests/test_gpt2.py checks it at full width). Broken by hand (the jit
    driver's one-pass map off): GPT-2's 1-block step reduced 340,282,376 bytes against 185,892,872, and failed."""
    found = [c for c in _collectives(runs["tied_data"]["compiled"]) if c.kind == "all-reduce"]
    params = sum(leaf.nbytes for leaf in jax.tree.leaves(runs["tied_data"]["params"]))
    assert [(c.group_size, c.trips) for c in found] == [(8, 1)], found
    assert found[0].operand_bytes == params + SCALARS, (found[0].operand_bytes, params)


def test_accumulation_reduces_over_the_data_axes_once_per_step(runs):
    """2 micro-batches under SP on ``data 2 × model 4``: the micro-batch loop runs inside one map over the data
    groups (dtx.step.accumulate.manual_gradients), so the only collective over the data axes is one all-reduce
    after the loop of each device's gradient bytes (:func:`dtx.parallel.tensor.costs.data_gradient_bytes`: what it holds,
    less the position table's rows it does not reduce); everything inside the loop (twice a step) is over
    ``model``: the blocks' Megatron collectives each micro-batch, as :func:`dtx.parallel.tensor.costs.block_collectives`.
    Broken by hand (``TensorLayout.manual`` False: each micro-batch's gradient reduced): 2 trips, caught."""
    run = runs["sp_accum2"]
    found = _collectives(run["compiled"])
    over_data = [c for c in found if c.group_size == D]
    assert [(c.kind, c.trips) for c in over_data] == [("all-reduce", 1)], over_data
    specs = jax.tree.map(lambda s: s.spec, run["placement"].state.params)
    assert over_data[0].operand_bytes == tensor_model.data_gradient_bytes(run["abstract"].params, specs, T, H, True) \
        + SCALARS
    looped = [c for c in found if c.trips != 1]
    assert looped and all(c.trips == 2 and c.group_size == T for c in looped), looped
    per_block = {}
    for c in looped:
        block = BLOCK.search(c.op_name)
        if block and "/shard_map/" in c.op_name[block.end():]:  # a region's (not a gradient sum named after one)
            per_block.setdefault(block.group(1), {}).setdefault(c.kind, []).append(c.operand_bytes)
    expected = tensor_model.block_collectives(BATCH // D // 2, S, H, T, True)
    assert sorted(per_block) == ["0", "1"] and all(
        {k: sorted(v) for k, v in block.items()} == expected for block in per_block.values())


def _region_collectives(lowered) -> collections.Counter:
    """The collectives of the program JAX hands XLA (StableHLO: the Megatron regions' own, before XLA's passes
    and partitioner): (kind, operand type) -> count."""
    from jaxlib.mlir import ir

    found = collections.Counter()

    def visit(op):
        name = op.name
        if name.startswith("stablehlo.") and name[len("stablehlo."):] in ("all_reduce", "all_gather",
                                                                         "reduce_scatter", "all_to_all"):
            found[(name[len("stablehlo."):], str(op.operands[0].type))] += 1
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(visit)
    return found


def test_bf16_compute_moves_bf16_activations(runs):
    """Under experiments/gpt2_small.py's policy (float32 master weights, bfloat16 compute) the regions' activation
    collectives carry bfloat16, as Megatron's do. In the program JAX hands XLA each block's 4 reduce-scatters of
    ``B·S·H`` and 6 all-gathers of ``B·S·H/T`` (4 in the layout ``(B, S/T, H)``, 2 gathered again as ``(S/T, B,
    H)``) are bf16, and none of that size is float32. XLA:CPU's compiled program carries them as float32: its
    collectives upcast bf16, so each reads the float32 bytes of :func:`dtx.parallel.tensor.costs.block_collectives` there
    (what dtx.comm.hlo reads on CPU); a GPU's NCCL moves the bf16. 20 steps stay within bf16's tolerance of the
    float32 run (losses rtol 1e-2). Broken by hand (SP's reduce-scatter in float32): caught."""
    run, b, t = runs["sp_bf16"], BATCH // D, S // T
    found = _region_collectives(run["lowered"])
    activations = {k: v for k, v in found.items() if re.fullmatch(rf"tensor<({b}x{S}|{b}x{t}|{t}x{b})x{H}x\w+>", k[1])}
    assert activations == {("reduce_scatter", f"tensor<{b}x{S}x{H}xbf16>"): 4 * LAYERS,
                           ("all_gather", f"tensor<{b}x{t}x{H}xbf16>"): 4 * LAYERS,
                           ("all_gather", f"tensor<{t}x{b}x{H}xbf16>"): 2 * LAYERS}, activations
    compiled = {}
    for c in _collectives(run["compiled"]):
        block = BLOCK.search(c.op_name)
        if block:
            compiled.setdefault(block.group(1), {}).setdefault(c.kind, []).append(c.operand_bytes)
    as_float32 = tensor_model.block_collectives(b, S, H, T, True, itemsize=4)
    assert sorted(compiled) == ["0", "1"] and all(
        {k: sorted(v) for k, v in block.items()} == as_float32 for block in compiled.values())
    np.testing.assert_allclose(run["losses"], runs["sp"]["losses"], rtol=1e-2)


def _activation_slope(text, run, batch):
    """Per-device temporary bytes the run's compiled train step adds per example of a data shard: its step (at
    ``BATCH``) against the same step compiled for ``batch`` examples (memory_analysis at two batch sizes:
    parameters, gradients, optimizer state and fixed buffers drop out)."""
    mesh = run["mesh"]
    other = run["step"].lower(run["state"], TrainLoader(text, batch, mesh, seed=0).batch(0)).compile()
    temps = [compiled.memory_analysis().temp_size_in_bytes for compiled in (run["compiled"], other)]
    return (temps[1] - temps[0]) / ((batch - BATCH) // mesh.shape["data"])


def test_sequence_parallel_keeps_a_tth_of_the_activations(runs, text):
    """Per device and example of its data shard: SP keeps ``≈ 1/T`` of what the unsplit run keeps (measured 1.12/T),
    TP the stream whole and the rest ``1/T``; :func:`dtx.parallel.tensor.costs.activation_bytes` predicts both ratios within
    15 %."""
    # One end of each slope is the fixture's compiled step (three programs fewer): 16 examples a shard on one
    # device, 8 on data 2; the other end 8 and 16.
    unsplit = _activation_slope(text, runs["one"], BATCH // 2)
    tp, sp = _activation_slope(text, runs["tp"], 2 * BATCH), _activation_slope(text, runs["sp"], 2 * BATCH)
    assert 1.0 / T <= sp / unsplit <= 1.15 / T
    assert sp < tp < unsplit
    profile = tensor_model.activation_profile(_model(), S, H)
    whole = tensor_model.activation_bytes(profile, 1, 1, False)
    for measured, sequence_parallel in ((tp, False), (sp, True)):
        predicted = tensor_model.activation_bytes(profile, 1, T, sequence_parallel) / whole
        assert abs(predicted - measured / unsplit) <= 0.15 * measured / unsplit, (predicted, measured / unsplit)


class _Pair(nn.Module):
    """An MLP 8 -> 6 -> 8: 6 hidden units, which 4 does not divide."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        return nn.Dense(8)(h)


def test_bad_input_is_refused_before_compiling(text):
    mesh = mesh_lib.make_mesh(MESH)
    example = jax.ShapeDtypeStruct((16, S), jnp.int32)
    odd = abstract_train_state(_model(num_heads=2), TX, example).params
    with pytest.raises(PartitionError, match=r"layer 'Block_0/MultiHeadDotProductAttention_0''s 2 attention heads "
                                             r".* size 4.* \[1, 2\]"):
        make_rules("tensor", mesh, odd)
    pair = jax.eval_shape(lambda: _Pair().init(jax.random.key(0), jnp.zeros((1, 8))))["params"]
    with pytest.raises(PartitionError, match=r"layer 'Dense_0''s 6 hidden units .* size 4.* \[1, 2\]"):
        make_rules("tensor", mesh, pair)
    assert param_specs(make_rules("tensor", mesh_lib.make_mesh([("data", 4), ("model", 2)]), pair), pair,
                       mesh_lib.make_mesh([("data", 4), ("model", 2)]))["Dense_1"]["kernel"] == \
        jax.sharding.PartitionSpec("model", None)  # the pair d -> f -> d, row-split second
    lenet = abstract_train_state(models.build_model("lenet"), TX, jax.ShapeDtypeStruct((8, 28, 28, 1), jnp.float32))
    with pytest.raises(PartitionError, match="neither"):
        make_rules("tensor", mesh, lenet.params)
    with pytest.raises(PartitionError, match="needs a 'model' mesh axis"):
        make_rules("tensor", mesh_lib.make_mesh([("data", 8)]), odd)
    # SP with positions the model axis does not split: refused while tracing, naming the layer and lengths that fit.
    model = _model()
    short = jax.ShapeDtypeStruct((16, 6), jnp.int32)
    abstract = abstract_train_state(model, TX, short)
    placement = get_layout("tensor").place(abstract, mesh, sequence_parallel=True)
    step = make_train_step(model, TX, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token()))
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, placement.state)
    batch = {"inputs": short, "labels": short, "mask": jax.ShapeDtypeStruct((16,), jnp.bool_)}
    with pytest.raises(PartitionError, match=r"layer 'Embed_0''s 6 positions .* size 4.* sequence length that 4 divides .*\[4, 8, 12, 16\]"):
        step.lower(state, batch)
    # The shard_map driver is refused by the layout's declaration.
    with pytest.raises(StepError, match="runs under driver jit"):
        make_train_step(model, TX, mesh, StepSpec(driver="shard_map", placement=placement))
    # The per-layer memory model of the other layouts says it does not model the pairs (dtx.parallel.tensor.costs does).
    from dtx.perf import layers as layers_lib
    from dtx.perf import memory
    with pytest.raises(memory.MemoryModelError, match="does not model Megatron's pairs"):
        memory.estimate(layers_lib.analyze(models.build_model("mlp", features=(8,)), (4,)), "tensor", nodes=8,
                        global_batch=8)
    # tensor.* goes to parallel.name=tensor only.
    config = config_lib.base_config().unlock()
    config.tensor.sequence_parallel = True
    with pytest.raises(config_lib.ConfigError,
                       match="tensor.sequence_parallel=True applies to parallel.name=tensor, not .data."):
        config_lib.validate(config)


def test_a_tied_output_layer_runs_where_the_labels_are():
    """GPT-2's tied embedding (``tie_embeddings``: the logits are ``Embed.attend``) is the head: under SP its logits
    come out split by examples like the labels, so no collective moves logits (the largest activation); loss and
    gradients equal one device's."""
    # One block: the claim is the head's (the fixture's sp run holds the stream between two blocks).
    model, task = _model(tie_embeddings=True, num_classes=256, num_layers=1), tasks.next_token()
    mesh = mesh_lib.make_mesh(MESH)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 256, size=(BATCH, S)), jnp.int32)
    # (init runs once: compiled at init's -O1, whose values are the default level's, tests/test_state.py)
    params = jax.jit(lambda: model.init(jax.random.key(0), tokens[:1])["params"]).lower().compile(
        INIT_COMPILER_OPTIONS)()
    placement = get_layout("tensor").place(abstract_train_state(model, TX, jax.ShapeDtypeStruct(tokens.shape,
                                                                                             tokens.dtype)),
                                           mesh, sequence_parallel=True)

    def loss_and_grads(layout):
        def loss(p, t):
            with layout():
                return task.loss(model.apply({"params": p}, t, train=True), t).mean()
        return jax.value_and_grad(loss)

    import contextlib
    want = jax.jit(loss_and_grads(contextlib.nullcontext))(params, tokens)
    split = mesh_lib.batch_sharding(mesh)
    compiled = jax.jit(loss_and_grads(placement.activations), in_shardings=(placement.state.params, split)).lower(
        params, tokens).compile()
    logits = BATCH // D * S * 256 * 4 // T  # one device's share of a data shard's logits
    assert all(c.operand_bytes < logits for c in hlo.collectives(compiled) if c.kind != "all-reduce")
    got = compiled(jax.device_put(params, placement.state.params), tokens)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(g, w, **TOL, err_msg=jax.tree_util.keystr(path))
