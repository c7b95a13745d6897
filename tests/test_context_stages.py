"""Pipeline stages with every sequence split over the ``context`` axis (dtx.parallel.pipeline.context_stages).

The tiny transformer LM (embedding + block 0 | block 1 + head) on ``data 2 × stage 2 × context 2``: each device
of a stage's context group holds ``S/C`` positions of its micro-batches' sequences and its stage's attention runs
a context kernel over the axis. Checked here: GPipe with the all-gather (balanced and contiguous) and 1F1B with
Ulysses equal one device after 20 steps; the compiled step's collectives over ``context`` are the kernels' (per
block and micro-batch: the forward slot's, and in the backward slot the re-run forward's and the transposes'), the
boundary messages carry ``S/C`` positions, and the step's accountant counts every byte the program sends; what
cannot run is refused by key before compiling (the ring inside stages, a ``model`` axis beside ``context``, a
stream the axis does not split, a model of vectors).

Hand-breaks (each fails the test named): the labels not cut to the device's positions (``own_labels`` returning
them whole) -> the step does not trace (the logits' and labels' shapes differ); the labels cut contiguously under the
balanced layout -> ``test_context_stages_equal_one_device[gpipe-allgather]``; the gradient row not averaged over
``context`` (``reduce_axes`` returning ``()``) -> ``test_context_stages_equal_one_device`` (each device steps on
its half of the tokens' gradient); the stages' attention
run whole (no ``attention_regions``) -> ``test_context_stages_equal_one_device`` (each device attends within its
own positions); the backward slot's re-run left out of ``context_traffic`` (1 instead of 3/2 of the kernel's bytes)
-> ``test_the_accountant_counts_what_the_program_sends``.
"""

import os

import jax
import numpy as np
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.comm import hlo
from dtx.data import TrainLoader, tasks
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import costs as context_costs
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline import tensor_stages
from dtx.parallel.pipeline.stages import PipelineError
from dtx.step.spec import StepError
from test_tensor_stages import _one_device, _setup  # the same tiny LM, text and batches

STEPS, MICRO, BATCH = 20, 4, 32
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)  # test_tensor_stages'
SEQ, C = 8, 2
MESH = [("data", 2), ("stage", 2), (CONTEXT_AXIS, C)]
RUNS = {"gpipe-allgather": ("gpipe", "allgather", True), "gpipe-allgather-contiguous": ("gpipe", "allgather", False),
        "1f1b-ulysses": ("1f1b", "ulysses", True)}


def _run(tx, mesh, schedule, attention, balance):
    model, split, example, abstract = _setup()
    pipeline = pp.make_pipeline(model, abstract, mesh, pp.StageOptions(schedule=schedule, micro=MICRO,
                                                                       attention=attention, balance=balance),
                                example=example, task=tasks.next_token())
    state = pp.init_state(model, tx, example, 0, mesh, pipeline.plan)
    loader = TrainLoader(split, BATCH, mesh, seed=0)
    compiled = pp.make_pipeline_step(tx, mesh, pipeline).lower(state, loader.batch(0)).compile()
    losses = []
    for s in range(STEPS):
        state, metrics = compiled(state, loader.batch(s))
        losses.append(float(metrics["loss"]))  # waits on each step (XLA:CPU's all-reduce deadlock otherwise)
    return dict(params=jax.device_get(pp.gather_params(state, pipeline.plan)), losses=losses, compiled=compiled,
                pipeline=pipeline, metrics=jax.device_get(metrics), start=jax.device_get(
                    pp.gather_params(pp.init_state(model, tx, example, 0, mesh, pipeline.plan), pipeline.plan)))


@pytest.fixture(scope="module")
def runs():
    """:data:`RUNS` on data 2 x stage 2 x context 2, M = 4 micro-batches of 4 sequences, SGD with momentum; and one
    device."""
    tx, mesh = optim.make_optimizer("momentum", 0.1, momentum=0.9), mesh_lib.make_mesh(MESH)
    out = {name: _run(tx, mesh, *settings) for name, settings in RUNS.items()}
    out["one"] = _one_device(tx, STEPS)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_context_stages_equal_one_device(runs, name):
    """20 steps of each schedule and kernel equal one device with the global batch: the parameters within the
    rounding of a gradient's sums (B·S = 256 token terms through 2 blocks, at the scale of the parameters' change),
    the losses within float32's relative rounding of such sums."""
    from numerics import sum_atol

    run, one = runs[name], runs["one"]
    change = max(float(np.abs(np.asarray(w) - np.asarray(s)).max())
                 for w, s in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(run["start"])))
    atol = sum_atol(None, terms=BATCH * SEQ, depth=2 * LM["num_layers"], scale=change)
    assert jax.tree.structure(run["params"]) == jax.tree.structure(one["params"])
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(run["params"]), jax.tree.leaves(one["params"])):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
    np.testing.assert_allclose(run["losses"], one["losses"], rtol=sum_atol(None, terms=BATCH * SEQ, depth=1,
                                                                            scale=1.0))


def _context_collectives(run):
    """The compiled step's collectives over ``context`` inside the stages' slots, by kind and slot."""
    counts = {}
    for c in hlo.collectives(run["compiled"]):
        if c.group_size == C and c.context == "conditional" and "MultiHeadDotProductAttention" in c.op_name:
            slot = "backward" if "jvp(" in c.op_name else "forward"
            counts[c.kind, slot] = counts.get((c.kind, slot), 0) + c.trips
    return counts


@pytest.mark.parametrize("name", ["gpipe-allgather", "1f1b-ulysses"])
def test_the_stages_attention_runs_the_kernels_collectives(runs, name):
    """Per block and micro-batch, summed over the program's copies of each stage's slots (their trips): the
    all-gather's 2 gathers (keys, values) in the forward slot, and in the backward slot 2 again (the re-run forward)
    and their 2 transposes (reduce-scatters); Ulysses' 4 all-to-alls forward, 4 + 4 backward; and nothing else over
    the axis inside the stages. A stage holds 1 block; 2 stages; GPipe's and 1F1B's M = 4 slots of each kind."""
    run = runs[name]
    schedule = run["pipeline"].schedule
    counts = _context_collectives(run)
    per_slot = {kind: schedule.slot_ticks(kind) for kind in ("forward", "backward")}
    want = ({("all-gather", "forward"): 2, ("all-gather", "backward"): 2, ("reduce-scatter", "backward"): 2}
            if "allgather" in name else {("all-to-all", "forward"): 4, ("all-to-all", "backward"): 8})
    # every device's program holds both stages' branches, each run in its slot's ticks
    assert counts == {key: n * LM["num_layers"] * per_slot[key[1]] for key, n in want.items()}, counts


@pytest.mark.parametrize("name", list(RUNS))
def test_the_accountant_counts_what_the_program_sends(runs, name):
    """The step's comm_bytes (dtx.parallel.pipeline.step.traffic, with context_stages.context_traffic) equal the
    compiled program's bytes as the busiest stage runs them (tensor_stages.step_bytes over context's group); the
    kernels' part is 3/2 of dtx.parallel.context.costs.block_bytes per block and micro-batch (the backward slot's
    re-run forward), and the boundary's collective-permutes carry S/C positions of the stream."""
    run = runs[name]
    schedule, plan = run["pipeline"].schedule, run["pipeline"].plan
    collectives = hlo.collectives(run["compiled"])
    assert run["metrics"]["comm_bytes"] == tensor_stages.step_bytes(collectives, schedule, C)
    micro = BATCH // 2 // MICRO
    kernel = sum(c.bytes_sent * c.trips * schedule.micro / schedule.slot_ticks("backward" if "jvp(" in c.op_name
                                                                            else "forward")
                 for c in collectives if c.group_size == C and c.context == "conditional"
                 and "MultiHeadDotProductAttention" in c.op_name) / plan.devices  # one block on each stage
    assert round(kernel) == MICRO * 1.5 * context_costs.block_bytes(plan.attention, micro, SEQ, LM["d_model"], C)
    permutes = [c for c in collectives if c.kind == "collective-permute"]
    assert permutes and {c.bytes_sent for c in permutes} == {micro * SEQ // C * LM["d_model"] * 4}


def test_what_context_stages_cannot_run_is_refused_by_key():
    """Before compiling: the ring inside stages (naming the kernels that run), a model axis beside context and stage
    (naming both), a sequence the balanced layout's 2C chunks do not divide (naming the length), a model of vectors
    (an MLP: no positions to split); and the context keys reach the pipeline (borrowed by key)."""
    experiment = os.path.join(os.path.dirname(__file__), "..", "experiments", "tiny_lm.py")
    base = ["--config.mesh=((\"data\", 2), (\"stage\", 2), (\"context\", 2))", "--config.driver=shard_map",
            "--config.pipeline.microbatches=2"]
    with pytest.raises(config_lib.ConfigError, match="context.attention='ring' inside pipeline stages.*allgather"):
        config_lib.load(experiment, base)
    loaded = config_lib.load(experiment, base + ["--config.context.attention=ulysses",
                                                 "--config.context.balance=False"])
    assert (loaded.context.attention, loaded.context.balance) == ("ulysses", False)
    with pytest.raises(config_lib.ConfigError, match="both 'context' and 'model'"):
        config_lib.load(experiment, ["--config.mesh=((\"stage\", 2), (\"context\", 2), (\"model\", 2))",
                                     "--config.driver=shard_map", "--config.context.attention=allgather"])
    model, _, _, abstract = _setup()
    odd = jax.ShapeDtypeStruct((BATCH, SEQ - 2), np.int32)
    with pytest.raises(PipelineError, match=r"6 positions into 4 chunks .*divisible by 4"):
        pp.make_pipeline(model, abstract, mesh_lib.make_mesh(MESH), pp.StageOptions(micro=MICRO,
                                                                                   attention="allgather"),
                         example=odd)
    with pytest.raises(PipelineError, match="context.attention='ring' inside pipeline stages"):
        pp.make_pipeline(model, abstract, mesh_lib.make_mesh(MESH), pp.StageOptions(micro=MICRO), example=odd)
    mlp = models.build_model("mlp", features=(16, 16), num_classes=4)
    mlp_params = jax.eval_shape(lambda: mlp.init(jax.random.key(0), np.zeros((1, 8), np.float32))["params"])
    with pytest.raises(PipelineError, match=r"not \(positions, features\)"):
        pp.make_pipeline(mlp, mlp_params, mesh_lib.make_mesh(MESH), pp.StageOptions(micro=MICRO,
                                                                                   attention="allgather"))
    with pytest.raises(StepError, match="both 'context' and 'model'"):
        pp.make_pipeline(model, abstract, mesh_lib.make_mesh([("stage", 2), (CONTEXT_AXIS, 2), ("model", 2)]),
                         pp.StageOptions(micro=MICRO, attention="allgather"), example=odd)
