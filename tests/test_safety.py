"""The records name what ran: your model and optimizer, the task and data you passed, not the config's.
(Batch norm under shard_map is tested in test_batchnorm.py, paced loops in test_pacing.py, the warnings
before a run in test_preflight.py.)
"""

import json
import warnings

import optax

import dtx
from dtx.run import metrics, preflight
from test_batchnorm import BNNet  # a user's own module
from test_preflight import _config  # a small run of the default config


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
