"""Megatron tensor and sequence parallelism by formula: collectives per block and step, parameters, activations.

What :mod:`dtx.parallel.tensor.layout` runs, as Megatron-LM (Shoeybi et al., arXiv 1909.08053, §3) and Korthikanti
et al. (arXiv 2205.05198, §4.2.2) count it, ``B`` the examples of one data shard, ``S`` positions, ``H`` the
width, ``T`` the ``model`` axis, ``e`` bytes per compute element, ``n = B·S·H·e``:

=====================  ==============================================  ==========================================
per block and step      tensor parallel (TP)                            sequence parallel (SP)
=====================  ==============================================  ==========================================
forward                 2 all-reduces of ``n`` (attention, MLP: ``g``)  2 all-gathers of ``n/T`` + 2 reduce-scatters
                                                                        of ``n`` (to ``n/T``)
backward                2 all-reduces of ``n`` (their inputs: ``f``)    the same, transposed; and 2 all-gathers of
                                                                        ``n/T`` gathering the column inputs again
bytes one device sends  ``4 · 2(T−1)/T · n``                            ``8 · (T−1)/T · n`` (the same) ``+ 2 ·
                                                                        (T−1)/T · n`` (the gathers again)
=====================  ==============================================  ==========================================

Outside the blocks, per step (the output head runs data parallel over every device): TP all-gathers the token
ids over ``model`` and, in the backward pass, the head's input gradient (``(T−1)/T·n``); SP moves the ids and
the head's input and its gradient between the position split and the example split (all-to-alls of
``(T−1)/T`` of the shard). The gradients: the head's all-reduced over every device, the rest over the data
axes (each device its ``1/T`` of the split parameters); under SP the replicated parameters used on the split
positions (embedding, positions, LayerNorms, the row layers' biases) are summed over ``model`` first.

Activations (:func:`activation_bytes`): the residuals JAX's autodiff keeps, per example, split into those of the
residual stream (``(B, S, H)`` and per-position statistics: whole under TP, ``1/T`` under SP) and the rest
(heads, hidden units, logits: ``1/T`` under both).
"""

from __future__ import annotations

import math
from typing import Any

from dtx.comm import costmodel

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


def block_collectives(examples: int, positions: int, width: int, group: int, sequence_parallel: bool,
                      itemsize: int = 4) -> dict[str, list[int]]:
    """The collectives over ``model`` of one block's forward and backward pass: kind -> each one's operand bytes
    on one device (module docstring)."""
    n = examples * positions * width * itemsize
    if not sequence_parallel:
        return {"all-reduce": [n] * 4}
    return {"reduce-scatter": [n] * 4, "all-gather": [n // group] * 6}


def bytes_sent(kind: str, operand: int, group: int, itemsize: int = 4) -> int:
    """Bytes one device sends for one collective (:mod:`dtx.comm.hlo`'s conventions: the ring)."""
    if group <= 1:
        return 0
    if kind == "all-reduce":
        return costmodel.expected_traffic("ring", operand, group, itemsize=itemsize).bytes_sent
    if kind == "all-gather":
        return (group - 1) * operand
    if kind == "reduce-scatter":
        return (group - 1) * operand // group
    if kind == "all-to-all":
        return (group - 1) * operand // group
    raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")


def block_bytes(examples: int, positions: int, width: int, group: int, sequence_parallel: bool,
                itemsize: int = 4) -> int:
    """Bytes one device sends over ``model`` per block and step."""
    return sum(bytes_sent(kind, operand, group, itemsize)
               for kind, operands in block_collectives(examples, positions, width, group, sequence_parallel,
                                                       itemsize).items() for operand in operands)


def step_bytes(abstract_params: Any, specs: Any, mesh_shape: dict, *, examples: int, positions: int, width: int,
               layers: int, sequence_parallel: bool, itemsize: int = 4) -> dict[str, int]:
    """Bytes one device sends per step: ``blocks`` (over ``model``, :func:`block_bytes` each), ``ends`` (the
    token ids and the head, over ``model``) and ``gradients`` (module docstring). ``specs``: the parameters'
    PartitionSpecs (:func:`dtx.parallel.tensor.megatron.megatron_rules`); the head is the replicated rank-2 kernel
    (and its bias) whose output is not the width; ``examples``: of one data shard."""
    from dtx.paths import named_leaves

    t = mesh_shape.get("model", 1)
    devices = math.prod(mesh_shape.values())
    data = devices // t
    n = examples * positions * width * itemsize
    tokens = examples * positions * 4  # int32 ids
    if sequence_parallel:
        ends = bytes_sent("all-to-all", tokens // t, t) + 2 * bytes_sent("all-to-all", n // t, t)
    else:
        ends = bytes_sent("all-gather", tokens // t, t) + bytes_sent("all-gather", n // t, t)
    leaves = dict(named_leaves(abstract_params))
    split = {path: spec for path, spec in named_leaves(specs, is_leaf=lambda x: hasattr(x, "index"))
             if any(axis is not None for axis in spec)}
    head = {path for path, leaf in leaves.items() if path.endswith("kernel") and path not in split
            and len(leaf.shape) == 2 and leaf.shape[1] != width}
    head |= {path[: -len("kernel")] + "bias" for path in head}
    head_bytes = sum(_nbytes(leaves[path]) for path in head if path in leaves)
    shard_bytes, stream_bytes = 0, 0  # per device, reduced over data; replicated ones used on split positions
    for path, leaf in leaves.items():
        if path in head:
            continue
        if path in split:
            shard_bytes += _nbytes(leaf) // t
        elif sequence_parallel and len(leaf.shape) == 2 and leaf.shape[1] == width and \
                not path.endswith(("embedding", "kernel")):
            shard_bytes += _nbytes(leaf) // t  # a position table: each device reduces its rows over data
            stream_bytes += _nbytes(leaf)
        else:
            shard_bytes += _nbytes(leaf)
            stream_bytes += _nbytes(leaf) if sequence_parallel else 0
    gradients = (bytes_sent("all-reduce", head_bytes, devices) + bytes_sent("all-reduce", shard_bytes, data)
                 + bytes_sent("all-reduce", stream_bytes, t))
    return dict(blocks=layers * block_bytes(examples, positions, width, t, sequence_parallel, itemsize), ends=ends,
                gradients=gradients)


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def param_bytes(abstract_params: Any, specs: Any, group: int) -> int:
    """Parameter bytes one device holds: the split ones' ``1/T``, the rest whole."""
    from dtx.paths import named_leaves

    split = {path for path, spec in named_leaves(specs, is_leaf=lambda x: hasattr(x, "index"))
             if any(axis is not None for axis in spec)}
    return sum(_nbytes(leaf) // (group if path in split else 1) for path, leaf in named_leaves(abstract_params))


def data_gradient_bytes(abstract_params: Any, specs: Any, group: int, width: int, sequence_parallel: bool) -> int:
    """Gradient bytes one device all-reduces over the data axes once per step when each data group sums its own
    gradient over the micro-batches (gradient accumulation: :func:`dtx.step.accumulate.manual_gradients`): what
    it holds (:func:`param_bytes`), the head whole, less under SP a position table's ``(T−1)/T`` (each device
    reduces its ``1/T`` of the rows, then they are gathered over ``model``)."""
    from dtx.paths import named_leaves

    held = param_bytes(abstract_params, specs, group)
    if not sequence_parallel:
        return held
    split = {path for path, spec in named_leaves(specs, is_leaf=lambda x: hasattr(x, "index"))
             if any(axis is not None for axis in spec)}
    tables = sum(_nbytes(leaf) for path, leaf in named_leaves(abstract_params) if path not in split
                 and len(leaf.shape) == 2 and leaf.shape[1] == width and not path.endswith(("embedding", "kernel")))
    return held - tables * (group - 1) // group


def activation_profile(model: Any, positions: int, width: int) -> dict[str, float]:
    """Bytes per example the backward pass keeps, from JAX's VJP of the training forward pass and the task's
    loss (traced at 4 and 8 examples, nothing runs): ``stream`` (residuals shaped ``(B, S, H)`` or ``(B, S, 1)``)
    and ``split`` (every other batch-sized residual: heads, hidden units, logits)."""
    import jax
    import jax.numpy as jnp

    from dtx.data import tasks

    task = tasks.next_token()
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, positions), jnp.int32)))["params"]

    def kept(batch: int) -> dict[str, float]:
        tokens = jax.ShapeDtypeStruct((batch, positions), jnp.int32)
        closure = jax.eval_shape(lambda p, t: jax.vjp(lambda p: task.loss(model.apply(
            {"params": p}, t, train=True), t).mean(), p)[1], params, tokens)
        found = {"stream": 0.0, "split": 0.0}
        for leaf in jax.tree.leaves(closure):
            shape = tuple(leaf.shape)
            if batch in shape:
                kind = "stream" if shape in ((batch, positions, width), (batch, positions, 1)) else "split"
                found[kind] += math.prod(shape) * leaf.dtype.itemsize
        return found

    four, eight = kept(4), kept(8)
    return {kind: (eight[kind] - four[kind]) / 4 for kind in four}


def activation_bytes(profile: dict[str, float], examples: int, group: int, sequence_parallel: bool) -> float:
    """Activation bytes one device keeps for ``examples`` examples of its data shard (module docstring)."""
    stream = profile["stream"] / (group if sequence_parallel else 1)
    return examples * (stream + profile["split"] / group)
