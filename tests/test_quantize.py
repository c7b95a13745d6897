"""dtx.compress.quantize: every quantiser puts values on its paper's levels with its paper's scale; bit packing round-trips
and is as tight as the bit width allows."""
import math

import jax
import numpy as np
import pytest

from dtx.compress import quantize


@pytest.mark.parametrize("name", ["sign", "ternary", "qsgd"])
def test_quantisers_put_every_value_on_their_papers_levels(name):
    """Decoded values lie on each paper's levels, with each paper's scale: sign ±mean|v| over the row's
    real entries (EF-signSGD); TernGrad {−s, 0, +s}, s = max|v| per bucket; QSGD ‖v‖₂·l/L per bucket,
    l = ⌊L|v|/‖v‖₂⌋ or the next level up, with v's sign. Rows of three magnitudes; row 2 is padded."""
    rng = np.random.default_rng(6)
    v = (rng.normal(size=(3, 40)) * [[1.0], [0.01], [100.0]]).astype(np.float32)
    count = np.array([40, 40, 33], np.int32)
    v[2, 33:] = 0.0  # padding is zero
    levels, bucket = 3, 16
    quantizer = {"sign": quantize.sign_quantizer(), "ternary": quantize.ternary_quantizer(bucket),
                 "qsgd": quantize.qsgd_quantizer(levels, bucket)}[name]
    u = quantize.uniforms([jax.random.key(0)], [quantizer.noise_shape(3, 40)])[0] if quantizer.stochastic else None
    codes, scales = jax.jit(quantizer.encode)(v, count, u)
    decoded = np.asarray(quantizer.decode(codes, scales), np.float64)
    assert int(np.max(codes)) < 2 ** quantizer.bits
    x = v.astype(np.float64)
    if name == "sign":
        scale = np.abs(x).sum(1, keepdims=True) / count[:, None]
        np.testing.assert_allclose(decoded, np.where(x >= 0, scale, -scale), rtol=1e-6)
        return
    per_bucket = np.pad(x, ((0, 0), (0, 8))).reshape(3, 3, bucket)  # 40 entries: buckets of 16, 16, 8
    s = np.abs(per_bucket).max(-1) if name == "ternary" else np.sqrt((per_bucket ** 2).sum(-1))
    s = np.repeat(s, bucket, axis=1)[:, :40]
    level = decoded / s * (1 if name == "ternary" else levels)
    np.testing.assert_allclose(level, np.round(level), atol=1e-5)  # on a level
    level = np.round(level)
    assert np.all((level == 0) | (np.sign(level) == np.sign(x)))
    floor = np.floor(np.abs(x) / s * (1 if name == "ternary" else levels))
    assert np.all((np.abs(level) == floor) | (np.abs(level) == floor + 1))
    assert np.any(np.abs(level) == floor) and np.any(np.abs(level) == floor + 1)  # both roundings occur


def test_bit_packing_round_trips_and_is_tight():
    rng = np.random.default_rng(4)
    codes = {bits: rng.integers(0, 2 ** bits, (3, 13)).astype(np.uint8) for bits in range(1, 9)}

    @jax.jit
    def round_trip(codes):
        packed = {b: quantize.pack_bits(c, b) for b, c in codes.items()}
        return packed, {b: quantize.unpack_bits(p, b, 13) for b, p in packed.items()}

    packed, unpacked = round_trip(codes)
    for bits in codes:
        assert packed[bits].shape == (3, math.ceil(13 * bits / 8))
        np.testing.assert_array_equal(unpacked[bits], codes[bits])
    np.testing.assert_array_equal(packed[1], np.packbits(codes[1], axis=1, bitorder="little"))


def test_the_leaves_uniforms_are_each_leafs_own_shaped_draw():
    """The quantisers draw every leaf's uniforms at once, flat, in one batched draw per size class (XLA:CPU
    compiles that far faster): the values must be each leaf's own shaped draw from its own key, bit for bit, or
    the change would alter every stochastic code. Sizes 1 to 180 over five classes, two of them shared."""
    keys = [jax.random.fold_in(jax.random.key(7), i) for i in range(7)]
    shapes = [(3, 4, 5), (2, 3, 4, 5), (7,), (1, 1, 1), (8, 2, 4), (5, 13), (2, 3, 30)]
    drawn = quantize.uniforms(keys, shapes)
    for key, shape, got in zip(keys, shapes, drawn):
        np.testing.assert_array_equal(got, jax.random.uniform(key, shape))
