"""A mixture-of-experts MLP: a float32 softmax router picks ``top_k`` of ``experts`` MLPs per token.

Shazeer et al., *Outrageously Large Neural Networks: the Sparsely-Gated Mixture-of-Experts Layer* (arXiv
1701.06538) made each token run through a few of many expert networks, so parameters grow ``experts / top_k``
times faster than compute. This layer follows the transformer MoEs that came after:

* **Routing.** A bias-free Dense router in float32 gives logits ``(tokens, experts)``; their softmax ``p`` is
  the routing probability. Each token takes the ``top_k`` experts of highest score (``p``, plus the balancing
  bias below; ties go to the lower expert index) and its gates are the chosen probabilities renormalised to sum
  to 1 — Mixtral's convention (Jiang et al. 2024, arXiv 2401.04088: softmax over the top-k logits, the same
  numbers). ``renormalize=False`` keeps the raw probabilities instead (Switch, Fedus et al. 2021, arXiv
  2101.03961, whose ``top_k=1`` gate would otherwise always be 1 and the router learn from the auxiliary losses
  alone). The token's output is ``Σ gate · expert(token)`` over the chosen experts that had room for it.
* **Groups and capacity** (GShard, Lepikhin et al. 2020, arXiv 2006.16668, §2.2 and Algorithm 2). Tokens are
  routed in groups, one per leading index of the input (each sequence of a ``(batch, time, d)`` input; a 2-D
  input is one group), so a token's fate depends on its own group only — the same on one device as on any
  number, whatever the driver. Each expert takes at most
  ``capacity = ceil(capacity_factor · tokens · top_k / experts)`` tokens of a group (at most ``tokens``):
  ``capacity_factor`` 1 holds an evenly routed group exactly. ``capacity_factor = 0`` is dropless: capacity
  ``tokens``, which no routing can overflow (a token takes an expert at most once), at the cost of buckets
  ``experts / top_k`` times larger than the average load.
* **Priority** (GShard's, Switch's): the buckets fill with every token's first choice in token order, then every
  token's second choice in token order, and so on; an assignment that finds its bucket full is dropped, and the
  token keeps what its other choices and the residual connection give it.
* **Buckets.** Dispatch gathers each expert's tokens into buckets shaped ``(experts, groups, capacity, d)``,
  the experts run as one batched MLP (``d -> mlp_ratio·d -> d``, GELU, biases: the zoo transformer's MLP),
  and combine gathers each token's outputs back, weighted by its gates. Experts lead the buckets' shape so that
  an expert-parallel layer can send each device its experts' buckets with one all-to-all (GShard's
  ``gsec,gsm->egcm``); on one device, or under data parallelism, every device holds every expert; an ``expert``
  mesh axis splits them and moves the buckets by all-to-all (:mod:`dtx.parallel.expert`).
* **Balance.** ``aux_weight · E · Σ_e f_e · P_e``, Switch's load-balancing loss (eq. 4; GShard's ``l_aux``), with
  ``f_e`` the fraction of a group's ``tokens · top_k`` assignments routed to expert ``e`` (before capacity) and
  ``P_e`` the group's mean routing probability for ``e``, averaged over the groups as GShard does: 1 when routing
  is even. ``z_weight · mean(logsumexp(logits)²)``, the router z-loss of ST-MoE (Zoph et al. 2022, arXiv
  2202.08906, eq. 5), keeps the logits small. Both are added to the training loss (:mod:`dtx.models.sown`).
  ``balance="bias"`` adds DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, §2.1.2): a per-expert
  bias, in the non-parameter collection ``balance``, is added to the scores for selecting the top-k only (the
  gates stay the probabilities), and after each training pass it moves by ``bias_rate · sign(mean load − load)``,
  the loads counted over the whole batch (summed over the data-parallel devices: ``axis_name``, which dtx's
  ``shard_map`` driver sets as it does for batch norm). With gradient accumulation it moves once per
  micro-batch. The auxiliary loss still counts with ``aux_weight`` under ``balance="bias"``; set it to 0 for
  DeepSeek-V3's loss-free form.

Records, per layer, while training (:mod:`dtx.models.sown`): ``dropped``, the fraction of the ``tokens ·
top_k`` assignments that found their bucket full; ``load_max``, the busiest expert's assignments over the mean
(1 when even, ``experts / top_k`` when one expert is in every token's choice; over the whole batch); ``aux_loss`` and ``z_loss``,
unweighted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from . import sown

EXPERT_PARAMS = ("wi", "bi", "wo", "bo")  # the experts' stacked weights, leading dimension E, beside a "router"
EXPERT_METHOD = "mix"  # the MoE method an expert-parallel layout runs its own way (dtx.parallel.expert)
BALANCE = "balance"  # the collection of the bias balancing's per-expert bias (not a parameter: no gradient)
BALANCES = ("aux", "bias")


@dataclasses.dataclass(frozen=True)
class Routing:
    """How an :class:`MoE` routes and balances (module docstring): experts per token, the capacity factor (0:
    dropless), the weights of the load-balancing loss and the router z-loss, ``balance`` (``"aux"``, or ``"bias"``
    for DeepSeek-V3's selection bias as well) with the bias's step, and whether the gates are renormalised over the
    chosen experts (Mixtral) or the raw probabilities (Switch)."""

    top_k: int = 2
    capacity_factor: float = 1.25
    aux_weight: float = 0.01
    z_weight: float = 0.001
    balance: str = "aux"
    bias_rate: float = 0.001
    renormalize: bool = True


@dataclasses.dataclass(frozen=True)
class MoESettings(Routing):
    """The zoo transformer's ``model.moe`` block (:class:`dtx.models.transformer.Transformer`): the routing, the
    number of experts and which blocks have them. ``experts`` 0 keeps every MLP dense; otherwise every
    ``every``-th block's MLP (blocks ``every − 1``, ``2·every − 1``, ...) is an :class:`MoE` with these settings."""

    experts: int = 0
    every: int = 1

    def layer(self, block: int) -> bool:
        """Whether block ``block`` (from 0) has an MoE MLP."""
        return self.experts > 0 and (block + 1) % self.every == 0


def check_settings(settings: MoESettings, key: str = "model.moe") -> None:
    """Refuse settings that cannot route, naming ``key.<setting>`` and the fix (:class:`ValueError`)."""
    s = settings

    def fix(name, value) -> str:
        return f"--config.{key}.{name}={value}" if key.startswith("model.") else f"{key}({name}={value!r})"

    if s.experts < 0:
        raise ValueError(f"{key}.experts={s.experts}: the number of experts is 0 (dense MLPs) or more; e.g. "
                         f"{fix('experts', 8)}")
    if s.experts == 0:
        changed = [f.name for f in dataclasses.fields(s) if getattr(s, f.name) != f.default]
        if changed:
            raise ValueError(f"{key}.{changed[0]}={getattr(s, changed[0])!r} is set but {key}.experts=0 (every MLP "
                             f"dense, no router): set {fix('experts', 8)} (2 or more), or leave {key}.{changed[0]} "
                             "at its default")
        return
    if not 1 <= s.top_k <= s.experts:
        raise ValueError(f"{key}.top_k={s.top_k}: each token takes between 1 and {key}.experts={s.experts} experts; "
                         f"use {fix('top_k', min(max(s.top_k, 1), s.experts))}")
    if s.every < 1:
        raise ValueError(f"{key}.every={s.every}: every n-th block's MLP is an MoE, n ≥ 1; use {fix('every', 1)} "
                         "(every block) or 2 (every other one)")
    if s.capacity_factor < 0 or 0 < s.capacity_factor * s.top_k < 1:
        raise ValueError(
            f"{key}.capacity_factor={s.capacity_factor}: below 1/top_k = {1 / s.top_k:.3g} the buckets cannot hold "
            "even one choice per token when routing is perfectly even (capacity_factor · tokens · top_k / experts < "
            f"tokens / experts); use {fix('capacity_factor', 1.25)} (a margin over even routing, Switch's "
            "default) or 0 (dropless)")
    if s.balance not in BALANCES:
        raise ValueError(f"{key}.balance={s.balance!r}: choose 'aux' (the load-balancing loss alone) or 'bias' "
                         f"(DeepSeek-V3's bias on the selection scores as well), e.g. {fix('balance', 'bias')}")
    for name in ("aux_weight", "z_weight", "bias_rate"):
        if getattr(s, name) < 0:
            raise ValueError(f"{key}.{name}={getattr(s, name)}: a weight or rate is 0 (off) or positive; e.g. "
                             f"{fix(name, 0)}")


def capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and group: ``ceil(capacity_factor · tokens · top_k / experts)``, between 1 and ``tokens``;
    ``tokens`` when ``capacity_factor`` is 0 (dropless)."""
    if capacity_factor == 0:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / experts)))


def assign_slots(chosen, experts: int, slots: int):
    """Each assignment's slot in its expert's bucket and whether it fits: ``(slot, kept)``, both shaped like
    ``chosen`` ``(groups, tokens, top_k)``. The buckets fill choice by choice, then token by token (module
    docstring: first choices first, each in token order)."""
    groups, tokens, k = chosen.shape
    one_hot = jax.nn.one_hot(jnp.swapaxes(chosen, 1, 2), experts, dtype=jnp.int32)  # (groups, k, tokens, experts)
    order = one_hot.reshape(groups, k * tokens, experts)  # choice-major: every first choice before any second
    before = jnp.cumsum(order, axis=1) - order  # the assignments to the same expert ahead of this one
    slot = jnp.sum(before * order, axis=-1).reshape(groups, k, tokens)
    slot = jnp.swapaxes(slot, 1, 2)
    return slot, slot < slots


def dispatch(x, chosen, slot, kept, experts: int, slots: int):
    """The buckets ``(experts, groups, slots, d)``: each kept assignment's token in its slot, empty slots zero.
    Written per group and mapped over the groups (``jax.vmap``), so the scatter and gather carry the groups as a
    batch dimension: XLA's partitioner then keeps each device to its own sequences' buckets under ``jit``."""

    def one(xg, cg, sg, kg):  # one group: x (tokens, d), its assignments (tokens, k)
        tokens = cg.shape[0]
        token = jnp.broadcast_to(jnp.arange(tokens)[:, None], cg.shape)
        # Which token fills each slot; ``tokens`` (a zero row appended below) where none does. A dropped
        # assignment writes out of bounds, which ``mode="drop"`` ignores.
        filler = jnp.full((experts, slots), tokens, jnp.int32).at[cg, jnp.where(kg, sg, slots)].set(token,
                                                                                                  mode="drop")
        return jnp.concatenate([xg, jnp.zeros_like(xg[:1])], axis=0)[filler]  # (experts, slots, d)

    return jnp.swapaxes(jax.vmap(one)(x, chosen, slot, kept), 0, 1)


def combine(outputs, chosen, slot, kept, gates):
    """Each token's ``Σ gate · output`` over its kept assignments; ``outputs`` ``(experts, groups, slots, d)``
    (mapped over the groups, as :func:`dispatch`)."""

    def one(og, cg, sg, kg, gg):  # one group: outputs (experts, slots, d)
        picked = og[cg, jnp.where(kg, sg, 0)]  # (tokens, k, d)
        return jnp.einsum("tk,tkd->td", jnp.where(kg, gg, 0.0).astype(og.dtype), picked)

    return jax.vmap(one, in_axes=(1, 0, 0, 0, 0))(outputs, chosen, slot, kept, gates)


def switch_aux_loss(probs, chosen, experts: int):
    """Switch's ``E · Σ_e f_e · P_e`` per group (``f_e``: the fraction of the group's ``tokens · top_k``
    assignments to ``e``; ``P_e``: its mean probability), averaged over the groups (GShard's ``l_aux``)."""
    counts = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32), axis=(1, 2))  # (groups, experts)
    fraction = counts / (chosen.shape[1] * chosen.shape[2])
    return experts * jnp.mean(jnp.sum(fraction * jnp.mean(probs, axis=1), axis=-1))


def z_loss(logits):
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)²``."""
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def mix(x, chosen, slot, kept, gates, weights, experts: int, slots: int, run=None):
    """Each group's tokens dispatched to the buckets ``(experts, groups, slots, d)``, the experts run on them
    (``run(buckets, *weights)``, default :func:`expert_mlp`), and each token's outputs combined by its gates."""
    buckets = dispatch(x, chosen, slot, kept, experts, slots)
    return combine((run or expert_mlp)(buckets, *weights), chosen, slot, kept, gates)


def expert_mlp(buckets, wi, bi, wo, bo):
    """Each expert's MLP on its buckets: ``(E, groups, slots, d)`` in and out, the weights stacked by expert
    (``wi (E, d, h)``, ``bi (E, h)``, ``wo (E, h, d)``, ``bo (E, d)``); ``E`` may be a device's share of them."""
    h = nn.gelu(jnp.einsum("egcd,edh->egch", buckets, wi) + bi[:, None, None])
    return jnp.einsum("egch,ehd->egcd", h, wo) + bo[:, None, None]


def expert_init(key, shape, dtype=jnp.float32):
    """LeCun normal per expert, as ``nn.Dense``'s kernels (fan-in: the second-to-last axis)."""
    return nn.initializers.lecun_normal(batch_axis=(0,))(key, shape, dtype)


class MoE(nn.Module):
    """The mixture-of-experts MLP (module docstring): ``(..., tokens, d) -> (..., tokens, d)``.

    Attributes:
      experts: E, the expert MLPs.
      routing: experts per token, capacity, balancing (:class:`Routing`), e.g.
        ``MoE(8, Routing(top_k=2, capacity_factor=1.0, balance="bias"))``.
      mlp_ratio: each expert's hidden width as a multiple of ``d``.
      axis_name: the mesh axes the loads are summed over (the bias's update, ``load_max``); dtx's ``shard_map``
        driver sets it to the batch axes, as for batch norm (:mod:`dtx.step.batchnorm`). Leave it None.
      dtype / param_dtype: the experts' compute and stored dtypes; the router computes in float32.
    """

    experts: int
    routing: Routing = Routing()
    mlp_ratio: int = 4
    axis_name: Any = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    batch_statistics: ClassVar[bool] = True  # dtx's shard_map driver fills axis_name (dtx.step.batchnorm)

    @nn.compact
    def __call__(self, x, train: bool = False):
        r = self.routing
        check_settings(MoESettings(**{f.name: getattr(r, f.name) for f in dataclasses.fields(Routing)},
                                   experts=self.experts), type(self).__name__)
        *_, tokens, d = x.shape
        groups = x.reshape(-1, tokens, d)
        logits = nn.Dense(self.experts, use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype,
                          name="router")(groups.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        scores = probs
        bias = None
        if r.balance == "bias":
            bias = self.variable(BALANCE, "bias", jnp.zeros, (self.experts,), jnp.float32)
            scores = probs + bias.value  # for the selection only: the gates stay the probabilities
        _, chosen = lax.top_k(lax.stop_gradient(scores), r.top_k)  # (groups, tokens, k)
        gates = jnp.take_along_axis(probs, chosen, axis=-1)
        if r.renormalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        slot, kept = assign_slots(chosen, self.experts, capacity(tokens, self.experts, r.top_k, r.capacity_factor))
        y = self.mix(groups.astype(self.dtype), chosen, slot, kept, gates, *self._weights(d))
        if train:
            self._account(logits, probs, chosen, kept, bias)
        return y.reshape(x.shape).astype(self.dtype)

    def _weights(self, d: int):
        """The E experts' stacked MLP weights ``wi (E, d, h)``, ``bi (E, h)``, ``wo (E, h, d)``, ``bo (E, d)``,
        in the compute dtype."""
        hidden = self.mlp_ratio * d
        wi = self.param("wi", expert_init, (self.experts, d, hidden), self.param_dtype)
        bi = self.param("bi", nn.initializers.zeros, (self.experts, hidden), self.param_dtype)
        wo = self.param("wo", expert_init, (self.experts, hidden, d), self.param_dtype)
        bo = self.param("bo", nn.initializers.zeros, (self.experts, d), self.param_dtype)
        return tuple(jnp.asarray(w, self.dtype) for w in (wi, bi, wo, bo))

    def mix(self, x, chosen, slot, kept, gates, wi, bi, wo, bo):
        """Dispatch, the experts' MLPs, combine (:func:`mix`): ``x (groups, tokens, d)`` and each assignment's
        expert, slot, fate and gate in, each token's output out. An expert-parallel layout intercepts this method
        (:data:`EXPERT_METHOD`) and runs it on each device's own sequences, the buckets moved to the experts'
        devices by all-to-all (:mod:`dtx.parallel.expert.layout`)."""
        slots = capacity(x.shape[1], self.experts, self.routing.top_k, self.routing.capacity_factor)
        return mix(x, chosen, slot, kept, gates, (wi, bi, wo, bo), self.experts, slots)

    def _account(self, logits, probs, chosen, kept, bias) -> None:
        """A training pass's losses, records and the bias's move (module docstring)."""
        r = self.routing
        aux, z = switch_aux_loss(probs, chosen, self.experts), z_loss(logits)
        if r.aux_weight:
            sown.add_loss(self, "aux_loss", r.aux_weight * aux)
        if r.z_weight:
            sown.add_loss(self, "z_loss", r.z_weight * z)
        load = jnp.sum(jax.nn.one_hot(chosen, self.experts, dtype=jnp.float32), axis=(0, 1, 2))
        if self.axis_name is not None:  # the whole batch's loads, as one device would count them
            load = lax.psum(load, self.axis_name)
        mean = jnp.mean(load)
        sown.add_record(self, "dropped", 1.0 - jnp.mean(kept.astype(jnp.float32)))
        sown.add_record(self, "load_max", jnp.max(load) / mean)
        sown.add_record(self, "aux_loss", aux)
        sown.add_record(self, "z_loss", z)
        if bias is not None and self.is_mutable_collection(BALANCE) and not self.is_initializing():
            bias.value = bias.value + r.bias_rate * jnp.sign(mean - load)
