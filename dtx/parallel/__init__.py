"""Where the state and the activations live: data, model, hybrid parallelism (Das et al. §3), FSDP, ZeRO.

The layouts, each a declaration (:mod:`dtx.parallel.layouts`); the partitioning rules they derive
(:mod:`dtx.parallel.rules`); where a layer's inputs and outputs live (:mod:`dtx.parallel.activations`);
and ZeRO's explicit reduce-scatter / all-gather under the ``shard_map`` driver (:mod:`dtx.parallel.zero`).
"""

from __future__ import annotations

from dtx.parallel import activations, rules  # noqa: F401
from dtx.parallel.activations import ActivationLayout, activation_layout  # noqa: F401
from dtx.parallel.layouts import (  # noqa: F401
    LAYOUTS, Layout, Placement, compose, configured, fsdp_stage, get_layout, make_rules, optimizer_rules, rules_layout,
)
from dtx.parallel.rules import (  # noqa: F401
    PartitionError, Rules, check_rules_match, gradient_shardings, param_specs, state_shardings,
)
