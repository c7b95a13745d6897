"""The zoo transformer's modern (Llama-style) settings: RMSNorm, rotary positions, SwiGLU, grouped-query attention,
no biases (models/transformer.py).

Checked: a Llama-configured block equals a float64 numpy reference written from the papers (RMSNorm; RoPE in its
complex form, z · e^{i·m·θ}; grouped attention with query head h reading key/value head h // (H/K) under a causal
mask; SwiGLU); RoPE against that reference and its relative-position property (q·k after rotation depends only on
the positions' difference); the defaults keep GPT-2's model (the same parameter names and flax's own attention
class, and the settings at their defaults spelled out give the same parameters and logits); the Llama tiny model
trained a few steps on 8 devices — data parallel, FSDP (ZeRO-3) and a context split, jit driver — equals one
device; cached decoding gives the recomputed greedy tokens and the full pass's logits; refusals by key (Megatron's
tensor split, from the config and from the traced step; pipeline stages; num_kv_heads not dividing num_heads;
unknown norm/positions/mlp values).

Hand-breaks (each made, seen failing, reverted): RoPE's rotation sign flipped (``even * cos + odd * sin`` for the first of a pair) -> the
block reference and the RoPE test fail; GQA's grouping made ``jnp.tile`` (query head h reading kv head h mod K) on the
repeated path -> the block under flax's attention no longer equals the grouped kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import parallel
from dtx.data import tasks
from dtx.models import build_model
from dtx.models import transformer as tf
from dtx.parallel.rules import PartitionError
from dtx.run import generate as gen
from dtx.step import StepSpec, make_train_step
from dtx.step.state import abstract_train_state, init_train_state
from numerics import magnitude, sum_atol

LLAMA = dict(norm="rmsnorm", positions="rope", mlp="swiglu", num_kv_heads=2, use_bias=False)
LM = dict(num_layers=2, d_model=32, num_heads=4, mlp_ratio=2, max_len=16, num_classes=64, **LLAMA)
B, T, D, H, K = 2, 8, 32, 4, 2


# ------------------------------------------------------------------------------------------ numpy references

def np_rope(x, positions, base=10000.0):
    """RoFormer's complex form (Su et al. eq. 34): feature pairs as complex numbers times e^{i·m·θ_j}."""
    d = x.shape[-1]
    theta = base ** (-np.arange(0, d, 2) / d)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * positions[:, None, None] * theta)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def np_block(p, x, heads, kv_heads, eps=1e-6):
    """A pre-norm Llama block in float64: RMSNorm, RoPE, grouped causal attention, SwiGLU, no biases."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)

    def rms(x, scale):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale

    att = p["MultiHeadDotProductAttention_0"]
    h = rms(x, p["RMSNorm_0"]["scale"])
    q, k, v = (np.einsum("btd,dhk->bthk", h, att[n]["kernel"]) for n in ("query", "key", "value"))
    positions = np.arange(x.shape[1])
    q, k = np_rope(q, positions), np_rope(k, positions)
    out = np.zeros_like(q)
    causal = np.tril(np.ones((x.shape[1], x.shape[1]), bool))
    for n in range(heads):
        g = n // (heads // kv_heads)  # query head n reads key/value head n // group size
        s = np.einsum("btk,bsk->bts", q[:, :, n], k[:, :, g]) / np.sqrt(q.shape[-1])
        s = np.where(causal, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("bts,bsk->btk", w / w.sum(-1, keepdims=True), v[:, :, g])
    x = x + np.einsum("bthk,hkd->btd", out, att["out"]["kernel"])
    h = rms(x, p["RMSNorm_1"]["scale"])
    gate, up = h @ p["gate"]["kernel"], h @ p["up"]["kernel"]
    return x + (gate / (1 + np.exp(-gate)) * up) @ p["down"]["kernel"]


def _block(**extra):
    return tf.Block(D, H, 2, 0.0, jnp.float32, jnp.float32, norm="rmsnorm", mlp="swiglu", mlp_hidden=64,
                    num_kv_heads=K, use_bias=False, rope=True, **extra)


@pytest.mark.parametrize("dropout", [False, True], ids=["grouped", "repeated"])
def test_a_llama_block_equals_numpy(dropout):
    """The block's output equals the float64 reference: through ``jax.nn.dot_product_attention`` with grouped
    key/value heads, and through flax's attention (dropout path, at rate 0: the heads repeated); tolerance: float32
    sums over the 32-wide stream and 8 positions, 4 reductions deep."""
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
    block = _block()
    params = block.init(jax.random.key(0), x, None, False)["params"]
    assert params["MultiHeadDotProductAttention_0"]["key"]["kernel"].shape == (D, K, D // H)
    if dropout:  # flax's nn.dot_product_attention under the causal mask: K/V repeated to the query heads
        attention = tf.Attention(num_heads=H, num_kv_heads=K, rope=True, use_bias=False, attention_fn=nn_attention)
        mask = np.tril(np.ones((T, T), bool))[None, None]
        got_attention = attention.apply({"params": params["MultiHeadDotProductAttention_0"]},
                                        x, mask=mask)
        fused = tf.Attention(num_heads=H, num_kv_heads=K, rope=True, use_bias=False,
                             attention_fn=tf.causal_attention)
        want_attention = fused.apply({"params": params["MultiHeadDotProductAttention_0"]}, x)
        np.testing.assert_allclose(got_attention, want_attention, rtol=0,
                                   atol=sum_atol(want_attention, terms=D * T, depth=4))
        return
    got = block.apply({"params": params}, x, None, False)
    want = np_block(params, x.astype(np.float64), H, K)
    np.testing.assert_allclose(got, want, rtol=0, atol=sum_atol(want, terms=D * T, depth=4))


def nn_attention(query, key, value, mask=None, **kwargs):
    import flax.linen as nn

    assert key.shape[-2] == query.shape[-2], "a non-grouped attention_fn gets key/value heads repeated"
    return nn.dot_product_attention(query, key, value, mask=mask)


def test_rope_is_the_complex_rotation_and_relative():
    """:func:`rotary` equals the complex form; after it, q·k depends on the positions only through m − n."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 12, 2, 8)).astype(np.float32)
    positions = np.arange(12)
    np.testing.assert_allclose(tf.rotary(x, positions), np_rope(x.astype(np.float64), positions), rtol=0,
                               atol=1e-5)
    q, k = rng.normal(size=(1, 1, 1, 8)).astype(np.float32), rng.normal(size=(1, 1, 1, 8)).astype(np.float32)

    def score(m, n):
        return float(np.sum(tf.rotary(q, np.array([m])) * tf.rotary(k, np.array([n]))))

    assert score(3, 1) == pytest.approx(score(10, 8), abs=1e-5) == pytest.approx(score(2, 0), abs=1e-5)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3  # and it does depend on the difference


def test_swiglu_width():
    """SwiGLU's default hidden width: two thirds of mlp_ratio · d_model, rounded up to 64 (2048 at 768)."""
    assert tf.mlp_width(tf.Transformer(d_model=768, mlp="swiglu")) == 2048
    assert tf.mlp_width(tf.Transformer(d_model=64, mlp="swiglu")) == 192
    assert tf.mlp_width(tf.Transformer(d_model=64, mlp="swiglu", mlp_hidden=100)) == 100
    assert tf.mlp_width(tf.Transformer(d_model=64)) == 256


# ------------------------------------------------------------------------------------------ defaults unchanged

def test_the_defaults_are_gpt2():
    """Built without the new keys: GPT-2's parameter names, flax's own attention class; with every new key at its
    default spelled out: the same parameters and logits."""
    kw = dict(num_layers=2, d_model=32, num_heads=4, max_len=16, num_classes=64)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 16)), jnp.int32)
    plain = build_model("transformer", **kw)
    spelled = build_model("transformer", **kw, **tf.DEFAULTS)
    params = plain.init(jax.random.key(0), tokens)["params"]
    same = spelled.init(jax.random.key(0), tokens)["params"]
    names = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    block = {f"['Block_0']['{m}']['{p}']" for m in ("LayerNorm_0", "LayerNorm_1") for p in ("scale", "bias")} | {
        f"['Block_0']['MultiHeadDotProductAttention_0']['{m}']['{p}']" for m in ("query", "key", "value", "out")
        for p in ("kernel", "bias")} | {f"['Block_0']['Dense_{i}']['{p}']" for i in (0, 1) for p in ("kernel", "bias")}
    assert {n for n in names if n.startswith("['Block_0']")} == block
    assert names - {n for n in names if n.startswith("['Block_")} == {
        "['Embed_0']['embedding']", "['positions']", "['LayerNorm_0']['scale']", "['LayerNorm_0']['bias']",
        "['Dense_0']['kernel']", "['Dense_0']['bias']"}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(plain.apply({"params": params}, tokens), spelled.apply({"params": params}, tokens))
    seen = []

    def record(next_fun, args, kwargs, context):
        seen.append(type(context.module))
        return next_fun(*args, **kwargs)

    import flax.linen as nn
    with nn.intercept_methods(record):
        plain.apply({"params": params}, tokens)
    assert nn.MultiHeadDotProductAttention in seen and tf.Attention not in seen


# ------------------------------------------------------------------------------------------ 8 devices == 1

BATCH, STEPS = 16, 3
MESHES = {"data8": [("data", 8)], "fsdp8": [("fsdp", 8)], "data2xcontext4": [("data", 2), ("context", 4)]}


def _train(spec):
    """STEPS SGD-momentum steps of the Llama tiny LM, jit driver, on mesh ``spec`` (the data preset composed)."""
    model, tx = build_model("transformer", **LM), optax.sgd(0.1, momentum=0.9)
    mesh = mesh_lib.make_mesh(spec, devices=jax.devices()[:int(np.prod([size for _, size in spec]))])
    tokens = np.random.default_rng(0).integers(0, LM["num_classes"], size=(BATCH, LM["max_len"] + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "labels": tokens[:, 1:].astype(np.int32)}
    layout = parallel.compose(parallel.get_layout("data"), [name for name, _ in spec], 3)
    example = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32)
    placement = layout.place(abstract_train_state(model, tx, example), mesh)
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))  # the jit driver lays it out (context: balanced)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    start = jax.device_get(state.params)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token(),
                                                     donate=False))
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        float(metrics["loss"])  # waits on the step
    return layout.name, start, jax.device_get(state.params)


@pytest.fixture(scope="module")
def trained():
    return {"one": _train([("data", 1)]), **{name: _train(spec) for name, spec in MESHES.items()}}


@pytest.mark.parametrize("name", list(MESHES))
def test_training_on_8_devices_equals_one(trained, name):
    """3 steps of the Llama tiny LM under data parallelism, FSDP (ZeRO-3) and a context split (ring attention over
    4 devices, K/V heads repeated for its kernel, rotary positions at the balanced sequence's global positions)
    give one device's parameters (tolerance: float32 sums over the batch's tokens, at the update's scale)."""
    layout, start, want = trained["one"]
    got_layout, _, got = trained[name]
    assert got_layout == {"data8": "data", "fsdp8": "fsdp", "data2xcontext4": "context"}[name]
    change = magnitude(jax.tree.map(np.subtract, want, start))
    atol = sum_atol(None, terms=BATCH * LM["max_len"], depth=2 * LM["num_layers"] + 2, scale=change)
    assert change > 10 * atol
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------------ decoding

def test_cached_decoding_is_recomputing():
    """A Llama-configured LM (rope: keys cached rotated at their own positions; 2 key/value heads cached for 4
    query heads): 10 greedy tokens after a 4-token prompt equal the recomputed ones, and the cache's logits at every
    position equal the full pass's."""
    model = build_model("transformer", **LM)
    params = model.init(jax.random.key(1), jnp.zeros((1, LM["max_len"]), jnp.int32))["params"]
    params = jax.tree.map(lambda p: p * 8 if p.ndim > 1 else p, params)  # spread logits: no greedy ties
    prompt = np.array([3, 17, 5, 60])
    cached = gen.generate(model, params, prompt, 10)
    np.testing.assert_array_equal(cached, gen.generate(model, params, prompt, 10, cache=False))
    tokens = np.concatenate([prompt, cached])
    full = model.apply({"params": params}, jnp.asarray(tokens[None]))[0]
    decoder = model.clone(decode=True)
    cache = decoder.init(jax.random.key(0), jnp.zeros((1, LM["max_len"]), jnp.int32),
                         positions=jnp.arange(LM["max_len"])[None])["cache"]
    assert cache["Block_0"]["MultiHeadDotProductAttention_0"]["cached_key"].shape == (1, LM["max_len"], 2, 8)
    step = jax.jit(lambda cache, token, position: decoder.apply(
        {"params": params, "cache": cache}, token, positions=position, mutable=["cache"]))
    steps = []
    for position, token in enumerate(tokens):
        logits, changed = step(cache, jnp.asarray([[token]]), jnp.asarray([[position]]))
        cache = changed["cache"]
        steps.append(logits[0, 0])
    np.testing.assert_allclose(np.stack(steps), full, rtol=0,
                               atol=sum_atol(full, terms=LM["d_model"] * len(tokens), depth=2 * LM["num_layers"]))


# ------------------------------------------------------------------------------------------ refusals

def _config(**values):
    base = config_lib.override(config_lib.base_config(), **{"model.name": "transformer",
                                                           "dataset.name": "python_docs", "task.name": "next_token",
                                                           "driver": "jit"})
    return config_lib.override(base, **values)


MEGATRON = (("data", 4), ("model", 2))
REFUSED = [
    ({"model.positions": "rope", "parallel.name": "tensor", "mesh": MEGATRON},
     r"model\.positions='rope' does not run under Megatron's tensor split.*without the rotation.*"
     r"--config\.model\.positions='learned'"),
    ({"model.num_kv_heads": 2, "model_axis.split": "megatron", "mesh": MEGATRON},
     r"model\.num_kv_heads=2 does not run under Megatron's.*--config\.model\.num_kv_heads=0"),
    ({"model.mlp": "swiglu", "parallel.name": "tensor", "mesh": MEGATRON},
     r"model\.mlp='swiglu' does not run under Megatron's.*no gate.*--config\.model\.mlp='gelu'"),
    ({"model.norm": "rmsnorm", "mesh": (("stage", 2), ("data", 4))},
     r"model\.norm='rmsnorm' does not run under pipeline stages.*--config\.model\.norm='layernorm'"),
    ({"model.use_bias": False, "parallel.name": "pipeline", "mesh": (("stage", 2), ("data", 4))},
     r"model\.use_bias=False does not run under pipeline stages.*--config\.model\.use_bias=True"),
    ({"model.num_kv_heads": 3}, r"model\.num_kv_heads=3 must divide model\.num_heads=4.*choose one of \[1, 2, 4\]"),
    ({"model.norm": "batchnorm"}, r"model\.norm='batchnorm': choose one of layernorm, rmsnorm"),
    ({"model.positions": "alibi"}, r"model\.positions='alibi': choose one of learned, rope"),
    ({"model.mlp": "relu"}, r"model\.mlp='relu': choose one of gelu, swiglu"),
    ({"model.mlp": "swiglu", "model.moe.experts": 4}, r"model\.mlp='swiglu'.*--config\.model\.moe\.experts=0"),
]


@pytest.mark.parametrize("values, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refusals_name_the_key(values, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(_config(**values))


def test_a_passed_model_is_refused_by_the_split_and_the_stages():
    """A model passed in (no config block read): the Megatron split refuses it when the step is traced (its
    attention's ``tensor_refusal``), pipeline stages when they cut it (``pipeline_layers``); an impossible
    ``num_kv_heads`` when it is built."""
    model, tx = build_model("transformer", **dict(LM, num_kv_heads=0)), optax.sgd(0.1)
    mesh = mesh_lib.make_mesh([("data", 4), ("model", 2)])
    example = jax.ShapeDtypeStruct((8, LM["max_len"]), jnp.int32)
    placement = parallel.get_layout("tensor").place(abstract_train_state(model, tx, example), mesh)
    state = abstract_train_state(model, tx, example)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token()))
    batch = {"inputs": example, "labels": example}
    with pytest.raises(PartitionError, match=r"cannot split layer 'Block_0/MultiHeadDotProductAttention_0': "
                                             r"model\.norm='rmsnorm'"):
        step.lower(state, batch)
    with pytest.raises(ValueError, match=r"model\.norm='rmsnorm' does not run under pipeline stages"):
        model.pipeline_layers()
    with pytest.raises(ValueError, match=r"model\.num_kv_heads=3 must divide"):
        build_model("transformer", **dict(LM, num_kv_heads=3)).init(jax.random.key(0), example)
