"""Checkpoints restore across layouts: a pipeline's stage rows (``(P, V·row)``, :mod:`dtx.parallel.pipeline.stages`) and the
model's own parameter tree are one state, and either resumes as the other (:func:`dtx.parallel.pipeline.relayout.relayout`).

Three steps of the digits MLP with Adam as a pipeline of 2 stages x 4 data shards, saved, then three more as data x8
and as one device; and three as data x8, then three as the pipeline: each equals, per step and in its final
parameters and Adam moments, an uninterrupted data x8 run of the six steps (within 1e-6).
"""

import os
import shutil

import flax
import jax
import numpy as np
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx.data import TrainLoader, datasets
from dtx.parallel.pipeline import relayout as pp
from dtx.parallel.pipeline.stages import make_plan
from dtx.run import metrics, setup
from dtx.run.evaluate import export_run
from dtx.run.trainer import train
from dtx.step import StepSpec, make_train_step

DIGITS_MLP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "digits_mlp.py")
RUN = ("--config.model.features=(32, 16)", "--config.global_batch_size=64", "--config.grad_accum_steps=4",
       "--config.log_every=1", "--config.progress=False", "--config.checkpoint.every_steps=3")
# grad_accum_steps=4 equals the pipeline's micro-batches (allowed: they are the same accumulation)
PIPELINE = ("--config.parallel.name=pipeline", "--config.mesh=((\"stage\", 2), (\"data\", 4))",
            "--config.pipeline.microbatches=4")
DATA = ("--config.mesh=((\"data\", 8),)",)


def _train(workdir, steps, layout):
    config = config_lib.load(DIGITS_MLP, RUN + layout + (f"--config.num_steps={steps}",))
    return config, train(config, workdir)


def _losses(workdir):
    return [r["loss"] for r in metrics.read_metrics(workdir) if "loss" in r]


def _resume_as(tmp, saved, name, layout):
    """A copy of ``saved``'s workdir (so each resume starts from the same step 3) resumed to step 6 as ``layout``."""
    workdir = tmp / name
    shutil.copytree(saved, workdir)
    _, result = _train(workdir, 6, layout)
    return dict(state=result.state, losses=_losses(workdir), steps=sorted(os.listdir(workdir / "checkpoints")))


def _one_device(config, checkpoints):
    """The pipeline's step-3 checkpoint restored onto one device's mesh (its parameters and Adam moments as the
    model's tree), then three steps of the plain data-parallel step on the same batches."""
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    dataset = datasets.load_dataset("digits")
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    parts = setup.build_parts(config_lib.override(config, mesh=(("data", 1),)), mesh, dataset,
                              loader.steps_per_epoch, 6)
    with checkpoint_lib.Checkpointer(checkpoints, read_only=True) as checkpointer:
        resumed = checkpointer.resume(checkpoint_lib.abstract_target(parts.abstract_state, parts.placement.state),
                                      relayout=setup.relayout(parts, mesh))
    state, step, losses = resumed.state, make_train_step(parts.model, parts.tx, mesh, StepSpec(accum_steps=4)), []
    for s in range(resumed.step, 6):
        state, record = step(state, loader.batch(s))
        losses.append(float(record["loss"]))
    return dict(state=state, losses=losses, step=resumed.step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    config, reference = _train(tmp / "reference", 6, DATA)
    _train(tmp / "pipeline3", 3, PIPELINE)
    _train(tmp / "data3", 3, DATA)
    model = models.build_model("mlp", features=(32, 16), num_classes=10)
    return dict(tmp=tmp, reference=reference.state, reference_losses=_losses(tmp / "reference"),
                plan=make_plan(model, reference.state.params, 2),
                pipeline_to_data=_resume_as(tmp, tmp / "pipeline3", "pipeline_to_data", DATA),
                data_to_pipeline=_resume_as(tmp, tmp / "data3", "data_to_pipeline", PIPELINE),
                pipeline_recut=_resume_as(tmp, tmp / "pipeline3", "pipeline_recut",
                                          PIPELINE + ("--config.pipeline.boundaries=(2,)",)),
                pipeline_to_one=_one_device(config, tmp / "pipeline3" / "checkpoints"))


# Rows <-> tree in one program per plan (eagerly, each slice, reshape and pad compiles its own).
_to_tree, _to_rows = (jax.jit(f, static_argnums=1) for f in (pp.to_tree, pp.to_rows))


def _close_states(state, reference):
    """Parameters, Adam's mu and nu and its count, and the step: within 1e-6 of the reference's."""
    got, want = jax.device_get((state.step, state.params, state.opt_state)), jax.device_get(
        (reference.step, reference.params, reference.opt_state))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def test_a_pipeline_checkpoint_resumes_as_data_parallel(runs):
    run = runs["pipeline_to_data"]
    np.testing.assert_allclose(run["losses"], runs["reference_losses"], rtol=1e-6)
    _close_states(run["state"], runs["reference"])
    assert run["steps"] == ["3", "6"]  # the pipeline's step 3 kept beside the data-parallel step 6


def test_a_pipeline_checkpoint_resumes_on_one_device(runs):
    run = runs["pipeline_to_one"]
    assert run["step"] == 3
    np.testing.assert_allclose(run["losses"], runs["reference_losses"][3:], rtol=1e-6)
    _close_states(run["state"], runs["reference"])


def test_a_data_parallel_checkpoint_resumes_as_a_pipeline(runs):
    run = runs["data_to_pipeline"]
    np.testing.assert_allclose(run["losses"], runs["reference_losses"], rtol=1e-6)
    assert run["state"].params.shape == (2, runs["plan"].row)  # the stages' rows
    _close_states(_to_tree(run["state"], runs["plan"]), runs["reference"])
    assert run["steps"] == ["3", "6"]


def test_a_pipeline_checkpoint_resumes_under_another_cut(runs):
    """Saved with the balanced cut (layers 0 | 1 2), resumed cut at layer 2 (0 1 | 2): other rows, the same run."""
    run, recut = runs["pipeline_recut"], make_plan(models.build_model("mlp", features=(32, 16), num_classes=10),
                                                   runs["reference"].params, 2, (2,))
    assert runs["plan"].bounds == (0, 1, 3) and run["state"].params.shape == (2, recut.row) != (2, runs["plan"].row)
    np.testing.assert_allclose(run["losses"], runs["reference_losses"], rtol=1e-6)
    _close_states(_to_tree(run["state"], recut), runs["reference"])


def test_rows_and_tree_convert_both_ways(runs):
    """to_rows is to_tree's inverse on a state with Adam's moments; the rows' padding is zeros."""
    reference, plan = jax.device_get(runs["reference"]), runs["plan"]
    rows = _to_rows(reference, plan)
    moments = [x for x in jax.tree.leaves(rows.opt_state) if x.shape == rows.params.shape]
    assert len(moments) == 2  # Adam's mu and nu, as rows
    _close_states(_to_tree(rows, plan), reference)
    rows, moments = jax.device_get((rows, moments))  # the padding read in numpy
    for s, size in enumerate(plan.stage_sizes):
        assert not any(np.any(np.asarray(x[s, size:])) for x in (rows.params, *moments))
    assert min(plan.stage_sizes) < plan.row  # a stage with padding


def test_export_reads_a_step_saved_in_the_other_layout(runs, tmp_path):
    """The run resumed as data x8 still holds the pipeline's step 3; dtx export of that step (under the run's config,
    now data-parallel) writes the same parameters as the export of the pipeline run's own step 3, bit for bit."""
    layouts = runs["tmp"]
    for name in ("pipeline3", "pipeline_to_data"):
        export_run(layouts / name, tmp_path / name, step=3)
    exported = []
    for name in ("pipeline3", "pipeline_to_data"):
        with open(tmp_path / name / "variables.msgpack", "rb") as f:
            exported.append(flax.serialization.msgpack_restore(f.read())["params"])
    jax.tree.map(np.testing.assert_array_equal, *exported)
    with pytest.raises(AssertionError):  # and step 3 is not the run's final state
        jax.tree.map(np.testing.assert_array_equal, exported[0], jax.device_get(runs["reference"].params))
