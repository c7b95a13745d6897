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
    codes, scales = jax.jit(quantizer.encode)(v, count, jax.random.key(0))
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


def test_stochastic_rounding_draws_flat_the_values_a_shaped_draw_gives():
    """The quantisers draw their uniforms flat and reshape (XLA:CPU compiles that far faster): the values must be
    the shaped draw's, bit for bit, or the change would alter every stochastic code."""
    key = jax.random.key(7)
    for shape in [(3, 4, 5), (2, 3, 4, 5), (7,)]:
        np.testing.assert_array_equal(quantize._uniform(key, shape), jax.random.uniform(key, shape))
