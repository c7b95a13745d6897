"""Safe by default: your own batch norm is synchronised under shard_map, hand-written loops are paced,
runs that differ from their config say so before they start, and the records name what ran.

Tolerances as in tests/test_step.py: parameters ``atol=1e-6, rtol=1e-5``, batch statistics
``atol=rtol=1e-5`` (float32 sums in another order); SGD-momentum, not Adam (see there).
"""

import json
import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dtx
from dtx import batchnorm, datasets, metrics, models, pacing, preflight
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader
from dtx.state import init_train_state
from dtx.step import make_train_step

PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
STATS_TOL = dict(atol=1e-5, rtol=1e-5)


class BNNet(nn.Module):
    """A user's module: batch norm with no ``norm_axis_name`` field and no ``axis_name``."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(32)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))


@pytest.fixture(scope="module")
def digits():
    return datasets.load_dataset("digits")


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh([("data", -1)])


def _sorted_batch(digits, mesh):
    """64 examples, device d holding 8 of digit d: each device's statistics are far from the global batch's."""
    labels = digits.train.labels
    rows = np.concatenate([np.flatnonzero(labels == d)[:8] for d in range(8)])
    return jax.device_put({"inputs": digits.train.inputs[rows], "labels": labels[rows]},
                          mesh_lib.batch_sharding(mesh))


TX = optax.sgd(0.1, momentum=0.9)


@pytest.fixture(scope="module")
def bn_state(digits, mesh):
    """One initial state for every batch-norm test (``axis_name`` changes no variable)."""
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    return init_train_state(BNNet(), TX, example, seed=0, mesh=mesh)


def _three_steps(model, mesh, driver, state, batch):
    step = make_train_step(model, TX, mesh, driver=driver, donate=False)  # the shared start state stays
    for _ in range(3):
        state, out = step(state, batch)
        jax.block_until_ready(out)
    return jax.device_get((state.params, state.model_state))


def test_your_batchnorm_gives_the_same_run_under_both_drivers(digits, mesh, bn_state):
    batch = _sorted_batch(digits, mesh)
    x = np.asarray(batch["inputs"]).reshape(64, -1)
    # The premise: pixel means per device differ from the global batch's by up to most of the range [0, 1].
    assert np.abs(x.reshape(8, 8, -1).mean(1) - x.mean(0)).max() > 0.5
    params_jit, stats_jit = _three_steps(BNNet(), mesh, "jit", bn_state, batch)
    params_sm, stats_sm = _three_steps(BNNet(), mesh, "shard_map", bn_state, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **PARAM_TOL), params_sm, params_jit)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **STATS_TOL), stats_sm, stats_jit)


def test_a_batchnorm_axis_name_the_mesh_does_not_split_is_refused(digits, mesh, bn_state):
    step = make_train_step(BNNet(axis_name="batch"), TX, mesh, driver="shard_map")
    with pytest.raises(batchnorm.NormSyncError, match=r"BatchNorm_0.*axis_name='batch'.*leave axis_name unset.*driver=jit"):
        step.lower(bn_state, _sorted_batch(digits, mesh))  # refused while tracing, before compiling


def test_a_paced_hand_loop_of_60_steps_completes(digits, mesh):
    # This loop without dtx.paced, batches placed beforehand so dispatch outruns the devices, aborts
    # in XLA:CPU's all-reduce rendezvous ("Termination timeout ... only 6 of them arrived"; measured
    # with 60 and 100 steps of this model). Paced, it keeps one step queued behind the running one.
    model = models.build_model("mlp", features=(2048,))
    tx = optax.sgd(0.1)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = dtx.init_train_state(model, tx, example, seed=0, mesh=mesh)
    step = dtx.paced(dtx.make_train_step(model, tx, mesh))
    loader = TrainLoader(digits.train, 64, mesh, seed=0)
    batches = [loader.batch(s) for s in range(60)]
    losses, unfinished = [], 0
    for batch in batches:
        state, out = step(state, batch)
        losses.append(out["loss"])
        unfinished += len(losses) > 1 and not losses[-2].is_ready()  # the step before has finished
    step.wait()
    assert unfinished == 0
    assert int(jax.device_get(state.step)) == 60
    assert float(np.mean(jax.device_get(losses[-5:]))) < 0.5 * float(losses[0])


def test_paced_waits_for_the_previous_call(monkeypatch):
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda xs: waited.append([id(x) for x in xs]) or real(xs))
    step = pacing.paced(jax.jit(lambda i: {"value": i + 1}))
    outs = [step(jnp.int32(i)) for i in range(4)]
    assert waited == [[id(outs[k]["value"])] for k in range(3)]  # call k+1 waited on call k, never on itself
    step.wait()
    assert waited[-1] == [id(outs[3]["value"])]
    # in_flight=0 waits on each call's own outputs; outputs donated to the next call (a train state) are
    # gone, so the wait falls to the newer call's.
    waited.clear()
    donating = pacing.paced(jax.jit(lambda x: x + 1, donate_argnums=0), in_flight=1)
    x = donating(jnp.zeros(3))
    y = donating(x)
    assert x.is_deleted() and waited == [[id(y)]]
    with pytest.raises(ValueError, match="in_flight=-1"):
        pacing.paced(lambda: None, in_flight=-1)


# ------------------------------------------------------------------- warnings
def _config(**values):
    base = {"model.features": (16,), "num_steps": 4, "log_every": 2, "progress": False, "global_batch_size": 64}
    return config_lib.override(config_lib.base_config(), **{**base, **values})


@pytest.mark.parametrize("values, kwargs, message", [
    ({"global_batch_size": 256}, {},
     r"global_batch_size=256 does not divide the 1437 training examples: each epoch trains 5 steps and drops 157 "
     r"examples \(11%.*drop fewer: 472 drops 21, 176 drops 29"),
    ({"optimizer.warmup_steps": 4}, {}, r"optimizer\.warmup_steps=4 is as long as the run \(4 steps\).*peak only "
                                         r"at the last step.*e\.g\. to 1 steps"),
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


# -------------------------------------------------------------------- records
def test_records_name_your_model_and_optimizer(tmp_path):
    config = _config(**{"optimizer.name": "lamb"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dtx.train(config, tmp_path, model=BNNet(), optimizer=optax.sgd(0.05, momentum=0.9))
    run_warnings = [str(w.message) for w in caught if issubclass(w.category, preflight.RunWarning)]
    assert len(run_warnings) == 1 and "optimizer.name='lamb'" in run_warnings[0]

    saved = json.loads((tmp_path / "config.json").read_text())
    model_class = f"{BNNet.__module__}.BNNet"
    assert saved["model"] == {"given": "dtx.train(model=...)", "class": model_class, "fields": {"axis_name": "None"}}
    description = saved["optimizer"]["description"]
    assert saved["optimizer"]["given"] == "dtx.train(optimizer=...)"
    assert "trace(decay=0.9" in description and "scale(step_size=-0.05)" in description
    assert "lamb" not in json.dumps(saved["optimizer"]) and "mlp" not in json.dumps(saved["model"])

    first = metrics.read_metrics(tmp_path)[0]
    assert first["model"] == model_class and first["optimizer"] == description
    assert first["train_examples"] == 1437 and first["examples_dropped_per_epoch"] == 1437 % 64


def test_optimizer_description_and_config_runs():
    config = _config()
    model = BNNet()
    given = preflight.what_ran(config, model, model_given=False, optimizer_given=True, optimizer=optax.sgd(0.1),
                               optimizer_description="sgd 0.1, my schedule")
    assert given.config["optimizer"]["description"] == given.record["optimizer"] == "sgd 0.1, my schedule"
    assert given.config["model"] == json.loads(config.to_json())["model"]  # not given: the config's block
    plain = preflight.what_ran(config, model, model_given=False, optimizer_given=False)
    assert plain.record["optimizer"] == "adam, constant schedule, learning_rate 0.001"
    assert plain.config == json.loads(config.to_json())


def test_given_task_and_data_are_marked_not_the_configs():
    config = _config(**{"dataset.name": "synthetic", "task.label_smoothing": 0.1})
    ran = preflight.what_ran(config, BNNet(), model_given=False, optimizer_given=False, task_name="regression",
                             task_given=True, data_fingerprint="0123abcd", data_description="train (100, 3)")
    assert ran.config["task"] == {"given": "dtx.train(task=...)", "name": "regression"}
    assert ran.config["dataset"] == {"given": "dtx.train(data=...)", "fingerprint": "0123abcd",
                                     "description": "train (100, 3)"}
    assert ran.record["task"] == "regression" and ran.record["data"] == "train (100, 3)"
    assert preflight.ignored_keys(config, dataset=True, task=True) == [("dataset.name", "synthetic"),
                                                                        ("task.label_smoothing", 0.1)]
