"""Pipeline parallelism (dtx.parallel.pipeline.step, dtx.parallel.pipeline.stages, dtx.parallel.pipeline.schedules).

GPipe and 1F1B on a ``stage`` axis combined with ``data`` compute what one device computes with the
same global batch (the MLP with Adam on 4 stages x 2, the speech DNN with SGD on 2 stages x 4, each over
5 steps of M micro-batches), and the compiled programs show what the schedules say: the
collective-permutes' bytes with their loops' trip counts, one gradient all-reduce per step, and stage
inputs kept for M micro-batches under GPipe but for at most 2P - 1 under 1F1B (memory_analysis).
"""

import dataclasses
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.comm import hlo
from dtx.data import TrainLoader, datasets, tasks
from dtx.parallel.pipeline import costs as pipeline_model
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline.check import PipelineSettings, check_settings
from dtx.parallel.pipeline.schedules import IDLE, ScheduleError, diagram, make_schedule
from dtx.parallel.pipeline.stages import PipelineError, balance, make_plan
from dtx.perf import clusters
from dtx.perf import memory as memory_lib
from dtx.precision import LossScaler, Policy, parse_policy
from dtx.run import metrics
from dtx.run.evaluate import export_run
from dtx.run.trainer import train
from dtx.step import StepError, StepSpec, make_train_step
from dtx.step.state import init_train_state

STEPS = 5
MLP = dict(features=(32, 24, 16), num_classes=10)  # 4 layers: one per stage on 4 stages
SPEECH = dict(hidden=(32, 16, 24), num_classes=10)


def _digits():
    digits = datasets.load_dataset("digits")
    return digits, jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)


# The rows unpacked in one program per plan (eagerly, pp.gather_params compiles each slice and reshape on its own).
_gather_params = jax.jit(pp.gather_params, static_argnums=1)


def _run(model, tx, mesh, schedule, batch_size, stages, boundaries=(), chunks=1, policy=Policy(), per_tensor=False,
         scaler=LossScaler()):
    digits, example = _digits()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), digits.train.inputs[:1])["params"])
    plan = make_plan(model, abstract, stages, boundaries, chunks)
    state = pp.init_state(model, tx, example, 0, mesh, plan, loss_scaler=scaler)
    step = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, schedule, policy=policy, per_tensor=per_tensor,
                                                       loss_scaler=scaler))
    loader = TrainLoader(digits.train, batch_size, mesh, seed=0)
    compiled = step.lower(state, loader.batch(0)).compile()
    losses = []
    for s in range(STEPS):
        state, metrics = step(state, loader.batch(s))
        losses.append(float(jax.block_until_ready(metrics)["loss"]))
    return dict(params=jax.device_get(_gather_params(state, plan)), losses=losses, compiled=compiled, plan=plan,
                schedule=schedule, metrics=jax.device_get(metrics))


def _one_device(model, tx, batch_size, policy=Policy(), accum_steps=1, scaler=LossScaler()):
    digits, example = _digits()
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    state = init_train_state(model, tx, example, 0, mesh, scaler)
    step = make_train_step(model, tx, mesh, StepSpec(policy=policy, accum_steps=accum_steps, loss_scaler=scaler))
    loader = TrainLoader(digits.train, batch_size, mesh, seed=0)
    losses = []
    for s in range(STEPS):
        state, metrics = step(state, loader.batch(s))
        losses.append(float(jax.block_until_ready(metrics)["loss"]))
    return dict(params=jax.device_get(state.params), losses=losses, metrics=jax.device_get(metrics))


@pytest.fixture(scope="module")
def mlp_runs():
    """The MLP on 4 stages x 2 data shards with 1F1B, M = 4 micro-batches of 4, Adam; and one device."""
    model, tx = models.build_model("mlp", **MLP), optim.make_optimizer("adam", 1e-2)
    mesh = mesh_lib.make_mesh([("stage", 4), ("data", 2)])
    runs = {"1f1b": _run(model, tx, mesh, make_schedule("1f1b", 4, 4), 32, 4)}
    runs["one"] = _one_device(model, tx, 32)
    return runs


@pytest.fixture(scope="module")
def speech_runs():
    """The speech DNN on 2 stages x 4 data shards at given boundaries, SGD, M = 8 (trained) and M = 16 (compiled
    only, for memory): micro-batches of 2 either way."""
    model, tx = models.build_model("speech_dnn", **SPEECH), optim.make_optimizer("sgd", 0.1)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    runs = {(name, 8): _run(model, tx, mesh, make_schedule(name, 2, 8), 64, 2, boundaries=(2,))
            for name in ("gpipe", "1f1b")}
    runs["one"] = _one_device(model, tx, 64)
    digits, example = _digits()
    plan = runs["gpipe", 8]["plan"]
    state = pp.abstract_state(model, tx, example, plan)  # compiled only: the shapes and shardings suffice
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state,
                         pp.state_shardings(state, mesh, plan))
    spec = NamedSharding(mesh, PartitionSpec(("stage", "data")))  # as dtx's loader places a batch
    batch = {"inputs": jax.ShapeDtypeStruct((128, 64), np.float32, sharding=spec),
             "labels": jax.ShapeDtypeStruct((128,), np.int32, sharding=spec)}
    for name in ("gpipe", "1f1b"):
        step = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, make_schedule(name, 2, 16)))
        runs[name, 16] = dict(compiled=step.lower(state, batch).compile())
    return runs


def _close(got, want, atol):
    for key in want:
        for leaf in want[key]:
            np.testing.assert_allclose(got[key][leaf], want[key][leaf], rtol=0, atol=atol, err_msg=f"{key}/{leaf}")


def test_mlp_pipeline_with_adam_equals_one_device(mlp_runs):
    """4 stages x 2 data shards, 4 micro-batches, 5 Adam steps == one device with the global batch. Held to 1e-6
    (measured 6e-8: the micro-batch means summed in another order than the whole batch's mean)."""
    run, one = mlp_runs["1f1b"], mlp_runs["one"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)


def test_schedules_compute_the_same_step(speech_runs):
    """GPipe and 1F1B run the same micro-batches through the same stages and sum the gradients in the same order."""
    _close(speech_runs["1f1b", 8]["params"], speech_runs["gpipe", 8]["params"], 1e-7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_speech_dnn_pipeline_with_sgd_equals_one_device(speech_runs, schedule):
    """The speech DNN cut at layer 2 (16 wide activations cross), 8 micro-batches, 5 SGD steps == one device.
    Held to 1e-6."""
    run, one = speech_runs[schedule, 8], speech_runs["one"]
    assert run["plan"].bounds == (0, 2, 4) and run["plan"].boundary_widths == (16,) and run["plan"].width == 16
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)


@pytest.fixture(scope="module")
def interleaved_run():
    """The MLP's 4 layers as 4 virtual stages on 2 devices (2 chunks each) x 4 data shards, M = 4, Adam."""
    model, tx = models.build_model("mlp", **MLP), optim.make_optimizer("adam", 1e-2)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    digits, _ = _digits()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), digits.train.inputs[:1])["params"])
    pipeline = pp.make_pipeline(model, abstract, mesh, pp.StageOptions(schedule="interleaved", micro=4, chunks=2))
    return _run(model, tx, mesh, pipeline.schedule, 32, 2, chunks=2)


def test_interleaved_equals_one_device(interleaved_run, mlp_runs):
    """Device 0 holds layers 0 and 2, device 1 layers 1 and 3; each micro-batch goes round the ring twice. 5 Adam
    steps == one device, held to 1e-6."""
    assert interleaved_run["plan"].bounds == (0, 1, 2, 3, 4) and interleaved_run["plan"].devices == 2
    _close(interleaved_run["params"], mlp_runs["one"]["params"], 1e-6)
    np.testing.assert_allclose(interleaved_run["losses"], mlp_runs["one"]["losses"], rtol=1e-6)
    assert interleaved_run["metrics"]["comm_bytes"] == hlo.total(interleaved_run["compiled"]).bytes_sent


@pytest.fixture(scope="module")
def optimizer_runs():
    """The MLP on 2 stages x 4 data shards, 1F1B, M = 4, with LARS and with LAMB, both with weight decay (biases
    excluded by name), each against one device: the updates that need each tensor's norm and name."""
    model, runs = models.build_model("mlp", **MLP), {}
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    for name, lr in (("lars", 0.5), ("lamb", 1e-2)):
        tx = optim.make_optimizer(name, lr, weight_decay=1e-2)
        runs[name] = _run(model, tx, mesh, make_schedule("1f1b", 2, 4), 32, 2, per_tensor=True)
        runs[name, "one"] = _one_device(model, tx, 32)
    return runs


@pytest.fixture(scope="module")
def bf16_runs(speech_runs):
    """The speech DNN on 2 stages x 4 data shards, GPipe, M = 8, SGD, computing in bfloat16 (float32 parameters,
    the all-reduce in bfloat16): the pipeline; one device under the same policy in the same 32 micro-batches of 2
    (bfloat16 rounds each micro-batch's products: the whole batch at once differs by 7e-4 after 5 steps); and one
    device in float32."""
    model, tx = models.build_model("speech_dnn", **SPEECH), optim.make_optimizer("sgd", 0.1)
    bf16 = models.build_model("speech_dnn", **SPEECH, dtype=jnp.bfloat16)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    policy = parse_policy("p=f32,c=bf16,r=bf16")
    return dict(pipeline=_run(model, tx, mesh, make_schedule("gpipe", 2, 8), 64, 2, boundaries=(2,), policy=policy),
                one=_one_device(bf16, tx, 64, policy, accum_steps=32), f32=speech_runs["one"])


def test_a_bf16_pipeline_equals_one_device_within_bf16s_resolution(bf16_runs):
    """After 5 steps the bf16 pipeline is within a tenth of bf16's own distance from float32 of one bf16 device
    running the same micro-batches (measured 5e-5 against 1.9e-3); activations travel in bfloat16."""
    run, one, f32 = bf16_runs["pipeline"], bf16_runs["one"], bf16_runs["f32"]
    gap = max(float(np.abs(one["params"][k][leaf] - f32["params"][k][leaf]).max()) for k in one["params"]
              for leaf in one["params"][k])
    got = max(float(np.abs(run["params"][k][leaf] - one["params"][k][leaf]).max()) for k in one["params"]
              for leaf in one["params"][k])
    assert gap > 0 and got < gap / 10, (got, gap)
    # 2M messages of 2 x 16 activations, bfloat16 in the program; XLA:CPU widens bfloat16 collectives to float32
    assert _permute_bytes(run["compiled"]) == 2 * 8 * 2 * 16 * 4


@pytest.fixture(scope="module")
def f16_runs(speech_runs):
    """bf16_runs' pipeline computing in float16 with dynamic loss scaling from 2^16, which overflows float16 at first
    (Micikevicius et al. 2018: skip the step, halve the scale); one device under the same policy and scaler in the
    same micro-batches; one device in float32."""
    model, tx = models.build_model("speech_dnn", **SPEECH), optim.make_optimizer("sgd", 0.1)
    f16 = models.build_model("speech_dnn", **SPEECH, dtype=jnp.float16)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    policy, scaler = parse_policy("p=f32,c=f16"), LossScaler(enabled=True, initial_scale=2.0**16, growth_interval=2)
    return dict(pipeline=_run(model, tx, mesh, make_schedule("1f1b", 2, 8), 64, 2, boundaries=(2,), policy=policy,
                              scaler=scaler),
                one=_one_device(f16, tx, 64, policy, accum_steps=32, scaler=scaler), f32=speech_runs["one"])


def test_loss_scaling_skips_the_same_steps_as_one_device(f16_runs):
    """The pipeline seeds each micro-batch's backward with 1/M times the loss scale, unscales the reduced gradient,
    and skips a step where any stage's overflowed: the steps one device skips, the same loss scale after them, and
    parameters within a tenth of float16's own distance from float32."""
    run, one, f32 = f16_runs["pipeline"], f16_runs["one"], f16_runs["f32"]
    assert run["metrics"]["skipped_steps"] == one["metrics"]["skipped_steps"] > 0
    assert run["metrics"]["loss_scale"] == one["metrics"]["loss_scale"]
    diff = lambda a, b: max(float(np.abs(a[k][x] - b[k][x]).max()) for k in a for x in a[k])  # noqa: E731
    assert diff(run["params"], one["params"]) < diff(one["params"], f32["params"]) / 10


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_lars_and_lamb_with_weight_decay_equal_one_device(optimizer_runs, name):
    """Each stage's update runs on its own tensors (dtx.parallel.pipeline.optim): LARS's and LAMB's per-tensor trust
    ratios and the weight decay that skips biases by name, as one device computes them. 5 steps, held to 1e-6."""
    run, one = optimizer_runs[name], optimizer_runs[name, "one"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)


def _bubble_from_program(compiled, micro: int, chunks: int = 1) -> float:
    """The bubble read from the loops: each slot's ppermute runs on every tick but the last of its slot (where only
    a stage without a neighbour works), so a slot has trips / 2 + 1 ticks, of which each stage is busy on V·M."""
    trips = sum(c.trips for c in hlo.collectives(compiled) if c.kind == "collective-permute")
    return 1 - micro * chunks / (trips / 2 + 1)


def test_interleaving_shrinks_the_bubble_read_from_the_loops(interleaved_run, speech_runs, mlp_runs):
    """From the compiled programs' trip counts: GPipe's and 1F1B's bubble (P - 1)/(M + P - 1), interleaved V = 2
    chunks' (P - 1)/(VM + P - 1): 1/9 against GPipe's 1/5 on the same 2 devices and 4 micro-batches."""
    assert _bubble_from_program(mlp_runs["1f1b"]["compiled"], 4) == pytest.approx(3 / 7)
    assert _bubble_from_program(speech_runs["gpipe", 8]["compiled"], 8) == pytest.approx(1 / 9)
    assert _bubble_from_program(interleaved_run["compiled"], 4, 2) == pytest.approx(1 / 9)
    assert interleaved_run["schedule"].bubble == pytest.approx(1 / 9)
    assert make_schedule("gpipe", 2, 4).bubble == pytest.approx(1 / 5)


@pytest.mark.parametrize("stages,micro,chunks", [(2, 4, 2), (4, 8, 2), (2, 2, 3)])
def test_interleaved_table_runs_each_chunk_once_after_its_predecessor(stages, micro, chunks):
    """Virtual stage v = c·P + s runs each micro-batch forward one tick after virtual stage v - 1 (on the previous
    device, or the last device's previous chunk) and backward one tick after v + 1."""
    schedule = make_schedule("interleaved", stages, micro, chunks)
    forward, backward = schedule.timeline("forward"), schedule.timeline("backward")
    ticks = {}
    for kind, table in (("F", forward), ("B", backward)):
        for t, s in zip(*np.nonzero(table != IDLE)):
            entry = int(table[t, s])
            v = (entry // micro) * stages + s
            assert (kind, v, entry % micro) not in ticks
            ticks[kind, v, entry % micro] = int(t)
    virtual = stages * chunks
    assert len(ticks) == 2 * virtual * micro
    for m in range(micro):
        for v in range(1, virtual):
            assert ticks["F", v, m] == ticks["F", v - 1, m] + 1
            assert ticks["B", v - 1, m] == ticks["B", v, m] + 1
    assert schedule.bubble == pytest.approx((stages - 1) / (chunks * micro + stages - 1))


def _permute_bytes(compiled):
    return sum(c.bytes_sent * c.trips for c in hlo.collectives(compiled) if c.kind == "collective-permute")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_send_2M_boundary_activations_per_step(speech_runs, schedule):
    """Read from the compiled program, trip counts included: each stage sends 2·M messages of one micro-batch's
    boundary buffer (M activations forward, M gradients back), the data shards all-reduce the gradients once, and
    the stages gather their data shard's batch once."""
    for m in (8, 16):
        compiled, plan = speech_runs[schedule, m]["compiled"], speech_runs["gpipe", 8]["plan"]
        assert _permute_bytes(compiled) == 2 * m * plan.message_bytes(micro=2) == 2 * m * 2 * 16 * 4
        others = [c for c in hlo.collectives(compiled) if c.kind != "collective-permute"]
        assert {c.kind for c in others} == {"all-reduce", "all-gather"} and all(c.trips == 1 for c in others)
        # The one all-gather of the batch over the 2 stages: a device's M rows of 64 inputs and a label each.
        assert sum(c.bytes_sent for c in others if c.kind == "all-gather") == (2 - 1) * m * (64 + 1) * 4


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_four_stages_send_the_bubble_too(mlp_runs, schedule):
    """With P = 4 the lock-step ticks that only carry the bubble send too: 2(M + P - 2) messages per step,
    the schedule's count, each of one micro-batch's buffer, 32 wide: the 24- and 16-wide boundaries padded to
    the widest."""
    run = mlp_runs[schedule]
    assert run["schedule"].messages == 2 * (4 + 4 - 2)
    assert run["plan"].boundary_widths == (32, 24, 16) and run["plan"].width == 32
    assert _permute_bytes(run["compiled"]) == run["schedule"].messages * run["plan"].message_bytes(micro=4)


@pytest.mark.parametrize("run", [("mlp", "1f1b"), ("speech", ("gpipe", 8)), ("speech", ("1f1b", 8))])
def test_the_accountant_counts_what_the_program_sends(mlp_runs, speech_runs, run):
    """The step's comm_bytes (dtx.parallel.pipeline.step.traffic: permutes, the gradient row's all-reduce, the records')
    equal the compiled program's bytes, trip counts included."""
    runs, key = (mlp_runs if run[0] == "mlp" else speech_runs), run[1]
    assert runs[key]["metrics"]["comm_bytes"] == hlo.total(runs[key]["compiled"]).bytes_sent


def test_1f1b_keeps_activations_for_P_not_M(speech_runs):
    """memory_analysis: from M = 8 to 16 micro-batches 1F1B's temporaries grow by the batch alone (8 x 2 more
    gathered examples of 64 inputs and a label), GPipe's also by the 8 more kept stage inputs (8 x 2 x 16 float32):
    1F1B keeps at most 2P - 1 = 3."""
    temp = {key: speech_runs[key]["compiled"].memory_analysis().temp_size_in_bytes
            for key in [("gpipe", 8), ("gpipe", 16), ("1f1b", 8), ("1f1b", 16)]}
    assert temp["1f1b", 16] - temp["1f1b", 8] == 8 * 2 * (64 + 1) * 4
    assert temp["gpipe", 16] - temp["gpipe", 8] == 8 * 2 * (64 + 1) * 4 + 8 * 2 * 16 * 4
    assert make_schedule("1f1b", 2, 16).slots == 3 and make_schedule("gpipe", 2, 16).slots == 16


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 1), (3, 5), (4, 8)])
def test_schedule_tables_run_each_micro_batch_once_in_order(name, stages, micro):
    """Every stage runs every micro-batch forward and backward once; a forward follows the previous stage's by a
    tick, a backward the next stage's; the bubble is (P - 1)/(M + P - 1) of the slots."""
    schedule = make_schedule(name, stages, micro)
    forward, backward = schedule.timeline("forward"), schedule.timeline("backward")
    for s in range(stages):
        for table in (forward, backward):
            assert sorted(m for m in table[:, s] if m != IDLE) == list(range(micro))
    tick = lambda table, s, m: int(np.argwhere(table[:, s] == m)[0, 0])  # noqa: E731
    for m in range(micro):
        for s in range(1, stages):
            assert tick(forward, s, m) == tick(forward, s - 1, m) + 1
            assert tick(backward, s - 1, m) == tick(backward, s, m) + 1
        assert tick(backward, stages - 1, m) >= tick(forward, stages - 1, m)
    assert schedule.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    assert len(diagram(schedule).splitlines()) == stages


def test_balanced_cut_and_given_boundaries():
    """Balanced by forward FLOPs: the contiguous split whose costliest stage is cheapest."""
    assert balance([1, 1, 1, 1], 2) == (2,)
    assert balance([8, 1, 1, 1, 1], 2) == (1,)
    assert balance([1, 2, 3, 4, 5], 3) == (3, 4)
    model = models.build_model("speech_dnn", **SPEECH)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"])
    plan = make_plan(model, params, 2)
    assert plan.bounds == (0, 1, 4)  # 64·32 against 32·16 + 16·24 + 24·10
    numbered = jax.tree.map(lambda s: np.arange(np.prod(s.shape), dtype=np.float32).reshape(s.shape), params)
    rows = jax.jit(plan.pack)(numbered)  # each one program (op by op, each slice and reshape compiles its own)
    assert rows.shape == (2, plan.row) and plan.row == max(plan.stage_sizes)
    _close(jax.jit(plan.unpack)(rows), numbered, 0)


def test_refusals_name_the_fix():
    resnet = models.build_model("resnet18")  # residual: not a sequence of pieces
    params = jax.eval_shape(lambda: resnet.init(jax.random.key(0), np.zeros((1, 8, 8, 1), np.float32))["params"])
    with pytest.raises(PipelineError, match="pipeline_layers"):
        make_plan(resnet, params, 2)
    mlp = models.build_model("mlp", **MLP)
    params = jax.eval_shape(lambda: mlp.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"])
    with pytest.raises(PipelineError, match=r"pipeline.boundaries=\(3, 1\) must be 2 increasing"):
        make_plan(mlp, params, 3, (3, 1))
    with pytest.raises(PipelineError, match="smaller 'stage' mesh axis"):
        make_plan(mlp, params, 5)
    with pytest.raises(ScheduleError, match="choose one of"):
        make_schedule("zigzag", 2, 4)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    pipeline, sgd = pp.make_pipeline(mlp, params, mesh, pp.StageOptions(micro=2)), optim.make_optimizer("sgd", 0.1)
    with pytest.raises(StepError, match="accum_steps=4 must be the schedule's 2"):
        pp.train_step(sgd, mesh, pipeline, StepSpec(accum_steps=4))
    with pytest.raises(StepError, match="leaves padding out"):
        pp.train_step(sgd, mesh, pipeline, StepSpec(accum_steps=2, task=tasks.make_task("next_token", pad_id=0)))
    plan = make_plan(mlp, params, 2)
    with pytest.raises(StepError, match="'stage' mesh axis"):
        pp.make_pipeline_step(optim.make_optimizer("sgd", 0.1), mesh_lib.make_mesh([("data", -1)]),
                              pp.Pipeline(plan, make_schedule("gpipe", 2, 2)))


GOOD = dict(mesh_shape={"stage": 2, "data": 4}, num_layers=4, global_batch_size=64, microbatches=4)


def test_settings_a_pipeline_takes_pass():
    check_settings(PipelineSettings(**GOOD))
    check_settings(PipelineSettings(**{**GOOD, "schedule": "1f1b", "boundaries": (1,), "optimizer": "sgd",
                                       "precision": "p=f32,c=f32"}))
    check_settings(PipelineSettings(**{**GOOD, "optimizer": "lamb", "weight_decay": 1e-2}))  # each stage its own tree
    check_settings(PipelineSettings(**{**GOOD, "precision": "p=f32,c=bf16,r=bf16"}))


@pytest.mark.parametrize("change,says", [
    (dict(mesh_shape={"data": 8}), "no 'stage' axis.*--config.mesh="),
    (dict(mesh_shape={"stage": 8}), "makes 8 stages but the model has 4 layers"),
    (dict(virtual_stages=2, mesh_shape={"stage": 4}), "4 devices x pipeline.virtual_stages=2 makes 8 stages"),
    (dict(virtual_stages=2), "virtual_stages=2 with pipeline.schedule='gpipe'.*schedule=interleaved"),
    (dict(schedule="interleaved"), "virtual_stages=1 with pipeline.schedule='interleaved'.*virtual_stages=2"),
    (dict(schedule="interleaved", virtual_stages=2, microbatches=3, global_batch_size=48),
     "pipeline.microbatches=3: the interleaved schedule.*multiple of 2"),
    (dict(schedule="zigzag"), r"pipeline.schedule='zigzag' is unknown: choose one of \['gpipe', '1f1b', 'interl"),
    (dict(boundaries=(1, 2)), r"pipeline.boundaries=\(1, 2\) must be 1 increasing"),
    (dict(driver="jit"), "--config.driver=shard_map"),
    (dict(strategy="local_sgd"), "--config.strategy.name=sync"),
    (dict(compression="topk"), "--config.compression.name=none"),
    (dict(allreduce="ring"), "--config.allreduce=psum"),
    (dict(precision="p=bf16"), "float32 parameters.*p=f32,c=bf16"),
    (dict(global_batch_size=60), "global_batch_size=60 must split over the 4 data shards"),
    (dict(microbatches=3), r"pipeline.microbatches=3 \(each shard.s batch is 16: pipeline.microbatches one of \[1, 2, 4, 8, 16\]\): change"),
    (dict(microbatches=1), "idle 50% of the step.*--config.pipeline.microbatches to at least 2"),
])
def test_settings_a_pipeline_refuses_name_the_key_and_fix(change, says):
    """Each refusal before compiling names the key and the fix (and all of them come in one error)."""
    with pytest.raises(StepError, match=says):
        check_settings(PipelineSettings(**{**GOOD, **change}))


def test_every_refusal_in_one_error():
    with pytest.raises(StepError) as error:
        check_settings(PipelineSettings(**{**GOOD, "driver": "jit", "compression": "topk", "schedule": "x"}))
    assert all(key in str(error.value) for key in ("pipeline.schedule='x'", "driver='jit'", "compression.name='topk'"))


# ---- parallel.name=pipeline through the config and dtx.train --------------------------------------------------

DIGITS_MLP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "digits_mlp.py")
TRAIN = ("--config.num_steps=6", "--config.model.features=(32, 16)", "--config.global_batch_size=64",
         "--config.log_every=2", "--config.progress=False")
_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *_, **__: _COMPILES.append(name) if name.endswith("backend_compile_duration") else None)
PIPELINE = ("--config.parallel.name=pipeline", "--config.mesh=((\"stage\", 2), (\"data\", 4))",
            "--config.pipeline.microbatches=4")


def test_dtx_train_runs_the_pipeline_like_one_device(tmp_path, mlp_runs):
    """dtx.train with parallel.name=pipeline (1F1B on 4 stages x 2) records, step by step, the losses of one device
    training the same MLP on the same batches (mlp_runs["one"]), held to 1e-6 as the step itself is."""
    overrides = ("--config.num_steps=5", "--config.model.features=(32, 24, 16)", "--config.global_batch_size=32",
                 "--config.optimizer.learning_rate=0.01", "--config.pipeline.microbatches=4", "--config.log_every=1",
                 "--config.progress=False", "--config.parallel.name=pipeline", "--config.pipeline.schedule=1f1b",
                 "--config.mesh=((\"stage\", 4), (\"data\", 2))", "--config.checkpoint.every_steps=5",
                 "--config.cluster=cloud_10gbe")
    result = train(config_lib.load(DIGITS_MLP, overrides), tmp_path)
    records = [r for r in metrics.read_metrics(tmp_path) if "loss" in r]
    np.testing.assert_allclose([r["loss"] for r in records], mlp_runs["one"]["losses"], rtol=1e-6)
    # The simulated clock (--config.cluster) times each step's schedule tick by tick, then its bytes.
    run = mlp_runs["1f1b"]
    clock = pipeline_model.clock_model(run["plan"], run["schedule"], 4, 2, clusters.get_cluster("cloud_10gbe"))
    first = clock.compute(0) + clock.comm(records[0]["comm_bytes"], records[0]["comm_rounds"]).total
    assert records[0]["sim_time_s"] == pytest.approx(first, rel=1e-9)
    assert np.diff([r["sim_time_s"] for r in records]) == pytest.approx(first, rel=1e-6)
    assert result.state.params.shape[0] == 4 and result.metrics["test_examples"] == 360  # the stages' rows, evaluated
    # dtx export writes the model's own tree (plain flax loads it), not the rows.
    export_run(tmp_path, tmp_path / "exported")
    with open(tmp_path / "exported" / "variables.msgpack", "rb") as f:
        exported = flax.serialization.msgpack_restore(f.read())["params"]
    _close(exported, mlp_runs["one"]["params"], 1e-6)


@pytest.mark.parametrize("overrides,says", [
    (("--config.parallel.schedule=1f1b",), "'parallel.schedule' is now 'pipeline.schedule'"),
    (("--config.pipeline.schedule=1f1b",), "pipeline.schedule='1f1b' applies to pipelines only"),
    (PIPELINE[:1] + PIPELINE[2:], "'stage' axis"),
    (PIPELINE + ("--config.grad_accum_steps=2",),
     "grad_accum_steps=2 with pipeline.microbatches=4.*--config.pipeline.microbatches=8"),
    (PIPELINE[:2] + ("--config.grad_accum_steps=4",), "--config.pipeline.microbatches=4 .*grad_accum_steps at 1"),
    (PIPELINE + ("--config.model.name=lenet",), "model.use_batch_norm=True.*--config.model.use_batch_norm=False"),
    (PIPELINE + ("--config.allreduce=ring", "--config.driver=jit"), "driver='jit'.*shard_map; allreduce='ring'"),
    (PIPELINE + ("--config.pipeline.boundaries=(5,)",), r"pipeline.boundaries=\(5,\)"),
])
def test_a_pipeline_config_is_refused_before_compiling(tmp_path, overrides, says):
    """Each refusal names the key and the fix, and comes from the config or the set-up, before any compiling."""
    base = tuple(o for o in TRAIN if "model.features" not in o or "--config.model.name=lenet" not in overrides)
    before = len(_COMPILES)
    with pytest.raises(config_lib.ConfigError, match=says):
        train(config_lib.load(DIGITS_MLP, base + overrides), tmp_path)
    assert len(_COMPILES) == before


# ---- the model (dtx.parallel.pipeline.costs) against the compiled programs --------------------------------------------

def test_the_model_predicts_the_compiled_bytes_and_kept_memory(speech_runs, mlp_runs, interleaved_run):
    """dtx.parallel.pipeline.costs from the stages and schedule alone: the point-to-point bytes every compiled program sends,
    and what XLA's temporaries grow by from M = 8 to M = 16: the gathered batch, and the kept inputs (GPipe)."""
    plan = speech_runs["gpipe", 8]["plan"]
    for (name, m) in [("gpipe", 8), ("gpipe", 16), ("1f1b", 8), ("1f1b", 16)]:
        e = pipeline_model.estimate(plan, make_schedule(name, 2, m), micro=2, data=4, optimizer="sgd")
        assert e.p2p_bytes == _permute_bytes(speech_runs[name, m]["compiled"])
    for run, micro, data in ((mlp_runs["1f1b"], 4, 2), (interleaved_run, 2, 4)):
        e = pipeline_model.estimate(run["plan"], run["schedule"], micro=micro, data=data)
        assert e.p2p_bytes == _permute_bytes(run["compiled"]) and e.bubble == run["schedule"].bubble
    temp = lambda key: speech_runs[key]["compiled"].memory_analysis().temp_size_in_bytes  # noqa: E731
    held = lambda name, m: pipeline_model.estimate(plan, make_schedule(name, 2, m), 2, 4, "sgd",  # noqa: E731
                                                    example_bytes=(64 + 1) * 4)
    for name in ("gpipe", "1f1b"):
        grown = [held(name, 16).kept_bytes - held(name, 8).kept_bytes,
                 held(name, 16).batch_bytes - held(name, 8).batch_bytes]
        assert temp((name, 16)) - temp((name, 8)) == sum(grown)


def test_the_modelled_time_follows_the_bubble():
    """On a cluster where compute dominates, 1F1B takes GPipe's time (the same bubble) and interleaving V = 2 chunks
    cuts the ticks from 2(M + P - 1) to 2(VM + P - 1) of half the work each: (VM + P - 1)/V/(M + P - 1) of it."""
    model = models.build_model("speech_dnn", hidden=(256,) * 7, num_classes=10)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"])
    fast_links = dataclasses.replace(clusters.get_cluster("cloud_10gbe"), latency=0.0, bandwidth=1e30)
    time = {}
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        plan = make_plan(model, params, 4, chunks=chunks)
        time[name] = pipeline_model.estimate(plan, make_schedule(name, 4, 8, chunks), 16, 1, cluster=fast_links).step_s
    assert time["1f1b"] == pytest.approx(time["gpipe"])
    assert time["interleaved"] / time["gpipe"] == pytest.approx((16 + 3) / 2 / (8 + 3), rel=0.02)


@pytest.mark.parametrize("case", [("speech", ("gpipe", 8)), ("speech", ("gpipe", 16)), ("speech", ("1f1b", 8)),
                                  ("speech", ("1f1b", 16)), ("mlp", "1f1b"), ("interleaved", None)])
def test_the_memory_model_predicts_each_schedules_compiled_peak(speech_runs, mlp_runs, interleaved_run, case):
    """dtx simulate --memory's and memory_limit's pipeline model (dtx.parallel.pipeline.costs.memory_estimate) within 15 % of
    the compiled step's peak (argument + output - alias + temp of memory_analysis) for each schedule: the speech DNN
    with SGD (GPipe, 1F1B; M = 8, 16), the MLP with Adam on 4 stages (1F1B) and interleaved. (The working rows were
    read from larger programs; the working messages from the 4-stage MLP's buffer assignment, after it missed.)"""
    example_bytes = (64 + 1) * 4
    if case[0] == "speech":
        plan, compiled = speech_runs["gpipe", 8]["plan"], speech_runs[case[1]]["compiled"]
        schedule, micro, data, optimizer = make_schedule(case[1][0], 2, case[1][1]), 2, 4, "sgd"
    else:
        run = mlp_runs["1f1b"] if case[0] == "mlp" else interleaved_run
        plan, compiled, schedule, optimizer = run["plan"], run["compiled"], run["schedule"], "adam"
        micro, data = (4, 2) if case[0] == "mlp" else (2, 4)
    e = pipeline_model.memory_estimate(plan, schedule, micro=micro, data=data, optimizer=optimizer,
                                     example_bytes=example_bytes)
    assert memory_lib.compiled_peak(compiled) / e.total == pytest.approx(1, abs=0.15)


@pytest.mark.parametrize("hidden,stages,schedule,micro_batches,chunks,optimizer", [
    ((48, 40, 56, 32), 4, "1f1b", 8, 1, "momentum"), ((64,) * 5, 2, "interleaved", 4, 3, "adam"),
    ((40, 24, 56), 2, "interleaved", 6, 2, "sgd")])
def test_the_memory_model_on_held_out_pipelines(hidden, stages, schedule, micro_batches, chunks, optimizer):
    """Pipelines chosen before the model's constants were read, compiled only: the speech DNN of other widths on 4
    stages x 2 with momentum (1F1B); 6 layers as 3 chunks on each of 2 devices x 4 with Adam (interleaved; it
    missed at 0.83 while every working row was counted as the device's V rows: the slot's gradient is one stage's);
    then, chosen after that fix, 4 layers as 2 chunks on 2 devices with SGD. The model within 15 % of the peak."""
    model, tx = models.build_model("speech_dnn", hidden=hidden, num_classes=10), optim.make_optimizer(optimizer, 0.1)
    mesh = mesh_lib.make_mesh([("stage", stages), ("data", 8 // stages)])
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"])
    plan = make_plan(model, params, stages, chunks=chunks)
    schedule = make_schedule(schedule, stages, micro_batches, chunks)
    state = pp.abstract_state(model, tx, jax.ShapeDtypeStruct((1, 64), np.float32), plan)
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state,
                         pp.state_shardings(state, mesh, plan))
    spec = NamedSharding(mesh, PartitionSpec(("stage", "data")))
    batch_size = micro_batches * 2 * (8 // stages)  # micro-batches of 2 on each data shard
    batch = {"inputs": jax.ShapeDtypeStruct((batch_size, 64), np.float32, sharding=spec),
             "labels": jax.ShapeDtypeStruct((batch_size,), np.int32, sharding=spec)}
    compiled = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, schedule)).lower(state, batch).compile()
    e = pipeline_model.memory_estimate(plan, schedule, micro=2, data=8 // stages, optimizer=optimizer,
                                     example_bytes=(64 + 1) * 4)
    assert memory_lib.compiled_peak(compiled) / e.total == pytest.approx(1, abs=0.15)


def test_memory_limit_refuses_a_pipeline_that_does_not_fit(tmp_path):
    """memory_limit below the pipeline model's estimate: refused before compiling, naming the pipeline's terms."""
    before = len(_COMPILES)
    with pytest.raises(config_lib.ConfigError, match=r"this pipeline needs about .* MiB per device.*kept inputs"):
        train(config_lib.load(DIGITS_MLP, TRAIN + PIPELINE + ("--config.memory_limit=20000",)), tmp_path)
    assert len(_COMPILES) == before


# ---- the simulated clock (dtx.parallel.pipeline.costs.PipelineClock) ----------------------------------------------------

def _equal_plan(stages, chunks=1, width=64):
    """``stages·chunks`` equal Dense layers of ``width``, one per (virtual) stage."""
    from dtx.parallel.pipeline.stages import StagePlan, dense_layer

    layers = tuple(dense_layer(f"fc{i}", width, width, relu=True) for i in range(stages * chunks))
    return StagePlan(layers, tuple(range(stages * chunks + 1)), chunks)


@pytest.mark.parametrize("name,stages,micro,chunks", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 8, 1),
                                                      ("interleaved", 2, 4, 2)])
def test_the_clock_shows_the_bubble(name, stages, micro, chunks):
    """Timed tick by tick on the simulated clock, equal stages are busy M/(M + P - 1) of their slots (interleaved:
    VM/(VM + P - 1)): the bubble the compiled programs' loops show (test_interleaving_shrinks_the_bubble_...)."""
    clock = pipeline_model.clock_model(_equal_plan(stages, chunks), make_schedule(name, stages, micro, chunks), 4, 2,
                                       clusters.get_cluster("haswell_fdr"))
    assert clock.busy() == pytest.approx(chunks * micro / (chunks * micro + stages - 1))


class _OneSlowDevice:
    """Stage 3 of data shard 0 at twice its compute, every step."""

    def multipliers(self, step, devices):
        slow = np.ones(devices)
        slow[3] = 2.0
        return slow


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_a_straggler_stretches_every_slot_it_works_in(name):
    """One slow device of 4 equal stages x 2 data shards: each of its M forward and M backward slots takes twice
    as long, the others as before, and the other data shard waits for it at the all-reduce: (2M + P - 1) slots'
    work instead of (M + P - 1)."""
    plan, schedule = _equal_plan(4), make_schedule(name, 4, 8)
    clock = pipeline_model.clock_model(plan, schedule, 4, 2, clusters.get_cluster("haswell_fdr"))
    work = clock.forward_s[0] + clock.backward_s[0]
    assert clock.compute(0) == pytest.approx((8 + 4 - 1) * work)
    slow = dataclasses.replace(clock, stragglers=_OneSlowDevice())
    assert slow.compute(0) == pytest.approx((2 * 8 + 4 - 1) * work)
    assert slow.worker_times(0, 1e-3) == pytest.approx([(2 * 8 + 4 - 1) * work + 1e-3])
