"""What expert parallelism moves, by formula: per MoE layer and step, the bytes one device sends.

A device holds ``g`` groups (sequences) of a step's batch — the global batch's sequences over the data axes and
``expert`` — and its buckets for them are ``(E, g, C, d)``: ``E`` experts, ``C`` slots per expert and group
(:func:`dtx.models.moe.capacity`), width ``d``, ``e`` bytes an element (the compute dtype). One all-to-all over the
``X`` devices of the ``expert`` axis keeps ``1/X`` of that on the device and sends the rest:
``(X − 1)/X · E·g·C·d·e``. A training step runs four per MoE layer: the dispatch (every expert's buckets to its
device) and the combine (the outputs back) forward, and their transposes backward (the outputs' gradient to the
experts' devices, the buckets' gradient back). So per layer and step::

    4 · (X − 1)/X · E · g · C · d · e

Under gradient accumulation each of ``m`` micro-batches moves ``g/m`` groups, ``m`` times: the same bytes per step.
An evaluation step runs the forward two. ``tests/test_expert.py`` holds this to the compiled step's all-to-alls.
"""

from __future__ import annotations

from dtx.models.moe import capacity


def all_to_all_bytes(experts: int, groups: int, slots: int, width: int, size: int, itemsize: int = 4,
                     train: bool = True) -> float:
    """Bytes one device sends by all-to-all per MoE layer and step (module docstring): ``groups`` its sequences,
    ``slots`` the capacity per expert and group, ``size`` the ``expert`` axis's; a training step's four, an
    evaluation's two."""
    bucket = experts * groups * slots * width * itemsize
    return (4 if train else 2) * (size - 1) / size * bucket


def layer_bytes(experts: int, top_k: int, capacity_factor: float, examples: int, tokens: int, width: int,
                size: int, itemsize: int = 4, train: bool = True) -> float:
    """:func:`all_to_all_bytes` of a ``(examples, tokens, d)`` MoE layer input on one device (one group a
    sequence), its capacity from the routing settings."""
    return all_to_all_bytes(experts, examples, capacity(tokens, experts, top_k, capacity_factor), width, size,
                            itemsize, train)
