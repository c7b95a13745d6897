"""Pipeline stages of other shapes (dtx.parallel.pipeline.stages): LeNet's convolutions and a transformer's blocks.

The conv net and the transformer declare their pieces (``pipeline_layers()``: a convolution with its ReLU and
pooling, the embedding with the positions, a block, the head); the stages trace each boundary's shape and carry it
flattened in one buffer as wide as the largest, padding the others. Checked here: each schedule equals one device
after 3 steps, the compiled collective-permutes (loops' trip counts included) carry exactly the padded buffer the
model charges, the memory model predicts each compiled program's peak (its max pool's backward included), and the
settings a stage cannot run are refused by key.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.comm import hlo
from dtx.data import TrainLoader, datasets, tasks
from dtx.data.datasets import Split
from dtx.parallel.pipeline import costs as pipeline_model
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline.schedules import make_schedule
from dtx.parallel.pipeline.stages import PipelineError, make_plan
from dtx.perf import memory as memory_lib
from dtx.step import StepSpec, make_train_step
from dtx.step.state import init_train_state

STEPS = 3  # Adam's and momentum's state is in play from step 2 on
LENET = dict(conv_features=(2, 4), dense_features=(8,), num_classes=10, use_batch_norm=False)
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)
SEQ, VOCAB = 8, 32


def _tokens():
    rng = np.random.default_rng(0)
    text = rng.integers(0, VOCAB, size=(64, SEQ + 1)).astype(np.int32)
    return Split(text[:, :-1], text[:, 1:])


def _split(name):
    return datasets.load_dataset("digits").train if name == "lenet" else _tokens()


def _model(name):
    return models.build_model("lenet", **LENET) if name == "lenet" else models.build_model("transformer", **LM)


def _task(name):
    return tasks.classification() if name == "lenet" else tasks.next_token()


# The rows unpacked in one program per plan (eagerly, pp.gather_params compiles each slice and reshape on its own).
_gather_params = jax.jit(pp.gather_params, static_argnums=1)


def _run(name, tx, mesh, schedule, batch_size, boundaries=(), chunks=1):
    model, split, task = _model(name), _split(name), _task(name)
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
    plan = make_plan(model, abstract, mesh.shape["stage"], boundaries, chunks, example=example)
    state = pp.init_state(model, tx, example, 0, mesh, plan)
    step = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, schedule, task))
    loader = TrainLoader(split, batch_size, mesh, seed=0)
    compiled = step.lower(state, loader.batch(0)).compile()  # read by the tests, and run: compiled once
    losses = []
    for s in range(STEPS):
        state, metrics = compiled(state, loader.batch(s))
        losses.append(float(jax.block_until_ready(metrics)["loss"]))
    return dict(params=jax.device_get(_gather_params(state, plan)), losses=losses, compiled=compiled, plan=plan,
                schedule=schedule, metrics=jax.device_get(metrics))


def _one_device(name, tx, batch_size):
    model, split = _model(name), _split(name)
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    state = init_train_state(model, tx, example, 0, mesh)
    step = make_train_step(model, tx, mesh, StepSpec(task=_task(name)))
    loader = TrainLoader(split, batch_size, mesh, seed=0)
    losses = []
    for s in range(STEPS):
        state, metrics = step(state, loader.batch(s))
        losses.append(float(jax.block_until_ready(metrics)["loss"]))
    return dict(params=jax.device_get(state.params), losses=losses)


@pytest.fixture(scope="module")
def lenet_runs():
    """LeNet (convolutions of 2 and 4 channels, one hidden Dense layer of 8: 4 pieces) on 2 stages x 4 data
    shards, Adam, M = 4 micro-batches of 2, under GPipe and 1F1B (balanced: the first convolution alone, the rest
    on stage 1), and interleaved with one piece per virtual stage (2 devices x 2 chunks); and one device."""
    tx, mesh = optim.make_optimizer("adam", 1e-2), mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    runs = {name: _run("lenet", tx, mesh, make_schedule(name, 2, 4), 32) for name in ("gpipe", "1f1b")}
    runs["interleaved"] = _run("lenet", tx, mesh, make_schedule("interleaved", 2, 4, 2), 32, (1, 2, 3), 2)
    runs["one"] = _one_device("lenet", tx, 32)
    return runs


@pytest.fixture(scope="module")
def lm_runs():
    """The transformer (2 blocks of width 16, 8 tokens, 32 words: embedding, 2 blocks, head) on 2 stages x 4 data
    shards, M = 4 micro-batches of 2 sequences, under GPipe and 1F1B; and one device. SGD with momentum: the
    attention's key bias has a zero gradient in exact arithmetic (a constant added to every score of a query), so
    Adam would turn its rounding noise, summed in another order here, into full-size steps."""
    tx, mesh = optim.make_optimizer("momentum", 0.1, momentum=0.9), mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    runs = {name: _run("lm", tx, mesh, make_schedule(name, 2, 4), 32) for name in ("gpipe", "1f1b")}
    runs["one"] = _one_device("lm", tx, 32)
    return runs


def _close(got, want, atol):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
    assert jax.tree.structure(got) == jax.tree.structure(want)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_lenet_stages_equal_one_device(lenet_runs, schedule):
    """Every schedule's LeNet after 3 Adam steps == one device with the global batch, held to 1e-6 as the Dense
    stacks are (tests/test_pipeline_parallel.py)."""
    run, one = lenet_runs[schedule], lenet_runs["one"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_transformer_stages_equal_one_device(lm_runs, schedule):
    """The transformer cut into embedding + block 0 | block 1 + head (balanced by FLOPs), 3 steps == one
    device (momentum), held to 1e-6: positions and causal attention inside the stages, the next-token loss on the
    last."""
    run, one = lm_runs[schedule], lm_runs["one"]
    assert run["plan"].bounds == (0, 2, 4)
    assert [layer.name for layer in run["plan"].stage_layers(0)] == ["Embed_0+positions", "Block_0"]
    _close(run["params"], one["params"], 1e-6)
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=1e-6)


def test_schedules_compute_the_same_step(lenet_runs, lm_runs):
    """GPipe and 1F1B run the same micro-batches through the same stages and sum the gradients in the same order."""
    _close(lenet_runs["1f1b"]["params"], lenet_runs["gpipe"]["params"], 0)
    _close(lm_runs["1f1b"]["params"], lm_runs["gpipe"]["params"], 0)


def _permute_bytes(compiled):
    return sum(c.bytes_sent * c.trips for c in hlo.collectives(compiled) if c.kind == "collective-permute")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_lenet_sends_its_largest_boundary_padded(lenet_runs, schedule):
    """LeNet's boundaries are a 4x4x2 map (after the first pooling), a 2x2x4 map and 8 features: one buffer of
    32 per example carries each, the smaller zero-padded. The compiled collective-permutes, trip counts included,
    carry exactly what the model charges: 2(VM + P - 2) messages of 2 examples x 32 float32, padding and all."""
    run = lenet_runs[schedule]
    plan, chunks = run["plan"], run["schedule"].chunks
    if schedule == "interleaved":
        assert plan.boundary_widths == (4 * 4 * 2, 2 * 2 * 4, 8)
    else:
        assert plan.bounds == (0, 1, 4) and plan.boundary_widths == (4 * 4 * 2,)
    assert plan.width == 32 and plan.message_bytes(micro=2) == 2 * 32 * 4
    assert _permute_bytes(run["compiled"]) == 2 * (chunks * 4 + 2 - 2) * 2 * 32 * 4
    assert run["metrics"]["comm_bytes"] == hlo.total(run["compiled"]).bytes_sent  # the accountant's count


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_transformer_sends_the_residual_stream(lm_runs, schedule):
    """The boundary is the (time, d_model) residual stream: 2M messages of 2 sequences x 8 tokens x 16 float32, read
    from the compiled program with its loops' trip counts; the step's comm_bytes count the same."""
    run = lm_runs[schedule]
    assert run["plan"].boundary_widths == (SEQ * 16,)
    assert _permute_bytes(run["compiled"]) == 2 * 4 * 2 * SEQ * 16 * 4
    assert run["metrics"]["comm_bytes"] == hlo.total(run["compiled"]).bytes_sent


def _abstract(model, x):
    return jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])


# ---- the memory model (dtx.parallel.pipeline.costs.memory_estimate) against the compiled peak ---------------------------------

DIGIT_BYTES, TOKEN_BYTES = (8 * 8 + 1) * 4, (SEQ + SEQ) * 4  # one example's inputs and labels


@pytest.mark.parametrize("name,schedule", [("lenet", "gpipe"), ("lenet", "1f1b"), ("lenet", "interleaved"),
                                           ("lm", "gpipe"), ("lm", "1f1b")])
def test_the_memory_model_predicts_each_stages_compiled_peak(lenet_runs, lm_runs, name, schedule):
    """dtx simulate --memory's and memory_limit's pipeline model within 15 % of the compiled step's peak
    (memory_analysis) for the programs the tests above run: LeNet (Adam) 0.98, 1.06, 1.03 (1.38-1.52 before its max
    pool's backward was counted: pipeline_model.stage_conv_slot_bytes); the transformer (momentum) 0.97-1.02."""
    run = (lenet_runs if name == "lenet" else lm_runs)[schedule]
    optimizer, example_bytes = ("adam", DIGIT_BYTES) if name == "lenet" else ("momentum", TOKEN_BYTES)
    e = pipeline_model.memory_estimate(run["plan"], run["schedule"], micro=2, data=4, optimizer=optimizer,
                                     example_bytes=example_bytes)
    assert memory_lib.compiled_peak(run["compiled"]) / e.total == pytest.approx(1, abs=0.15)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_the_planners_memory_predicts_the_same_programs(lenet_runs, schedule):
    """dtx simulate --memory's and --plan's pipeline rows (dtx.parallel.pipeline.plan, from the analysed Dense/Conv layers,
    which describe no pooling) on the same programs: the planner's cut is the one compiled, and its memory is within
    15 % of the compiled peak (measured 0.98, 1.06, 1.03; 1.15, 1.25 and 1.21 without the program's ~4 KiB of scalars
    and tuple tables, pipeline_model.SMALL_BUFFERS)."""
    from dtx.parallel.pipeline import plan as pipeline_plan
    from dtx.perf import clusters
    from dtx.perf.layers import analyze

    run, chunks = lenet_runs[schedule], lenet_runs[schedule]["schedule"].chunks
    p = pipeline_plan.plan(analyze(_model("lenet"), (8, 8, 1)), clusters.get_cluster("cloud_10gbe"), 8, 32, 2, 4,
                           chunks=chunks, schedule="gpipe" if schedule == "gpipe" else "1f1b")
    assert (0, *p.boundaries, len(run["plan"].layers)) == run["plan"].bounds and p.schedule == schedule
    assert memory_lib.compiled_peak(run["compiled"]) / p.memory_bytes == pytest.approx(1, abs=0.15)


def test_a_max_pools_backward_is_counted_at_its_input(lenet_runs, lm_runs):
    """The costliest stage's backward slot, from the traced pieces: a max pool's gradient needs rank + 1 buffers of
    the pool's input (4 int32 index arrays of a (micro, 8, 8, 2) map, the scatter's zeros), its convolution's output
    and ReLU 2 more, and the stage's kernel is sliced (the model's first, never flipped); stage 1's pool (4x4x4) and
    sliced-and-flipped kernel cost less. The same figure as the planner's from the analysed layers. No pool,
    nothing."""
    from dtx.parallel.pipeline import plan as pipeline_plan
    from dtx.perf import clusters
    from dtx.perf.layers import analyze

    plan = lenet_runs["gpipe"]["plan"]
    slot = ((4 + 1) + 2) * 2 * 8 * 8 * 2 + 5 * 5 * 1 * 2
    assert slot > ((4 + 1) + 2) * 2 * 4 * 4 * 4 + 2 * 5 * 5 * 2 * 4  # stage 1's
    assert pipeline_model.stage_conv_slot_bytes(plan, micro=2) == 4 * slot
    assert pipeline_model.stage_conv_slot_bytes(lenet_runs["interleaved"]["plan"], micro=2) == 4 * slot
    assert pipeline_plan.plan(analyze(_model("lenet"), (8, 8, 1)), clusters.get_cluster("cloud_10gbe"), 8, 32, 2,
                              4).conv_bytes == 4 * slot
    assert pipeline_model.stage_conv_slot_bytes(lm_runs["gpipe"]["plan"], micro=2) == 0


def _compile_only(model, x, task, tx, stages, schedule, micro_batches, chunks=1):
    """A pipeline step compiled from shapes alone (micro-batches of 2 on each of 8 / stages data shards)."""
    mesh = mesh_lib.make_mesh([("stage", stages), ("data", 8 // stages)])
    example = jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype)
    plan = make_plan(model, _abstract(model, x), stages, chunks=chunks, example=example)
    schedule = make_schedule(schedule, stages, micro_batches, chunks)
    state = pp.abstract_state(model, tx, example, plan)
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state,
                         pp.state_shardings(state, mesh, plan))
    spec, size = NamedSharding(mesh, PartitionSpec(("stage", "data"))), micro_batches * 2 * (8 // stages)
    labels = (size,) + x.shape[1:] if x.dtype == np.int32 else (size,)
    batch = {"inputs": jax.ShapeDtypeStruct((size,) + x.shape[1:], x.dtype, sharding=spec),
             "labels": jax.ShapeDtypeStruct(labels, np.int32, sharding=spec)}
    compiled = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, schedule, task)).lower(state, batch).compile()
    return plan, schedule, compiled


def test_the_memory_model_on_a_held_out_stage_cut():
    """A pipeline chosen before the pool rule was measured, compiled only: LeNet on 4 stages x 2 with SGD under GPipe
    (compiled / estimate 1.80 without the pool's backward, 1.13 with the largest pool's rank + 3 buffers added, 0.99
    with the slot's rules). The other held-out cases, measured once
    and not compiled here for the suite's time (docs/pipeline.md): VGG-A at 1/32 width on 8x8 images, 2 stages
    GPipe Adam 0.99 and 4 stages 1F1B momentum 0.99 (1.00 and 1.02 with the slot's rules); LeNet of 4 and 8 channels,
    1F1B, M = 8, Adam 0.92 (1.03); a 3-block
    transformer on 4 stages, 1F1B, M = 8, 1.01; a transformer of width 32 interleaved (2 x 2 chunks, Adam) 0.93."""
    model, x = _model("lenet"), np.zeros((1, 8, 8, 1), np.float32)
    plan, schedule, compiled = _compile_only(model, x, _task("lenet"), optim.make_optimizer("sgd", 0.1), 4, "gpipe", 4)
    e = pipeline_model.memory_estimate(plan, schedule, micro=2, data=2, optimizer="sgd", example_bytes=DIGIT_BYTES)
    assert memory_lib.compiled_peak(compiled) / e.total == pytest.approx(1, abs=0.15)


def test_pieces_trace_their_shapes_and_flops():
    """Each piece's shapes are traced from the example, its FLOPs are its products' (a convolution:
    2·H·W·C_out·k²·C_in; a block: 2·T·(4d² + 2·d·f) + 2·2·T²·d, attention's scores over the full T x T), and the balanced cut
    minimises the costliest stage."""
    lenet = _model("lenet")
    x = np.zeros((1, 8, 8, 1), np.float32)
    layers = make_plan(lenet, _abstract(lenet, x), 1, example=x).layers
    assert [(x.in_shape, x.out_shape) for x in layers] == [((8, 8, 1), (4, 4, 2)), ((4, 4, 2), (2, 2, 4)),
                                                           ((2, 2, 4), (8,)), ((8,), (10,))]
    assert [x.flops for x in layers] == [2 * 8 * 8 * 2 * 25, 2 * 4 * 4 * 4 * 25 * 2, 2 * 16 * 8, 2 * 8 * 10]
    lm = _model("lm")
    tokens = np.zeros((1, SEQ), np.int32)
    layers = make_plan(lm, _abstract(lm, tokens), 1, example=tokens).layers
    d, f, t = 16, 32, SEQ
    assert [x.flops for x in layers] == [0, 2 * t * (4 * d * d + 2 * d * f) + 4 * t * t * d,
                                         2 * t * (4 * d * d + 2 * d * f) + 4 * t * t * d, 2 * t * d * VOCAB]
    vgg = models.build_model("vgg_a", width=1 / 32, fc_features=16, dropout_rate=0.0, num_classes=10)
    x = np.zeros((1, 8, 8, 3), np.float32)
    plan = make_plan(vgg, _abstract(vgg, x), 4, example=x)
    assert len(plan.layers) == 11 and plan.layers[-1].out_shape == (10,)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(0, 0.5, a.shape).astype(np.float32), _abstract(vgg, x))

    @jax.jit
    def staged(params, x):  # the stages in a row are the model
        rows, y = plan.pack(params), x
        for s in range(plan.num_stages):
            y = plan.apply_stage(s, rows[s], y)
        return y, vgg.apply({"params": params}, x)
    got, want = staged(params, x + 1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,change,says", [
    ("lenet", dict(use_batch_norm=True), "model.use_batch_norm=True.*--config.model.use_batch_norm=False"),
    ("transformer", dict(tie_embeddings=True), "model.tie_embeddings=True.*--config.model.tie_embeddings=False"),
    ("transformer", dict(dropout_rate=0.1), "model.dropout_rate=0.1.*--config.model.dropout_rate=0"),
    ("vgg_a", dict(width=1 / 32, fc_features=16), "model.dropout_rate=0.5.*--config.model.dropout_rate=0"),
])
def test_what_a_stage_cannot_run_is_refused_by_key(name, change, says):
    """Batch norm (a micro-batch's statistics are not the batch's), a tied embedding (first and last stage) and
    dropout are refused before anything compiles, naming the config key and the fix."""
    settings = {"lenet": LENET, "transformer": LM, "vgg_a": {}}[name]
    model = models.build_model(name, **{**settings, **change})
    x = np.zeros((1, SEQ), np.int32) if name == "transformer" else np.zeros((1, 8, 8, 3), np.float32)
    with pytest.raises(PipelineError, match=says):
        make_plan(model, _abstract(model, x), 2, example=x)
