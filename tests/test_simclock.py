"""The simulated clock: a synchronous step costs what ``dtx simulate`` predicts, communication
scales with the link, stragglers make synchronous SGD wait for the slowest, bounded staleness
lets workers run ahead, and the straggler draws are the same on the host and in a jitted step.

Tolerances: the clock and the perf model add the same float64 terms in another order: ``rtol=1e-12``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx.perf import clusters, model as perfmodel, simclock
from dtx.perf import layers as layers_lib
from dtx import comm, models
from dtx.run import metrics as metrics_lib
from dtx.run import setup
from dtx import config as config_lib
from dtx.strategies.stragglers import Stragglers, StragglerError

TIGHT = dict(rel=1e-12, abs=0)
P, BATCH = 8, 64


def _model(features=(), num_classes=16, dtype=jnp.float32):
    """A model whose leaves all split evenly over 8 workers (no ring padding), analysed and its parameter shapes."""
    model = models.build_model("mlp", features=features, num_classes=num_classes, dtype=dtype, param_dtype=dtype)
    layers = layers_lib.analyze(model, (64,), dtype=dtype)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64), dtype)))["params"]
    return layers, params


def _sent(params, algorithm="psum", p=P):
    """What the step's gradient allreduce sends, counted by the accountant the records' comm_bytes come from."""
    traffic = comm.allreduce_traffic(params, comm.CommContext(("data",), p, lambda t: t, algorithm))
    return traffic.bytes_sent, traffic.messages


@pytest.mark.parametrize("name", ["cloud_10gbe", "haswell_fdr", "h100_nvlink_ndr"])
def test_a_synchronous_step_costs_what_dtx_simulate_predicts(name):
    """One Dense layer, 8 workers, batch 64: the clock's step from the roofline plus the bytes and rounds
    the psum sends equals make_plan's data-parallel ``overlap=none`` time (what ``dtx simulate`` prints),
    on a 10 GbE and an InfiniBand cluster and inside one NVLink machine (its local link, bf16)."""
    cluster = clusters.get_cluster(name)
    layers, params = _model(dtype=jnp.bfloat16 if cluster.bytes_per_element == 2 else jnp.float32)
    predicted = perfmodel.make_plan(layers, cluster, P, BATCH, mode="data", overlap="none",
                                    algorithm="ring").times["none"]
    model = simclock.make_model(cluster, layers, workers=P, global_batch=BATCH)
    assert simclock.SimClock(model).advance(0, *_sent(params)) == pytest.approx(predicted, **TIGHT)
    assert model.compute_s == pytest.approx(sum(c.compute for c in perfmodel.make_plan(
        layers, cluster, P, BATCH, mode="data").costs), **TIGHT)


def test_deeper_models_differ_from_dtx_simulate_only_by_the_rounds_xla_fuses():
    """Three layers: dtx simulate allreduces each layer (3 × 2(p−1) rounds), the psum step sends one fused
    2(p−1)-round schedule: the clock is faster by exactly 2 × 2(p−1) α; bytes and compute agree."""
    cluster = clusters.get_cluster("cloud_10gbe")
    layers, params = _model(features=(32, 32))
    plan = perfmodel.make_plan(layers, cluster, P, BATCH, mode="data", overlap="none", algorithm="ring")
    clock = simclock.SimClock(simclock.make_model(cluster, layers, workers=P, global_batch=BATCH))
    fused = 2 * 2 * (P - 1) * cluster.latency
    assert clock.advance(0, *_sent(params)) == pytest.approx(plan.times["none"] - fused, **TIGHT)


def test_doubling_the_bandwidth_halves_the_bandwidth_term_and_nothing_else():
    layers, params = _model(features=(32,))
    base = clusters.get_cluster("cloud_10gbe")
    slow = simclock.make_model(base, layers, workers=P, global_batch=BATCH)
    fast = simclock.make_model(base.replace(bandwidth=2 * base.bandwidth), layers, workers=P, global_batch=BATCH)
    a, b = slow.comm(*_sent(params)), fast.comm(*_sent(params))
    assert b.bandwidth_s == pytest.approx(a.bandwidth_s / 2, **TIGHT) and a.bandwidth_s > 0
    assert (b.latency_s, b.reduce_s, fast.compute_s) == (a.latency_s, a.reduce_s, slow.compute_s)
    # without latency (and reduction, far below the network) the whole communication halves
    free = base.replace(latency=0.0, memory_bandwidth=1e30)
    halves = [simclock.make_model(free.replace(bandwidth=f * base.bandwidth), layers, workers=P,
                                  global_batch=BATCH).comm(*_sent(params)).total for f in (1, 2)]
    assert halves[1] == pytest.approx(halves[0] / 2, **TIGHT)


def test_overlap_hides_communication_behind_the_backward_pass_only():
    layers, _ = _model()
    model = simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                                overlap=1.0)
    c = model.compute_s
    assert model.worker_times(0, c / 3)[0] == pytest.approx(c, **TIGHT)  # fully hidden
    assert model.worker_times(0, 2 * c)[0] == pytest.approx(c + 2 * c - 2 * c / 3, **TIGHT)  # only 2c/3 hidden
    half = model._replace(overlap=0.5)
    assert half.worker_times(0, c / 3)[0] == pytest.approx(c + c / 6, **TIGHT)


def _noisy(**kwargs):
    layers, _ = _model()
    return simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                               stragglers=Stragglers("lognormal", 5, 0.5).check(), **kwargs)


def test_synchronous_sgd_waits_for_the_slowest_and_backup_workers_for_the_nth():
    sync, backup = _noisy(), _noisy(drops=3)
    for clock_model, rank in ((sync, P - 1), (backup, P - 3 - 1)):
        clock, total = simclock.SimClock(clock_model), 0.0
        for step in range(4):
            times = clock_model.worker_times(step, 1e-3)
            total += np.sort(times)[rank]
            assert clock.advance(step, *(_bytes_rounds_for(clock_model, 1e-3))) == pytest.approx(total, **TIGHT)
        assert len(set(np.round(times, 12))) == P  # the noise is per worker


def _bytes_rounds_for(model, seconds):
    """Bytes that take ``seconds`` on the model's link, zero rounds."""
    return seconds / (1 / model.bandwidth + model.reduce_s_per_byte), 0


class _Fixed(simclock.ClockModel):
    """Worker times given by hand (a NamedTuple subclass adds no fields): ``_times`` per worker, every step."""

    def worker_times(self, step, comm_s):
        return _TIMES


_TIMES = None


def test_bounded_staleness_lets_fast_workers_run_exactly_s_steps_ahead():
    """Worker 0 takes 3c every step, the others c, bound s = 2. Update k needs every worker's step-k gradient,
    so it is applied at 3c(k+1), as under sync; the fast workers run ahead until their gradient would be
    more than s updates stale: from step s+1 on, each starts step k when update k-1-s is applied,
    finishing at 3c(k-s) + c."""
    global _TIMES
    layers, _ = _model()
    s, c = 2, 1.0
    _TIMES = np.array([3 * c] + [c] * (P - 1))
    base = simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                               runs_ahead=s)
    clock = simclock.SimClock(_Fixed(*base))
    assert [clock.advance(k, 0, 0) for k in range(6)] == pytest.approx([3 * c * (k + 1) for k in range(6)], **TIGHT)
    assert np.array(clock.finish)[:, 1] == pytest.approx([3 * c * (k - s) + c for k in (3, 4, 5)], **TIGHT)


def test_bounded_staleness_beats_sync_on_transient_stragglers_and_bound_zero_is_sync():
    """Transient stragglers (each worker slow 4x with probability 0.25 at each step): sync pays the slowest of
    every step; a bound lets the workers' noise average out. No bound can beat max_i sum_k T_i(k), each
    worker's own total, and s = 0 is sync exactly."""
    layers, _ = _model()
    cluster = clusters.get_cluster("cloud_10gbe")
    noise = Stragglers("slow", 1, slow_fraction=0.25, slow_factor=4.0)
    totals = {}
    for s in (0, 2, 8):
        model = simclock.make_model(cluster, layers, workers=P, global_batch=BATCH, runs_ahead=s, stragglers=noise)
        clock = simclock.SimClock(model)
        totals[s] = [clock.advance(k, 0, 0) for k in range(40)][-1]
    sync = simclock.SimClock(simclock.make_model(cluster, layers, workers=P, global_batch=BATCH, stragglers=noise))
    assert totals[0] == pytest.approx([sync.advance(k, 0, 0) for k in range(40)][-1], **TIGHT)
    own = max(sum(model.worker_times(k, 0.0)[i] for k in range(40)) for i in range(P))
    assert totals[0] > 1.5 * totals[8] and totals[0] > totals[2] > totals[8] >= own * (1 - 1e-12)


def test_the_clock_resumes_where_it_stopped():
    model = _noisy(runs_ahead=2)
    whole = simclock.SimClock(model)
    times = [whole.advance(k, 1e4, 14) for k in range(6)]
    first = simclock.SimClock(model)
    for k in range(3):
        first.advance(k, 1e4, 14)
    resumed = simclock.SimClock(model, saved=first.saved())
    assert [resumed.advance(k, 1e4, 14) for k in range(3, 6)] == times[3:]


@pytest.mark.parametrize("model", ["none", "lognormal", "slow"])
def test_straggler_draws_agree_between_the_host_and_a_jitted_step(model):
    s = Stragglers(model, 11, 0.4, 0.3, 5.0).check()
    keys = jax.jit(lambda t: s.arrival_keys(t, P, jnp))
    for step in (0, 1, 7, 2**20 + 3):
        np.testing.assert_array_equal(np.asarray(keys(step)), s.arrival_keys(step, P))
        order = s.arrival_order(step, P)
        assert np.all(np.diff(s.multipliers(step, P)[order]) >= 0)  # arrival order = order of the times
    other = Stragglers(model, 12, 0.4, 0.3, 5.0)
    assert any((s.arrival_order(t, P) != other.arrival_order(t, P)).any() for t in range(4))  # seeded


def test_straggler_models_have_the_stated_distribution():
    draws = np.concatenate([Stragglers("lognormal", 0, 0.5).multipliers(t, P) for t in range(1000)])
    assert abs(draws.mean() - 1) < 0.03 and abs(np.log(draws).std() - 0.5) < 0.02
    slow = np.concatenate([Stragglers("slow", 0, 0, 0.1, 4.0).multipliers(t, P) for t in range(1000)])
    assert set(np.unique(slow)) == {1.0, 4.0} and abs((slow > 1).mean() - 0.1) < 0.015


@pytest.mark.parametrize("overrides, match", [
    (["--config.cluster=nope"], r"cluster.name='nope' is unknown; choose a preset"),
    (["--config.cluster.name=custom", "--config.cluster.latency=0"], r"needs cluster.node_flops"),
    (["--config.cluster=cloud_10gbe", "--config.cluster.latency=-2"], r"cluster.latency=-2.0 must be >= 0"),
    (["--config.cluster=cloud_10gbe", "--config.cluster.bandwidth=-3"], r"cluster.bandwidth=-3.0 must be a positive"),
    (["--config.cluster=cloud_10gbe", "--config.cluster.overlap=1.5"], r"cluster.overlap=1.5 must be in \[0, 1\]"),
    (["--config.cluster.straggler=gamma"], r"cluster.straggler='gamma' is unknown"),
    (["--config.cluster.straggler=slow", "--config.cluster.slow_factor=0.5"], r"cluster.slow_factor=0.5 must be >= 1"),
    # settings their choice does not take: a clock setting without a cluster, a straggler setting of another model
    (["--config.cluster.bandwidth=1e9"], r"cluster.bandwidth=1000000000.0 is a setting of the simulated clock, which "
                                         r"is off \(cluster.name=''\); set --config.cluster=NAME"),
    (["--config.cluster.sigma=0.5"], r"cluster.sigma=0.5 applies to cluster.straggler=lognormal only, not 'none'"),
    (["--config.cluster=cloud_10gbe", "--config.cluster.straggler=lognormal", "--config.cluster.slow_factor=2"],
     r"cluster.slow_factor=2.0 applies to cluster.straggler=slow only, not 'lognormal'"),
    (["--config.strategy.backup_workers=-1"], r"strategy.backup_workers=-1 must be >= 0"),
    (["--config.cluster=cloud_10gbe", "--config.cluster.compute_s=-1"], r"cluster.compute_s=-1.0 must be >= 0"),
])
def test_bad_cluster_settings_are_refused_with_the_key_and_the_fix(overrides, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.load("digits_mlp", overrides)


def test_cluster_by_name_or_custom_numbers():
    config = config_lib.load("digits_mlp", ["--config.cluster=h100_nvlink_ndr", "--config.cluster.bandwidth=1e9"])
    cluster = setup.cluster_spec(config).cluster
    assert (cluster.name, cluster.bandwidth, cluster.local_size) == ("h100_nvlink_ndr", 1e9, 8)
    custom = setup.cluster_spec(config_lib.load("digits_mlp", [
        "--config.cluster.name=custom", "--config.cluster.node_flops=1e12", "--config.cluster.memory_bandwidth=1e11",
        "--config.cluster.bandwidth=1e9", "--config.cluster.latency=0"])).cluster
    assert (custom.node_flops, custom.latency, custom.bandwidth) == (1e12, 0.0, 1e9)
    assert setup.cluster_spec(config_lib.base_config()) is None
    with pytest.raises(StragglerError, match="cluster.sigma"):
        Stragglers("lognormal", 0, -1.0).check()


def test_the_records_clock_charges_each_window_its_mean_traffic_and_resumes():
    """The step log's extra: records every 2 steps of a run sending 1e4 bytes in 14 rounds per step give the
    times of a clock advanced step by step; restored from its saved state mid-run it continues the same."""
    model = _noisy(drops=2)
    exact = simclock.SimClock(model)
    times = [exact.advance(k, 1e4, 14) for k in range(6)]
    recorder = simclock.Recorder(model)
    record = lambda step: {"comm_bytes_total": 1e4 * step, "comm_rounds_per_step": 14.0}  # noqa: E731
    assert recorder(2, record(2))["sim_time_s"] == pytest.approx(times[1], **TIGHT)
    resumed = simclock.Recorder(model, saved=recorder.saved())
    for step in (4, 6):
        assert recorder(step, record(step)) == resumed(step, record(step))
        assert resumed(step, record(step))["sim_time_s"] == pytest.approx(times[step - 1], **TIGHT)


def test_dtx_plot_draws_accuracy_against_the_simulated_time(tmp_path):
    import json

    from dtx.tools.cli import main

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 1.0 / s, "sim_time_s": 0.25 * s} for s in (1, 2, 3)] + [
        {"step": 3, "test_accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(run), "--out", str(tmp_path / "p"), "--x", "sim_time"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["loss_vs_sim_time.png",
                                                                  "test_accuracy_vs_sim_time.png"]


def test_a_run_records_its_simulated_time_and_a_resume_continues_it(tmp_path, monkeypatch):
    """dtx.train with --config.cluster, ssp (s = 2: pulls, hence bytes, vary by step) under lognormal stragglers:
    3 steps, a checkpoint, a resume to 6. Every record's sim_time_s is a host clock advanced step by step with
    that step's recorded comm_bytes and comm_rounds, the straggler draws of the run's seed and workers running
    at most 2 steps ahead; the strategy was built with the same straggler model (backup's arrival order)."""
    from dtx import strategies
    from dtx.run.trainer import train

    built = []
    make = strategies.make_strategy
    monkeypatch.setattr(strategies, "make_strategy", lambda *a, **k: built.append(k["stragglers"]) or make(*a, **k))
    # a slow custom node: compute (~16 ms, spread by sigma = 1) outweighs communication (~1 ms), so fast workers
    # reach the bound and wait, and how the varying bytes fall on the steps matters (a resume must know it)
    cluster = ["--config.cluster=custom", "--config.cluster.node_flops=1e7", "--config.cluster.memory_bandwidth=1e11",
               "--config.cluster.bandwidth=1e8", "--config.cluster.latency=1e-4"]
    overrides = cluster + ["--config.cluster.straggler=lognormal", "--config.cluster.sigma=1.0", "--config.seed=4",
                 "--config.strategy.name=ssp", "--config.strategy.staleness=2", "--config.log_every=1",
                 "--config.model.features=(16,)", "--config.progress=False", "--config.checkpoint.every_steps=3",
                 "--config.checkpoint.async_save=False", "--config.eval_batch_size=360"]
    for steps in (3, 6):
        train(config_lib.load("digits_mlp", overrides + [f"--config.num_steps={steps}"]), tmp_path)
    noise = Stragglers("lognormal", 4, 1.0, 0.1, 4.0)
    assert built == [noise, noise]
    records = [r for r in metrics_lib.read_metrics(str(tmp_path)) if "sim_time_s" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and len({r["comm_bytes"] for r in records}) > 1
    model = models.build_model("mlp", features=(16,))
    host = simclock.SimClock(simclock.make_model(
        clusters.Cluster("custom", node_flops=1e7, memory_bandwidth=1e11, bandwidth=1e8, latency=1e-4),
        layers_lib.analyze(model, (64,)), workers=P, global_batch=128, stragglers=noise, runs_ahead=2))
    assert all(r["comm_bytes_logging"] > 0 for r in records)  # the metric averages ride in ssp's psum
    for k, r in enumerate(records):  # the clock charges what the step ran, the records' averages included
        assert r["comm_steps"] == [[r["comm_bytes"], r["comm_rounds"]]]
        assert r["sim_time_s"] == pytest.approx(host.advance(k, r["comm_bytes"], r["comm_rounds"]), **TIGHT)


def test_records_retimed_on_their_own_clock_give_their_own_times_and_scale_with_the_link():
    model = _noisy()
    recorder = simclock.Recorder(model)
    records = [{"step": 0, "num_params": 1}]
    for step in (2, 4, 6):
        records.append({"step": step, "loss": 1.0, "comm_bytes_total": 1e5 * step, "comm_rounds_per_step": 14.0})
        records[-1].update(recorder(step, records[-1]))
    records.append({"step": 6, "test_accuracy": 0.5})
    assert simclock.retime(records, model) == {r["step"]: r["sim_time_s"] for r in records if "sim_time_s" in r}
    no_latency = model._replace(latency=0.0, stragglers=Stragglers(), compute_s=0.0, reduce_s_per_byte=0.0)
    times = [simclock.retime(records, no_latency._replace(bandwidth=f * model.bandwidth))[6] for f in (1, 2)]
    assert times[1] == pytest.approx(times[0] / 2, **TIGHT)
    assert times[0] == pytest.approx(6e5 / model.bandwidth, **TIGHT)


def test_a_measured_compute_replaces_the_roofline_for_any_model():
    """cluster.compute_s: the clock's compute is the given seconds, not the roofline's, and needs no analysable
    model (a model without Dense/Conv layers is refused by the roofline, with compute_s named as the way out)."""
    import flax.linen as nn

    class NoLayers(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return x * self.param("scale", nn.initializers.ones, (x.shape[-1],))

    caps = comm.Capabilities()
    config = config_lib.load("digits_mlp", ["--config.cluster=cloud_10gbe"])
    spec = setup.cluster_spec(config)
    run = dict(workers=P, global_batch=config.global_batch_size, caps=caps)
    roofline = simclock.model_for_run(spec, models.build_model("mlp", features=(16,)), (64,), jnp.float32, **run)
    measured = simclock.model_for_run(setup.cluster_spec(config_lib.override(config, **{"cluster.compute_s": 2e-3})),
                                      NoLayers(), (64,), jnp.float32, **run)
    assert measured == roofline._replace(compute_s=2e-3)
    with pytest.raises(simclock.ClockError, match="cluster.compute_s=SECONDS"):
        simclock.model_for_run(spec, NoLayers(), (64,), jnp.float32, **run)


def test_a_token_model_runs_on_the_clock(tmp_path):
    """A transformer takes integer token ids: the clock analyses it with the data's dtype (not the compute
    dtype), so tiny_lm trains with --config.cluster and its records carry sim_time_s."""
    from dtx.experiments import tiny_lm
    from dtx.run.trainer import train

    config = config_lib.override(tiny_lm.get_config(), num_steps=2, log_every=1, progress=False, global_batch_size=16,
                                 eval_batch_size=256, **{"cluster.name": "cloud_10gbe", "optimizer.warmup_steps": 0,
                                                         "model.num_layers": 1})
    train(config, tmp_path)
    times = [r["sim_time_s"] for r in metrics_lib.read_metrics(str(tmp_path)) if "sim_time_s" in r]
    assert len(times) == 2 and 0 < times[0] < times[1]


def test_workers_with_their_own_models_wait_for_each_other_only_where_they_exchange():
    """local_models: with stragglers, H = 4 steps of which the last exchanges take max_i(sum of worker i's
    4 computes) + exchange — stragglers average out — where sync pays sum over steps of max_i, plus 4 exchanges."""
    layers, _ = _model()
    noise = Stragglers("lognormal", 3, 0.8)
    local, sync = (simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                                       stragglers=noise, local_models=flag, compute_s=1e-3) for flag in (True, False))
    exchange = local.comm(1e5, 14).total
    clock = simclock.SimClock(local)
    times = [clock.advance(k, 1e5 if k == 3 else 0.0, 14 if k == 3 else 0) for k in range(4)]
    computes = np.array([1e-3 * noise.multipliers(k, P) for k in range(4)])
    assert times[2] == pytest.approx(computes[:3].sum(0).max(), **TIGHT)
    assert times[3] == pytest.approx(computes.sum(0).max() + exchange, **TIGHT)
    assert simclock.SimClock(local, clock.saved()).advance(4, 0.0, 0.0) == pytest.approx(
        times[3] + 1e-3 * noise.multipliers(4, P).max(), **TIGHT)  # a resume: all start from the exchange
    sync_clock = simclock.SimClock(sync)
    assert [sync_clock.advance(k, 1e5, 14) for k in range(4)][-1] == pytest.approx(
        computes.max(1).sum() + 4 * exchange, **TIGHT)
    assert times[3] < computes.max(1).sum() + exchange  # the point of it


def test_the_records_clock_charges_each_step_what_it_ran_the_record_steps_averages_included():
    """A gossip-like run recorded every 3 steps: each step exchanges 1e4 bytes in 2 rounds, the record step also
    averages the records (56 bytes, 14 rounds of its own). The clock charges every step its own figures
    (comm_steps), the averages included where they ran: it equals one advanced step by step. Without comm_steps
    (older records) the window's traffic lands on its last step."""
    model = _noisy()._replace(local_models=True)
    recorder, clock = simclock.Recorder(model), simclock.SimClock(model)
    window = [[1e4, 2.0], [1e4, 2.0], [1e4 + 56.0, 16.0]]
    for step in (3, 6):
        record = {"comm_bytes_total": step / 3 * (3e4 + 56.0), "comm_rounds_per_step": 20.0 / 3, "comm_steps": window,
                  "comm_bytes_logging": 56.0, "comm_rounds_logging": 14.0}
        got = recorder(step, record)["sim_time_s"]
        for k in range(step - 3, step):
            want = clock.advance(k, *window[k % 3])
        assert got == pytest.approx(want, **TIGHT)
    older, clock = simclock.Recorder(model), simclock.SimClock(model)
    got = older(3, {"comm_bytes_total": 3e4 + 56.0, "comm_rounds_per_step": 20.0 / 3})["sim_time_s"]
    want = [clock.advance(k, 3e4 + 56.0 if k == 2 else 0.0, 20.0 if k == 2 else 0.0) for k in range(3)][-1]
    assert got == pytest.approx(want, **TIGHT)


def test_an_overlapped_exchange_is_awaited_tau_steps_later_and_survives_a_resume():
    """overlaps = τ = 2 (Streaming DiLoCo): an exchange sent at step 1 costs nothing until the end of step 3,
    which ends no earlier than the exchange; an exchange shorter than 2 steps' compute is hidden entirely."""
    layers, _ = _model()
    base = simclock.make_model(clusters.get_cluster("cloud_10gbe"), layers, workers=P, global_batch=BATCH,
                               stragglers=Stragglers("lognormal", 2, 0.5), local_models=True, compute_s=1e-3)
    computes = np.array([1e-3 * base.stragglers.multipliers(k, P) for k in range(5)])
    for nbytes in (1e7, 1e3):  # ~8 ms, ~0.7 ms (its 14 rounds of 50 µs): longer and shorter than 2 steps
        exchange = base.comm(nbytes, 14).total
        clock = simclock.SimClock(base._replace(overlaps=2))
        times = [clock.advance(k, nbytes if k == 1 else 0.0, 14 if k == 1 else 0) for k in range(3)]
        assert times[2] == pytest.approx(computes[:3].sum(0).max(), **TIGHT)  # nobody waited yet
        resumed = simclock.SimClock(clock.model, clock.saved())  # the exchange is still in flight
        ends = computes[:2].sum(0).max() + exchange  # it starts when the last worker has sent at step 1
        assert resumed.advance(3, 0.0, 0) == pytest.approx(max(computes[:4].sum(0).max(), ends), **TIGHT)
        assert resumed.pending == []
    assert exchange < computes[2:4].sum(0).min()  # the short one: hidden behind the next two steps
    from dtx import strategies
    assert strategies.make_strategy("streaming_diloco", period=4, fragments=2, overlap=1).caps.overlaps == 1


def test_a_transformers_compute_counts_attention():
    """The clock times every matrix product of a transformer (dtx.perf.layers.matmuls): its projections, QKᵀ and
    AV and the output layer, not only its Dense layers. Each product's roofline at the worker's batch, summed;
    attention's products and projections are 37.5 % of tiny_lm's matmul FLOPs (d = 64, S = 64) but, memory-bound
    at 8 sequences per worker on an H100 (their B·H·S² scores), 48 % of the time: measured 3.08 µs against
    1.62 µs for the Dense layers alone."""
    config = config_lib.load("tiny_lm", ["--config.cluster=h100_nvlink_ndr", "--config.global_batch_size=64"])
    spec, model = setup.cluster_spec(config), models.build_model("transformer", **{
        key: value for key, value in config.model.items() if key != "name"}, num_classes=256)
    clock = simclock.model_for_run(spec, model, (64,), jnp.int32, workers=P, global_batch=64, caps=comm.Capabilities())
    products = layers_lib.matmuls(model, (64,), dtype=jnp.int32)
    assert {layer.kind for layer in products} == {"dense", "projection", "attention"}
    assert clock.compute_s == pytest.approx(sum(perfmodel.compute_time(layer, spec.cluster, 64 / P)
                                                for layer in products), **TIGHT)
    dense_only = simclock.compute_seconds(layers_lib.analyze(model, (64,), dtype=jnp.int32), spec.cluster, P, 64)
    assert clock.compute_s > 1.4 * dense_only
