"""Synchronous, asynchronous and relaxed-synchronous SGD on the reference task, side by side.

The Hitchhiker's Guide (Chahal et al., arXiv 1810.11787) contrasts synchronous
SGD with asynchronous parameter servers and relaxed schemes that communicate less.
This experiment is the default digits task (experiments/digits_mlp.py: MLP 256-256,
Adam 2e-3, global batch 128 over 8 workers, 20 epochs = 220 steps) with
``strategy.name`` set to the config argument and these settings:

===========  ==============================================================================
sync         average the gradients every step (the baseline)
async        Downpour-style stale gradients, delays drawn in [0, 4] per worker and step
ssp          stale-synchronous, each worker's parameter cache at most 4 steps old
local_sgd    16 local Adam steps between parameter averagings
diloco       16 inner AdamW steps (weight decay 1e-4), outer Nesterov SGD (0.7, momentum 0.9)
easgd        elastic exchange every 4 steps, β = moving_rate = 0.9, α = rho = β/8 (the
             paper's symmetric choice β = pα for p = 8)
gossip       ring, weights (1/3, 1/3, 1/3) for (self, left, right)
===========  ==============================================================================

Launch one (any key overridable, e.g. the period):

    dtx train experiments/sync_strategies.py:local_sgd --config.strategy.period=64

The sweep over strategies and settings, table and plot: ``python benchmarks/strategies_sweep.py``
(BENCHMARKS.md, docs/strategies.md). Expected (one seed, 360 test digits; ~5–10 s a run):
sync 98.6% test accuracy; local_sgd 98.1, diloco 98.1, easgd 98.3, gossip 98.3, ssp 97.8 —
while local_sgd and diloco send 17× fewer bytes per step than sync, easgd 4×, ssp 1.7×, and
gossip sends only to its neighbours (no global all-reduce in its step). async drops to 88.1%: stale gradients
act as extra momentum on top of Adam's b1 = 0.9; ``--config.optimizer.momentum=0.5`` gives 97.8%.
"""

from dtx.experiments import digits_mlp

SETTINGS = {
    "sync": {},
    "async": {"staleness": 4, "random_delay": True},
    "ssp": {"staleness": 4},
    "local_sgd": {"period": 16},
    "diloco": {"period": 16, "outer_learning_rate": 0.7, "outer_momentum": 0.9},
    "easgd": {"period": 4, "rho": 0.9 / 8, "moving_rate": 0.9},
    "gossip": {"topology": "ring", "mixing": (1 / 3, 1 / 3, 1 / 3)},
}


def get_config(strategy: str = "sync"):
    if strategy not in SETTINGS:
        raise ValueError(f"sync_strategies: strategy {strategy!r} must be one of {sorted(SETTINGS)}")
    config = digits_mlp.get_config()  # the reference task, unchanged but for the strategy
    config.log_every = 20
    config.strategy.name = strategy
    for key, value in SETTINGS[strategy].items():
        config.strategy[key] = value
    if strategy == "diloco":  # the paper's inner optimizer
        config.optimizer.name = "adamw"
        config.optimizer.weight_decay = 1e-4
    return config
