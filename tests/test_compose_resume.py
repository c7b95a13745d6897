"""Checkpoints move between compositions exactly: data x8, FSDP x8 (an fsdp axis), FSDP x pipeline x tensor (+SP)
(fsdp 2 x stage 2 x model 2, each stage's row split over fsdp at ZeRO-3) and one device.

Each of the three 8-device layouts trains the tiny transformer language model (AdamW, weight decay) for 2 steps
through ``dtx.train`` and checkpoints; each checkpoint is restored through the Checkpointer as every other layout
and as one device (``setup.build_parts`` and ``setup.relayout``, what ``dtx train`` resumes with), and the restored
parameters and optimizer state, read as the model's tree, equal the saving run's bit for bit: a layout change moves
bytes and changes none. (A one-device checkpoint holds the model's tree as data x8's does, sharded differently;
orbax restores either onto any sharding, so data x8 stands for it as a source.)

Hand-break: ``setup.relayout`` reading a saved pipeline from its ``parallel.name`` alone (not its mesh's ``stage``
axis) -> ``test_every_layout_restores_every_other`` fails for the tree targets (data, fsdp, one device): the composed
run (``parallel.name=data`` with a stage axis) saved rows they then take for a tree.
"""

import os

import jax
import numpy as np
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx.data import inputs
from dtx.parallel.pipeline import relayout as pipeline_relayout
from dtx.run import setup
from dtx.run.trainer import train

TINY_LM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "tiny_lm.py")
RUN = ("--config.model.d_model=32", "--config.model.num_heads=2", "--config.dataset.seq_len=16",
       "--config.global_batch_size=32", "--config.num_steps=2", "--config.checkpoint.every_steps=2",
       "--config.progress=False", "--config.log_every=1", "--config.optimizer.warmup_steps=0")
LAYOUTS = {
    "data": ("--config.mesh=((\"data\", 8),)",),
    "fsdp": ("--config.mesh=((\"fsdp\", 8),)", "--config.driver=jit"),
    "composed": ("--config.mesh=((\"fsdp\", 2), (\"stage\", 2), (\"model\", 2))",
                 "--config.tensor.sequence_parallel=True", "--config.pipeline.schedule=1f1b",
                 "--config.pipeline.microbatches=4"),
}
_to_tree = jax.jit(pipeline_relayout.to_tree, static_argnums=1)


def _config(layout):
    return config_lib.load(TINY_LM, RUN + LAYOUTS.get(layout, ()))


def _tree(state, parts):
    """The state as the model's tree (a pipeline's rows unpacked by its plan), on the host."""
    pipeline = parts.placement.runner
    state = state if pipeline is None else _to_tree(state, pipeline.plan)
    return jax.device_get((state.params, state.opt_state))


def _parts(layout):
    config = _config("data" if layout == "one" else layout)
    devices = jax.devices()[:1] if layout == "one" else None
    if layout == "one":
        config = config_lib.override(config, mesh=(("data", 1),))
    mesh = mesh_lib.make_mesh(config.mesh, devices=devices)
    dataset = inputs.load_dataset(config.dataset, seed=config.seed)
    return setup.build_parts(config, mesh, dataset, 100, config.num_steps), mesh


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compositions")
    runs = {}
    for layout in LAYOUTS:
        result = train(_config(layout), str(tmp / layout))
        parts, _ = _parts(layout)
        runs[layout] = dict(checkpoints=tmp / layout / "checkpoints", tree=_tree(result.state, parts))
    return runs


@pytest.mark.parametrize("target", ["data", "fsdp", "composed", "one"])
def test_every_layout_restores_every_other(saved, target):
    parts, mesh = _parts(target)
    for source, run in saved.items():
        with checkpoint_lib.Checkpointer(run["checkpoints"], read_only=True) as checkpointer:
            resumed = checkpointer.resume(checkpoint_lib.abstract_target(parts.abstract_state, parts.placement.state),
                                          relayout=setup.relayout(parts, mesh))
        assert resumed.step == 2
        got, want = _tree(resumed.state, parts), run["tree"]
        assert jax.tree.structure(got) == jax.tree.structure(want), (source, target)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b, err_msg=f"{source} -> {target}")
