"""Context parallelism's attention kernels (dtx.parallel.context.attention) on 8 devices, ``data 2 × context 4``.

Values: each kernel's output and its gradients equal one device's causal attention — a float64 numpy reference
for the values, ``jax.nn.dot_product_attention`` differentiated on one device for the gradients — with the
sequence laid out contiguous or balanced. Tolerances from the computation: an output is a softmax-weighted mean of
``S`` values, so its rounding is bounded by ``S·eps·max|v|`` (float32 scores and sums). What runs: the compiled
program's collectives are the kernel's — the ring's ``C − 1`` hops of keys and values (collective-permutes), the
all-gather's two gathers, Ulysses' four all-to-alls — each with the bytes the kernel moves. Load balancing: the
causal pairs each device keeps are equal when balanced, and ``2C − 1`` to 1 across devices when contiguous.

Hand-breaks (each fails the tests named): the ring's rescale ``exp(m − m_new)`` left out ->
``test_kernels_equal_one_devices_attention[ring-*]``; the ring skipping blocks whose key chunk is not after the
query chunk (``>=``) -> ``test_balancing_evens_the_rings_work``; Ulysses' return all-to-all with its axes swapped ->
``[ulysses-*]``; :func:`positions` balanced with the second chunk ``2C − 2 − rank`` -> every balanced case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.comm import hlo
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import attention as cp

B, S, H, D, C = 4, 32, 4, 8, 4  # examples, positions, heads, head width, the context axis
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh([("data", 2), (CONTEXT_AXIS, C)])


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(0)
    return tuple(rng.normal(size=(B, S, H, D)).astype(np.float32) for _ in range(3))


def reference(q, k, v):
    """Causal softmax attention in float64 numpy: ``(B, S, H, D)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((q.shape[1], q.shape[1]), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def sharded(kind: str, mesh, balanced: bool):
    """The kernel under a shard_map over ``data`` (examples) and ``context`` (positions), taking and returning
    natural-order arrays: the sequence laid out for the axis before, back after."""
    kernel = functools.partial(cp.ATTENTION[kind], axis=CONTEXT_AXIS, balanced=balanced)
    spec = P("data", CONTEXT_AXIS)
    mapped = jax.shard_map(lambda q, k, v: kernel(q, k, v), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def run(q, k, v):
        laid = [cp.balance(x, C, balanced=balanced) for x in (q, k, v)]
        return cp.unbalance(mapped(*laid), C, balanced=balanced)

    return run


CASES = [(kind, balanced) for kind in cp.KINDS for balanced in (True, False)]
IDS = [f"{kind}-{'balanced' if balanced else 'contiguous'}" for kind, balanced in CASES]


@pytest.fixture(scope="module")
def compiled(mesh, qkv):
    """Each case's forward and gradient, compiled once: ``(forward, grads, program text of the forward)``."""
    out, placed = {}, [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in qkv]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, H, D)), jnp.float32)
    for kind, balanced in CASES:
        run = sharded(kind, mesh, balanced)
        forward = jax.jit(run)
        loss = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(q, k, v) * weights), argnums=(0, 1, 2)))
        out[kind, balanced] = (np.asarray(forward(*placed)), [np.asarray(g) for g in loss(*placed)],
                               forward.lower(*placed).compile().as_text())

    def one(q, k, v):  # one device's gradients: jax's own causal attention
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * weights)

    single = [jax.device_put(x, jax.devices()[0]) for x in qkv]
    out["one"] = [np.asarray(g) for g in jax.jit(jax.grad(one, argnums=(0, 1, 2)))(*single)]
    return out, weights


@pytest.mark.parametrize("kind, balanced", CASES, ids=IDS)
def test_kernels_equal_one_devices_attention(compiled, qkv, kind, balanced):
    """Output and the three input gradients, against one device's causal attention."""
    results, weights = compiled
    got, grads, _ = results[kind, balanced]
    q, k, v = qkv
    scale = np.abs(v).max()
    np.testing.assert_allclose(got, reference(q, k, v), rtol=0, atol=4 * S * EPS * scale)

    for name, g, w in zip("qkv", grads, results["one"]):
        w = np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=0, atol=8 * S * EPS * np.abs(w).max(), err_msg=f"d{name}")


@pytest.mark.parametrize("size", [2, 8])
def test_kernels_at_other_axis_sizes(size):
    """C = 2 and C = 8 (the whole machine one context group): each kernel, balanced, equals the float64 reference;
    8 heads so that Ulysses divides them at C = 8."""
    rng = np.random.default_rng(size)
    q, k, v = (rng.normal(size=(2, S, 8, 4)).astype(np.float32) for _ in range(3))
    mesh = mesh_lib.make_mesh([(CONTEXT_AXIS, size)], devices=jax.devices()[:size])
    spec = P(None, CONTEXT_AXIS)
    want = reference(q, k, v)
    for kind in cp.KINDS:
        kernel = functools.partial(cp.ATTENTION[kind], axis=CONTEXT_AXIS, balanced=True)
        run = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        got = cp.unbalance(run(*(cp.balance(jnp.asarray(x), size) for x in (q, k, v))), size)
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * S * EPS * np.abs(v).max(), err_msg=f"{kind} C={size}")


def test_layout_of_positions():
    """Balanced: device i holds chunks i and 2C − 1 − i of 2C; contiguous: chunk i of C; both a permutation, and
    :func:`unbalance` inverts :func:`balance`."""
    order = cp.order(C, 16)
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert cp.order(C, 16, balanced=False).tolist() == list(range(16))
    x = jnp.arange(2 * 16).reshape(2, 16)
    np.testing.assert_array_equal(cp.unbalance(cp.balance(x, C), C), x)
    with pytest.raises(ValueError, match="must divide by 8; set context.balance=False"):
        cp.order(C, 12)


@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
def test_balancing_evens_the_rings_work(mesh, qkv, balanced):
    """The blocks each device's ring computes (it skips those the causal mask hides entirely), read from the
    kernel: balanced, every device 2C + 1 (its 2 query chunks against the 2C chunks, the half of the 4C pairs the
    mask keeps); contiguous, device i computes i + 1 of C, so the last waits on the first C times over. The
    query-key pairs the mask keeps per device agree: equal when balanced, 2C − 1 to 1 when contiguous."""
    spec, each = P("data", CONTEXT_AXIS), P(("data", CONTEXT_AXIS))
    kernel = functools.partial(cp.ring, axis=CONTEXT_AXIS, balanced=balanced, count=True)
    counted = jax.jit(jax.shard_map(lambda q, k, v: (lambda out, n: (out, n[None]))(*kernel(q, k, v)), mesh=mesh,
                                    in_specs=(spec,) * 3, out_specs=(spec, each)))
    out, blocks = counted(*(cp.balance(jnp.asarray(x), C, balanced=balanced) for x in qkv))
    per_device = np.asarray(blocks).reshape(2, C)[0]  # the data replicas compute alike
    assert per_device.tolist() == ([2 * C + 1] * C if balanced else list(range(1, C + 1)))
    assert per_device.tolist() == cp.ring_work(C, balanced)  # what docs/context_parallel.md's diagram shows
    np.testing.assert_allclose(cp.unbalance(out, C, balanced=balanced), reference(*qkv), rtol=0,
                               atol=4 * S * EPS * np.abs(qkv[2]).max())
    local = S // C
    kept = [int((np.asarray(cp.positions(r, C, local, balanced))[:, None] >= np.arange(S)[None, :]).sum())
            for r in range(C)]
    assert sum(kept) == S * (S + 1) // 2
    assert max(kept) / min(kept) == (1 if balanced else pytest.approx(2 * C - 1, rel=0.2))


def test_each_kernel_moves_what_it_declares(compiled):
    """The forward program's collectives over the context axis (groups of C): the ring's 2(C − 1)
    collective-permutes of a key or value chunk, the all-gather's 2 gathers of the keys and values, Ulysses' 4
    all-to-alls (q, k, v there, the output back); each moving a local chunk of ``B/2 · S/C · H · D`` float32."""
    results, _ = compiled
    chunk = B // 2 * S // C * H * D * 4
    expected = {"ring": ("collective-permute", 2 * (C - 1)), "allgather": ("all-gather", 2),
                "ulysses": ("all-to-all", 4)}
    for (kind, balanced), (_, _, text) in ((key, run) for key, run in results.items() if key != "one"):
        moved = [c for c in hlo.collectives(text) if c.kind in ("collective-permute", "all-gather", "all-to-all")]
        want_kind, count = expected[kind]
        kernel = [c for c in moved if c.kind == want_kind and c.operand_bytes == chunk]
        assert len(kernel) == count, (kind, balanced, [(c.kind, c.operand_bytes) for c in moved])


def test_ulysses_refuses_heads_the_axis_does_not_divide(mesh):
    q = jnp.zeros((2, S, 6, D))
    run = jax.shard_map(lambda q: cp.ulysses(q, q, q, CONTEXT_AXIS), mesh=mesh, in_specs=P(None, CONTEXT_AXIS),
                        out_specs=P(None, CONTEXT_AXIS))
    with pytest.raises(ValueError, match="6 heads over the 4 devices of 'context'"):
        jax.eval_shape(run, q)


# ------------------------------------------------------------------ a training step on data 2 x context 4

LM = dict(num_layers=2, d_model=32, num_heads=4, mlp_ratio=4, max_len=16, num_classes=64)
STEPS = 20
PAD = 0  # token id 0 is padding: each sequence ends in a run of it, which the loss does not score


def _train(mesh, layout_name, accum_steps=1, remat="none", tx=None, **settings):
    """20 steps of the tiny transformer LM under the jit driver, its sequences padded at the end (3 to 10 padding
    tokens, unscored: next_token's pad_id): ``(initial params, final params, compiled step, final params as
    placed)``."""
    import optax

    from dtx import parallel
    from dtx.data import tasks
    from dtx.models import build_model
    from dtx.step import StepSpec, make_train_step
    from dtx.step.state import abstract_train_state, init_train_state

    model, tx = build_model("transformer", **LM, remat=remat), tx or optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, LM["num_classes"], size=(16, LM["max_len"] + 1)).astype(np.int32)
    for row, pad in enumerate(rng.integers(3, 11, size=16)):
        tokens[row, -pad:] = PAD
    batch = jax.device_put({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}, mesh_lib.batch_sharding(mesh))
    example = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32)
    placement = parallel.get_layout(layout_name).place(abstract_train_state(model, tx, example), mesh, **settings)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    start = jax.device_get(state.params)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement,
                                                     task=tasks.next_token(pad_id=PAD), donate=False,
                                                     accum_steps=accum_steps, grad_norm=True))
    compiled = step.lower(state, batch).compile()
    norms = []
    for _ in range(STEPS):
        state, metrics = compiled(state, batch)
        norms.append(float(metrics["grad_norm"]))  # waits on the step
    return start, jax.device_get(state.params), compiled, state.params, norms


@pytest.fixture(scope="module")
def trained(mesh):
    from dtx import parallel

    one = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    from dtx import optim

    lars = optim.make_optimizer("lars", 2.0, momentum=0.9)  # trust ratios from each whole tensor's norm
    fsdp = parallel.compose(parallel.get_layout("data"), ["fsdp", CONTEXT_AXIS], 3)  # FSDP x context
    tensor = [("data", 2), (CONTEXT_AXIS, 2), ("model", 2)]  # Megatron x context (model_axis.split=megatron)
    megatron = parallel.compose(parallel.get_layout("data"), [name for name, _ in tensor], 3, "megatron")
    return {"one": _train(one, "data"), "one-lars": _train(one, "data", tx=lars),
            "lars": _train(mesh, "context", tx=lars, attention="allgather"),
            **{kind: _train(mesh, "context", attention=kind) for kind in cp.KINDS},
            "ring-contiguous": _train(mesh, "context", attention="ring", balance=False),
            "ring-accumulating": _train(mesh, "context", accum_steps=2, attention="ring"),
            "fsdp": _train(mesh_lib.make_mesh([("fsdp", 2), (CONTEXT_AXIS, C)]), fsdp),
            "tp+sp-ring": _train(mesh_lib.make_mesh(tensor), megatron, accum_steps=2, attention="ring",
                                 sequence_parallel=True),
            "tp-ulysses": _train(mesh_lib.make_mesh(tensor), megatron, attention="ulysses"),
            "tp-remat": _train(mesh_lib.make_mesh(tensor), megatron, remat="dots", attention="allgather")}


@pytest.mark.parametrize("kind", [*cp.KINDS, "ring-contiguous", "ring-accumulating", "fsdp", "tp+sp-ring",
                                  "tp-ulysses", "tp-remat"])
def test_a_context_parallel_step_trains_what_one_device_trains(trained, kind):
    """data 2 x context 4, each kernel on the load-balanced layout (context.balance, the default: the batch's
    positions permuted, the model told their global positions), the ring on the contiguous one and accumulating 2
    micro-batches (in the global view: no per-shard map around a layout that moves activations), fsdp 2 x
    context 4 (ZeRO-3 over fsdp, the ring), and data 2 x context 2 x model 2 with Megatron's pairs over model (TP +
    SP with the ring, accumulating 2 micro-batches: positions over context and model between the pairs; TP with
    Ulysses over each device's 2 heads; TP with the all-gather and remat.policy=dots, whose blocks run lifted by
    nn.remat), with causal masks and padding: the parameters after 20 SGD-momentum
    steps equal one device's, and under
    FSDP they are split over fsdp alone. Tolerance: a
    gradient sums B·S = 256 token terms through the model's 2 blocks, so its rounding is that of such sums at the
    scale of the parameters' change (measured for the ring: 2.4e-7 against 7.3e-6)."""
    from numerics import sum_atol

    start, want = trained["one"][:2]
    got = trained[kind][1]
    change = max(float(np.abs(np.asarray(w) - np.asarray(s)).max()) for w, s in
                 zip(jax.tree.leaves(want), jax.tree.leaves(start)))
    atol = sum_atol(None, terms=16 * LM["max_len"], depth=2 * LM["num_layers"], scale=change)
    for path, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"leaf {path}")
    if kind == "fsdp":
        specs = {tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(trained[kind][3])}
        assert ("fsdp",) in specs and all(set(spec) <= {None, "fsdp"} for spec in specs), specs


def test_whole_model_reductions_see_the_whole_model(trained):
    """Under data 2 x context 4 (the all-gather) the reductions over the whole model are one device's: LARS's
    trust ratios (each tensor's norm, of its parameters and its gradient) give the same parameters after 20 steps, and
    the recorded global gradient norm of every step equals one device's — each device's part of a gradient summed
    over context before any norm is taken. Tolerances: the parameters' as the SGD runs'; a norm's relative
    rounding that of a sum of the gradient's squares."""
    from numerics import sum_atol

    start, want, *_, want_norms = trained["one-lars"]
    _, got, *_, got_norms = trained["lars"]
    change = max(float(np.abs(np.asarray(w) - np.asarray(s)).max()) for w, s in
                 zip(jax.tree.leaves(want), jax.tree.leaves(start)))
    atol = sum_atol(None, terms=16 * LM["max_len"], depth=2 * LM["num_layers"], scale=change)
    for path, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"leaf {path}")
    size = sum(np.size(leaf) for leaf in jax.tree.leaves(want))
    rtol = (sum_atol(None, terms=16 * LM["max_len"], depth=2 * LM["num_layers"], scale=1.0)  # each gradient entry
            + sum_atol(None, terms=size, scale=1.0))  # the sum of their squares
    np.testing.assert_allclose(got_norms, want_norms, rtol=rtol)
    np.testing.assert_allclose(trained["allgather"][4], trained["one"][4], rtol=rtol)


def test_megatron_and_context_each_move_their_own(trained):
    """data 2 x context 2 x model 2: the compiled TP + SP step runs the ring over context — 2(C − 1) hops of keys
    and values each way per block and micro-batch (2 micro-batches: the loop's trip count) — and Megatron's SP
    collectives over model (an all-gather before each column region, again in its backward, a reduce-scatter
    after each row region and for each column region's input gradient: 4 all-gathers and 4 reduce-scatters a
    block); the kernels are split by heads over model and whole over context; Ulysses' TP step runs 4 all-to-alls
    each way per block over context and none of the ring's permutes."""
    layers, size = LM["num_layers"], 2
    ring = [c for c in hlo.collectives(trained["tp+sp-ring"][2]) if c.kind == "collective-permute"]
    assert sum(c.trips for c in ring) == 2 * 2 * 2 * (size - 1) * layers
    sp = {kind: sum(c.trips for c in hlo.collectives(trained["tp+sp-ring"][2]) if c.kind == kind)
          for kind in ("all-gather", "reduce-scatter")}
    assert sp["reduce-scatter"] == 2 * 4 * layers and sp["all-gather"] >= 2 * 4 * layers, sp
    ulysses = hlo.collectives(trained["tp-ulysses"][2])
    assert sum(c.trips for c in ulysses if c.kind == "all-to-all" and "MultiHeadDotProductAttention" in c.op_name) \
        == 2 * 4 * layers
    assert not [c for c in ulysses if c.kind == "collective-permute" and "MultiHeadDotProductAttention" in c.op_name]
    specs = {tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(trained["tp+sp-ring"][3])}
    assert (None, "model", None) in specs and all(CONTEXT_AXIS not in spec for spec in specs), specs


def test_the_step_moves_positions_only_through_its_kernel(trained):
    """What the compiled steps run over the context axis, forward and backward, per block: the ring's 2(C − 1)
    hops of keys and values each way (collective-permutes), Ulysses' 4 all-to-alls each way, the all-gather's 2
    gathers of keys and values forward (their transposes, reduce-scatters, backward); no kernel's collective in
    another kernel's step."""
    layers = LM["num_layers"]
    counts = {kind: {k: sum(1 for c in hlo.collectives(trained[kind][2]) if c.kind == k and c.group_size >= C)
                     for k in ("collective-permute", "all-to-all", "reduce-scatter")} for kind in cp.KINDS}
    assert counts["ring"] == {"collective-permute": 2 * 2 * (C - 1) * layers, "all-to-all": 0, "reduce-scatter": 0}
    assert counts["ulysses"] == {"collective-permute": 0, "all-to-all": 2 * 4 * layers, "reduce-scatter": 0}
    assert counts["allgather"] == {"collective-permute": 0, "all-to-all": 0, "reduce-scatter": 2 * layers}
    gathers = [c for c in hlo.collectives(trained["allgather"][2])
               if c.kind == "all-gather" and "MultiHeadDotProductAttention" in c.op_name]
    assert len(gathers) == 2 * layers


@pytest.mark.parametrize("kind", cp.KINDS)
def test_the_steps_bytes_are_the_formulas(trained, kind):
    """The bytes one device sends for attention per step, read from the compiled step (the kernel's collectives,
    trip counts included), equal dtx.parallel.context.costs.block_bytes times the blocks: 4(C − 1) chunks a block
    for the ring and the all-gather, 8(C − 1)/C for Ulysses (a chunk: 8 examples x 4 positions x 32 x 4 B)."""
    from dtx.parallel.context import costs

    moved = {"ring": ("collective-permute",), "allgather": ("all-gather", "reduce-scatter"),
             "ulysses": ("all-to-all",)}[kind]
    attention = [c for c in hlo.collectives(trained[kind][2]) if c.kind in moved and
                 ("MultiHeadDotProductAttention" in c.op_name or c.kind != "all-gather")]
    sent = sum(c.bytes_sent * c.trips for c in attention)
    assert sent == LM["num_layers"] * costs.block_bytes(kind, 16 // 2, LM["max_len"], LM["d_model"], C)


def test_context_parallelism_refuses_what_it_cannot_run(mesh):
    """A model without positions= under load balancing is refused naming the setting; a non-causal attention
    (flax's default attention_fn) is refused naming the module; the ring beside a stage axis is refused by key; an
    unknown kernel is refused."""
    import flax.linen as nn
    import optax

    from dtx import config as config_lib
    from dtx import parallel
    from dtx.parallel.context.layout import ContextError
    from dtx.step.state import abstract_train_state

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.MultiHeadDotProductAttention(num_heads=2)(x, x)

    model, tx = Plain(), optax.sgd(0.1)
    example = jax.ShapeDtypeStruct((8, 16, 8), jnp.float32)
    variables = model.init(jax.random.key(0), jnp.zeros((8, 16, 8)))
    for balance, match in ((True, "Plain takes no positions= argument.*context.balance=False"),
                           (False, "MultiHeadDotProductAttention_0: context parallelism runs causal")):
        placement = parallel.get_layout("context").place(abstract_train_state(model, tx, example), mesh,
                                                          balance=balance)
        with pytest.raises(ContextError, match=match):
            with placement.activations():
                jax.eval_shape(model.apply, variables, jnp.zeros((8, 16, 8)))
    config = config_lib.base_config().unlock()
    config.mesh, config.driver = (("data", 2), ("stage", 2), ("context", 2)), "jit"
    with pytest.raises(config_lib.ConfigError, match="context.attention='ring' inside pipeline stages.*allgather"):
        config_lib.validate(config)  # the pipeline's stages take the other kernels (tests/test_context_stages.py)
    config.mesh, config.context.attention = (("data", 2), ("context", 4)), "rings"
    with pytest.raises(config_lib.ConfigError, match="context.attention='rings': choose one of ring, allgather"):
        config_lib.validate(config)


@pytest.mark.parametrize("overrides, match", [
    (["--config.dataset.seq_len=60"], r"dataset.seq_len=60 does not split into 8 chunks over the 4 devices.*balanced"),
    (["--config.dataset.seq_len=36"], r"divisible by 8 or --config.context.balance=False"),
    (["--config.context.attention=ulysses", "--config.model.num_heads=6", "--config.model.d_model=48"],
     r"context.attention='ulysses' splits model.num_heads=6 over the 4 devices"),
    (["--config.mesh=((\"context\", 2), (\"model\", 4))", "--config.model_axis.split=megatron",
      "--config.context.attention=ulysses"],
     r"splits model.num_heads=4 over the 2 devices of the 'context' axis times the 4 of 'model'"),
    (["--config.mesh=((\"context\", 4), (\"model\", 2))", "--config.model_axis.split=megatron",
      "--config.tensor.sequence_parallel=True", "--config.dataset.seq_len=20", "--config.context.balance=False"],
     r"dataset.seq_len=20 with tensor.sequence_parallel=True splits over the 4 devices of 'context' and the 2"),
    (["--config.mesh=((\"context\", 4), (\"model\", 2))", "--config.model_axis.split=all"],
     r"not with \['model'\] \(over 'model' it takes Megatron's pairs: model_axis.split=megatron\)"),
])
def test_what_the_axis_cannot_split_is_refused_by_key(overrides, match):
    """The tiny LM's config on data 2 x context 4: a sequence that does not split into 2C chunks (C without
    balancing), Ulysses' heads that do not divide by C (by C·T beside Megatron's heads split over model), SP's
    positions that do not divide by C·T, a model axis split other than Megatron's — refused by key before anything
    is built."""
    import os

    from dtx import config as config_lib

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "tiny_lm.py")
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.load(path, ["--config.mesh=((\"data\", 2), (\"context\", 4))", "--config.driver=jit",
                               *overrides])


@functools.lru_cache(maxsize=None)
def _read(positions: int, size: int, kind: str = "ring"):
    """``(peak bytes, FLOPs)`` per device of the tiny LM's step on data 2 × context ``size`` (data 2 alone at 1),
    4 sequences of ``positions``, lowered from shapes and compiled to be read (nothing runs)."""
    import optax

    from dtx import parallel
    from dtx.data import tasks
    from dtx.models import build_model
    from dtx.perf import flops as flops_lib
    from dtx.perf import memory as memory_lib
    from dtx.step import StepSpec, make_train_step
    from dtx.step.state import abstract_train_state

    model = build_model("transformer", **{**LM, "max_len": positions})
    tx = optax.sgd(0.1)
    mesh = mesh_lib.make_mesh([("data", 2)] + [(CONTEXT_AXIS, size)] * (size > 1), devices=jax.devices()[:2 * size])
    example = jax.ShapeDtypeStruct((4, positions), jnp.int32)
    abstract = abstract_train_state(model, tx, example)
    placement = parallel.get_layout("context" if size > 1 else "data").place(
        abstract, mesh, **({"attention": kind} if size > 1 else {}))
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token(),
                                                     donate=False))
    tokens = jax.ShapeDtypeStruct((4, positions), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
    compiled = flops_lib.compile_to_read(step.lower(state, {"inputs": tokens, "labels": tokens}))
    return memory_lib.compiled_peak(compiled), flops_lib.compiled_flops(compiled)


def test_a_devices_work_and_memory_fall_with_the_axis():
    """At 256 positions, the balanced ring on context 4 against data alone (the same 2 examples per data shard):
    XLA's FLOPs per device are 1/C of the whole within 5 % (the online softmax's rescaling and the masks add
    element-wise work; measured 0.2554), and the sequence's share of the compiled peak (its growth from 128 to 256
    positions) falls at least 3-fold (measured 0.278; 0.29 from 256 to 512: what the ring keeps for its
    backward beyond 1/C, the arriving chunks among it, is in docs/context_parallel.md)."""
    (whole_128, _), (whole_256, whole_flops) = _read(128, 1), _read(256, 1)
    (split_128, _), (split_256, split_flops) = _read(128, C), _read(256, C)
    assert abs(split_flops / whole_flops * C - 1) <= 0.05, split_flops / whole_flops
    assert (split_256 - split_128) * 3 <= whole_256 - whole_128, (split_256 - split_128, whole_256 - whole_128)


def test_in_bfloat16_the_losses_are_one_devices_to_its_rounding():
    """Under experiments/gpt2_small.py's policy (float32 parameters, bfloat16 compute), each kernel on data 2 x
    context 4 trains 3 steps whose losses equal one device's within bfloat16's unit roundoff of the loss, 2^-9 ·
    |loss|: the kernels' scores and softmax are float32 and their outputs bfloat16, as one device's attention
    (measured: 4e-4 to 1e-3 at a loss of 4.5, against 8.8e-3)."""
    import optax

    from dtx import parallel
    from dtx.data import tasks
    from dtx.models import build_model
    from dtx.precision import parse_policy
    from dtx.step import StepSpec, make_train_step
    from dtx.step.state import abstract_train_state, init_train_state

    policy = parse_policy("params=float32,compute=bfloat16,output=float32,reduce=float32")
    model, tx = build_model("transformer", **{**LM, "dtype": jnp.bfloat16}), optax.sgd(0.1)
    tokens = np.random.default_rng(0).integers(1, LM["num_classes"], size=(16, LM["max_len"] + 1)).astype(np.int32)
    example = jax.ShapeDtypeStruct((16, LM["max_len"]), jnp.int32)

    def losses(mesh, name, **settings):
        batch = jax.device_put({"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}, mesh_lib.batch_sharding(mesh))
        placement = parallel.get_layout(name).place(abstract_train_state(model, tx, example), mesh, **settings)
        state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
        step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token(),
                                                         donate=False, policy=policy))
        out = []
        for _ in range(3):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return np.asarray(out)

    want = losses(mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1]), "data")
    for kind in cp.KINDS:
        got = losses(mesh_lib.make_mesh([("data", 2), (CONTEXT_AXIS, C)]), "context", attention=kind)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -9, atol=0, err_msg=kind)


def _modelled(positions: int, size: int, kind: str) -> float:
    """The memory check's estimate of ``_read``'s step (dtx.run.memory_check): the model's data-parallel estimate at
    a device's ``S/C`` positions (2 examples per data shard) plus what the layout says its attention keeps."""
    from dtx.models import build_model
    from dtx.parallel.context.layout import ContextSplit
    from dtx.perf import memory as memory_lib

    model = build_model("transformer", **{**LM, "max_len": positions})
    mesh = mesh_lib.make_mesh([("data", 2), (CONTEXT_AXIS, size)], devices=jax.devices()[:2 * size])
    shape, _, extra = ContextSplit(mesh, kind).memory(model, jax.ShapeDtypeStruct((4, positions), jnp.int32),
                                                   jnp.float32)
    found = memory_lib.estimate_model(model, shape, "data", dtype=jnp.int32, nodes=2, global_batch=4,
                                      optimizer="sgd")
    return extra(2, found).total


# Chosen before they were compiled: lengths and an axis size the constants (dtx.parallel.context.costs.KEPT) were
# not read from (those: 128 and 256 positions at C = 4).
HELD_OUT = [(384, 4), (512, 2)]


@pytest.mark.parametrize("kind", cp.KINDS)
def test_the_memory_model_holds_on_held_out_lengths(kind):
    """The memory check's estimate of a context-parallel step against the compiled peak (memory_analysis), on the
    held-out rows: within 15 % at C = 4 (measured 0.97-1.06 at 384 positions), and at C = 2 never under the peak
    and within the 35 % the memory model says it may miss there (dtx.perf.memory.uncovered: the data-parallel
    estimate at 256 positions is itself 11 % high, and Ulysses keeps less at C = 2; measured 1.17-1.35)."""
    for positions, size in HELD_OUT:
        ratio = _modelled(positions, size, kind) / _read(positions, size, kind)[0]
        if size == 4:
            assert abs(ratio - 1) <= 0.15, (positions, size, ratio)
        else:
            assert 1 <= ratio <= 1.35, (positions, size, ratio)


def test_the_memory_model_says_where_it_is_loose():
    """The memory check says, whenever it checks a context-parallel run, how it estimates one and how far its
    held-out rows read (dtx.perf.memory.uncovered)."""
    from dtx import parallel
    from dtx.perf import memory

    said = memory.uncovered(parallel.LAYOUTS["context"])
    assert "context parallelism" in said and "S/C positions" in said and "C = 2" in said
    assert memory.uncovered(parallel.LAYOUTS["data"]) == ""
