"""dtx.perf.layers: per-layer MACs and weights against the papers' layer tables, FLOPs against XLA's cost analysis."""
import contextlib
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from dtx.perf import layers as layers_lib
from dtx.models import build_model


# ------------------------------------------------------------------ hand counts from the layer tables
# Per layer: (name, forward multiply-adds per image, parameters incl. biases).
# MACs = H_out * W_out * C_out * (k * k * C_in); params = k * k * C_in * C_out + C_out.

# Simonyan & Zisserman 2015, Table 1 config A: 3x3 convs, padding 1, 2x2 pools; 224x224x3 input.
VGG_A_TABLE = [
    ("conv1", 86_704_128, 1_792),  # 224*224*64*(9*3);       9*3*64 + 64
    ("conv2", 924_844_032, 73_856),  # 112*112*128*(9*64);    9*64*128 + 128
    ("conv3_1", 924_844_032, 295_168),  # 56*56*256*(9*128);  9*128*256 + 256
    ("conv3_2", 1_849_688_064, 590_080),  # 56*56*256*(9*256); 9*256*256 + 256
    ("conv4_1", 924_844_032, 1_180_160),  # 28*28*512*(9*256); 9*256*512 + 512
    ("conv4_2", 1_849_688_064, 2_359_808),  # 28*28*512*(9*512); 9*512*512 + 512
    ("conv5_1", 462_422_016, 2_359_808),  # 14*14*512*(9*512)
    ("conv5_2", 462_422_016, 2_359_808),  # 14*14*512*(9*512)
    ("fc6", 102_760_448, 102_764_544),  # (7*7*512)*4096;      + 4096
    ("fc7", 16_777_216, 16_781_312),  # 4096*4096;             + 4096
    ("fc8", 4_096_000, 4_097_000),  # 4096*1000;               + 1000
]

# Sermanet et al. 2014, Table 1 (fast model), 231x231x3 input: conv1 11x11/4 -> 56 (pool 28), conv2 5x5 -> 24
# (pool 12), conv3-5 3x3 pad 1 -> 12 (pool 6), fc6 6*6*1024 -> 3072, fc7 -> 4096, fc8 -> 1000.
OVERFEAT_FAST_TABLE = [
    ("conv1", 109_283_328, 34_944),  # 56*56*96*(11*11*3);     363*96 + 96
    ("conv2", 353_894_400, 614_656),  # 24*24*256*(5*5*96);     2400*256 + 256
    ("conv3", 169_869_312, 1_180_160),  # 12*12*512*(9*256);    2304*512 + 512
    ("conv4", 679_477_248, 4_719_616),  # 12*12*1024*(9*512);   4608*1024 + 1024
    ("conv5", 1_358_954_496, 9_438_208),  # 12*12*1024*(9*1024); 9216*1024 + 1024
    ("fc6", 113_246_208, 113_249_280),  # 36864*3072;            + 3072
    ("fc7", 12_582_912, 12_587_008),  # 3072*4096;               + 4096
    ("fc8", 4_096_000, 4_097_000),  # 4096*1000;                 + 1000
]


@pytest.mark.parametrize("name, table, macs_total", [
    ("vgg_a", VGG_A_TABLE, 7_609_090_048),  # "7.6 G" (Simonyan & Zisserman Table 2 counts multiply-adds)
    ("overfeat_fast", OVERFEAT_FAST_TABLE, 2_801_403_904),  # "2.81 G" (Sermanet et al. Table 4)
])
def test_per_layer_flops_and_params_match_the_layer_tables(name, table, macs_total):
    model = build_model(name)
    layers = layers_lib.analyze(model, type(model).default_input_shape)
    assert [(l.name, l.macs, l.weights) for l in layers] == table
    assert all(l.forward_flops == 2 * l.computed_macs and l.train_flops == 6 * l.computed_macs for l in layers)
    assert sum(l.macs for l in layers) == macs_total
    # What runs skips the taps that fall on padding: fewer MACs for padded convolutions only.
    assert all(l.computed_macs == l.macs for l in layers if l.kind == "dense")
    assert all(l.computed_macs <= l.macs for l in layers)
    assert 0.9 * macs_total < sum(l.computed_macs for l in layers) < macs_total
    fc6 = layers[-3]
    assert (fc6.kind, fc6.in_elements, fc6.out_elements) == ("dense", fc6.kernel_shape[0], fc6.kernel_shape[1])


class _ValidCNN(nn.Module):
    """No padding: XLA's cost analysis counts only taps that hit real pixels, the papers count padded ones."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(16, (5, 5), padding="VALID", name="conv1")(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2, padding="VALID", name="conv2")(x))
        x = nn.relu(nn.Dense(64, name="fc1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="fc2")(x)


def _xla_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_flops_agree_with_xla_cost_analysis():
    model, batch = _ValidCNN(), 4
    layers = layers_lib.analyze(model, (20, 20, 3))
    x = jax.ShapeDtypeStruct((batch, 20, 20, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    forward = batch * sum(l.forward_flops for l in layers)
    # XLA also counts bias adds and ReLUs: within 2 %.
    assert _xla_flops(model.apply, variables, x) == pytest.approx(forward, rel=0.02)
    # Backward = 2x forward, except that nothing asks for the gradient of the input images.
    train = 3 * forward - batch * layers[0].forward_flops
    grad = jax.grad(lambda v, x: jnp.sum(model.apply(v, x)))
    assert _xla_flops(grad, variables, x) == pytest.approx(train, rel=0.02)


@pytest.mark.parametrize("padding, size, kernel, stride", [
    ("SAME", 8, 3, 1), ("VALID", 8, 3, 1), ("SAME", 2, 3, 1), (((1, 1), (1, 1)), 5, 3, 1), ("SAME", 9, 4, 2),
    ((2, 0), 7, 5, 2), ("CAUSAL", 6, 3, 1),
])
def test_conv_flops_are_what_xla_counts(padding, size, kernel, stride):
    """Forward FLOPs of a convolution == XLA's cost analysis of it (which counts only in-bounds taps),
    less the bias additions (one per output element), which the model leaves out."""

    class OneConv(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Conv(16, (kernel,) if padding == "CAUSAL" else (kernel, kernel), strides=stride,
                           padding=padding)(x)

    shape = (size, 8) if padding == "CAUSAL" else (size, size, 8)
    model, x = OneConv(), jnp.zeros((1, *shape))
    params = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes only: the count needs no values (drawing
    out = jax.eval_shape(model.apply, params, x)  # a 4-D kernel's values compiled its own random program, seconds each)
    xla = jax.jit(model.apply).lower(params, x).compile().cost_analysis()["flops"]
    (layer,) = layers_lib.analyze(model, shape)
    assert layer.forward_flops + math.prod(out.shape) == xla


# ------------------------------------------------------------------ a transformer's model FLOPs
# Chowdhery et al. (PaLM, arXiv 2204.02311, App. B) and Kaplan et al. (arXiv 2001.08361, §2.1): a training step
# costs 6·N + 12·L·d·S FLOPs per token, N the weights of the matrix products (the output layer's, tied or not),
# 12·L·d·S attention's QKᵀ and AV over all S positions (a causal mask does not halve them).
LM = dict(num_layers=2, d_model=32, num_heads=4, max_len=64, num_classes=64)
SEQ, BATCH = 64, 16


def _matmul_weights(params, tied: bool) -> int:
    """N: every kernel (attention's projections, the MLP, an untied head), plus the embedding table if tied."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    kernels = sum(leaf.size for path, leaf in flat if path[-1].key == "kernel")
    return kernels + (params["Embed_0"]["embedding"].size if tied else 0)


def _per_token_formula(model, params) -> int:
    return 6 * _matmul_weights(params, model.tie_embeddings) + 12 * model.num_layers * model.d_model * SEQ


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_model_flops_are_6n_plus_12lds_per_token(tied):
    """Every matrix product of the forward pass, tied head or not: the formula exactly (biases, norms and the
    position table are not matrix products; with them N would be 1.6 % larger here)."""
    model = build_model("transformer", tie_embeddings=tied, **LM)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))["params"]
    per_token = layers_lib.model_flops(model, (SEQ,), dtype=jnp.int32) / SEQ
    assert per_token == _per_token_formula(model, params)
    L, d, V = LM["num_layers"], LM["d_model"], LM["num_classes"]
    assert per_token == 6 * (12 * L * d * d + V * d) + 12 * L * d * SEQ  # QKV 3d², out d², MLP 8d²; head V·d
    kinds = {}
    for layer in layers_lib.matmuls(model, (SEQ,), dtype=jnp.int32):
        kinds[layer.kind] = kinds.get(layer.kind, 0) + layer.macs
    assert kinds["attention"] == L * 2 * SEQ * SEQ * d  # QKᵀ and AV: S·S·d MACs each per layer
    # The planner's and the memory model's layers stay the Dense layers dtx's layouts split.
    assert {layer.kind for layer in layers_lib.analyze(model, (SEQ,), dtype=jnp.int32)} == {"dense"}


@pytest.fixture(scope="module")
def lm_steps():
    """The tiny LM's jit train step as a run compiles it (dtx.run.setup, SGD, data × 8): per (tied, remat
    policy), the recorded model FLOPs (program_figures) and XLA's FLOPs per device."""
    from dtx import config as config_lib
    from dtx.run import setup

    found = {}
    for tied, policy in ((False, "none"), (True, "none"), (False, "dots"), (False, "full")):
        overrides = [f"--config.model.{key}={value}" for key, value in LM.items() if key != "num_classes"]
        overrides += [f"--config.dataset.seq_len={SEQ}", f"--config.global_batch_size={BATCH}",
                      "--config.driver=jit", "--config.optimizer.name=sgd", "--config.optimizer.weight_decay=0.0",
                      f"--config.remat.policy={policy}"]
        config = config_lib.load("experiments/tiny_lm.py", overrides)
        with config.unlocked() if hasattr(config, "unlocked") else contextlib.nullcontext():
            config.model.tie_embeddings = tied  # tiny_lm's model block has no such key; gpt2_small's has
        mesh = setup.make_mesh(config)
        inputs = setup.load_data(config, mesh)
        parts = setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)
        state = setup.init_state(config, parts, mesh)
        compiled = setup.compile_step(setup.make_step(config, parts, mesh), state, inputs.loader.batch(0))
        figures = setup.program_figures(compiled, parts.model, parts, mesh, BATCH)
        found[tied, policy] = dict(model=parts.model, recorded=figures.get("model_flops_per_step"),
                                   xla=setup.step_flops(config, compiled) * mesh.size)
    return found


@pytest.mark.parametrize("tied", [False, True])
def test_transformer_model_flops_against_xla(tied, lm_steps):
    """A run records the formula's FLOPs for a transformer (it recorded none before: its token ids were analysed
    as floats, which the model refuses), and XLA's count of the compiled train step and forward pass is that
    plus element-wise work (softmax over 4·64 scores per token and layer, GELU, LayerNorm, the 256-way loss, SGD),
    which is large beside matrix products of width 32: measured 1.110x (untied) and 1.106x (tied) for the step,
    1.091x and 1.088x for the forward. The bound, 1.15, tells the count apart from the old one: without
    attention's QKᵀ and AV XLA would read 1.39x, without the projections too (Dense layers only) 1.85x."""
    run = lm_steps[tied, "none"]
    model = run["model"]
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))["params"]
    assert run["recorded"] == BATCH * SEQ * _per_token_formula(model, params)
    assert 1.0 <= run["xla"] / run["recorded"] < 1.15, run["xla"] / run["recorded"]
    forward = sum(layer.forward_flops for layer in layers_lib.matmuls(model, (SEQ,), dtype=jnp.int32)) * 2
    tokens = jax.ShapeDtypeStruct((2, SEQ), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    assert 1.0 <= _xla_flops(model.apply, variables, tokens) / forward < 1.15


def test_remat_raises_hfu_not_mfu(lm_steps):
    """MFU's numerator (the recorded model FLOPs) is the same under every remat.policy; HFU's (XLA's count)
    rises by the recomputed forward: under ``full`` at least the blocks' matmuls but the MLP down-projection
    (XLA drops that recomputation as dead code; tests/test_remat.py), L·(16·d² + 4·S·d) per token, and ``dots``
    recomputes at least attention's products, L·4·S·d."""
    from dtx.perf import flops

    recorded = {p: lm_steps[False, p]["recorded"] for p in ("none", "dots", "full")}
    assert recorded["none"] == recorded["dots"] == recorded["full"]
    seconds, peak = 0.25, 1e12
    used = {p: flops.utilisation(recorded[p], lm_steps[False, p]["xla"] / 8, 8, seconds, peak)
            for p in ("none", "dots", "full")}
    assert used["none"]["mfu"] == used["dots"]["mfu"] == used["full"]["mfu"]
    L, d, tokens = LM["num_layers"], LM["d_model"], BATCH * SEQ
    none, dots, full = (lm_steps[False, p]["xla"] for p in ("none", "dots", "full"))
    assert (full - none) >= tokens * L * (16 * d * d + 4 * SEQ * d)
    assert full > dots >= none + tokens * L * 4 * SEQ * d
    assert used["full"]["hfu"] / used["none"]["hfu"] == pytest.approx(full / none)
    assert used["none"]["hfu"] > used["none"]["mfu"]


def test_gpt2_small_model_flops_at_full_size():
    """experiments/gpt2_small.py at full size, from abstract shapes only (nothing compiles): 12 blocks of 768,
    1024 positions, the 50257-word output layer tied to the embedding. N = 85.0 M block weights + 38.6 M output
    layer; 854.4 M FLOPs per token, of which attention's 12·L·d·S is 113.2 M (13 %)."""
    from dtx.experiments import gpt2_small

    config = gpt2_small.get_config()
    settings = {key: value for key, value in config.model.items() if key != "name"}
    model = build_model("transformer", num_classes=gpt2_small.VOCAB, dtype=jnp.bfloat16, **settings)
    seq = config.dataset.seq_len
    per_token = layers_lib.model_flops(model, (seq,), dtype=jnp.int32) / seq
    L, d, V = 12, 768, gpt2_small.VOCAB
    assert per_token == 6 * (12 * L * d * d + V * d) + 12 * L * d * seq
    assert per_token == pytest.approx(854.4e6, rel=1e-4)


def test_one_trace_per_model_shape_and_dtype():
    """The memory model asks for a model's layers and variables many times (per layout it weighs, its VJP profile,
    its remat terms): two builds of one model share one abstract trace; another width, example shape or input
    dtype is traced anew, and what the shared trace gives equals a fresh trace's."""
    calls = []
    model = build_model("mlp", features=(24,), num_classes=5)

    def counted(next_fun, args, kwargs, context):
        if context.method_name == "__call__" and type(context.module) is type(model):  # the model, once a trace
            calls.append(context.module)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(counted):
        first = layers_lib.analyze(model, (7,))
        again = layers_lib.analyze(build_model("mlp", features=(24,), num_classes=5), [7])  # equal settings
        variables = layers_lib.abstract_variables(model, (7,))
        assert len(calls) == 1 and again == first
        assert layers_lib.analyze(model.clone(features=(16,)), (7,))[0].out_elements == 16  # another width
        assert layers_lib.analyze(model, (9,))[0].in_elements == 9  # another example shape
        layers_lib.analyze(model, (7,), dtype=jnp.bfloat16)  # another input dtype
        assert len(calls) == 4
        listed = build_model("mlp", features=[24], num_classes=5)  # a list field: no hash, traced each time
        assert layers_lib.analyze(listed, (7,)) == layers_lib.analyze(listed, (7,)) == first
        assert len(calls) == 6
    fresh = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 7)), train=False))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), variables) == jax.tree.map(lambda a: (a.shape, a.dtype), fresh)
