"""Checkpoints of pipeline stages split over ``model`` restore across layouts (dtx.parallel.pipeline.relayout.relayout).

The tiny transformer of tests/test_tensor_stages.py, SGD with momentum as there (for the attention key bias's sake;
its traces are the optimizer leaves shaped like the parameters). Three steps on ``data 2 x stage 2 x model 2`` saved
(rows ``(P, T*row)``, split over ``stage`` and ``model``), restored through the Checkpointer as data x8 (the model's
tree), on one device, and as a plain pipeline of 4 stages x data 2; and data x8's step 3 restored as the split
pipeline. A layout change moves bytes: each restored state equals the saved one bit for bit, read against the rows
as the step's devices read them (``StagePlan.stage_params`` on each ``(stage, model)`` device's row, the split
leaves' slices joined). Training then continues equal to the uninterrupted data x8 run of six steps (within
test_tensor_stages' 1e-6).

Hand-breaks (each fails the tests named): ``TensorStagePlan.unpack`` joining the ``model`` slices in reverse order ->
``test_a_split_checkpoint_resumes_as_the_models_tree``, ``test_layouts_of_the_split_checkpoint_hold_the_same_bytes``
and both ``test_training_continues_as_the_uninterrupted_run``; ``pipeline_relayout._split`` ignoring the saved
``model`` axis (the plain plan) -> every test: the fixture's restore of the split rows is refused (``'params' was
saved as float32[2, 3600] but this run expects float32[2, 2864]``).
"""

import jax
import numpy as np
import pytest

from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx.data import TrainLoader, tasks
from dtx.data.datasets import Split
from dtx.parallel.pipeline import relayout as relayout_lib
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline.stages import PipelineError, StagePlan, make_plan
from dtx.step import StepSpec, make_train_step
from dtx.step.state import abstract_train_state, init_train_state

SAVED, STEPS, MICRO, BATCH = 3, 6, 4, 32
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)
SEQ, VOCAB = 8, 32
SPLIT = [("data", 2), ("stage", 2), ("model", 2)]
CONFIGS = {  # what the trainer saves of a run's config: what relayout reads of the saved layout
    "split": {"parallel": {"name": "pipeline"}, "pipeline": {"boundaries": [], "virtual_stages": 1},
              "mesh": [list(axis) for axis in SPLIT]},
    "data": {"parallel": {"name": "data"}, "mesh": [["data", 8]]},
}


def _setup():
    model = models.build_model("transformer", **LM)
    text = np.random.default_rng(0).integers(0, VOCAB, size=(64, SEQ + 1)).astype(np.int32)
    split = Split(text[:, :-1], text[:, 1:])
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    return model, split, example


def _restore(directory, model, tx, example, mesh, plan=None):
    """Checkpoint ``directory``'s step restored into ``mesh``'s layout: ``plan``'s rows, or the model's tree."""
    tree = abstract_train_state(model, tx, example)
    if plan is None:
        abstract = tree
        shardings = jax.tree.map(lambda _: mesh_lib.replicated(mesh), abstract)
    else:
        abstract = pp.abstract_state(model, tx, example, plan)
        shardings = pp.state_shardings(abstract, mesh, plan)
    target = checkpoint_lib.abstract_target(abstract, shardings)
    convert = relayout_lib.relayout(model, tx, example, tree, target, mesh, plan,
                                    lambda saved: (saved.get("parallel") or {}).get("name") == "pipeline")
    with checkpoint_lib.Checkpointer(directory, read_only=True) as checkpointer:
        resumed = checkpointer.resume(target, relayout=convert)
    assert resumed.step == SAVED
    return resumed.state


def _train(step, state, loader, steps):
    losses = []
    for s in steps:
        state, metrics = step(state, loader.batch(s))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split_layouts")
    tx, (model, split, example) = optim.make_optimizer("momentum", 0.1, momentum=0.9), _setup()
    task = tasks.next_token()
    data8, split_mesh = mesh_lib.make_mesh([("data", 8)]), mesh_lib.make_mesh(SPLIT)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
    pipeline = pp.make_pipeline(model, abstract, split_mesh, pp.StageOptions(schedule="1f1b", micro=MICRO),
                                example=example, task=task)
    data_step = make_train_step(model, tx, data8, StepSpec(task=task))
    split_step = pp.make_pipeline_step(tx, split_mesh, pipeline)
    data_loader, split_loader = TrainLoader(split, BATCH, data8, seed=0), TrainLoader(split, BATCH, split_mesh, seed=0)

    reference, losses = _train(data_step, init_train_state(model, tx, example, 0, data8), data_loader, range(SAVED))
    saved = {"data": jax.device_get(reference)}
    reference, later = _train(data_step, reference, data_loader, range(SAVED, STEPS))
    state, _ = _train(split_step, pp.init_state(model, tx, example, 0, split_mesh, pipeline.plan), split_loader,
                      range(SAVED))
    saved["split"] = jax.device_get(state)
    for name, value in saved.items():
        with checkpoint_lib.Checkpointer(tmp / name, async_save=False) as checkpointer:
            checkpointer.save(SAVED, value, {"config": CONFIGS[name]})

    as_data = _restore(tmp / "split", model, tx, example, data8)
    one = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    four = mesh_lib.make_mesh([("stage", 4), ("data", 2)])
    plain = pp.make_pipeline(model, abstract, four, pp.StageOptions(micro=MICRO), example=example).plan
    as_split = _restore(tmp / "data", model, tx, example, split_mesh, pipeline.plan)
    return dict(
        model=model, abstract=abstract, example=example, plan=pipeline.plan, saved=saved,
        reference=jax.device_get(reference), reference_losses=losses + later,
        as_data=jax.device_get(as_data), continued_as_data=_train(data_step, as_data, data_loader,
                                                                  range(SAVED, STEPS)),
        as_one=jax.device_get(_restore(tmp / "split", model, tx, example, one)),
        plain=plain, as_plain=jax.device_get(_restore(tmp / "split", model, tx, example, four, plain)),
        as_split=jax.device_get(as_split),
        continued_as_split=_train(split_step, as_split, split_loader, range(SAVED, STEPS)))


def _devices_tree(rows, plan):
    """The model's tree from split rows as the step's devices read them: device ``(s, t)``'s row sliced into its
    stage's parameters; a split leaf's ``T`` slices joined, a whole leaf the same on every ``t`` (asserted)."""
    width = plan.chunks * plan.row
    tree = {}
    for s in range(plan.num_stages):
        parts = [StagePlan.stage_params(plan, s, rows[s, t * width:(t + 1) * width]) for t in range(plan.tensor)]
        for key in parts[0]:
            def join(path, *slices):
                dim = dict(plan.splits).get((key,) + tuple(k.key for k in path))
                if dim is None:
                    for other in slices[1:]:
                        np.testing.assert_array_equal(other, slices[0])
                    return slices[0]
                return np.concatenate(slices, axis=dim)
            tree[key] = jax.tree_util.tree_map_with_path(join, *(part[key] for part in parts))
    return tree


def _equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _close(got, want, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def _moments(state):
    """The optimizer leaves shaped like the parameters: momentum's trace (a tree, or rows)."""
    trees = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, dict)) if isinstance(x, dict)]
    rows = [x for x in jax.tree.leaves(state.opt_state) if np.shape(x) == np.shape(state.params)]
    return trees or rows


def test_a_split_checkpoint_resumes_as_the_models_tree(runs):
    """Split rows -> data x8: the parameters and the momentum trace equal, bit for bit, what the saved devices held;
    a split rows' width is T rows of a device's slices (more than the unsplit parameters)."""
    saved, plan, got = runs["saved"]["split"], runs["plan"], runs["as_data"]
    assert plan.tensor == 2 and saved.params.shape == plan.rows_shape
    _equal(got.params, _devices_tree(saved.params, plan))
    (trace,), (want,) = _moments(got), _moments(saved)
    assert np.any(want)  # three steps in: a trace of gradients, not zeros
    _equal(trace, _devices_tree(want, plan))
    assert int(got.step) == SAVED


def test_layouts_of_the_split_checkpoint_hold_the_same_bytes(runs):
    """On one device the same tree; as a plain pipeline of 4 stages its rows unpack to that tree; and the rows
    packed back by the split plan are the saved rows bit for bit (padding zeros included)."""
    tree, plan = runs["as_data"], runs["plan"]
    _equal(jax.device_get((runs["as_one"].params, runs["as_one"].opt_state)), (tree.params, tree.opt_state))
    plain = runs["as_plain"]
    assert plain.params.shape == runs["plain"].rows_shape == (4, runs["plain"].row)
    back = relayout_lib.to_tree(plain, runs["plain"])
    _equal((back.params, back.opt_state), (tree.params, tree.opt_state))
    saved = runs["saved"]["split"]
    rows = jax.device_get(relayout_lib.to_rows(tree, plan))
    _equal((rows.params, rows.opt_state), (saved.params, saved.opt_state))


def test_a_tree_checkpoint_resumes_as_split_stages(runs):
    """data x8 -> split rows: each device's slices are the tree's, bit for bit."""
    got, want, plan = runs["as_split"], runs["saved"]["data"], runs["plan"]
    assert got.params.shape == plan.rows_shape
    _equal(_devices_tree(got.params, plan), want.params)
    (trace,), (reference,) = _moments(got), _moments(want)
    _equal(_devices_tree(trace, plan), reference)


@pytest.mark.parametrize("name", ["continued_as_data", "continued_as_split"])
def test_training_continues_as_the_uninterrupted_run(runs, name):
    """Three more steps after either resume == the uninterrupted data x8 run's steps 4-6 within 1e-6."""
    state, losses = runs[name]
    state = jax.device_get(state if name == "continued_as_data" else relayout_lib.to_tree(state, runs["plan"]))
    np.testing.assert_allclose(losses, runs["reference_losses"][SAVED:], rtol=1e-6)
    _close(state.params, runs["reference"].params)
    _close(_moments(state), _moments(runs["reference"]))


def test_the_saved_model_size_is_read_from_its_mesh_or_from_the_rows(runs):
    """The saved run's T: its mesh's model size; where that was -1 (the devices left), the T whose rows are the
    saved width; no model axis: the plain stages. Rows no T lays out are refused, naming the keys, before any array
    is read."""
    model, abstract, example, split = runs["model"], runs["abstract"], runs["example"], runs["plan"]
    plain = make_plan(model, abstract, 2, (), 1, example)

    def saved(mesh, shape=split.rows_shape):
        return relayout_lib._split(plain, abstract, example, mesh, shape)
    assert saved(CONFIGS["split"]["mesh"]) == split
    assert saved([["stage", 2], ["model", -1]]) == split
    assert saved([["stage", 2], ["data", -1]]) == plain
    assert saved([["stage", 2], ["model", -1]], (2, split.rows_shape[1] - 1)) == plain
    data8 = mesh_lib.make_mesh([("data", 8)])
    tx = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    tree = abstract_train_state(model, tx, example)
    adapt = relayout_lib.relayout(model, tx, example, tree, tree, data8, None,
                                  lambda saved: (saved.get("parallel") or {}).get("name") == "pipeline")
    config = {**CONFIGS["split"], "mesh": [["stage", 2], ["model", -1]]}
    narrow = [2, split.rows_shape[1] - 1]
    with pytest.raises(PipelineError, match=rf"rows \[2, {narrow[1]}\].*not split over model.* the layout it was saved"):
        adapt(config, {"params": (narrow, "float32", None)})
    assert adapt(config, {"params": (list(split.rows_shape), "float32", None)}) is not None
