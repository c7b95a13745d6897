"""dtx.run.rundir: what a resumed run may change, and a checkpoint older than a config key."""

import json

import pytest
from ml_collections import ConfigDict

from dtx import config as config_lib
from dtx.run.rundir import check_resumable


def _saved(config):
    return json.loads(config.to_json())


def test_a_checkpoint_written_before_a_key_existed_resumes_under_its_default():
    """A run saved before ``task`` and ``dataset.seq_len`` existed ran with what their defaults mean."""
    config = config_lib.base_config()
    old = _saved(config)
    del old["task"], old["dataset"]["seq_len"]
    check_resumable(old, config)  # no error: the missing keys take their defaults
    with pytest.raises(config_lib.ConfigError, match="task differ"):
        check_resumable(old, config_lib.override(config, **{"task.name": "regression"}))


def test_what_a_resume_may_and_may_not_change():
    config = config_lib.base_config()
    saved = _saved(config)
    check_resumable(saved, config_lib.override(config, num_steps=7, driver="jit"))
    with pytest.raises(config_lib.ConfigError, match="seed differ"):
        check_resumable(saved, config_lib.override(config, seed=config.seed + 1))


def test_a_resume_may_change_how_data_is_read_but_not_what():
    """``dataset.workers`` changes who builds a batch, never the batch (tests/test_inputs.py)."""
    config = config_lib.override(config_lib.base_config(), **{"dataset.name": "cifar10"})
    saved = _saved(config)
    check_resumable(saved, config_lib.override(config, **{"dataset.workers": 2}))
    with pytest.raises(config_lib.ConfigError, match="dataset differ"):
        check_resumable(saved, config_lib.override(config, **{"dataset.augment.flip": True}))


def test_a_block_the_experiment_replaced_gains_no_default_keys():
    """An experiment's own model block (lenet: no ``features``) resumes: defaults fill only keys the run has."""
    config = config_lib.base_config()
    config.model = ConfigDict(dict(name="lenet", conv_features=(4,), dense_features=()))
    check_resumable(_saved(config), config)


def test_a_run_without_checkpoints_stopped_by_sigterm_starts_over_and_a_finished_one_is_refused(tmp_path, capsys):
    """SIGTERM told such a run "run the same command to start again"; that command was refused ("already holds
    a run ... no checkpoint to resume"). Now it starts over, its records kept aside; a run that ended otherwise
    is still never overwritten."""
    from dtx.run.rundir import decide_resume

    preempted, finished = tmp_path / "preempted", tmp_path / "finished"
    for workdir, last in ((preempted, {"step": 3, "preempted": 1}), (finished, {"step": 3, "test_accuracy": 0.5})):
        workdir.mkdir()
        (workdir / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 2.3}) + "\n" + json.dumps(last) + "\n")
    records = (preempted / "metrics.jsonl").read_text()
    assert decide_resume("auto", str(preempted / "checkpoints"), str(preempted)) is False
    assert "holds a run preempted before anything was saved; starting over" in capsys.readouterr().err
    assert (preempted / "interrupted-1" / "metrics.jsonl").read_text() == records
    assert not (preempted / "metrics.jsonl").exists()
    with pytest.raises(FileExistsError, match="already holds a run"):
        decide_resume("auto", str(finished / "checkpoints"), str(finished))
