"""Expert parallelism, one package: a mixture of experts' experts split over the ``expert`` mesh axis.

An MoE layer's parameters grow with its experts ``E`` while each token runs through ``k`` of them, so the experts
are what stops fitting on one device. An ``expert`` axis of ``X`` devices gives each of them ``E/X`` experts (the
stacked expert weights split along their leading dimension, their optimizer state with them) and, as in GShard
(Lepikhin et al. 2020, arXiv 2006.16668), carries the batch for every other layer: examples are split over the data
axes and ``expert`` together, and the gradients of the layers that are not experts are averaged over both (the
axis declares ``replicas=True, batch=True``). Between the router and the experts the capacity buckets travel by
all-to-all: each device sends every expert's buckets of its own sequences to the device that holds that expert,
the experts run on what they received, and a second all-to-all brings the outputs back (their transposes in the
backward pass).

The package holds the axis's declaration, the placement and the activation context that runs the all-to-alls
(:mod:`.layout`) and their bytes by formula (:mod:`.costs`); :func:`dtx.parallel.compose` makes an ``expert`` axis
this parallelism (beside data axes and an ``fsdp`` axis).
"""

from __future__ import annotations

from dtx import mesh as mesh_lib

EXPERT_AXIS = "expert"

mesh_lib.declare_axis(mesh_lib.Axis(
    EXPERT_AXIS, "expert", replicas=True, state=False, batch=True,
    doc="a mixture of experts' experts split over it (expert parallelism); the batch for every other layer"))
