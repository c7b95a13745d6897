"""Pipeline stages split over the ``model`` axis (dtx.parallel.pipeline.tensor_stages): Megatron inside each stage.

The tiny transformer (embedding + block 0 | block 1 + head) on ``data 2 × stage 2 × model 2``: each stage's
attention split by heads and its MLP by columns then rows, the boundary buffer replicated over ``model``. Checked
here: GPipe and 1F1B equal one device after 3 steps (the pipeline tests' convention and tolerance), a device holds
``1/T`` of each split kernel, the compiled collective-permutes carry the pipeline formula's bytes, the all-reduces
over ``model`` are Megatron's per block and micro-batch (forward and backward slot, the backward slot's re-run of
the forward included), the step's accountant counts what the program sends, the settings it cannot run are
refused by key before compiling, and dtx simulate's model of such a pipeline (dtx.parallel.pipeline.lm_costs, written before
any was compiled; its stage element-wise terms since read from slots of this file's shape among others) predicts
this program's FLOPs and bytes within --verify's 2 %, with and without SP. With tensor.sequence_parallel=True
(dtx.parallel.pipeline.positions): GPipe and 1F1B equal one device, the collectives over model inside the blocks are
Korthikanti et al.'s reduce-scatters and all-gathers with the TP run's bytes (no all-reduce), the boundary sends
half the TP pipeline's bytes, the temporaries are smaller, and a sequence T does not split is refused.

Hand-breaks (each fails the test named): the row layer's ``psum`` over ``model`` dropped (``reduce_from_model``
returning its input) -> ``test_split_stages_equal_one_device``; the forward ``ppermute`` skipped (the forward slot
keeping its output) -> ``test_split_stages_equal_one_device`` and ``test_messages_are_the_pipeline_formulas``; the
column input's gradient not summed over ``model`` (``copy_to_model``'s backward as the identity) -> every test of the
compiled steps; the backward slot's re-run left out of the planner's FLOPs -> ``test_the_planner_predicts_...``.
Under SP: ``g``'s reduce-scatter replaced by a psum and the device's slice of it ->
``test_sequence_parallel_collectives_are_korthikantis`` and ``..._sends_and_keeps_a_tth_at_the_boundary`` (the
values stay equal); the boundary buffer sent unsplit (the whole stream's width) -> ``..._sends_and_keeps_...``;
the replicated gradients not summed over model -> every SP test (values, the all-reduce, comm_bytes); the last
stage's loss not divided by T -> ``test_sequence_parallel_stages_equal_one_device``; ``f``'s backward keeping its own
positions' gradient instead of reduce-scattering -> every SP test; the positions check skipped ->
``test_what_split_stages_cannot_run_is_refused_by_key``. The planner (dtx.parallel.pipeline.lm_costs; FLOPs, bytes measured
0.9993, 1.0002 without SP and 0.9995, 1.0005 with it): the residual stream's element-wise work split by T without
SP -> ``test_the_planner_predicts_...[1f1b]``; that work, or the output layer and loss, whole under SP, the boundary
messages whole under SP, or the replicated entries' all-reduce over model left out -> ``...[sp-1f1b]``.
"""

import os
import re

import jax
import numpy as np
import pytest

from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.comm import hlo
from dtx.data import TrainLoader, tasks
from dtx.data.datasets import Split
from dtx.parallel.pipeline import costs as pipeline_model
from dtx.parallel.pipeline import positions as stage_positions
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline import tensor_stages
from dtx.parallel.pipeline.stages import PipelineError, StagePlan
from dtx.parallel.tensor import costs as tensor_model
from dtx.step import StepSpec, make_train_step
from dtx.step.spec import StepError
from dtx.step.state import init_train_state

STEPS, MICRO, BATCH = 3, 4, 32
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)
SEQ, VOCAB, WIDTH = 8, 32, 16
MESH = [("data", 2), ("stage", 2), ("model", 2)]


def _tokens():
    text = np.random.default_rng(0).integers(0, VOCAB, size=(64, SEQ + 1)).astype(np.int32)
    return Split(text[:, :-1], text[:, 1:])


def _setup():
    model, split = models.build_model("transformer", **LM), _tokens()
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
    return model, split, example, abstract


def _run(tx, mesh, schedule, sequence_parallel=False):
    model, split, example, abstract = _setup()
    pipeline = pp.make_pipeline(model, abstract, mesh,
                                pp.StageOptions(schedule=schedule, micro=MICRO, sequence_parallel=sequence_parallel),
                                example=example, task=tasks.next_token())
    state = pp.init_state(model, tx, example, 0, mesh, pipeline.plan)
    compiled = pp.make_pipeline_step(tx, mesh, pipeline).lower(state, TrainLoader(split, BATCH, mesh, seed=0)
                                                               .batch(0)).compile()
    loader, losses = TrainLoader(split, BATCH, mesh, seed=0), []
    for s in range(STEPS):
        state, metrics = compiled(state, loader.batch(s))
        losses.append(float(metrics["loss"]))
    return dict(params=jax.device_get(pp.gather_params(state, pipeline.plan)), losses=losses, compiled=compiled,
                pipeline=pipeline, state=state, metrics=jax.device_get(metrics))


def _one_device(tx, steps=STEPS):
    """``steps`` of the global batch on one device: its parameters and losses."""
    model, split, example, _ = _setup()
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    state = init_train_state(model, tx, example, 0, mesh)
    step = make_train_step(model, tx, mesh, StepSpec(task=tasks.next_token()))
    loader, losses = TrainLoader(split, BATCH, mesh, seed=0), []
    for s in range(steps):
        state, metrics = step(state, loader.batch(s))
        losses.append(float(metrics["loss"]))
    return dict(params=jax.device_get(state.params), losses=losses)


@pytest.fixture(scope="module")
def runs():
    """GPipe and 1F1B on data 2 x stage 2 x model 2, M = 4 micro-batches of 4 sequences, SGD with momentum (as
    tests/test_pipeline_stages.py's transformer, for the attention key bias's sake), with tensor parallelism and
    with sequence parallelism ("sp-gpipe", "sp-1f1b"); and one device."""
    tx, mesh = optim.make_optimizer("momentum", 0.1, momentum=0.9), mesh_lib.make_mesh(MESH)
    out = {name: _run(tx, mesh, name) for name in ("gpipe", "1f1b")}
    out.update({"sp-" + name: _run(tx, mesh, name, sequence_parallel=True) for name in ("gpipe", "1f1b")})
    out["one"] = _one_device(tx)
    return out


def _collectives(run):
    """The run's compiled collectives (dtx.comm.hlo), parsed once."""
    if "collectives" not in run:
        run["collectives"] = hlo.collectives(run["compiled"])
    return run["collectives"]


def _close(got, want, atol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_split_stages_equal_one_device(runs, schedule):
    """3 steps of each schedule == one device with the global batch within 1e-6 (the pipeline tests' tolerance),
    losses included; GPipe and 1F1B sum the same micro-batches in the same order (equal within 1e-7)."""
    run, one = runs[schedule], runs["one"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)
    _close(runs["1f1b"]["params"], runs["gpipe"]["params"], 1e-7)


def test_a_device_holds_its_slices(runs):
    """The rows are split over stage and model; a device's row holds 1/T of each split kernel and the whole of the
    rest, so the split stage's row is the local parameters (the pipeline's own row less half the blocks' kernels)."""
    run = runs["gpipe"]
    plan, rows = run["pipeline"].plan, run["state"].params
    assert rows.sharding.spec == jax.sharding.PartitionSpec("stage", "model")
    assert rows.addressable_shards[0].data.shape == (1, plan.row)
    d, f = WIDTH, 2 * WIDTH
    split = 4 * d * d + 3 * d + 2 * d * f + f  # Q, K, V, out kernels, Q/K/V biases, the MLP pair, its column bias
    whole = 4 * d + d + d  # two LayerNorms, the out and row biases
    stage1 = split // 2 + whole + 2 * d + d * VOCAB + VOCAB  # block 1 and the head (final LayerNorm, Dense)
    assert plan.stage_sizes[1] == stage1 and plan.row == max(plan.stage_sizes)
    # After 3 steps the two devices of a group hold the same replicated parameters, bit for bit: their gradients
    # are equal without a reduction over model (f sums the input gradients first).
    _replicated_equal(run)


def _replicated_equal(run):
    plan, rows = run["pipeline"].plan, run["state"].params
    rows = np.asarray(jax.device_get(rows)).reshape(2, 2, plan.row)
    halves = [StagePlan.unpack(plan, rows[:, t]) for t in range(2)]
    split = {path for path, _ in plan.splits}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(halves[0]), jax.tree.leaves(halves[1])):
        if tuple(k.key for k in path) not in split:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _model_all_reduces(collectives):
    """The all-reduces over model (2 devices) by stage branch and slot: (stage, "forward" / "re-run" / "backward")
    -> trips summed, and their operand bytes."""
    found, operands = {}, set()
    for c in collectives:
        m = re.search(r"branch_(\d+)_fun/(jvp\(|transpose\(jvp\()?Block", c.op_name)
        if c.kind != "all-reduce" or c.group_size != 2 or not m:
            continue
        slot = {None: "forward", "jvp(": "re-run", "transpose(jvp(": "backward"}[m.group(2)]
        found[int(m.group(1)), slot] = found.get((int(m.group(1)), slot), 0) + c.trips
        operands.add(c.operand_bytes)
    return found, operands


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_all_reduces_are_megatrons_per_block_and_micro_batch(runs, schedule):
    """Every device's program holds every stage's code, each slot's inside its phases' loops: a stage's
    all-reduces over model, their trips summed and divided by the slot's ticks, are per micro-batch Megatron's per
    block (dtx.parallel.tensor.costs.block_collectives: 2 forward, g; 2 backward, f) and the backward slot's re-run of the
    forward (2, less the stage output's g on a stage that is not the last: nothing in the backward slot reads it,
    and XLA drops it). Each carries one micro-batch's (time, d_model) stream; the accountant counts M times them."""
    run = runs[schedule]
    schedule_ = run["pipeline"].schedule
    found, operands = _model_all_reduces(_collectives(run))
    megatron = tensor_model.block_collectives(examples=BATCH // 2 // MICRO, positions=SEQ, width=WIDTH, group=2,
                                              sequence_parallel=False)
    assert operands == set(megatron["all-reduce"])
    ticks = {slot: schedule_.slot_ticks("backward" if slot != "forward" else "forward")
             for slot in ("forward", "re-run", "backward")}
    per_micro = {key: trips / ticks[key[1]] for key, trips in found.items()}
    blocks = 1  # one block per stage
    assert per_micro == {(0, "forward"): 2 * blocks, (0, "re-run"): 2 * blocks - 1, (0, "backward"): 2 * blocks,
                         (1, "forward"): 2 * blocks, (1, "re-run"): 2 * blocks, (1, "backward"): 2 * blocks}
    plan = run["pipeline"].plan
    assert [tensor_stages.stage_all_reduces(plan, s) for s in range(2)] == [5, 6]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_messages_are_the_pipeline_formulas(runs, schedule):
    """The collective-permutes, trip counts included, carry the pipeline's 2(M + P - 2) = 2M messages of one
    micro-batch's stream per device (dtx.parallel.pipeline.costs.estimate), as without the model axis (the buffer is replicated
    over model: each device sends its copy), and the gradient all-reduce over data carries the device's local row
    once; the step's comm_bytes are the program's, the model all-reduces counted as the busiest stage runs them
    (M x 6)."""
    run = runs[schedule]
    plan, schedule_ = run["pipeline"].plan, run["pipeline"].schedule
    message = plan.message_bytes(micro=BATCH // 2 // MICRO)
    assert message == 4 * SEQ * WIDTH * 4  # 4 sequences per micro-batch
    collectives = _collectives(run)
    permutes = sum(c.bytes_sent * c.trips for c in collectives if c.kind == "collective-permute")
    e = pipeline_model.estimate(plan, schedule_, micro=BATCH // 2 // MICRO, data=2)  # dtx.parallel.pipeline.costs's formulas
    assert permutes == e.p2p_bytes == schedule_.messages * message == 2 * MICRO * message
    grad = [c for c in collectives
            if c.kind == "all-reduce" and c.context == "entry" and c.operand_bytes >= plan.row * 4]
    # The local row once over data (XLA sends the metrics' pmean, two float32 scalars, in the same all-reduce).
    assert len(grad) == 1 and grad[0].bytes_sent - e.allreduce_bytes == 8 and e.allreduce_bytes == plan.row * 4
    total = sum(c.bytes_sent * (c.trips or 1) for c in collectives)
    found, _ = _model_all_reduces(collectives)
    static_model = sum(found.values()) * tensor_model.bytes_sent("all-reduce", message, 2)
    busiest = MICRO * 6 * tensor_model.bytes_sent("all-reduce", message, 2)
    assert run["metrics"]["comm_bytes"] == total - static_model + busiest
    assert tensor_stages.step_bytes(collectives, schedule_, 2) == total - static_model + busiest


def test_what_split_stages_cannot_run_is_refused_by_key():
    """Before compiling: LARS and LAMB (each whole tensor's norm) under a model axis, the tensor layout's ZeRO key
    with parallel.name=pipeline (naming the one tensor.* key a pipeline takes), sequence parallelism without a model
    axis, and under it a sequence the model axis does not split (naming the lengths that split)."""
    from dtx import config as config_lib
    from dtx.parallel.pipeline import check as pipeline_check

    with pytest.raises(StepError, match="optimizer.name='lamb'"):
        pipeline_check.check_settings(pipeline_check.PipelineSettings(
            mesh_shape=dict(MESH), num_layers=4, global_batch_size=BATCH, microbatches=MICRO, optimizer="lamb"))
    pipeline_check.check_settings(pipeline_check.PipelineSettings(
        mesh_shape=dict(MESH), num_layers=4, global_batch_size=BATCH, microbatches=MICRO, optimizer="adamw",
        weight_decay=0.01))
    base = ["--config.parallel.name=pipeline", "--config.mesh=((\"data\", 2), (\"stage\", 2), (\"model\", 2))",
            "--config.pipeline.microbatches=4"]
    experiment = os.path.join(os.path.dirname(__file__), "..", "experiments", "tiny_lm.py")
    with pytest.raises(config_lib.ConfigError, match=r"tensor.zero_stage=1 .*takes tensor.sequence_parallel only"):
        config_lib.load(experiment, base + ["--config.tensor.zero_stage=1"])
    assert config_lib.load(experiment, base + ["--config.tensor.sequence_parallel=True"]).tensor.sequence_parallel
    with pytest.raises(config_lib.ConfigError, match="tensor.sequence_parallel=True .*has none"):
        config_lib.load(experiment, base[:1] + ["--config.mesh=((\"data\", 4), (\"stage\", 2))",
                                                "--config.tensor.sequence_parallel=True"])
    model, _, _, abstract = _setup()
    odd = jax.ShapeDtypeStruct((BATCH, SEQ - 1), np.int32)
    with pytest.raises(PipelineError, match=r"7 positions .*dataset.seq_len, e.g. \[2, 4, 6, 8\]"):
        pp.make_pipeline(model, abstract, mesh_lib.make_mesh(MESH),
                         pp.StageOptions(micro=MICRO, sequence_parallel=True), example=odd)


def test_a_model_without_pairs_is_refused():
    """An MLP's layers are Dense pieces by name, which a stage cannot split over model: refused naming the mesh."""
    model = models.build_model("mlp", features=(16, 16), num_classes=4)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), np.zeros((1, 8), np.float32))["params"])
    with pytest.raises(PipelineError, match="--config.mesh"):
        pp.make_pipeline(model, abstract, mesh_lib.make_mesh(MESH), pp.StageOptions(micro=MICRO))


@pytest.mark.parametrize("name", ["1f1b", "sp-1f1b"])
def test_the_planner_predicts_the_compiled_split_pipeline(runs, name):
    """dtx simulate's T x P plans (dtx.parallel.pipeline.lm_costs, --verify's reading: dtx.tools.lm_sim) against this file's
    compiled 1F1B programs, without and with SP: the bytes a device of the last stage sends per step and its slots'
    FLOPs times M, each within --verify's 2 %."""
    from types import SimpleNamespace

    from dtx.perf import lm_plan
    from dtx.perf.clusters import get_cluster
    from dtx.precision import Policy
    from dtx.tools import lm_sim
    from dtx.tools.plancheck import VERIFY_TOLERANCE

    run = runs[name]
    shape = lm_plan.LMShape(2, WIDTH, 2, SEQ, vocab=VOCAB, mlp_ratio=2)
    p = lm_plan.plan(shape, get_cluster("h100_nvlink_ndr"), 8, BATCH, tensor=2, stages=2, micro=MICRO,
                     tensor_element=4, sp=name.startswith("sp"))
    parts = SimpleNamespace(placement=SimpleNamespace(runner=run["pipeline"]), policy=Policy(),
                            task=tasks.next_token())
    flops, sent = lm_sim._pipeline_figures(parts, mesh_lib.make_mesh(MESH), p, run["compiled"])  # module docstring
    assert abs(sent / p.bytes_sent - 1) <= VERIFY_TOLERANCE and abs(flops / p.flops - 1) <= VERIFY_TOLERANCE


def _blocks(collectives, schedule):
    """The collectives over model (2 devices) inside the blocks, per micro-batch, by stage branch and slot:
    (stage, slot) -> {kind: count}, (stage, slot) -> bytes one device sends, and kind -> operand bytes."""
    counts, sent, operands = {}, {}, {}
    for c in collectives:
        m = re.search(r"branch_(\d+)_fun/(jvp\(|transpose\(jvp\()?Block", c.op_name)
        if c.group_size != 2 or not m:
            continue
        slot = {None: "forward", "jvp(": "re-run", "transpose(jvp(": "backward"}[m.group(2)]
        key = (int(m.group(1)), slot)
        counts.setdefault(key, {})[c.kind] = counts.get(key, {}).get(c.kind, 0) + c.trips
        sent[key] = sent.get(key, 0) + c.bytes_sent * c.trips
        operands.setdefault(c.kind, set()).add(c.operand_bytes)

    def per_micro(key, trips):  # each slot's collectives run once per tick of its loops
        ticks = schedule.slot_ticks("forward" if key[1] == "forward" else "backward")
        assert trips % ticks == 0
        return trips // ticks
    counts = {key: {kind: per_micro(key, n) for kind, n in kinds.items()} for key, kinds in counts.items()}
    return counts, {key: per_micro(key, n) for key, n in sent.items()}, operands


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequence_parallel_stages_equal_one_device(runs, schedule):
    """tensor.sequence_parallel=True: the stream split over model by positions inside each stage (Korthikanti et
    al.), the embedding's output and the head's labels each device's own positions, the loss summed over model:
    3 steps == one device within 1e-6 (this file's tolerance), losses included, and the two devices of a group
    hold bit-equal replicated parameters (their gradients, each from its own positions, summed over model)."""
    run, one = runs["sp-" + schedule], runs["one"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)
    _replicated_equal(run)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequence_parallel_collectives_are_korthikantis(runs, schedule):
    """Inside the blocks SP runs reduce-scatters of one micro-batch's whole (time, d_model) stream and all-gathers of
    a device's 1/T of it (dtx.parallel.tensor.costs.block_collectives(sequence_parallel=True)'s operands), no all-reduce:
    per block and micro-batch 2 + 2 in the forward slot, 2 + 2 in the backward slot's re-run (less the stage output's
    dead reduce-scatter on stage 0) and 2 + 2 in its backward (tensor_stages.stage_collectives). Forward and backward
    send Megatron's all-reduce bytes (dtx.parallel.tensor.costs.block_bytes of TP), slot by slot the TP run's, but for the
    re-run on stage 0: TP's dead g is an all-reduce, SP's a reduce-scatter, so SP sends one all-gather's bytes more
    there. Outside the blocks one all-reduce over model: the replicated entries of the gradient row, once a step
    (each device's embedding, positions, LayerNorms, biases and head gradients are its own positions')."""
    sp, tp = runs["sp-" + schedule], runs[schedule]
    plan, schedule_ = sp["pipeline"].plan, sp["pipeline"].schedule
    micro = BATCH // 2 // MICRO
    stream = micro * SEQ * WIDTH * 4
    counts, sent, operands = _blocks(_collectives(sp), schedule_)
    korthikanti = tensor_model.block_collectives(examples=micro, positions=SEQ, width=WIDTH, group=2,
                                                 sequence_parallel=True)
    assert operands == {kind: set(korthikanti[kind]) for kind in ("reduce-scatter", "all-gather")}
    pair = {"reduce-scatter": 2, "all-gather": 2}
    assert counts == {(0, "forward"): pair, (0, "re-run"): {"reduce-scatter": 1, "all-gather": 2},
                      (0, "backward"): pair, (1, "forward"): pair, (1, "re-run"): pair, (1, "backward"): pair}
    assert [tensor_stages.stage_collectives(plan, s) for s in range(2)] == [
        {"reduce-scatter": 5, "all-gather": 6}, {"reduce-scatter": 6, "all-gather": 6}]
    _, tp_sent, _ = _blocks(_collectives(tp), schedule_)
    megatron = tensor_model.block_bytes(micro, SEQ, WIDTH, 2, sequence_parallel=False)
    for stage in range(2):
        assert sent[stage, "forward"] + sent[stage, "backward"] == megatron
    dead = tensor_model.bytes_sent("all-gather", stream // 2, 2)
    assert sent == {key: value + (dead if key == (0, "re-run") else 0) for key, value in tp_sent.items()}
    outside = [c for c in _collectives(sp) if c.group_size == 2 and "Block" not in c.op_name]
    # (the other: the row's all-reduce over data, with the metrics' two float32 scalars)
    assert sorted((c.kind, c.context, c.operand_bytes) for c in outside) == [
        ("all-reduce", "entry", 4 * stage_positions.replicated_size(plan)), ("all-reduce", "entry", 4 * plan.row + 8)]
    assert stage_positions.replicated_size(plan) == VOCAB * WIDTH + SEQ * WIDTH + 6 * WIDTH  # stage 0's


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sequence_parallel_sends_and_keeps_a_tth_at_the_boundary(runs, schedule):
    """The boundary buffer carries a device's 1/T of the positions: the collective-permutes send half the TP
    pipeline's bytes (dtx.parallel.pipeline.costs.estimate's p2p bytes of the SP plan's message); the step's comm_bytes are
    the program's as the busiest stage sends them (tensor_stages.step_bytes); and a device's temporaries (the kept
    stage inputs among them) are smaller than the TP pipeline's (memory_analysis)."""
    sp, tp = runs["sp-" + schedule], runs[schedule]
    plan, schedule_ = sp["pipeline"].plan, sp["pipeline"].schedule
    micro = BATCH // 2 // MICRO

    def permutes(run):
        return sum(c.bytes_sent * c.trips for c in _collectives(run) if c.kind == "collective-permute")
    assert plan.message_bytes(micro) * 2 == tp["pipeline"].plan.message_bytes(micro) == micro * SEQ * WIDTH * 4
    e = pipeline_model.estimate(plan, schedule_, micro=micro, data=2)
    assert permutes(sp) * 2 == permutes(tp)
    assert permutes(sp) == e.p2p_bytes == schedule_.messages * micro * SEQ * WIDTH * 4 // 2
    assert sp["metrics"]["comm_bytes"] == tensor_stages.step_bytes(_collectives(sp), schedule_, 2)
    temp = {name: run["compiled"].memory_analysis().temp_size_in_bytes for name, run in (("sp", sp), ("tp", tp))}
    kept = schedule_.slots * plan.message_bytes(micro)  # what the kept inputs save
    assert temp["tp"] - temp["sp"] >= kept, temp
