"""How workers synchronise (the Hitchhiker's Guide §3.1; Das et al. §2), selected by name.

Synchronous SGD, asynchronous and stale-synchronous SGD, backup workers (:mod:`dtx.strategies.base`);
workers with their own models — local SGD, DiLoCo, EASGD, gossip (:mod:`dtx.strategies.local_models`);
Streaming DiLoCo (:mod:`dtx.strategies.streaming`); 1-bit Adam/LAMB (:mod:`dtx.strategies.onebit`);
and the straggler model they and the simulated clock share (:mod:`dtx.strategies.stragglers`).
"""

from __future__ import annotations

from dtx.strategies import local_models, onebit, streaming, stragglers  # noqa: F401
from dtx.strategies.base import (  # noqa: F401
    StepContext, Strategy, StrategyError, async_sgd, backup, draw_delays, global_params, ssp, sync,
)
from dtx.strategies.local_models import diloco, easgd, gossip, local_sgd  # noqa: F401
from dtx.strategies.onebit import onebit_adam, onebit_lamb  # noqa: F401
from dtx.strategies.streaming import streaming_diloco  # noqa: F401
from dtx.strategies.registry import STRATEGIES, make_strategy, strategy_settings  # noqa: F401
