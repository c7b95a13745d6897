"""Tests for dtx.run.wandb_sink: offline wandb runs (no network) read back from their .wandb files hold
metrics.jsonl's records and config.json; a preempted run continues its wandb run without a step twice."""

import glob
import json
import os
import shutil
import struct
import sys

import pytest

from dtx import config as config_lib
from dtx.ckpt import preemption
from dtx.run import metrics, wandb_sink
from dtx.run.trainer import train

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2 as wandb_pb  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ("--config.num_steps=20", "--config.model.features=(32,)", "--config.log_every=5", "--config.progress=False",
        "--config.checkpoint.every_steps=10", "--config.checkpoint.keep=5", "--config.wandb.project=dtx-tests")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """wandb offline and quiet, its files in the run's workdir (the sink's default without $WANDB_DIR)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)


# ------------------------------------------------- reading an offline run back

def _records(path):
    """The protobuf records of a .wandb file: wandb's LevelDB-log framing (a 7-byte file header
    ``:W&B``, magic 0xBEE1, version 0; 32 KiB blocks of chunks with a 7-byte header: CRC, length,
    type FULL/FIRST/MIDDLE/LAST) around ``wandb_internal_pb2.Record`` messages."""
    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline(workdir):
    """Every attempt of the workdir's offline wandb run, in order: ``(run_id, config, {step: row})``."""
    # wandb-core writes a run's .wandb file out when the run's stream closes, which run.finish() does not
    # wait for (a script's exit does, through wandb's atexit teardown): wait for it here.
    wandb.teardown()
    attempts = []
    for path in glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")):
        run_id, started, config, history = None, None, {}, {}
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id, started = record.run.run_id, record.run.start_time.ToNanoseconds()
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                row = {k: v for k, v in items.items() if not k.startswith("_")}  # not wandb's _step, _runtime
                assert record.history.step.num not in history, "wandb committed a step twice"
                history[record.history.step.num] = row
        config.pop("_wandb", None)
        attempts.append((started, run_id, config, history))
    # by start time: two attempts in one second get offline-run-TIME-ID and offline-run-TIME-ID-1
    return [attempt[1:] for attempt in sorted(attempts)]


def by_step(records):
    """metrics.jsonl's records merged by step (wandb's rows: records of one step share a row), as wandb
    holds them: the non-finite strings as floats."""
    rows = {}
    for record in records:
        rows.setdefault(record["step"], {}).update(
            {k: wandb_sink._value(v) for k, v in record.items() if k != "step"})
    return rows


def same(a, b):
    """Rows equal, NaN equal to NaN."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        if isinstance(a[key], float) and a[key] != a[key]:
            assert b[key] != b[key], key
        else:
            assert a[key] == b[key], (key, a[key], b[key])


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One 20-step run with the sink on (module-scoped: the resume test continues a copy of it)."""
    workdir = tmp_path_factory.mktemp("wandb") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        patch.delenv("WANDB_DIR", raising=False)
        train(config_lib.load(DEFAULT, TINY), workdir)
    return workdir


def test_the_wandb_run_holds_every_record_and_the_config(finished):
    (run_id, config, history), = read_offline(finished)
    assert wandb_sink.read_state(finished) == {"id": run_id, "project": "dtx-tests", "entity": "", "last_step": 20}
    with open(finished / "config.json") as f:
        assert config == json.load(f)  # the very dict of config.json
    records = metrics.read_metrics(finished)
    expected = by_step(records)
    assert sorted(history) == sorted(expected) == [0, 5, 10, 15, 20]
    for step in expected:
        same(history[step], expected[step])
    assert history[20]["test_accuracy"] == records[-1]["test_accuracy"] > 0.1
    assert isinstance(history[0]["precision"], str) and isinstance(history[5]["comm_steps"], list)


def test_a_preempted_run_continues_its_wandb_run_without_a_step_twice(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    with monkeypatch.context() as patch:  # SIGTERM noticed at step 10: save there and stop (dtx.ckpt.preemption)
        patch.setattr(preemption.PreemptionWatcher, "requested", lambda self, step: step >= 10)
        assert train(config_lib.load(DEFAULT, TINY), workdir).preempted
    assert wandb_sink.read_state(workdir)["last_step"] == 10
    resumed = train(config_lib.load(DEFAULT, TINY), workdir)
    assert not resumed.preempted and resumed.metrics["test_accuracy"] > 0.1

    (first, _, before), (second, _, after) = read_offline(workdir)
    assert first == second == wandb_sink.read_state(workdir)["id"]  # one wandb run, two attempts
    assert sorted(before) == [0, 5, 10] and sorted(after) == [15, 20]  # steps only go forward
    assert before[10]["preempted"] == 1
    expected = by_step(r for r in metrics.read_metrics(workdir) if "resumed_from" not in r)
    assert sorted(expected) == [0, 5, 10, 15, 20]  # the resumed run's own first record is the one left out
    for step, row in {**before, **after}.items():
        same(row, expected[step])


def test_resuming_behind_the_last_logged_step_logs_only_new_steps(finished, tmp_path, capfd):
    """A resume from an older checkpoint (checkpoint.resume_step, or a killed process) redoes steps wandb
    holds: wandb keeps those, the resumed run logs from the step after its last on, and says so."""
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    train(config_lib.load(DEFAULT, TINY + ("--config.checkpoint.resume_step=10", "--config.num_steps=30")), workdir)
    assert "wandb keeps the earlier values of steps 11..20" in capfd.readouterr().err
    (first, _, before), (second, _, after) = read_offline(workdir)
    assert first == second
    assert sorted(after) == [25, 30]  # 15 and 20 were redone but wandb holds them already
    expected = by_step(metrics.read_metrics(workdir))
    for step in after:
        same(after[step], expected[step])
    assert wandb_sink.read_state(workdir)["last_step"] == 30


# ---------------------------------------------------------------- the sink alone

def test_equal_steps_share_a_row_and_a_step_behind_is_left_out(tmp_path):
    settings = {"project": "dtx-tests", "entity": "", "name": "", "mode": "offline"}
    sink = wandb_sink.WandbSink(tmp_path, settings, {"lr": 0.1})
    assert sink.write(0, {"step": 0, "a": 1}) and sink.write(5, {"step": 5, "loss": "nan"})
    assert sink.write(5, {"step": 5, "test_accuracy": 0.5})  # an evaluation at a training record's step
    assert not sink.write(3, {"step": 3, "late": 1})
    sink.close()
    resumed = wandb_sink.WandbSink(tmp_path, settings, {"lr": 0.1}, resumed_from=5)
    assert not resumed.write(5, {"step": 5, "resumed_from": 5})  # wandb committed step 5 in the first attempt
    assert resumed.write(6, {"step": 6, "loss": 1.0})
    resumed.close()
    (first, config, before), (second, _, after) = read_offline(tmp_path)
    assert first == second and config == {"lr": 0.1}
    assert before[0] == {"a": 1} and before[5]["test_accuracy"] == 0.5 and before[5]["loss"] != before[5]["loss"]
    assert sorted(before) == [0, 5] and after == {6: {"loss": 1.0}}


def test_a_new_project_or_a_fresh_run_starts_a_new_wandb_run(tmp_path):
    settings = {"project": "dtx-tests", "entity": "", "name": "", "mode": "offline"}
    sink = wandb_sink.WandbSink(tmp_path, settings)
    sink.write(7, {"step": 7, "a": 1})
    sink.close()
    fresh = wandb_sink.WandbSink(tmp_path, settings)  # resumed_from=None: a new dtx run
    assert fresh.run.id != sink.run.id and fresh.last_step == -1
    fresh.close()
    moved = wandb_sink.WandbSink(tmp_path, {**settings, "project": "elsewhere"}, resumed_from=7)
    assert moved.run.id != fresh.run.id and moved.write(1, {"step": 1, "a": 1})
    moved.close()


def test_a_disabled_run_logs_and_stores_nothing(tmp_path):
    writer = metrics.MetricWriter(tmp_path, tensorboard=False, wandb={"project": "dtx-tests", "mode": "disabled"})
    writer.write(0, {"a": 1})
    writer.close()
    assert not os.path.exists(tmp_path / wandb_sink.STATE_FILE) and not os.path.exists(tmp_path / "wandb")
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "a": 1}]


# ---------------------------------------------------------------- refusals

def test_without_wandb_a_run_is_refused_before_any_compile(tmp_path, monkeypatch):
    config = config_lib.load(DEFAULT, TINY)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails, as when it is not installed
    fix = r"wandb\.project='dtx-tests'.*pip install 'dtx\[wandb\]'.*--config\.wandb\.project=''"
    with pytest.raises(config_lib.ConfigError, match=fix):
        config_lib.load(DEFAULT, TINY)
    with pytest.raises(config_lib.ConfigError, match=fix):
        train(config, tmp_path / "run")
    assert not os.path.exists(tmp_path / "run")  # refused before the workdir, data or a compile
    with pytest.raises(config_lib.ConfigError, match=fix):  # the sink itself, should a caller build one
        wandb_sink.WandbSink(tmp_path, {"project": "dtx-tests"})
    config_lib.load(DEFAULT, TINY + ("--config.wandb.project=",))  # off: wandb is not needed


def test_an_unknown_mode_is_refused():
    with pytest.raises(config_lib.ConfigError, match=r"wandb\.mode='ofline' is unknown.*'offline'.*"
                                                     r"--config\.wandb\.mode=offline"):
        config_lib.load(DEFAULT, ("--config.wandb.mode=ofline",))


def test_the_wandb_block_may_change_on_resume():
    """Turning the sink on (or changing where it logs) for a resume changes no state's meaning."""
    from dtx.run import rundir

    saved = json.loads(config_lib.load(DEFAULT, TINY[:-1]).to_json())  # checkpointed without wandb
    rundir.check_resumable(saved, config_lib.load(DEFAULT, TINY + ("--config.wandb.mode=offline",)))
