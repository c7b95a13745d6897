"""The compressed allreduce: the mean over workers with only low-bit codes on the wire.

A collective several families use — the ``sign``, ``terngrad`` and ``qsgd`` compressors
(:mod:`dtx.compress`), 1-bit Adam/LAMB (:mod:`dtx.strategies.onebit`) and Streaming DiLoCo's
quantised outer gradients (:mod:`dtx.strategies.streaming`) — so it lives here, on the
communication floor, with what it needs: the bit packing, the one-row byte layout, the
:class:`Quantizer` interface a code plugs in by (the quantisers themselves are
:mod:`dtx.compress.quantize`'s) and the batched uniforms of the stochastic ones.

:func:`compressed_allreduce` follows the two phases of 1-bit Adam's compressed
allreduce (Tang et al., ICML 2021): each leaf is split into ``p`` chunks; phase 1
is an all-to-all of every worker's codes for chunk ``j`` to worker ``j``, which
decodes them and averages its chunk; phase 2 re-quantises the averaged chunk and
all-gathers it. Each device sends ``2(p−1)`` chunks of codes, against ``2(p−1)``
float32 chunks for a ring allreduce: the wire ratio equals the code ratio
(:func:`dtx.comm.costmodel.compressed_allreduce_traffic`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


# ----------------------------------------------------------------------------- bytes on the wire
def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``bits``-bit codes (uint8, last axis ``w``) into ``⌈w·bits/8⌉`` bytes, little-endian."""
    *lead, w = codes.shape
    nbytes = -(-w * bits // 8)
    if 8 % bits == 0:  # whole codes per byte: shift each into its slot
        per = 8 // bits
        codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, nbytes * per - w)]).reshape(*lead, nbytes, per)
        shifts = (bits * jnp.arange(per)).astype(jnp.uint8)
    else:  # codes straddle bytes: go through single bits
        planes = (codes[..., None] >> jnp.arange(bits, dtype=jnp.uint8)) & 1  # (..., w, bits)
        planes = jnp.pad(planes.reshape(*lead, w * bits), [(0, 0)] * len(lead) + [(0, 8 * nbytes - w * bits)])
        codes, shifts = planes.reshape(*lead, nbytes, 8), jnp.arange(8, dtype=jnp.uint8)
    # The slots of a byte are disjoint, so their sum cannot carry.
    return (codes << shifts).sum(-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, w: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: the first ``w`` codes of ``bits`` bits each, as uint8."""
    *lead, nbytes = packed.shape
    if 8 % bits == 0:
        per = 8 // bits
        shifts = (bits * jnp.arange(per)).astype(jnp.uint8)
        codes = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
        return codes.reshape(*lead, nbytes * per)[..., :w]
    planes = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    planes = planes.reshape(*lead, nbytes * 8)[..., : w * bits].reshape(*lead, w, bits)
    return (planes << jnp.arange(bits, dtype=jnp.uint8)).sum(-1, dtype=jnp.uint8)


class Layout:
    """A static byte layout: several arrays ``(..., m_i)`` of dtypes ``d_i`` in one uint8 row.

    One buffer means one collective per step however many leaves and parts there are.
    """

    def __init__(self, parts: Sequence[tuple[int, jnp.dtype]]):
        self.parts = [(int(m), jnp.dtype(d)) for m, d in parts]
        self.nbytes = sum(m * d.itemsize for m, d in self.parts)

    def pack(self, arrays: Sequence[jax.Array]) -> jax.Array:
        rows = []
        for a, (m, dtype) in zip(arrays, self.parts, strict=True):
            assert a.shape[-1] == m and a.dtype == dtype, (a.shape, a.dtype, m, dtype)
            if dtype.itemsize > 1:
                a = lax.bitcast_convert_type(a, jnp.uint8).reshape(*a.shape[:-1], m * dtype.itemsize)
            rows.append(a)
        return jnp.concatenate(rows, axis=-1)

    def unpack(self, buffer: jax.Array) -> list[jax.Array]:
        out, start = [], 0
        for m, dtype in self.parts:
            piece = buffer[..., start: start + m * dtype.itemsize]
            start += m * dtype.itemsize
            if dtype.itemsize > 1:
                piece = lax.bitcast_convert_type(piece.reshape(*piece.shape[:-1], m, dtype.itemsize), dtype)
            out.append(piece)
        return out


# ----------------------------------------------------------------------------- codes
class Quantizer(NamedTuple):
    """Rows of values ↔ codes and scales.

    Attributes:
      name: ``sign``, ``ternary`` or ``qsgd``.
      bits: bits per code on the wire.
      bucket: entries per scale; 0: one scale per row.
      encode: ``(v_RW, count_R, u) -> (codes_RW uint8, scales_RB float32)``; only the
        first ``count`` entries of a row are real (the rest is padding, zero). ``u``: uniforms
        in [0, 1) shaped :meth:`noise_shape` for a stochastic quantiser (:func:`uniforms` draws
        them), ``None`` for a deterministic one.
      decode: ``(codes_RW, scales_RB) -> v_RW`` float32.
      stochastic: whether ``encode`` rounds with uniforms.
    """

    name: str
    bits: int
    bucket: int
    encode: Callable[[jax.Array, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array, jax.Array], jax.Array]
    stochastic: bool = False

    def buckets(self, w: int) -> int:
        return -(-w // self.bucket) if self.bucket else 1

    def noise_shape(self, r: int, w: int) -> tuple[int, int, int]:
        """The uniforms ``encode`` takes for ``r`` rows of ``w``: one per bucketed entry, padding included."""
        return r, self.buckets(w), self.bucket or w


def uniforms(keys: Sequence[jax.Array], shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    """``[jax.random.uniform(k, shape) for k, shape in zip(keys, shapes)]``, the same values bit for bit, in one
    batched draw per size class instead of one draw per leaf.

    JAX's threefry (``jax_threefry_partitionable``, the default) counts each element by its row-major index, so
    a shape's draw is the first ``prod(shape)`` values of a longer flat draw from the same key: leaves whose
    sizes lie in the same power-of-two class ``(2^(c-1), 2^c]`` share one draw of the class's longest size,
    vmapped over their keys (at most twice the values drawn). Each key's draw is flat and reshaped, never
    shaped: XLA:CPU compiles a 1-D threefry in a fraction of the time of a 3-D one (LLVM's -O2 on the loop
    nest: ~1 s against 4-10 s). Each draw is a kernel of its own: a 1-block transformer's QSGD step spent
    8.6 s of its compile on one draw per leaf and phase, 4.4 s on these.
    """
    sizes = [math.prod(shape) for shape in shapes]
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        classes.setdefault(max(n - 1, 0).bit_length(), []).append(i)
    out: list = [None] * len(sizes)
    for members in classes.values():
        longest = max(sizes[i] for i in members)
        drawn = jax.vmap(lambda k: jax.random.uniform(k, (longest,)))(jnp.stack([keys[i] for i in members]))
        for row, i in enumerate(members):
            out[i] = drawn[row, : sizes[i]].reshape(shapes[i])
    return out


# ----------------------------------------------------------------------------- the collective
def chunk_layout(n: int, p: int, q: Quantizer) -> tuple[int, np.ndarray, Layout]:
    """For a leaf of ``n`` entries over ``p`` workers: chunk width, real entries per chunk, one chunk's bytes."""
    w = max(1, -(-n // p))
    counts = np.clip(n - w * np.arange(p), 0, w).astype(np.int32)
    return w, counts, Layout([(-(-w * q.bits // 8), jnp.uint8), (q.buckets(w), jnp.float32)])


def chunk_bytes(shapes: Sequence[tuple[int, ...]], p: int, q: Quantizer) -> int:
    """Bytes of one worker's message to one peer in either phase: one chunk of every leaf."""
    return sum(chunk_layout(int(np.prod(s, dtype=np.int64)), p, q)[2].nbytes for s in shapes)


def compressed_allreduce(
    leaves: Sequence[jax.Array], server: Sequence[jax.Array] | None, q: Quantizer, key: jax.Array,
    axes: tuple[str, ...], p: int, index: jax.Array,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array] | None]:
    """The mean over workers of float32 ``leaves``, with only ``q``'s codes on the wire.

    Args:
      leaves: this worker's values (error feedback already added), float32, any shapes.
      server: per leaf, this worker's server-side residual (error feedback of phase 2),
        float32 and shaped like the leaf; only the entries of the chunk this worker
        averages are used (its width depends on ``p``, which the state's ``init`` does
        not know). ``None``: no server-side error feedback.
      q: the quantiser.
      key: this worker's key (its randomness must differ from the other workers').
      axes: the workers' mesh axes; ``()`` runs both phases locally (no collectives),
        as the yardstick step of ``dtx bench step`` does; the server residual is then
        left alone.
      p: number of workers.
      index: this worker's index (chunk ``index`` is the one it averages).

    Returns:
      ``(mean, sent, server)``: the decoded mean per leaf, identical on every worker;
      what this worker's phase-1 codes decode to (its own error is ``leaves − sent``);
      and the new server residuals (``None`` when ``server`` is).
    """
    key1, key2 = jax.random.split(key)
    plans = [chunk_layout(x.size, p, q) for x in leaves]
    rows = Layout([(lay.nbytes, jnp.uint8) for _, _, lay in plans])

    def encode(x_RW, count_R, u, lay):
        codes, scales = q.encode(x_RW, count_R, u)
        return lay.pack([pack_bits(codes, q.bits), scales])

    def draws(phase_key, r):  # every leaf's uniforms for one phase: leaf i's from fold_in(phase_key, i)
        if not q.stochastic:
            return [None] * len(leaves)
        return uniforms([jax.random.fold_in(phase_key, i) for i in range(len(leaves))],
                        [q.noise_shape(r, w) for w, _, _ in plans])

    def decode(row_RB, lay, w, count_R):
        packed, scales = lay.unpack(row_RB)
        values = q.decode(unpack_bits(packed, q.bits, w), scales)
        return jnp.where(jnp.arange(w) < count_R[:, None], values, 0.0)  # drop the padding's codes

    def chunked(x, w):
        return jnp.pad(x.reshape(-1), (0, p * w - x.size)).reshape(p, w)

    def unchunked(x_PW, like):
        return x_PW.reshape(-1)[: like.size].reshape(like.shape)

    # Phase 1: every worker encodes all p chunks of every leaf; chunk j is for worker j.
    phase1, sent = [], []
    for x, u, (w, counts, lay) in zip(leaves, draws(key1, p), plans):
        phase1.append(encode(chunked(x, w), jnp.asarray(counts), u, lay))
        sent.append(unchunked(decode(phase1[-1], lay, w, jnp.asarray(counts)), x))
    if not axes:
        # The yardstick of `dtx bench step`: the same arithmetic with the two collectives
        # replaced by local stand-ins (my own p chunks play the p received pieces; my one
        # re-quantised chunk plays the p gathered ones). The mean is therefore not a
        # gradient — only the compute is faithful, which is all a timing needs.
        mean = []
        for r, x, u, (w, counts, lay) in zip(phase1, leaves, draws(key2, 1), plans):
            count = jnp.asarray(counts)[index]
            y = decode(r, lay, w, jnp.broadcast_to(count, (p,))).mean(0, keepdims=True)
            row = encode(y, count[None], u, lay)
            mean.append(unchunked(decode(jnp.broadcast_to(row, (p,) + row.shape[1:]), lay, w, jnp.asarray(counts)), x))
        return mean, sent, server

    received = rows.unpack(lax.all_to_all(rows.pack(phase1), axes, 0, 0))  # row i: worker i's piece of my chunk
    phase2, new_server = [], []
    for i, (r, x, u, (w, counts, lay)) in enumerate(zip(received, leaves, draws(key2, 1), plans)):
        count = jnp.asarray(counts)[index]
        y = decode(r, lay, w, jnp.broadcast_to(count, (p,))).mean(0, keepdims=True)
        if server is not None:
            s_PW = chunked(server[i], w)
            y = y + lax.dynamic_index_in_dim(s_PW, index, keepdims=True)
        # Phase 2: re-quantise the averaged chunk (plus the server residual) and share it.
        phase2.append(encode(y, count[None], u, lay))
        if server is not None:
            error = y - decode(phase2[-1], lay, w, count[None])
            new_server.append(unchunked(lax.dynamic_update_index_in_dim(s_PW, error[0], index, 0), x))
    gathered = rows.unpack(lax.all_gather(rows.pack(phase2)[0], axes))  # row j: chunk j, from worker j
    mean = [unchunked(decode(g, lay, w, jnp.asarray(counts)), x)
            for g, x, (w, counts, lay) in zip(gathered, leaves, plans)]
    return mean, sent, new_server if server is not None else None
