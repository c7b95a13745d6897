"""Optimizers and learning-rate schedules, by name, built on optax.

Every optimizer is an optax ``GradientTransformation`` — the pure ``(init,
update)`` pair with explicit state (DESIGN.md §4.3) — so its state lives in the
train state and in checkpoints.
"""

from __future__ import annotations

import optax

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "lars", "lamb")
SCHEDULES = ("constant", "cosine")


class OptimizerError(ValueError):
    """Unknown optimizer or schedule, or a value out of range."""


def make_schedule(name: str, learning_rate: float, total_steps: int, warmup_steps: int = 0) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_steps`` (Goyal et al. 2017), then ``name``."""
    if learning_rate <= 0:
        raise OptimizerError(f"optimizer.learning_rate={learning_rate} must be > 0")
    if not 0 <= warmup_steps <= total_steps:
        raise OptimizerError(f"optimizer.warmup_steps={warmup_steps} must be in [0, total steps={total_steps}]")
    if name == "constant":
        decay = optax.constant_schedule(learning_rate)
    elif name == "cosine":
        decay = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
    else:
        raise OptimizerError(f"unknown optimizer.schedule {name!r}; choose one of {list(SCHEDULES)}")
    if not warmup_steps:
        return decay
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(
    name: str, learning_rate: optax.ScalarOrSchedule, *, momentum: float = 0.9, weight_decay: float = 0.0
) -> optax.GradientTransformation:
    """The optax optimizer ``name``.

    Args:
      name: one of :data:`OPTIMIZERS`.
      learning_rate: a float or an optax schedule.
      momentum: momentum coefficient of the SGD family; ``b1`` of Adam-like optimizers.
      weight_decay: decoupled weight decay (adamw, lars, lamb) or L2 added to the
        gradient (sgd family, adam).
    """
    if isinstance(learning_rate, (int, float)) and learning_rate <= 0:
        raise OptimizerError(f"optimizer.learning_rate={learning_rate} must be > 0")
    if not 0 <= momentum < 1:
        raise OptimizerError(f"optimizer.momentum={momentum} must be in [0, 1)")
    if weight_decay < 0:
        raise OptimizerError(f"optimizer.weight_decay={weight_decay} must be >= 0")
    l2 = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    if name == "sgd":
        return optax.chain(*l2, optax.sgd(learning_rate))
    if name in ("momentum", "nesterov"):
        return optax.chain(*l2, optax.sgd(learning_rate, momentum=momentum, nesterov=name == "nesterov"))
    if name == "adam":
        return optax.chain(*l2, optax.adam(learning_rate, b1=momentum))
    if name == "adamw":
        return optax.adamw(learning_rate, b1=momentum, weight_decay=weight_decay)
    if name == "lars":
        return optax.lars(learning_rate, weight_decay=weight_decay, momentum=momentum)
    if name == "lamb":
        return optax.lamb(learning_rate, b1=momentum, weight_decay=weight_decay)
    raise OptimizerError(f"unknown optimizer.name {name!r}; choose one of {list(OPTIMIZERS)}")
