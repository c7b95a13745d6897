"""dtx.run.steplog: the loop's records one step behind the dispatch (lag-1), one host read a step,
communication totals, throughput windows, the divergence halt and the last step's flush.

Pure host code: metrics are numpy scalars, the clock and the writer are the test's.
"""

import math

import numpy as np
import pytest

from dtx.run import steplog
from dtx.precision import LossScaler
from dtx.run.steplog import CommTotals, StepLog


class Writer:
    def __init__(self):
        self.records = []

    def write(self, step, record):
        self.records.append((step, dict(record)))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def metrics(step, loss=None, comm=True):
    """Step ``step``'s metrics as the train step returns them (``comm_bytes`` = 100 × step)."""
    out = {"loss": np.float32(step if loss is None else loss)}
    if comm:
        out.update(comm_bytes=np.float32(100 * step), comm_rounds=np.float32(2))
    return out


def batch(step):
    return {"batch_hash": f"h{step}", "data_digest": f"d{step}"}


def make_log(writer, clock, **kwargs):
    return StepLog(writer, log_every=kwargs.pop("log_every", 2), global_batch_size=16, num_devices=8,
                   reference_bytes=1000, clock=clock, run_start=0.0, **kwargs)


def test_the_record_of_step_k_is_written_once_step_k_plus_1_is_dispatched_and_holds_step_ks_metrics(monkeypatch):
    reads = []
    monkeypatch.setattr(steplog, "to_host", lambda tree: reads.append(tree) or tree)
    writer, clock = Writer(), Clock()
    rates = np.arange(1, 7) / 10  # the rate of step k is k / 10
    with make_log(writer, clock, learning_rates=rates) as log:
        for step in range(1, 7):
            log.dispatched(step, metrics(step), batch(step))
            # Lag-1: step k is read only after k + 1 was dispatched, and read once.
            assert len(reads) == step - 1
            assert [s for s, _ in writer.records] == [s for s in (2, 4) if s < step]
        log.flush()
        log.flush()  # nothing pending: writes nothing
    assert len(reads) == 6
    assert [s for s, _ in writer.records] == [2, 4, 6]  # log_every=2; the last step by the flush, once
    for step, record in writer.records:
        assert record["loss"] == step
        assert (record["batch_hash"], record["data_digest"]) == (f"h{step}", f"d{step}")
        # The bytes of every step so far, step k's included: 100 + 200 + ... + 100 k.
        assert record["comm_bytes_total"] == 100 * step * (step + 1) / 2
        assert record["comm_bytes_per_step"] == 100 * (step + 1) / 2
        assert record["comm_ratio"] == pytest.approx(1000 / record["comm_bytes_per_step"])
    assert writer.records[0][1]["learning_rate"] == pytest.approx(0.2)
    assert writer.records[1][1]["learning_rate"] == pytest.approx(0.4)
    # The last step's record: nothing was dispatched after it, so no window closes (no throughput).
    assert "examples_per_sec" not in writer.records[-1][1] and "learning_rate" not in writer.records[-1][1]


def test_throughput_is_the_steps_done_since_the_previous_record_over_its_wall_time():
    writer, clock = Writer(), Clock()
    with make_log(writer, clock, log_every=2, utilisation=lambda seconds: {"mfu": seconds}) as log:
        for step, now in zip(range(1, 6), (0.0, 1.0, 2.0, 6.0, 10.0)):
            clock.now = now  # when step `step` is dispatched
            log.dispatched(step, metrics(step), batch(step))
    first, second = writer.records[0][1], writer.records[1][1]
    # Step 2 recorded at t=2 when step 3 was dispatched: steps 1 and 2 done in 2 s -> 16 examples/s.
    assert first["examples_per_sec"] == 16 and first["examples_per_sec_per_device"] == 2
    assert first["step_time_ms"] == 1000 and first["mfu"] == 1.0
    # Step 4 at t=10: the window (from t=2, step 3 in flight) holds steps 3 and 4, 8 s -> 4 examples/s.
    assert second["examples_per_sec"] == 4 and second["step_time_ms"] == 4000 and second["elapsed_s"] == 10


def test_a_run_of_one_step_shows_that_steps_rate_not_zero():
    """The probe: a resume one step from the end printed "0 ex/s" -- its only record is the last step's, which
    closes no window, and the bar was shown the rate of a window that never was."""
    import io

    from rich.console import Console

    from dtx.run.metrics import ProgressBar

    console = Console(file=io.StringIO(), force_terminal=False, force_jupyter=False, color_system=None, width=200)
    writer, clock = Writer(), Clock()
    with make_log(writer, clock, log_every=5, bar=ProgressBar(6, console=console)) as log:
        log.dispatched(6, metrics(6), batch(6))  # resumed at step 5: one step, 16 examples
        clock.now = 2.0
        log.flush()  # reads the step: done 2 s after the loop started
    assert console.file.getvalue().splitlines() == ["step 6/6  loss 6.0000  8 ex/s"]
    assert "examples_per_sec" not in writer.records[-1][1]  # the record's own rule is unchanged
    # A rate not measured yet is shown as such, never as 0.
    quiet = Console(file=io.StringIO(), force_terminal=False, force_jupyter=False, color_system=None, width=200)
    with ProgressBar(3, console=quiet) as bar:
        bar.update(1, 0.5, None)
    assert quiet.file.getvalue().splitlines() == ["step 1/3  loss 0.5000  - ex/s"]


def test_checkpointed_totals_include_the_step_in_flight_and_the_jit_figures_are_the_programs():
    log = make_log(Writer(), Clock())
    with log:
        log.dispatched(1, metrics(1), batch(1))
        log.dispatched(2, metrics(2), batch(2))
        assert log.comm_saved() == {"steps": 2, "bytes": 300.0, "rounds": 4.0}
        assert log.comm.steps == 1  # the totals themselves: step 1 only, step 2 is in flight
    fixed = CommTotals(fixed=(50.0, 3.0))
    writer = Writer()
    with make_log(writer, Clock(), comm=fixed) as log:
        for step in (1, 2, 3):
            log.dispatched(step, metrics(step, comm=False), batch(step))
    record = writer.records[0][1]
    assert record["comm_bytes"] == 50.0 and record["comm_rounds"] == 3.0 and record["comm_bytes_total"] == 100.0


def test_a_non_finite_loss_halts_at_the_next_record_naming_its_step():
    writer = Writer()
    with pytest.raises(FloatingPointError, match=r"step 4: the training loss is nan.*peak rate is 0\.5"):
        with make_log(writer, Clock(), log_every=4, peak_learning_rate=0.5) as log:
            for step in range(1, 9):
                log.dispatched(step, metrics(step, loss=math.nan if step >= 3 else None), batch(step))
    assert writer.records == []  # nothing recorded past the halt
    # Under loss scaling a non-finite step is skipped, not a divergence -- unless the scale is at its minimum.
    scaler = LossScaler(enabled=True, min_scale=1.0)
    log = make_log(Writer(), Clock(), loss_scaler=scaler)
    skipped = {"loss": np.float32(math.nan), "skipped": np.int32(1), "loss_scale": np.float32(2.0)}
    log.dispatched(1, skipped, batch(1))
    log.dispatched(2, {**skipped, "loss_scale": np.float32(1.0)}, batch(2))
    with pytest.raises(FloatingPointError, match="step 2: gradients are non-finite even at the minimum loss scale"):
        log.flush()


def test_extras_add_their_fields_to_every_record_and_the_watchdog_sees_every_step():
    class Watchdog:
        steps, sent = [], []

        def tick(self, step):
            self.steps.append(step)

        def dispatched(self, step):  # marked in the progress file: who waits in whose collective
            self.sent.append(step)

    writer, watchdog = Writer(), Watchdog()
    extra = lambda step, record: {"sim_time_s": 0.5 * step, "loss_seen": record["loss"]}  # noqa: E731
    with make_log(writer, Clock(), log_every=2, extras=[extra], watchdog=watchdog) as log:
        for step in range(1, 4):
            log.dispatched(step, metrics(step), batch(step))
        log.flush()
    assert [(s, r["sim_time_s"], r["loss_seen"]) for s, r in writer.records] == [(2, 1.0, 2.0), (3, 1.5, 3.0)]
    assert watchdog.steps == [1, 2, 3] and watchdog.sent == [1, 2, 3]


def test_settle_records_a_saved_step_at_once_and_keeps_the_windows_right():
    """The loop settles the step it just saved (a checkpoint must not commit before its step's record, which
    lag-1 would write only at a next dispatch that a killed or stuck rank never reaches): a record step is
    written at once, with the throughput of every step dispatched so far; other steps are only counted."""
    writer, clock = Writer(), Clock()
    with make_log(writer, clock, log_every=2) as log:
        log.dispatched(1, metrics(1), batch(1))
        clock.now = 1.0
        log.dispatched(2, metrics(2), batch(2))
        clock.now = 4.0
        log.settle()  # step 2 saved: recorded now, steps 1-2 done in 4 s
        assert [s for s, _ in writer.records] == [2]
        assert writer.records[0][1]["examples_per_sec"] == 8 and writer.records[0][1]["step_time_ms"] == 2000
        log.dispatched(3, metrics(3), batch(3))
        log.settle()  # step 3 is no record step: counted, not written
        assert log.comm.steps == 3 and [s for s, _ in writer.records] == [2]
        clock.now = 6.0
        log.dispatched(4, metrics(4), batch(4))
        clock.now = 8.0
        log.dispatched(5, metrics(5), batch(5))
    # Step 4 at t=8 (step 5 in flight): the window from t=4 holds steps 3 and 4 -> 8 examples/s.
    assert writer.records[1][0] == 4 and writer.records[1][1]["examples_per_sec"] == 8
