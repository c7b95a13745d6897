"""Clipping by the global norm (``optimizer.clip_norm``, ``StepSpec(clip_norm=...)``) is one device's in every layout.

Pascanu et al. 2013 (arXiv 1211.5063, §3.2) scale the gradient by ``min(1, c / ‖g‖)``, ``‖g‖`` the whole model's
L2 norm. A layout whose devices hold parts of the model must sum the parts' squares over the devices that hold
them: the step's reduction does (:class:`dtx.step.body.Norms`), with the norm each layout declares — under ``jit``
and the data-parallel and ZeRO steps the reduction sees every tensor (whole or as a global array), a pipeline's
stage rows sum over ``stage``, over ``model`` for split entries (replicated ones once) and over ZeRO's slices
(:func:`dtx.parallel.pipeline.optim.global_norm`).

The tiny transformer LM, SGD with momentum, a threshold every step's norm exceeds (the clip acts each step): after
5 steps the parameters and every step's ``grad_norm`` equal one device's, and ``grad_clipped`` is 1 every step, on
data 8 (shard_map), ZeRO-1 (shard_map), Megatron's tensor layout (jit), FSDP (jit), context 4 (jit), a GPipe
pipeline on data 4 × stage 2, a ZeRO-1 pipeline of Megatron-split stages on fsdp 2 × stage 2 × model 2, and a
pipeline × context on data 2 × stage 2 × context 2. An optimizer that itself reads across tensors
(``optax.clip_by_global_norm`` in a chain) is refused under a pipeline, found by what it does; a strategy whose
workers step on their own gradients is refused by key.

Hand-breaks: the pipeline's norm not summed over ``stage`` -> every pipeline case; the replicated entries counted
``T`` times (summed over ``model`` with the split ones) -> ``[pipeline-tp-zero1]``; the slice offset left out
under ZeRO (every rank's mask from entry 0) -> ``[pipeline-tp-zero1]``.
"""

import os

import jax
import numpy as np
import optax
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models, optim, parallel
from dtx.data import TrainLoader, tasks
from dtx.data.datasets import Split
from dtx.parallel.pipeline import step as pp
from dtx.step import StepSpec, make_train_step
from dtx.step.spec import StepError
from dtx.step.state import abstract_train_state, init_train_state

STEPS, MICRO, BATCH, CLIP = 5, 4, 32, 0.3
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)
SEQ, VOCAB = 8, 32
LAYOUTS = {  # name -> (mesh, layout or pipeline options, driver)
    "data": ([("data", 8)], "data", "shard_map"),
    "zero1": ([("data", 8)], "zero1", "shard_map"),
    "tensor": ([("data", 4), ("model", 2)], "tensor", "jit"),
    "fsdp": ([("fsdp", 8)], "fsdp", "jit"),
    "context": ([("data", 2), ("context", 4)], "context", "jit"),
    "pipeline": ([("data", 4), ("stage", 2)], pp.StageOptions(micro=MICRO), None),
    "pipeline-tp-zero1": ([("fsdp", 2), ("stage", 2), ("model", 2)], pp.StageOptions(micro=MICRO, zero_stage=1),
                          None),
    "pipeline-context": ([("data", 2), ("stage", 2), ("context", 2)],
                         pp.StageOptions(micro=MICRO, attention="allgather"), None),
}


def _setup():
    model = models.build_model("transformer", **LM)
    text = np.random.default_rng(0).integers(0, VOCAB, size=(64, SEQ + 1)).astype(np.int32)
    split = Split(text[:, :-1], text[:, 1:])
    return model, split, jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)


def _train(mesh, step, state, split, params=lambda state: state.params):
    loader, norms = TrainLoader(split, BATCH, mesh, seed=0), []
    for s in range(STEPS):
        state, metrics = step(state, loader.batch(s))
        norms.append((float(metrics["grad_norm"]), float(metrics["grad_clipped"])))  # waits on the step
    return dict(params=jax.device_get(params(state)), norms=np.array(norms))


def _run(name):
    model, split, example = _setup()
    tx = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    task = tasks.next_token()
    if name == "one":
        mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
        state = init_train_state(model, tx, example, 0, mesh)
        return _train(mesh, make_train_step(model, tx, mesh, StepSpec(task=task, clip_norm=CLIP)), state, split)
    axes, chosen, driver = LAYOUTS[name]
    mesh = mesh_lib.make_mesh(axes)
    if driver is None:  # a pipeline
        abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
        pipeline = pp.make_pipeline(model, abstract, mesh, chosen, example=example, task=task)
        state = pp.init_state(model, tx, example, 0, mesh, pipeline.plan,
                              pp.state_shardings(pp.abstract_state(model, tx, example, pipeline.plan), mesh,
                                                 pipeline.plan, chosen.zero_stage))
        step = pp.train_step(tx, mesh, pipeline, StepSpec(task=task, clip_norm=CLIP, accum_steps=MICRO,
                                                          donate=False))
        return _train(mesh, step, state, split, lambda state: pp.gather_params(state, pipeline.plan))
    placement = parallel.get_layout(chosen).place(abstract_train_state(model, tx, example), mesh,
                                                  **({"attention": "allgather"} if name == "context" else {}))
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver=driver, placement=placement, task=task, clip_norm=CLIP,
                                                     donate=False))
    return _train(mesh, step, state, split)


@pytest.fixture(scope="module")
def one():
    return _run("one")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_clipping_is_one_devices_in_every_layout(one, name):
    """The clip acts on every step; the parameters after 5 steps and each step's global norm equal one device's,
    within the rounding of a gradient's sums (B·S = 256 token terms through 2 blocks; the norm's relative rounding
    that of those entries plus the sum of their squares)."""
    from numerics import sum_atol

    run = _run(name)
    assert (one["norms"][:, 1] == 1).all() and (run["norms"][:, 1] == 1).all()
    size = sum(np.size(leaf) for leaf in jax.tree.leaves(one["params"]))
    rtol = sum_atol(None, terms=BATCH * SEQ, depth=2 * LM["num_layers"], scale=1.0) + sum_atol(None, terms=size,
                                                                                             scale=1.0)
    np.testing.assert_allclose(run["norms"][:, 0], one["norms"][:, 0], rtol=rtol)
    atol = sum_atol(None, terms=BATCH * SEQ, depth=2 * LM["num_layers"], scale=0.1 * STEPS * CLIP)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(run["params"]),
                                 jax.tree.leaves(one["params"])):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_what_cannot_clip_whole_is_refused():
    """A chain with optax.clip_by_global_norm under a pipeline (each stage would clip by its own norm) is refused,
    found by what the optimizer does (an element-wise or per-tensor one is not); a local-model strategy and a
    negative threshold are refused by key; the key reaches the step."""
    model, split, example = _setup()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
    mesh = mesh_lib.make_mesh([("data", 4), ("stage", 2)])
    pipeline = pp.make_pipeline(model, abstract, mesh, pp.StageOptions(micro=MICRO), example=example,
                                task=tasks.next_token())
    chained = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-3))
    with pytest.raises(StepError, match="clip_by_global_norm does.*optimizer.clip_norm"):
        pp.train_step(chained, mesh, pipeline, StepSpec(accum_steps=MICRO))
    assert optim.couples_tensors(chained) and not optim.couples_tensors(optim.make_optimizer("lamb", 1e-3))
    experiment = os.path.join(os.path.dirname(__file__), "..", "experiments", "tiny_lm.py")
    with pytest.raises(config_lib.ConfigError, match="optimizer.clip_norm=1.0 .*strategy.name='local_sgd'"):
        config_lib.load(experiment, ["--config.optimizer.clip_norm=1.0", "--config.strategy.name=local_sgd"])
    with pytest.raises(config_lib.ConfigError, match="optimizer.clip_norm=-1.0"):
        config_lib.load(experiment, ["--config.optimizer.clip_norm=-1.0"])
    from dtx.run import setup

    config = config_lib.load(experiment, ["--config.optimizer.clip_norm=0.5"])
    assert setup.step_spec(config, setup.Parts(*([None] * 13))).clip_norm == 0.5
