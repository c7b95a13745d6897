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
