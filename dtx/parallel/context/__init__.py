"""Context parallelism, one package: every sequence split over the ``context`` mesh axis.

Activation memory grows with the sequence; splitting the batch does not shrink one sequence's. A ``context``
axis of ``C`` devices gives each of them ``S/C`` positions of every sequence of its examples (the batch is not
split over it: ``batch=False``; the state is whole on it). Everything but attention is position-wise and runs on
the local positions; attention needs every key, and :mod:`~dtx.parallel.context.attention` brings them three
ways: the ring (``ppermute`` of key/value chunks with a float32 online softmax), the all-gather of keys and
values, and Ulysses' all-to-alls to a head split — each with causal load balancing.

The package holds the axis's declaration, the per-device kernels (:mod:`.attention`), the activation context that
runs them in a model (:mod:`.layout`: alone, beside data and fsdp axes, or inside Megatron's regions over a
``model`` axis) and their bytes by formula (:mod:`.costs`); :func:`dtx.parallel.compose` makes a ``context`` axis
this parallelism.
"""

from __future__ import annotations

from dtx import mesh as mesh_lib

CONTEXT_AXIS = "context"

mesh_lib.declare_axis(mesh_lib.Axis(
    CONTEXT_AXIS, "context", replicas=False, state=False, batch=False,
    doc="each sequence's positions split over it (context parallelism); attention brings the keys and values"))
