"""Experiment configs: the shared defaults and their checks (:mod:`dtx.config.defaults`, the numbers'
ranges in :mod:`dtx.config.numbers`), reading
experiment files and ``--config.KEY=VALUE`` overrides (:mod:`dtx.config.files`), and your own parts by
import path (:mod:`dtx.config.parts`)."""

from __future__ import annotations

from dtx.config.defaults import (  # noqa: F401
    LOSS_SCALES, RESUME_MODES, ConfigError, base_config, check_block, check_plain_sgd, chosen_settings,
    declared_settings, foreign_setting, refuse_foreign, register_check, replaces_optimizer, validate,
)
from dtx.config.files import load, override, packaged_experiments  # noqa: F401
from dtx.config.parts import choose, is_import_path, parameters, register_family, resolve  # noqa: F401
