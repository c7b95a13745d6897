"""The training step: a pure ``(state, batch) -> (state, metrics)`` built by a factory.

:func:`make_train_step` / :func:`make_eval_step` take the model, the optimizer, the mesh and one
:class:`StepSpec`; a driver (:mod:`dtx.step.shard_map`, :mod:`dtx.step.jit`, registered in
:mod:`dtx.step.drivers`) builds them around the one per-worker body (:mod:`dtx.step.body`) on the
train state (:mod:`dtx.step.state`); ZeRO's step under ``shard_map`` (:mod:`dtx.step.zero_step`),
synchronised batch norm (:mod:`dtx.step.batchnorm`) and a paced loop of your own (:mod:`dtx.step.pacing`).
"""

from __future__ import annotations

from dtx.step import batchnorm, body, pacing, state  # noqa: F401
from dtx.step.drivers import (  # noqa: F401
    DRIVERS, EvalStep, Metrics, TrainStep, check_accumulation, check_combination, get_driver, make_eval_step,
    make_train_step,
)
from dtx.step.shard_map import state_specs  # noqa: F401
from dtx.step.spec import StepError, StepSpec  # noqa: F401
