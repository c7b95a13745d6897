"""Optimizers, learning-rate schedules and large-batch scaling rules, by name, on optax.

Every optimizer is an optax ``GradientTransformation`` — the pure ``(init,
update)`` pair with explicit state — so its state lives in the
train state and in checkpoints. Nothing here re-implements an optimizer: LARS
(You et al. 2017) and LAMB (You et al. 2019) are optax's building blocks,
composed with masks.

Large-batch training (the Hitchhiker's Guide §4.1): the linear scaling rule
``lr = base_lr × global_batch / base_batch`` with gradual warmup (Goyal et al.
2017), or the square-root rule (Krizhevsky 2014); layer-wise trust ratios (LARS,
LAMB) that exclude biases and normalisation parameters, like weight decay does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from dtx.paths import path_str

SCHEDULES = ("constant", "cosine", "polynomial", "step")
SCALING_RULES = ("none", "linear", "sqrt")
# Biases and normalisation scales/offsets: no weight decay, no trust ratio (LARS paper §3, Goyal et al. §5).
DEFAULT_EXCLUDE = r"(^|/)(bias|scale)$"
# FLOPs per parameter of one update and its application (optax's ``update`` + ``apply_updates``) as XLA's cost
# analysis counts them, float32, no weight decay: read from each optimizer's update compiled alone (4,096 and 65,536
# parameters: the same figures), and seen again in whole training steps, where the plans of the speech DNN at 8 nodes
# (G = 1, 4, 8) count 11.0 more per parameter a device holds under Adam than under SGD. Element-wise work, so a
# device pays it on the parameters it holds (dtx.tools.plancheck adds it to a plan's whole step).
@dataclasses.dataclass(frozen=True)
class Optimizer:
    """An optimizer, declared by what the rest of dtx needs to know of it (the memory models, the pipeline's and
    ZeRO's checks, the planners): never by its name.

    Attributes:
      name: its ``optimizer.name``.
      slots: parameter-shaped arrays of state it keeps per parameter (Adam's two moments, momentum's trace).
      by_entry: its update of each entry reads only that entry's gradient and state (without weight decay), so
        it acts on a flat row of parameters as on the tree (a pipeline's rows, ZeRO's slices).
      whole_tensors: it needs each tensor whole: LARS's and LAMB's trust ratios ``‖w‖/‖u‖`` (You et al. 2017,
        arXiv 1708.03888; 2019, arXiv 1904.00962), which a slice of a row cannot give.
      masks_by_name: it decays weights masked by the leaves' names (``optimizer.exclude``) whatever the weight
        decay, so it needs the tree where a row would hide the names (AdamW).
      update_flops: FLOPs per parameter of one update and its application (``update`` + ``apply_updates``) as
        XLA's cost analysis counts them, float32, no weight decay: read from each optimizer's update compiled
        alone (4,096 and 65,536 parameters: the same figures), and seen again in whole training steps, where the
        plans of the speech DNN at 8 nodes (G = 1, 4, 8) count 11.0 more per parameter a device holds under Adam
        than under SGD. Element-wise work, so a device pays it on the parameters it holds.
    """

    name: str
    slots: int
    by_entry: bool
    whole_tensors: bool
    update_flops: int
    masks_by_name: bool = False


DECLARED: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("sgd", slots=0, by_entry=True, whole_tensors=False, update_flops=2),
    Optimizer("momentum", slots=1, by_entry=True, whole_tensors=False, update_flops=4),
    Optimizer("nesterov", slots=1, by_entry=True, whole_tensors=False, update_flops=6),
    Optimizer("adam", slots=2, by_entry=True, whole_tensors=False, update_flops=13),
    Optimizer("adamw", slots=2, by_entry=True, whole_tensors=False, update_flops=13, masks_by_name=True),
    Optimizer("lars", slots=1, by_entry=False, whole_tensors=True, update_flops=15),
    Optimizer("lamb", slots=2, by_entry=False, whole_tensors=True, update_flops=24),
)}
OPTIMIZERS = tuple(DECLARED)
UPDATE_FLOPS = {name: o.update_flops for name, o in DECLARED.items()}  # dtx.tools.plancheck adds it to a whole step


def declared(name: str) -> Optimizer:
    """The declaration of optimizer ``name`` (:class:`Optimizer`)."""
    if name not in DECLARED:
        raise OptimizerError(f"unknown optimizer.name {name!r}; choose one of {list(DECLARED)}")
    return DECLARED[name]


class OptimizerError(ValueError):
    """Unknown optimizer, schedule or rule, or a value out of range."""


def scaled_learning_rate(base_lr: float, global_batch: int, base_batch: int, rule: str = "none") -> float:
    """Peak learning rate for ``global_batch`` under a batch-size scaling rule.

    ``linear``: ``base_lr × global_batch / base_batch`` (Goyal et al. 2017);
    ``sqrt``: ``base_lr × sqrt(global_batch / base_batch)`` (Krizhevsky 2014);
    ``none``: ``base_lr``.
    """
    if base_lr <= 0:
        raise OptimizerError(f"optimizer.learning_rate={base_lr} must be > 0")
    if rule not in SCALING_RULES:
        raise OptimizerError(f"unknown optimizer.scaling {rule!r}; choose one of {list(SCALING_RULES)}")
    if rule != "none" and base_batch < 1:
        raise OptimizerError(f"optimizer.base_batch_size={base_batch} must be >= 1")
    ratio = global_batch / base_batch if rule != "none" else 1.0
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


def make_schedule(
    name: str,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    *,
    power: float = 2.0,
    boundaries: Sequence[float] = (0.5, 0.75),
    factor: float = 0.1,
) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_steps`` (Goyal et al. 2017), then ``name``.

    Args:
      name: ``constant``; ``cosine`` (to 0); ``polynomial`` (to 0 with ``power``,
        2 as in the LARS paper); ``step`` (multiply by ``factor`` at each fraction
        of the post-warmup steps in ``boundaries``).
      learning_rate: the peak rate, reached at the end of warmup.
      total_steps: length of training, warmup included.
      warmup_steps: steps of linear warmup.
    """
    if learning_rate <= 0:
        raise OptimizerError(f"optimizer.learning_rate={learning_rate} must be > 0")
    if not 0 <= warmup_steps <= total_steps:
        raise OptimizerError(f"optimizer.warmup_steps={warmup_steps} must be in [0, total steps={total_steps}]")
    decay_steps = max(total_steps - warmup_steps, 1)
    if name == "constant":
        decay = optax.constant_schedule(learning_rate)
    elif name == "cosine":
        decay = optax.cosine_decay_schedule(learning_rate, decay_steps)
    elif name == "polynomial":
        if power <= 0:
            raise OptimizerError(f"optimizer.decay_power={power} must be > 0")
        decay = optax.polynomial_schedule(learning_rate, 0.0, power, decay_steps)
    elif name == "step":
        steps = [round(b * decay_steps) for b in boundaries]
        if not all(0 < b < 1 for b in boundaries) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise OptimizerError(
                f"optimizer.step_boundaries={tuple(boundaries)} must be increasing fractions in (0, 1) that fall "
                f"on distinct steps of the {decay_steps} post-warmup steps (they fall on {steps})"
            )
        if not 0 < factor < 1:
            raise OptimizerError(f"optimizer.step_factor={factor} must be in (0, 1)")
        decay = optax.piecewise_constant_schedule(learning_rate, {step: factor for step in steps})
    else:
        raise OptimizerError(f"unknown optimizer.schedule {name!r}; choose one of {list(SCHEDULES)}")
    if not warmup_steps:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def couples_tensors(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx``'s update of one tensor reads another tensor's gradient — a reduction across the model's
    tensors, as ``optax.clip_by_global_norm`` does — read from what it does, not its name: the derivative of one
    tensor's update with respect to another's gradient, probed at gradients large enough to clip (nothing but a
    three-entry tree runs). A layout that updates the model in parts (a pipeline's stages) cannot run such an
    optimizer whole; the step's own ``clip_norm`` reduces over every part there."""
    params = {"a": jnp.ones(3, jnp.float32), "b": jnp.ones(3, jnp.float32)}
    state = tx.init(params)

    def update_a(grad_b):
        updates, _ = tx.update({"a": jnp.full(3, 1e6, jnp.float32), "b": grad_b}, state, params)
        return updates["a"]

    return bool(jnp.any(jax.jacobian(update_a)(jnp.full(3, 1e6, jnp.float32)) != 0))


def path_mask(exclude: str):
    """A mask function: True for parameters whose path (``"Dense_0/kernel"``) does not match ``exclude``."""
    try:
        pattern = re.compile(exclude)
    except re.error as e:
        raise OptimizerError(f"optimizer.exclude={exclude!r} is not a valid regular expression: {e}") from None

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: not pattern.search(path_str(path)), params)

    return mask


def make_optimizer(
    name: str,
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    exclude: str = DEFAULT_EXCLUDE,
    trust_coefficient: float = 0.001,
) -> optax.GradientTransformation:
    """The optax optimizer ``name``.

    Args:
      name: one of :data:`OPTIMIZERS`.
      learning_rate: a float or an optax schedule.
      momentum: momentum coefficient of the SGD family and LARS; ``b1`` of Adam-like optimizers.
      weight_decay: decoupled weight decay (adamw, lars, lamb) or L2 added to the
        gradient (sgd family, adam).
      exclude: regex on parameter paths that get neither weight decay nor a
        LARS/LAMB trust ratio (default: biases and normalisation parameters).
      trust_coefficient: LARS's η.

    Example:
      >>> tx = make_optimizer("lars", make_schedule("polynomial", 2.0, 1000, 50), weight_decay=1e-4)
    """
    if isinstance(learning_rate, (int, float)) and learning_rate <= 0:
        raise OptimizerError(f"optimizer.learning_rate={learning_rate} must be > 0")
    if not 0 <= momentum < 1:
        raise OptimizerError(f"optimizer.momentum={momentum} must be in [0, 1)")
    if weight_decay < 0:
        raise OptimizerError(f"optimizer.weight_decay={weight_decay} must be >= 0")
    mask = path_mask(exclude)
    l2 = [optax.add_decayed_weights(weight_decay, mask=mask)] if weight_decay else []
    if name == "sgd":
        return optax.chain(*l2, optax.sgd(learning_rate))
    if name in ("momentum", "nesterov"):
        return optax.chain(*l2, optax.sgd(learning_rate, momentum=momentum, nesterov=name == "nesterov"))
    if name == "adam":
        return optax.chain(*l2, optax.adam(learning_rate, b1=momentum))
    if name == "adamw":
        return optax.adamw(learning_rate, b1=momentum, weight_decay=weight_decay, mask=mask)
    if name == "lars":
        return optax.lars(learning_rate, weight_decay=weight_decay, weight_decay_mask=mask,
                          trust_coefficient=trust_coefficient, trust_ratio_mask=mask, momentum=momentum)
    if name == "lamb":
        # optax.lamb with a trust-ratio mask (optax's own applies the ratio to every leaf).
        return optax.chain(
            optax.scale_by_adam(b1=momentum, b2=0.999, eps=1e-6),
            optax.add_decayed_weights(weight_decay, mask=mask),
            optax.masked(optax.scale_by_trust_ratio(), mask),
            optax.scale_by_learning_rate(learning_rate),
        )
    raise OptimizerError(f"unknown optimizer.name {name!r}; choose one of {list(OPTIMIZERS)}")
