"""Tasks (dtx.data.tasks): each task's loss and metrics, on 8 devices == 1 device with both drivers,
exact masked means however unevenly padding falls on the devices, and the transformer LM
experiment through the drivers, a strategy and a compressor.

Tolerances (as tests/test_step.py): float32 sums in a different order differ in the last bits;
parameters are held to ``atol=1e-6, rtol=1e-5`` after a few SGD-momentum steps, losses to
``rtol=1e-5``; integer counts exactly.
"""

import inspect
import json
from typing import NamedTuple

import jax
import numpy as np
import optax
import pytest

from dtx import config as config_lib
from dtx.comm import hlo
from dtx import models, optim
from dtx.data import tasks
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader, eval_batches
from dtx.data.datasets import Split
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_eval_step, make_train_step
from dtx.run.trainer import evaluate

PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
STEPS = 4
BATCH = 16  # two sequences per device on 8: padding falls very unevenly
VOCAB, T, PAD = 32, 8, 0


@pytest.fixture(scope="module")
def meshes():
    return {"1": mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1]), "8": mesh_lib.make_mesh([("data", -1)])}


def _padded_tokens(n, seed):
    """Sequences of random lengths 1..T, padded with PAD (ids 1..VOCAB-1 are real tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(n, T + 1)).astype(np.int32)
    lengths = rng.integers(1, T + 1, size=n)
    tokens[np.arange(T + 1)[None, :] > lengths[:, None]] = PAD
    return Split(tokens[:, :-1], tokens[:, 1:])


@pytest.fixture(scope="module")
def text():
    return {"train": _padded_tokens(64, 0), "test": _padded_tokens(37, 1)}  # 37: a ragged last eval batch


@pytest.fixture(scope="module")
def regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] * x[:, 3]], axis=1).astype(np.float32)
    return Split(x, y)


def _lm():
    return models.build_model("transformer", num_layers=1, d_model=16, num_heads=2, mlp_ratio=2, max_len=T,
                              num_classes=VOCAB)


class Run(NamedTuple):
    state: object  # the final state, on the host
    records: list  # each step's metrics
    start: object  # the initial parameters
    compiled: object  # dtx.comm.hlo.total of the compiled step


TX = optim.make_optimizer("momentum", 0.1, momentum=0.9)
_INITIAL = {}  # (model, mesh) -> initial state: its compile is shared by the runs (they do not donate it)


def _initial(model, split, mesh):
    key = (model, tuple(mesh.devices.flat))
    if key not in _INITIAL:
        example = jax.ShapeDtypeStruct(split.inputs.shape, split.inputs.dtype)
        _INITIAL[key] = init_train_state(model, TX, example, seed=0, mesh=mesh)
    return _INITIAL[key]


def _run(model, task, split, mesh, driver, steps=STEPS, accum_steps=1) -> Run:
    state = _initial(model, split, mesh)
    start = jax.device_get(state.params)
    loader = TrainLoader(split, BATCH, mesh, seed=0)
    step = make_train_step(model, TX, mesh, StepSpec(driver=driver, task=task, accum_steps=accum_steps, donate=False))
    step = step.lower(state, loader.batch(0)).compile()
    records = []
    for s in range(steps):
        state, metrics = step(state, loader.batch(s))
        records.append({k: float(v) for k, v in metrics.items()})  # waits on each step
    state = jax.device_get(state)
    # It trained: a zero or stale gradient would also "agree" between device counts.
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start))) > 1e-3
    return Run(state, records, start, hlo.total(step))


def _assert_params_close(a, b):
    for path, x, y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, **PARAM_TOL, err_msg=jax.tree_util.keystr(path[0]))


# ----------------------------------------------------------------------------- the losses


def test_label_smoothing_equals_optax_with_smoothed_labels():
    rng = np.random.default_rng(0)
    for shape in ((5, 7), (3, 4, 11)):  # classification and per-token logits
        logits = rng.normal(size=shape).astype(np.float32) * 3
        labels = rng.integers(0, shape[-1], size=shape[:-1])
        targets = optax.smooth_labels(jax.nn.one_hot(labels, shape[-1]), 0.1)
        expected = optax.softmax_cross_entropy(logits, targets)
        np.testing.assert_allclose(tasks.classification(0.1).loss(logits, labels), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(tasks.next_token(label_smoothing=0.1).loss(logits, labels), expected,
                                   rtol=1e-6, atol=1e-6)
    plain = tasks.classification().loss(logits, labels)
    assert np.all(np.abs(np.asarray(plain) - np.asarray(expected)) > 1e-3)  # smoothing changed something


def test_regression_scores_mse_and_mae_per_example():
    outputs = np.array([[1.0, 2.0], [0.0, -1.0]], np.float32)
    targets = np.array([[0.0, 0.0], [0.0, 1.0]], np.float32)
    task = tasks.regression()
    np.testing.assert_allclose(task.loss(outputs, targets), [2.5, 2.0])
    np.testing.assert_allclose(task.metrics(outputs, targets)["mae"], [1.5, 1.0])
    np.testing.assert_allclose(task.loss(outputs[:, :1], targets[:, 0]), [1.0, 0.0])  # (B, 1) against (B,)
    with pytest.raises(tasks.TaskError, match="outputs .*2.* values per example"):
        task.loss(outputs, targets[:, 0])


def test_task_settings_are_checked_with_the_key_and_the_fix():
    with pytest.raises(tasks.TaskError, match="task.name='ranking'"):
        tasks.make_task("ranking")
    with pytest.raises(tasks.TaskError, match="task.pad_id=0 applies to task.name=next_token"):
        tasks.make_task("classification", pad_id=0)
    base = config_lib.base_config()
    for key, value, message in [("task.name", "lm", "task.name='lm' is unknown"),
                                ("task.label_smoothing", 1.0, r"must be in \[0, 1\)"),
                                ("task.pad_id", 3, "applies to task.name=next_token only")]:
        with pytest.raises(config_lib.ConfigError, match=message):
            config_lib.override(base, **{key: value})
    with pytest.raises(config_lib.ConfigError, match="not regression"):
        config_lib.override(base, **{"task.name": "regression", "task.label_smoothing": 0.1})
    with pytest.raises(tasks.TaskError, match="needs integer class ids"):
        tasks.classification().check((4,), np.float32)
    with pytest.raises(tasks.TaskError, match="float targets"):
        tasks.regression().check((4,), np.int32)


def test_a_setting_the_task_does_not_take_is_refused():
    """make_task and the config refuse a task setting the chosen task does not take, naming what it takes."""
    with pytest.raises(tasks.TaskError, match=r"task.label_smoothing=0.1 applies to task.name=classification or "
                                              r"next_token only, not regression \(task 'regression' takes none\)"):
        tasks.make_task("regression", label_smoothing=0.1)
    with pytest.raises(tasks.TaskError, match=r"unknown task setting\(s\) \['smoothing'\] \(task 'classification' "
                                              r"takes: label_smoothing;"):
        tasks.make_task("classification", smoothing=0.1)
    with pytest.raises(config_lib.ConfigError, match=r"task.pad_id=0 applies to task.name=next_token only, not "
                                                     r"classification \(task 'classification' takes: "
                                                     r"label_smoothing\); leave task.pad_id at its default -1"):
        config_lib.override(config_lib.base_config(), **{"task.pad_id": 0})
    with pytest.raises(config_lib.ConfigError, match=r"task.pad_id=0 .* not regression"):
        config_lib.load("tiny_lm", ["--config.task.pad_id=0", "--config.task.name=regression"])
    config_lib.load("tiny_lm", ["--config.task.pad_id=0"])  # next_token takes it


def test_each_task_declares_its_factorys_signature():
    block = config_lib.base_config().task
    declared = tasks.task_settings()
    for name, factory in tasks.TASKS.items():
        parameters = inspect.signature(factory).parameters.values()
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters), name
        assert declared[name] == tuple(p.name for p in parameters)
        assert tasks.make_task(name, **{k: block[k] for k in declared[name]}).name == name
    assert sorted({k for keys in declared.values() for k in keys}) == sorted(k for k in block if k != "name")
    assert tasks.make_task("next_token", pad_id=-1).valid is None  # the config's -1: every token is scored
    assert tasks.make_task("next_token", pad_id=0).valid is not None


# ----------------------------------------------------------------------------- 8 devices == 1 device


@pytest.fixture(scope="module")
def regression_runs(meshes, regression_data):
    cache = {}

    def get(mesh, driver):
        if (mesh, driver) not in cache:
            model = models.build_model("mlp", features=(32,), num_classes=2)
            cache[mesh, driver] = _run(model, tasks.regression(), regression_data, meshes[mesh], driver)
        return cache[mesh, driver]

    return get


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_regression_on_eight_devices_equals_one_device(regression_runs, driver):
    reference, ref_records, _, _ = regression_runs("1", "jit")
    state, records, _, _ = regression_runs("8", driver)
    _assert_params_close(state.params, reference.params)
    for name in ("loss", "mae"):
        np.testing.assert_allclose([r[name] for r in records], [r[name] for r in ref_records], rtol=1e-5)
    assert "accuracy" not in records[0]
    assert records[-1]["loss"] < records[0]["loss"] - 0.05  # it trained


@pytest.fixture(scope="module")
def lm_runs(meshes, text):
    cache = {}

    def get(mesh, driver, accum_steps=1):
        key = (mesh, driver, accum_steps)
        if key not in cache:
            cache[key] = _run(_lm(), tasks.next_token(pad_id=PAD), text["train"], meshes[mesh], driver,
                              accum_steps=accum_steps)
        return cache[key]

    return get


@pytest.mark.parametrize("driver,accum_steps", [("shard_map", 1), ("jit", 1), ("shard_map", 2), ("jit", 2)])
def test_padded_next_token_on_eight_devices_equals_one_device(lm_runs, driver, accum_steps):
    reference, ref_records, _, _ = lm_runs("1", "jit")
    state, records, _, _ = lm_runs("8", driver, accum_steps)
    _assert_params_close(state.params, reference.params)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose([r[name] for r in records], [r[name] for r in ref_records], rtol=1e-5)


def test_the_training_loss_is_the_mean_over_the_global_batchs_real_tokens(meshes, text, lm_runs):
    """Step 0's loss is sum(token losses) / count(real tokens) over the whole global batch, computed here
    in numpy: not the mean of per-device means (padding differs from device to device)."""
    _, records, start, _ = lm_runs("8", "shard_map")
    rows = TrainLoader(text["train"], BATCH, meshes["8"], seed=0).indices(0)
    labels = text["train"].labels[rows]
    nll = _token_nll(start, text["train"].inputs[rows], labels)
    real = labels != PAD
    rows_of_device = np.arange(BATCH).reshape(8, -1)  # device i holds rows 2i, 2i + 1
    per_device = [nll[r][real[r]].mean() for r in rows_of_device if real[r].any()]
    np.testing.assert_allclose(records[0]["loss"], nll[real].sum() / real.sum(), rtol=1e-5)
    assert abs(np.mean(per_device) - nll[real].sum() / real.sum()) > 1e-3  # the two really differ here


def test_padded_next_token_step_counts_its_count_all_reduce(lm_runs):
    """The valid-token count's all-reduce is in the shard_map step's comm figures, as compiled."""
    _, records, _, compiled = lm_runs("8", "shard_map")
    assert (records[0]["comm_bytes"], records[0]["comm_rounds"]) == (compiled.bytes_sent, compiled.rounds)


@jax.jit
def _logits(params, inputs):
    return _lm().apply({"params": params}, inputs)


def _token_nll(params, inputs, labels):
    """Per-token negative log-likelihood in float64 numpy (and the logits)."""
    logits = np.asarray(_logits(params, inputs), np.float64)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]


# ----------------------------------------------------------------------------- evaluation


def test_masked_eval_is_exact_with_uneven_padding(meshes, text, lm_runs):
    """Per-token masked sums: 8 devices (both drivers) report what 1 device does, and what numpy computes
    over the real tokens of the real examples (37 sequences: the last batch is ragged too)."""
    params = lm_runs("1", "jit").state.params
    model, task, test = _lm(), tasks.next_token(pad_id=PAD), text["test"]
    found = {}
    for name, mesh, driver in [("1", meshes["1"], "jit"), ("8", meshes["8"], "shard_map"),
                               ("8 jit", meshes["8"], "jit")]:
        state = _initial(model, text["train"], mesh).replace(params=params)
        step = make_eval_step(model, mesh, StepSpec(driver=driver, task=task))
        found[name] = evaluate(step, state, eval_batches(test, BATCH, mesh), task)
    nll = _token_nll(params, test.inputs, test.labels)
    real = test.labels != PAD
    correct = (np.asarray(_logits(params, test.inputs)).argmax(-1) == test.labels) & real
    for record in found.values():
        assert record["test_examples"] == 37 and record["test_tokens"] == real.sum()
        assert record["test_accuracy"] == correct.sum() / real.sum()  # integer counts: exact
        np.testing.assert_allclose(record["test_loss"], nll[real].mean(), rtol=1e-5)
        np.testing.assert_allclose(record["perplexity"], np.exp(nll[real].mean()), rtol=1e-5)
    for name in ("8", "8 jit"):
        np.testing.assert_allclose(found[name]["test_loss"], found["1"]["test_loss"], rtol=1e-6)


def test_perplexity_is_exp_of_the_unsmoothed_token_cross_entropy(meshes, text, lm_runs):
    """With label smoothing, ``test_loss`` is the smoothed objective but ``perplexity`` is exp of the plain
    cross-entropy per real token (numpy, float64), on 8 devices under both drivers; without smoothing the
    two are one figure."""
    trained = lm_runs("1", "jit").state.params
    # A confident model that is mostly right (sharper output logits; labels its own best guess among the
    # real ids where a real token stands): its smoothed loss lies far from its cross-entropy.
    params = {**trained, "Dense_0": {**trained["Dense_0"], "kernel": 20 * trained["Dense_0"]["kernel"]}}
    model, text_test = _lm(), text["test"]
    logits = np.asarray(_logits(params, text_test.inputs), np.float64)
    real = text_test.labels != PAD
    test = Split(text_test.inputs, np.where(real, logits[..., 1:].argmax(-1) + 1, PAD).astype(np.int32))
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_p, test.labels[..., None], -1)[..., 0]
    smoothed = 0.9 * nll - 0.1 * log_p.mean(-1)  # target (1 - a) one_hot + a / K, a = 0.1
    state = _initial(model, text["train"], meshes["8"]).replace(params=params)
    for smoothing, driver in [(0.1, "shard_map"), (0.1, "jit"), (0.0, "shard_map")]:
        task = tasks.next_token(pad_id=PAD, label_smoothing=smoothing)
        step = make_eval_step(model, meshes["8"], StepSpec(driver=driver, task=task))
        record = evaluate(step, state, eval_batches(test, BATCH, meshes["8"]), task)
        np.testing.assert_allclose(record["perplexity"], np.exp(nll[real].mean()), rtol=1e-5)
        if smoothing:
            np.testing.assert_allclose(record["test_loss"], smoothed[real].mean(), rtol=1e-5)
            np.testing.assert_allclose(record["test_nll"], nll[real].mean(), rtol=1e-5)
            # The smoothed loss really is another figure: exp of it is no perplexity.
            assert record["test_loss"] - np.log(record["perplexity"]) > 1.0, record
        else:
            assert "test_nll" not in record
            np.testing.assert_allclose(record["perplexity"], np.exp(record["test_loss"]), rtol=1e-12)


# ----------------------------------------------------------------------------- the tiny LM experiment


# The tiny LM through the jit driver, and through the shard_map driver with stale-gradient SGD (async,
# delay 1) and top-k compression at once (two dtx.train runs: each compiles a transformer's init, step and eval).
TINY_LM_RUNS = {"jit": {"driver": "jit"},
                "shard_map+async+topk": {"strategy.name": "async", "strategy.staleness": 1,
                                         "compression.name": "topk", "compression.fraction": 0.1}}


@pytest.fixture(scope="module")
def tiny_lm_runs(tmp_path_factory):
    """experiments/tiny_lm.py shrunk to a few seconds a run: width 32, 1 block, 16-byte windows, 3 steps."""
    from dtx.experiments import tiny_lm  # the experiment ships inside dtx
    from dtx.run.trainer import train

    base = config_lib.override(
        tiny_lm.get_config(), **{"num_steps": 3, "optimizer.warmup_steps": 1, "progress": False,
                                 "dataset.seq_len": 16, "model.max_len": 16, "model.d_model": 32,
                                 "model.num_layers": 1, "eval_batch_size": 1024, "log_every": 1})
    cache = {}

    def get(name):
        if name not in cache:
            result = train(config_lib.override(base, **TINY_LM_RUNS[name]), tmp_path_factory.mktemp("tiny_lm"))
            with open(result.workdir + "/metrics.jsonl") as f:
                cache[name] = result.metrics, [json.loads(line) for line in f]
        return cache[name]

    return get


@pytest.mark.parametrize("run", sorted(TINY_LM_RUNS))
def test_tiny_lm_trains_under_both_drivers_a_strategy_and_a_compressor(tiny_lm_runs, run):
    """Each run trains and evaluates; the first step's loss (same initial model, same batch) agrees."""
    final, records = tiny_lm_runs(run)
    _, other = tiny_lm_runs(next(name for name in TINY_LM_RUNS if name != run))
    first = [next(r["loss"] for r in rs if "loss" in r) for rs in (records, other)]
    np.testing.assert_allclose(first[0], first[1], rtol=1e-5)
    assert final["test_tokens"] == final["test_examples"] * 16
    assert final["perplexity"] < 256  # better than a uniform guess over the bytes, after 3 steps
    np.testing.assert_allclose(final["perplexity"], np.exp(final["test_loss"]), rtol=1e-12)
