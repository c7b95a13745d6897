"""Causal attention over a sequence split on the ``context`` axis: ring, all-gather and Ulysses, per device.

Each function runs inside a ``shard_map`` that is manual over the ``context`` axis of ``C`` devices (and may be
over others: only ``axis`` is named). Every device holds ``S/C`` positions of each sequence of its examples —
its queries, keys and values, ``(batch, S/C, heads, head_dim)`` — and returns the attention output of its own
positions, the same values one device computes over the whole sequence (``jax.nn.dot_product_attention`` with a
causal mask), to the rounding of float32.

* **The layout of positions** (:func:`positions`). Contiguous, device ``i`` holding chunk ``i`` of ``C``: under
  a causal mask device ``C − 1`` attends to every key and device 0 to its own only. Balanced (the default), the
  sequence cut into ``2C`` chunks and device ``i`` holding chunks ``i`` and ``2C − 1 − i`` (Megatron-LM's and
  Llama 3's load balancing for context parallelism): every device then has the same number of query-key pairs
  the mask keeps. The caller lays the sequence out so (:func:`balance`, :func:`unbalance`).
* **Ring** (:func:`ring`; Liu, Zaharia & Abbeel 2023, *Ring Attention with Blockwise Transformers*, arXiv
  2310.01889): each device keeps its queries; the key/value chunks travel the ring by ``ppermute``, ``C − 1``
  hops, and each arriving chunk is folded into a float32 online softmax — the running maximum ``m``, the running
  sum ``l`` and the unnormalised output, rescaled by ``exp(m_old − m_new)`` as flash attention does (Dao et al.
  2022, arXiv 2205.14135, §3.1; Milakov & Gimelshein 2018). Nothing of size ``S × S`` exists on a device.
* **All-gather** (:func:`allgather`; Llama 3, Dubey et al. 2024, arXiv 2407.21783, §3.3.2): the keys and values
  of the whole sequence all-gathered over the axis, the local queries attending to them under the mask of their
  global positions.
* **Ulysses** (:func:`ulysses`; Jacobs et al. 2023, *DeepSpeed Ulysses*, arXiv 2309.14509): an all-to-all turns
  the sequence split into a head split — each device then holds every position of ``heads/C`` heads — attention
  runs whole for those heads, and a second all-to-all turns the output back. ``heads`` must divide by ``C``.

The scores and the softmax are float32 whatever the inputs' dtype; the output has the values' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG_INF = -1e30  # a masked score: finite, so a row with no key yet keeps exp(NEG_INF - m) = 0 without NaNs
KINDS = ("ring", "allgather", "ulysses")


def positions(rank, size: int, local: int, balanced: bool = True):
    """The global positions of the ``local`` positions device ``rank`` of ``size`` holds (module docstring):
    contiguous chunk ``rank``, or, balanced, chunks ``rank`` and ``2·size − 1 − rank`` of ``2·size``."""
    xp = np if isinstance(rank, (int, np.integer)) else jnp  # numpy for a known rank: a layout, not a program
    if not balanced:
        return rank * local + xp.arange(local)
    half = local // 2
    return xp.concatenate([rank * half + xp.arange(half), (2 * size - 1 - rank) * half + xp.arange(half)])


def order(size: int, length: int, balanced: bool = True) -> np.ndarray:
    """The global positions in the order the devices hold them, device 0's first: ``x[:, order]`` lays a
    natural-order sequence out for the axis (a permutation of ``range(length)``)."""
    local = length // size
    if balanced and local % 2:
        raise ValueError(f"balanced context parallelism cuts each sequence into 2 x {size} chunks: the sequence "
                         f"length {length} must divide by {2 * size}; set context.balance=False or pad the sequence")
    if length % size:
        raise ValueError(f"a sequence of {length} positions does not split over {size} devices of the context axis")
    return np.concatenate([np.asarray(positions(r, size, local, balanced)) for r in range(size)])


def balance(x, size: int, axis: int = 1, balanced: bool = True):
    """``x`` (natural order along ``axis``) in the order the devices hold it (:func:`order`)."""
    return jnp.take(x, order(size, x.shape[axis], balanced), axis=axis)


def unbalance(x, size: int, axis: int = 1, balanced: bool = True):
    """The inverse of :func:`balance`: a sequence in the devices' order back in natural order."""
    return jnp.take(x, np.argsort(order(size, x.shape[axis], balanced)), axis=axis)


def _scores(q, k):
    """``(batch, heads, q, k)`` float32 scores of queries ``(b, q, h, d)`` and keys ``(b, k, h, d)``."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    return jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale


def _visible(q_pos, k_pos):
    """``(q, k)``: whether the query at each position sees the key at each position (causal)."""
    return q_pos[:, None] >= k_pos[None, :]


def chunks(rank, size: int, balanced: bool = True) -> tuple:
    """The chunk indices device ``rank`` holds, in its local order: ``(rank,)`` of ``size`` contiguous chunks, or
    balanced ``(rank, 2·size − 1 − rank)`` of ``2·size``."""
    return (rank, 2 * size - 1 - rank) if balanced else (rank,)


def _fold(state, q, k, v, q_pos, k_pos):
    """One key/value block folded into the online softmax ``(m, l, o)`` of the queries ``q`` (module docstring)."""
    m, l, o = state
    s = jnp.where(_visible(q_pos, k_pos), _scores(q, k), NEG_INF)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    rescale = jnp.exp(m - m_new)
    return (m_new, l * rescale + p.sum(-1),
            o * rescale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, v.astype(jnp.float32)))


def _varying_like(x, ref):
    """``x`` typed as varying over the manual axes ``ref`` varies over (``shard_map``'s replication types: both
    branches of a ``lax.cond`` must agree)."""
    kind = jax.typeof(ref)
    axes = getattr(getattr(kind, "manual_axis_type", None), "varying", None)  # jax 0.10
    axes = getattr(kind, "vma", frozenset()) if axes is None else axes  # later jax
    if not axes:
        return x
    cast = getattr(lax, "pcast", None)
    return cast(x, tuple(sorted(axes)), to="varying") if cast else lax.pvary(x, tuple(sorted(axes)))


def ring(q, k, v, axis: str, balanced: bool = True, skip: bool = True, count: bool = False):
    """Ring attention of the local queries over every device's keys and values (module docstring).

    Each device's positions are its :func:`chunks` (two when ``balanced``); at every hop each pair of a query chunk
    and an arriving key chunk is one block. ``skip``: a block the causal mask hides entirely (its key chunk after
    its query chunk) is not computed (``lax.cond``), so a device's work is the blocks it keeps — equal on every
    device when balanced, ``rank + 1`` of ``C`` when contiguous. ``count``: also return the blocks this device
    computed (an int32 scalar), what the tests read the balance from."""
    size, rank = lax.axis_size(axis), lax.axis_index(axis)
    parts = 2 if balanced else 1
    width = q.shape[1] // parts  # positions per chunk
    sub = lambda x, i: x[:, i * width:(i + 1) * width]  # noqa: E731 - the i-th chunk of a local array
    at = lambda chunk: chunk * width + jnp.arange(width)  # noqa: E731 - a chunk's global positions
    shape = (q.shape[0], q.shape[2], width)  # (batch, heads, queries of a chunk)
    like = functools.partial(_varying_like, ref=q)  # a skipped block's state typed as a computed one (lax.cond)
    states = [(like(jnp.full(shape, NEG_INF, jnp.float32)), like(jnp.zeros(shape, jnp.float32)),
               like(jnp.zeros((*shape, v.shape[-1]), jnp.float32))) for _ in range(parts)]
    blocks = like(jnp.zeros((), jnp.int32))
    hop = [(i, (i + 1) % size) for i in range(size)]
    q_chunks = chunks(rank, size, balanced)
    for step in range(size):  # the chunks of device (rank - step) mod size
        if step:
            k, v = lax.ppermute(k, axis, hop), lax.ppermute(v, axis, hop)
        k_chunks = chunks((rank - step) % size, size, balanced)
        for i, q_chunk in enumerate(q_chunks):
            for j, k_chunk in enumerate(k_chunks):
                fold = functools.partial(_fold, q=sub(q, i), k=sub(k, j), v=sub(v, j), q_pos=at(q_chunk),
                                         k_pos=at(k_chunk))
                if skip:  # a hidden block: the key chunk lies after the query chunk
                    states[i], blocks = lax.cond(k_chunk > q_chunk, lambda st, b: (st, b),
                                                 lambda st, b: (fold(st), b + 1), states[i], blocks)
                else:
                    states[i], blocks = fold(states[i]), blocks + 1
    out = jnp.concatenate([o / l[..., None] for _, l, o in states], axis=2)  # (batch, heads, local, head_dim)
    out = jnp.einsum("bhqd->bqhd", out).astype(v.dtype)
    return (out, blocks) if count else out


def ring_table(size: int, balanced: bool = True) -> list[list[tuple]]:
    """Who holds which key/value chunks at each hop of :func:`ring`: ``table[step][rank]``, the chunks of device
    ``(rank − step) mod size`` (:func:`chunks`, what the kernel itself calls), and whether each block against the
    device's own query chunks is computed or skipped."""
    return [[chunks((rank - step) % size, size, balanced) for rank in range(size)] for step in range(size)]


def ring_work(size: int, balanced: bool = True) -> list[int]:
    """The blocks each device of :func:`ring` computes, from :func:`ring_table`: the pairs of a query chunk of its
    own and a key chunk it holds at some hop that the causal mask does not hide entirely."""
    mine = [chunks(rank, size, balanced) for rank in range(size)]
    return [sum(1 for row in ring_table(size, balanced) for c in row[r] for q in mine[r] if c <= q)
            for r in range(size)]


def ring_diagram(size: int, balanced: bool = True) -> str:
    """:func:`ring_table` drawn: a row per hop, a column per device, each cell the key/value chunks the device
    holds then, a ``*`` on each that some query chunk of the device sees under the causal mask (a block it
    computes), and the blocks each device computes in all (:func:`ring_work`)."""
    table = ring_table(size, balanced)
    mine = [chunks(rank, size, balanced) for rank in range(size)]
    cell = lambda rank, held: ",".join(f"{c}{'*' if any(c <= q for q in mine[rank]) else ''}"  # noqa: E731
                                       for c in held)
    width = max([len(f"device {size - 1}")] + [len(cell(r, held)) for row in table for r, held in enumerate(row)]) + 2
    lines = ["hop   " + "".join(f"device {r}".ljust(width) for r in range(size)).rstrip()]
    for step, row in enumerate(table):
        lines.append(f"{step:<6}" + "".join(cell(r, held).ljust(width) for r, held in enumerate(row)).rstrip())
    lines.append("work  " + "".join(f"{w} blocks".ljust(width) for w in ring_work(size, balanced)).rstrip())
    return "\n".join(lines)


def allgather(q, k, v, axis: str, balanced: bool = True):
    """The local queries over the all-gathered keys and values (module docstring)."""
    size, rank = lax.axis_size(axis), lax.axis_index(axis)
    local = q.shape[1]
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)  # device 0's positions first, then device 1's, ...
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    k_pos = jnp.concatenate([positions(r, size, local, balanced) for r in range(size)])
    s = jnp.where(_visible(positions(rank, size, local, balanced), k_pos), _scores(q, k_all), NEG_INF)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v_all.astype(jnp.float32))
    return out.astype(v.dtype)


def ulysses(q, k, v, axis: str, balanced: bool = True):
    """All-to-all to a head split, whole-sequence attention of ``heads/C`` heads, all-to-all back (module
    docstring)."""
    size = lax.axis_size(axis)
    local, heads = q.shape[1], q.shape[2]
    if heads % size:
        raise ValueError(f"Ulysses splits the {heads} heads over the {size} devices of {axis!r}: they must divide; "
                         "use context.attention=ring or allgather, or a context axis that divides the heads")

    def to_heads(x):  # (b, S/C, h, d) -> (b, S, h/C, d): every position, 1/C of the heads
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    pos = jnp.concatenate([positions(r, size, local, balanced) for r in range(size)])
    s = jnp.where(_visible(pos, pos), _scores(to_heads(q), to_heads(k)), NEG_INF)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), to_heads(v).astype(jnp.float32))
    return lax.all_to_all(out.astype(v.dtype), axis, split_axis=1, concat_axis=2, tiled=True)


ATTENTION = {"ring": ring, "allgather": allgather, "ulysses": ulysses}
