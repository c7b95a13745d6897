"""Checks of a config's numbers that hold whatever the experiment: no NaN or infinity, signs and ranges
where a value has one meaning, model sizes >= 1 (called by :func:`dtx.config.defaults.validate`)."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from dtx.config.errors import ConfigError

# Hyper-parameters that must be positive / non-negative, and fractions in [0, 1): a sign error or a
# NaN here would silently train nonsense, so it is refused before anything runs.
_POSITIVE = ("heartbeat_seconds", "startup_seconds", "optimizer.trust_coefficient", "optimizer.decay_power",
             "optimizer.step_factor", "optimizer.base_batch_size", "loss_scale.initial", "loss_scale.min_scale",
             "loss_scale.growth_interval")
_NON_NEGATIVE = ("optimizer.learning_rate", "optimizer.weight_decay", "optimizer.warmup_steps",
                 "optimizer.warmup_epochs", "watchdog_seconds", "num_epochs", "seed", "memory_limit")
_FRACTIONS = ("optimizer.momentum", "loss_scale.backoff")
# Model sizes whose 0 means "the model's default" (the transformer's: as many key/value heads as query heads, the
# MLP's width from mlp_ratio): >= 0.
_ZERO_IS_DEFAULT = ("model.num_kv_heads", "model.mlp_hidden")


def check_numbers(config: ConfigDict) -> None:
    """No NaN or infinity anywhere; signs and ranges where a value has one meaning."""
    for key, value in _leaves(config):
        for number in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"{key}={value!r} is not a finite number; set --config.{key} to a real value")
    for key in _POSITIVE + _NON_NEGATIVE + _FRACTIONS:
        value = _get(config, key)
        if value is None or isinstance(value, bool):
            continue
        if key in _POSITIVE and not value > 0:
            raise ConfigError(f"{key}={value!r} must be > 0; set --config.{key}=<positive value>")
        if key in _NON_NEGATIVE and value < 0:
            raise ConfigError(f"{key}={value!r} must be >= 0; set --config.{key}=<value >= 0>")
        if key in _FRACTIONS and not 0 <= value < 1:
            raise ConfigError(f"{key}={value!r} must be in [0, 1); set --config.{key}, e.g. 0.9")
    # Model sizes: every integer of a built-in model's block is a width, count or size, so >= 1 (your own
    # model's, chosen by import path, may mean anything: its class checks them). A nested block is a part's own
    # settings, checked by the model (the transformer's model.moe, whose experts=0 means dense MLPs).
    top = [(f"model.{key}", value) for key, value in config.model.items() if not isinstance(value, ConfigDict)]
    for key, value in top if ":" not in str(config.model.get("name")) else ():
        for number in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(number, int) and not isinstance(number, bool) and number < (key not in _ZERO_IS_DEFAULT):
                raise ConfigError(f"{key}={value!r}: widths and sizes must be >= 1; fix --config.{key}")
            if isinstance(number, float) and number < 0:
                raise ConfigError(f"{key}={value!r} must be >= 0; fix --config.{key}")


def _leaves(node: ConfigDict, prefix: str = ""):
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, ConfigDict):
            yield from _leaves(value, name)
        else:
            yield name, value


def _get(config: ConfigDict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, ConfigDict) or part not in node:
            return None
        node = node[part]
    return node

