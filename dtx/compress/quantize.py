"""Low-bit gradient codes (Hitchhiker's Guide §5), carried by the compressed allreduce of :mod:`dtx.comm.compressed`.

The quantisers of the Hitchhiker's Guide (Chahal et al., arXiv 1810.11787, §5:
"quantization") as pure array functions, the bit packing that makes their codes
small on the wire (:mod:`dtx.comm.compressed`, with the two-phase *compressed allreduce*
in which only packed codes cross the mesh). :mod:`dtx.compress` builds its ``sign``,
``terngrad`` and ``qsgd`` compressors from these pieces.

Quantisers map rows of float32 values to ``bits``-bit codes plus float32 scales
(one per row, or one per bucket of ``bucket`` entries):

* ``sign`` — 1 bit: ``scale · sign(v)`` with ``scale = mean |v|`` over the row.
  EF-signSGD (Karimireddy et al., *Error Feedback Fixes SignSGD and other Gradient
  Compression Schemes*, ICML 2019); the descendant of 1-bit SGD (Seide et al.,
  Interspeech 2014), which also feeds the quantisation error back. Biased.
* ``ternary`` — 2 bits: ``s · sign(v) · b`` with ``s = max |v|`` per bucket and
  ``b ~ Bernoulli(|v| / s)``: TernGrad (Wen et al., NeurIPS 2017). Unbiased.
* ``qsgd`` — ``⌈lg(2L+1)⌉`` bits: ``‖v‖₂ · sign(v) · l / L`` per bucket with the
  level ``l`` rounded stochastically between ``⌊L|v|/‖v‖₂⌋`` and the next: QSGD
  (Alistarh et al., NeurIPS 2017), without its Elias coding. Unbiased.

:func:`compressed_allreduce` follows the two phases of 1-bit Adam's compressed
allreduce (Tang et al., ICML 2021): each leaf is split into ``p`` chunks; phase 1
is an all-to-all of every worker's codes for chunk ``j`` to worker ``j``, which
decodes them and averages its chunk; phase 2 re-quantises the averaged chunk and
all-gathers it. Each device sends ``2(p−1)`` chunks of codes, against ``2(p−1)``
float32 chunks for a ring allreduce: the wire ratio equals the code ratio.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# The bytes on the wire, the quantiser interface and the collective: dtx.comm.compressed's (other families use them).
from dtx.comm.compressed import (  # noqa: F401
    Layout, Quantizer, chunk_bytes, chunk_layout, compressed_allreduce, pack_bits, unpack_bits, uniforms,
)


# ----------------------------------------------------------------------------- quantisers
def _bucketed(v_RW: jax.Array, bucket: int) -> jax.Array:
    """``(R, W) -> (R, B, bucket)`` zero-padded; one bucket of ``W`` when ``bucket == 0``."""
    r, w = v_RW.shape
    size = bucket or w
    nb = -(-w // size)
    return jnp.pad(v_RW, ((0, 0), (0, nb * size - w))).reshape(r, nb, size)


def _unbucketed(x_RBS: jax.Array, w: int) -> jax.Array:
    return x_RBS.reshape(x_RBS.shape[0], -1)[:, :w]


def sign_quantizer() -> Quantizer:
    """1 bit per entry, one scale (the mean magnitude of the row's real entries) per row."""

    def encode(v_RW, count_R, u):
        del u
        scale_R = jnp.abs(v_RW).sum(-1) / jnp.maximum(count_R, 1)  # padding is zero: divide by the real count
        return (v_RW >= 0).astype(jnp.uint8), scale_R[:, None].astype(jnp.float32)

    def decode(codes_RW, scales_RB):
        return scales_RB[:, :1] * (2.0 * codes_RW.astype(jnp.float32) - 1.0)

    return Quantizer("sign", 1, 0, encode, decode)


def ternary_quantizer(bucket: int) -> Quantizer:
    """TernGrad: codes 0, 1, 2 for −s, 0, +s with ``P(±s) = |v| / s``, ``s = max |v|`` per bucket."""

    def encode(v_RW, count_R, u):
        del count_R
        w = v_RW.shape[1]
        v = _bucketed(v_RW, bucket)
        s = jnp.abs(v).max(-1, keepdims=True)
        prob = jnp.clip(jnp.abs(v) / jnp.where(s > 0, s, 1.0), 0.0, 1.0)
        keep = u < prob
        codes = 1 + jnp.where(keep, jnp.sign(v), 0.0)
        return _unbucketed(codes, w).astype(jnp.uint8), s[..., 0]

    def decode(codes_RW, scales_RB):
        w = codes_RW.shape[1]
        c = _bucketed(codes_RW.astype(jnp.float32) - 1.0, bucket)
        return _unbucketed(c * scales_RB[..., None], w)

    return Quantizer("ternary", 2, bucket, encode, decode, stochastic=True)


def qsgd_quantizer(levels: int, bucket: int) -> Quantizer:
    """QSGD with ``L = levels``: codes ``L + sign(v)·l`` in ``[0, 2L]``, ``l`` stochastically rounded."""
    bits = max(1, math.ceil(math.log2(2 * levels + 1)))

    def encode(v_RW, count_R, u):
        del count_R
        w = v_RW.shape[1]
        v = _bucketed(v_RW, bucket)
        norm = jnp.sqrt(jnp.sum(v * v, -1, keepdims=True))
        x = jnp.abs(v) / jnp.where(norm > 0, norm, 1.0) * levels
        # floor(x + u), u ~ U[0, 1): E = x, so the code is unbiased. Clip: x may round past L.
        level = jnp.clip(jnp.floor(x + u), 0, levels)
        codes = levels + jnp.sign(v) * level
        return _unbucketed(codes, w).astype(jnp.uint8), norm[..., 0]

    def decode(codes_RW, scales_RB):
        w = codes_RW.shape[1]
        c = _bucketed(codes_RW.astype(jnp.float32) - levels, bucket)
        return _unbucketed(c * (scales_RB[..., None] / levels), w)

    return Quantizer("qsgd", bits, bucket, encode, decode, stochastic=True)
