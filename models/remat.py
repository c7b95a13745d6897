"""Rematerialisation policies: which activations of a block the backward pass keeps and which it recomputes.

Chen et al., *Training Deep Nets with Sublinear Memory Cost* (arXiv 1604.06174): keep only each block's
input and recompute the block in the backward pass. Korthikanti et al., *Reducing Activation Recomputation
in Large Transformer Models* (arXiv 2205.05198, §5 "selective activation recomputation"): keep the outputs
of the weight matmuls and recompute the cheap, large rest (attention's ``softmax(QKᵀ)`` of ``B·heads·T²``).
Ren et al., *ZeRO-Offload* (arXiv 2101.06840): park what is kept in host memory instead.

``remat.policy`` names one (a run setting; a model that takes it declares a ``remat`` field):

* ``none`` — autodiff keeps every residual it needs (no recomputation).
* ``full`` — each block is recomputed in the backward pass; only its input is kept
  (``jax.checkpoint_policies.nothing_saveable``).
* ``dots`` — the outputs of matmuls without batch dimensions are kept, i.e. the Dense/DenseGeneral
  projections (QKV, attention output, MLP up and down), the rest recomputed
  (``dots_with_no_batch_dims_saveable``, and the values named :data:`PROJECTION`). Not ``checkpoint_dots``: it
  would also keep the attention's batched ``QKᵀ`` and ``PV`` einsums, whose ``B·heads·T²`` scores are the
  largest activations of a block — the very ones selective recomputation exists to drop.
* ``offload`` — as ``dots``, but what is kept moves to the host's pinned memory and back for the backward
  pass (``offload_dot_with_no_batch_dims("device", "pinned_host")``, and the values named :data:`PROJECTION`
  offloaded too, so that under tensor parallelism it keeps what ``dots`` keeps); needs a backend whose devices
  have a ``pinned_host`` memory space (:func:`check_backend`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

POLICIES = ("none", "full", "dots", "offload")
# A value a layer names so (``jax.ad_checkpoint.checkpoint_name``) is a matmul's output that ``dots`` keeps although
# no ``dot_general`` makes it where the policy looks: the projections of dtx's Megatron regions, made inside a
# custom VJP (dtx.parallel.tensor.layout).
PROJECTION = "dtx_projection"


class RematError(ValueError):
    """An unknown policy, or one the backend cannot run; the message names ``remat.policy`` and the fix."""


def check_policy(name: str) -> str:
    """``name`` if it is a policy of :data:`POLICIES`, else a :class:`RematError` naming the config key."""
    if name not in POLICIES:
        raise RematError(f"remat.policy={name!r} is unknown; choose one of {', '.join(POLICIES)}")
    return name


def checkpoint_policy(name: str):
    """The ``jax.checkpoint`` policy of ``name`` (``None`` for ``none``: no checkpoint at all)."""
    policies = jax.checkpoint_policies
    dots = policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                            policies.save_only_these_names(PROJECTION))
    return {"none": None, "full": policies.nothing_saveable, "dots": dots,
            "offload": _offload_as_dots}[check_policy(name)]


def _offload_as_dots(prim, *args, **params):
    """``offload``'s policy: what ``dots`` keeps, moved to pinned host memory. ``offload_dot_with_no_batch_dims``
    alone misses the values named :data:`PROJECTION`: under tensor parallelism the projections run inside the
    Megatron regions' custom VJP, where the policy sees only their names (docs/remat.md), and ``dots`` keeps them
    by name. ``save_from_both_policies`` cannot join the two: it accepts only boolean policies."""
    policies = jax.checkpoint_policies
    if prim.name == "name" and params.get("name") == PROJECTION:
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=(PROJECTION,), offload_src="device",
            offload_dst="pinned_host")(prim, *args, **params)
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")(prim, *args, **params)


def check_backend(name: str, devices: Sequence = ()) -> None:
    """Refuse ``offload`` before compiling where it cannot move anything off the device: a backend whose devices
    have no ``pinned_host`` memory space, or XLA:CPU, whose device memory is the host's (it compiles the transfers,
    but its peak is that of ``dots``: measured equal by ``memory_analysis``)."""
    check_policy(name)
    if name != "offload":
        return
    device = (list(devices) or jax.devices())[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    if device.platform == "cpu" or "pinned_host" not in kinds:
        why = ("its device memory is the host's memory, so nothing leaves the device" if device.platform == "cpu"
               else f"its devices have no pinned_host memory space (memory kinds: {', '.join(sorted(kinds))})")
        raise RematError(f"remat.policy='offload' moves the kept activations to pinned host memory, which the "
                         f"{device.platform} backend cannot do: {why}; use --config.remat.policy=dots (the same "
                         "activations kept on the device) or full (none kept), or run on a GPU")


def compiler_options(name: str, platform: str) -> dict[str, str]:
    """XLA options a step of a model with policy ``name`` compiles with on ``platform``.

    XLA:CPU (the jaxlib of jax 0.10) removes the optimization barriers that ``jax.checkpoint`` puts around a
    recomputation (its ``cse_barrier_expander`` pass) before common-subexpression elimination, which then
    merges the recomputed forward back into the first one: the program keeps every activation, as without
    remat (measured: a 4-block transformer's temp memory equal under none, dots and full). Disabling that pass
    keeps the recomputation where jax put it; the jaxlib of jax 0.11 keeps the barriers by itself, and a pass
    it does not have is ignored.
    """
    if check_policy(name) == "none" or platform != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "cse_barrier_expander"}
