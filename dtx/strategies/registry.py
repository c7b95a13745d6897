"""The strategies by name: one line each (:func:`make_strategy`); each factory's signature declares its settings."""

from __future__ import annotations

from collections.abc import Callable

from dtx.config import ConfigError, check_block, check_plain_sgd, declared_settings, refuse_foreign, register_check
from dtx.strategies.base import Strategy, StrategyError, async_sgd, backup, ssp, sync
from dtx.strategies.local_models import diloco, easgd, gossip, local_sgd
from dtx.strategies.onebit import onebit_adam, onebit_lamb
from dtx.strategies.streaming import streaming_diloco
from dtx.strategies.stragglers import Stragglers

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "sync": sync, "async": async_sgd, "ssp": ssp, "local_sgd": local_sgd, "diloco": diloco,
    "easgd": easgd, "gossip": gossip,
    "backup": backup,
    "streaming_diloco": streaming_diloco, "onebit_adam": onebit_adam, "onebit_lamb": onebit_lamb,
}
SUPPLIED = ("stragglers",)  # what make_strategy gives the factories that name it, not a key of config.strategy


def strategy_settings() -> dict[str, tuple[str, ...]]:
    """Each strategy's settings (keys of ``config.strategy``): its factory's parameters."""
    return {name: declared_settings(factory, SUPPLIED) for name, factory in STRATEGIES.items()}


def make_strategy(name: str, *, stragglers: Stragglers | None = None, **settings) -> Strategy:
    """The strategy ``name`` built from ``settings``, keys of ``config.strategy`` that it takes
    (:func:`strategy_settings`); a setting it does not take raises :class:`StrategyError`, as do settings
    out of range.

    ``stragglers``: the run's straggler model (:mod:`dtx.strategies.stragglers`, from ``config.cluster`` and
    ``config.seed``), which decides the arrival order of ``backup``; it goes to the strategies whose factory
    takes it.
    """
    if name not in STRATEGIES:
        raise StrategyError(f"strategy.name={name!r} is unknown; choose one of {sorted(STRATEGIES)}")
    refuse_foreign("strategy", name, settings, strategy_settings(), StrategyError)
    factory = STRATEGIES[name]
    supplied = {"stragglers": stragglers} if "stragglers" in declared_settings(factory) else {}
    return factory(**settings, **supplied)


@register_check
def check_config(config) -> None:
    """``config.strategy`` sets only what its strategy takes; a strategy that does Adam's work runs over SGD."""
    check_block(config, "strategy", strategy_settings())
    check_plain_sgd(config, "strategy", STRATEGIES.get(config.strategy.name))
    clip = config.optimizer.get("clip_norm", 0.0)
    if clip < 0:
        raise ConfigError(f"optimizer.clip_norm={clip!r}: the largest global gradient norm must be > 0 (or 0: off)")
    if clip and config.strategy.name in STRATEGIES and not make_strategy(config.strategy.name).caps.reduces_once:
        raise ConfigError(f"optimizer.clip_norm={clip!r} clips the gradient every worker applies by its global "
                          f"norm, and strategy.name={config.strategy.name!r} does not reduce the gradients once per "
                          "step (its workers step on their own gradients or models): use strategy.name=sync (or "
                          "another that reduces each step), or leave optimizer.clip_norm at 0")
