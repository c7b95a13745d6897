"""dtx.perf.layers: per-layer MACs and weights against the papers' layer tables, FLOPs against XLA's cost analysis."""
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
    params = model.init(jax.random.key(0), x)
    out = jax.eval_shape(model.apply, params, x)
    xla = jax.jit(model.apply).lower(params, x).compile().cost_analysis()["flops"]
    (layer,) = layers_lib.analyze(model, shape)
    assert layer.forward_flops + math.prod(out.shape) == xla
