"""dtx.run.preflight: runs that differ from their config say so before any work (dropped examples, warm-ups as long
as the run, keys a given model or optimizer makes meaningless); a plain run has nothing to warn about."""

import os
import warnings

import optax
import pytest

import dtx
from dtx import config as config_lib
from dtx.run import preflight
from test_batchnorm import BNNet  # a user's own module


def _config(**values):
    base = {"model.features": (16,), "num_steps": 4, "log_every": 2, "progress": False, "global_batch_size": 64}
    return config_lib.override(config_lib.base_config(), **{**base, **values})


@pytest.mark.parametrize("values, kwargs, message", [
    ({"global_batch_size": 256}, {},
     r"global_batch_size=256 does not divide the 1437 training examples: each epoch trains 5 steps and drops 157 "
     r"examples \(11%.*drop fewer: 472 drops 21, 176 drops 29"),
    ({"optimizer.warmup_steps": 4}, {}, r"optimizer\.warmup_steps=4 is as long as the run \(4 steps\).*peak only "
                                         r"at the last step.*--config.optimizer.warmup_steps=1 "),
    ({"optimizer.warmup_epochs": 1.0, "num_steps": 22}, {}, r"warmup_epochs=1\.0 \(22 steps at 22 per epoch\)"),
    ({"optimizer.learning_rate": 0.5, "model.features": (8,)}, {"model": BNNet(), "optimizer": optax.sgd(0.1)},
     r"dtx\.train\(model= and optimizer=\.\.\.\).*model\.features=\(8,\), optimizer\.learning_rate=0\.5"),
])
def test_runs_unlike_their_config_warn_before_any_work(tmp_path, values, kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error", preflight.RunWarning)  # the warning stops the run where it is raised
        with pytest.raises(preflight.RunWarning, match=message):
            dtx.train(_config(**values), tmp_path / "run", **kwargs)
    assert not os.path.exists(tmp_path / "run")  # before anything was written (or compiled)


def test_a_warmup_longer_than_the_run_is_refused_with_the_fix(tmp_path):
    with pytest.raises(config_lib.ConfigError, match=r"warmup_steps=10 is longer than the run's 4 steps.*Shorten"):
        dtx.train(_config(**{"optimizer.warmup_steps": 10}), tmp_path / "run")
    assert not os.path.exists(tmp_path / "run")


def test_nothing_to_warn_about_a_plain_run():
    assert preflight.dropped_examples_message(1437, 128, 8) is None  # 29 dropped: 2%, a different 29 each epoch
    assert preflight.warmup_message(_config(**{"optimizer.warmup_steps": 3}), 22, 4) is None
    assert preflight.ignored_keys(_config(), model=False, optimizer=False) == []
