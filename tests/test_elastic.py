"""dtx.run.elastic: the job an elastic restart goes on with (same global batch, same micro-batches, more of
them per device) and the membership record each start leaves. The restarts themselves run in
tests/test_launch.py (processes are costly)."""

import json

import pytest

from dtx.run import elastic


def test_the_largest_job_keeps_the_global_batch_in_the_same_micro_batches():
    # 4 processes x 2 devices, global batch 128, no accumulation: 8 micro-batches of 16.
    plan = lambda n: elastic.plan(n, 2, global_batch=128, grad_accum_steps=1, data_parallel=8)  # noqa: E731
    assert plan(4) == elastic.Plan(4, 8, 8, 1)
    assert plan(3) == elastic.Plan(2, 4, 4, 2)  # 6 devices do not divide 8 micro-batches: one process waits
    assert plan(2) == elastic.Plan(2, 4, 4, 2)
    assert plan(1) == elastic.Plan(1, 2, 2, 4)
    for p in (plan(4), plan(3), plan(1)):  # every start: 128 examples in micro-batches of 16
        assert p.data_parallel * p.grad_accum_steps * elastic.micro_batch(128, 8, 1) == 128
    # Accumulation already on: 2 devices x 4 micro-batches of 16 -> 1 device x 8.
    assert elastic.plan(1, 1, global_batch=128, grad_accum_steps=4, data_parallel=2) == elastic.Plan(1, 1, 1, 8)


def test_a_model_axis_keeps_its_size_and_does_not_split_the_batch():
    # mesh (("data", -1), ("model", 2)) on 4 processes x 2: data 4; on 3 processes: 6 devices, data 3 does not
    # divide 4 micro-batches -> 2 processes, data 2, accumulation 2.
    plan = elastic.plan(3, 2, global_batch=64, grad_accum_steps=1, data_parallel=4, fixed=2, model_axis=2)
    assert plan == elastic.Plan(2, 4, 2, 2)
    assert elastic.fixed_axes((("data", -1), ("model", 2))) == 2


def test_what_cannot_shrink_is_refused_naming_the_setting():
    with pytest.raises(elastic.ElasticError, match=r"exactly one axis of size -1.*\('data', -1\)"):
        elastic.fixed_axes((("data", 8),))
    with pytest.raises(elastic.ElasticError, match="micro-batches of 16"):
        # 3 processes x 3 devices: no count of them divides 8 micro-batches
        elastic.plan(3, 3, global_batch=128, grad_accum_steps=1, data_parallel=8)


def test_the_membership_record_says_who_ran_and_what_was_recomputed(monkeypatch):
    assert elastic.record({"data": 4}, 1, 0) == {}  # outside dtx launch --elastic: nothing
    monkeypatch.setenv(elastic.ENV, elastic.environment(1, 1, [1], 7)[elastic.ENV])
    assert elastic.record({"data": 2}, 2, 5) == {"membership": {
        "restart": 1, "processes": 1, "mesh": {"data": 2}, "grad_accum_steps": 2, "restored_step": 5, "lost": [1],
        "steps_recomputed": 2}}
    monkeypatch.setenv(elastic.ENV, json.dumps({"restart": 0, "processes": 2, "lost": [], "last_step": None}))
    assert elastic.record({"data": 4}, 1, 0)["membership"]["steps_recomputed"] == 0


def test_a_process_set_aside_rejoins_at_the_next_restart_and_a_replacement_counts():
    # 4 processes; one lost -> 3 left, the mesh uses 2 (plan above), one waits. Another of the 2 is lost: the
    # next start has the waiting one back (2 processes), not 1; an announced replacement adds one, up to 4.
    assert elastic.available(slots=3, lost=1, replacements=0, processes=4) == 2
    assert elastic.available(slots=2, lost=0, replacements=1, processes=4) == 3
    assert elastic.available(slots=4, lost=0, replacements=2, processes=4) == 4


def _settings(*overrides, processes=4, devices=2, minimum=1):
    import os

    experiment = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                              "digits_mlp.py")
    return elastic.settings(experiment, ["--config.checkpoint.every_steps=5", *overrides], processes, devices, minimum)


def test_the_restart_mesh_keeps_the_eval_batch_split_or_the_launch_is_refused():
    # 6 processes x 1 device, global batch 96 with grad_accum_steps=2: 12 micro-batches of 8. With 5 left, 4
    # devices split the 12 micro-batches but not an eval batch of 30 (test batches go over every device): the
    # restart takes the next mesh that splits both, 3 devices (4 micro-batches each), not 4.
    plan = lambda n, **eval_batch: elastic.plan(n, 1, global_batch=96, grad_accum_steps=2,  # noqa: E731
                                                data_parallel=6, **eval_batch)
    assert plan(5) == elastic.Plan(4, 4, 4, 3)
    assert plan(5, eval_batch=30) == elastic.Plan(3, 3, 3, 4)
    assert plan(5, eval_batch=60) == elastic.Plan(4, 4, 4, 3)
    # From an experiment: eval_batch_size=12 does not split over the first start's 8 devices: refused at launch,
    # naming the key and a size every mesh down to --elastic MIN splits.
    with pytest.raises(elastic.ElasticError, match=r"first start.*eval_batch_size=12.*multiple of every device "
                                                   r"count.*\(e\.g\. 24\)"):
        _settings("--config.eval_batch_size=12")
    assert _settings("--config.eval_batch_size=24").plan(3) == elastic.Plan(2, 4, 4, 2)


def test_state_kept_per_worker_is_refused_at_launch_naming_what_works():
    with pytest.raises(elastic.ElasticError) as refused:
        _settings("--config.strategy.name=local_sgd")
    said = str(refused.value)
    assert "strategy.name='local_sgd'" in said and "worker.strategy" in said
    assert "strategy.name=sync" in said and "strategy.name=local_sgd" not in said.split("works with")[1]
    with pytest.raises(elastic.ElasticError, match=r"compression.name='topk'.*worker.compress.*"
                                                   r"compression.name=topk with compression.error_feedback=False"):
        _settings("--config.compression.name=topk")
    assert _settings("--config.compression.name=topk", "--config.compression.error_feedback=False").start.processes == 4


def test_batch_norm_is_refused_at_launch_naming_the_switch():
    with pytest.raises(elastic.ElasticError, match=r"model.name='lenet'.*batch_stats.*"
                                                   r"--config.model.use_batch_norm=False"):
        _settings("--config.model.name=lenet")
    assert _settings("--config.model.name=lenet", "--config.model.use_batch_norm=False").start.processes == 4


def test_without_a_launcher_the_membership_is_read_from_the_runs_records(tmp_path, monkeypatch):
    """One `dtx train` per host (SLURM): no launcher says who ran before. A multi-process first start records
    restart 0; a later start counts the starts recorded (kept, or moved aside by a resume), and the steps
    recorded past its restored step are the ones it computes again; which rank was lost is not knowable."""
    monkeypatch.delenv(elastic.ENV, raising=False)
    assert elastic.record({"data": 4}, 1, 0, processes=1, workdir=str(tmp_path)) == {}  # one process: its own run
    assert elastic.record({"data": 4}, 1, 0, processes=2, workdir=str(tmp_path))["membership"] == {
        "restart": 0, "processes": 2, "mesh": {"data": 4}, "grad_accum_steps": 1, "restored_step": 0, "lost": [],
        "steps_recomputed": 0}
    first = {"restart": 0, "processes": 2, "mesh": {"data": 4}}
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 0, "membership": first}, {"step": 1, "loss": 2.0}, {"step": 6, "loss": 1.0})) + '\n{"step": 7, "lo')
    # (the half-written last line: a killed run's)
    (tmp_path / "metrics.superseded.jsonl").write_text(json.dumps({"step": 3, "membership": first}) + "\n")
    assert elastic.record({"data": 2}, 2, 4, processes=1, workdir=str(tmp_path))["membership"] == {
        "restart": 2, "processes": 1, "mesh": {"data": 2}, "grad_accum_steps": 2, "restored_step": 4, "lost": None,
        "steps_recomputed": 2}
