"""Gradient accumulation: k micro-batches == one k× batch, for both drivers (DESIGN.md §6).

``make_train_step(..., accum_steps=k)`` splits every device's slice of the global
batch into k micro-batches, sums their gradients into one accumulator and reduces
once. Since the micro-batches have equal sizes, the mean of their mean gradients
is the mean gradient of the whole batch: the step must equal the ``accum_steps=1``
step on the same global batch, and the 1-device step too. It must also keep its
two promises: less activation memory, and one all-reduce per step whatever k.

Tolerance: accumulation sums k micro-batch means and divides by k where the
reference sums the whole batch at once — float32 sums in a different order, as
in tests/test_step.py (measured <= 1.2e-7 absolute on parameters over 10
SGD-momentum steps). Parameters are held to ``atol=1e-6, rtol=1e-5`` and the
per-step losses to ``rtol=1e-5``. The model is an MLP without batch norm:
batch norm over a micro-batch is by design *not* batch norm over the k× batch.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx import models
from dtx import optim
from dtx import mesh as mesh_lib
from dtx.data import TrainLoader
from dtx.step.state import init_train_state
from dtx.step import StepSpec, StepError, check_accumulation, make_train_step

STEPS = 10
BATCH = 64  # 8 per device on the 8-device mesh: splits into 2, 4 or 8 micro-batches
PARAM_TOL = dict(atol=1e-6, rtol=1e-5)
LOSS_TOL = dict(rtol=1e-5)


def _model():
    return models.build_model("mlp", features=(32,))


def _tx():
    return optim.make_optimizer("momentum", 0.1, momentum=0.9)


@pytest.fixture(scope="module")
def meshes():
    return {
        "1": mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1]),
        "8": mesh_lib.make_mesh([("data", -1)]),
    }


def _abstract(state_or_tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state_or_tree)


@pytest.fixture(scope="module")
def initial_state(digits):
    """The same initial state for every run (host copy; initialised once, not once per run)."""
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    one_device = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    return jax.device_get(init_train_state(_model(), _tx(), example, seed=0, mesh=one_device))


@pytest.fixture(scope="module")
def runs(digits, meshes, initial_state):
    """(mesh, driver, k) -> (step function, final host state, per-step losses), computed once each."""
    cache = {}

    def get(mesh_name, driver, k):
        key = (mesh_name, driver, k)
        if key not in cache:
            mesh, model, tx = meshes[mesh_name], _model(), _tx()
            state = jax.device_put(initial_state, mesh_lib.replicated(mesh))  # fresh buffers: the step donates them
            step = make_train_step(model, tx, mesh, StepSpec(driver=driver, accum_steps=k))
            loader = TrainLoader(digits.train, BATCH, mesh, seed=0)
            losses = []
            for s in range(STEPS):
                state, metrics = step(state, loader.batch(s))
                losses.append(float(metrics["loss"]))  # waits on each step (DESIGN.md §2)
            cache[key] = step, jax.device_get(state), losses
        return cache[key]

    return get


def _assert_close(tree, reference, tol):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, **tol, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------ k micro-batches == one k× batch

@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_accumulation_equals_the_whole_batch(runs, driver, k):
    _, reference, ref_losses = runs("8", driver, 1)
    _, state, losses = runs("8", driver, k)
    assert int(state.step) == STEPS  # k micro-batches make one optimizer step, not k
    _assert_close(state.params, reference.params, PARAM_TOL)
    _assert_close(state.opt_state, reference.opt_state, PARAM_TOL)
    np.testing.assert_allclose(losses, ref_losses, **LOSS_TOL)  # the metric is the k× batch's mean loss
    # Training did something: a zero or stale gradient would also "agree".
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_accumulation_on_eight_devices_equals_one_device(runs, driver, k):
    _, reference, ref_losses = runs("1", "jit", 1)
    _, state, losses = runs("8", driver, k)
    _assert_close(state.params, reference.params, PARAM_TOL)
    np.testing.assert_allclose(losses, ref_losses, **LOSS_TOL)


# ------------------------------------------------------------------------- errors

def test_check_accumulation_names_the_setting_the_batch_and_the_divisors(meshes):
    with pytest.raises(StepError) as error:
        check_accumulation(BATCH, 3, meshes["8"])
    message = str(error.value)
    assert "grad_accum_steps=3" in message
    assert "per-device batch 8" in message
    assert "global_batch_size=64 over 8 devices" in message
    assert "[1, 2, 4, 8]" in message


@pytest.mark.parametrize("k", [0, -2, 16])
def test_check_accumulation_refuses_non_divisors(meshes, k):
    with pytest.raises(StepError, match=rf"grad_accum_steps={k} must divide the per-device batch 8"):
        check_accumulation(BATCH, k, meshes["8"])


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_check_accumulation_accepts_divisors(meshes, k):
    check_accumulation(BATCH, k, meshes["8"])


def test_one_device_divisors_are_of_the_whole_batch(meshes):
    with pytest.raises(StepError, match=r"per-device batch 12 .*choose one of \[1, 2, 3, 4, 6, 12\]"):
        check_accumulation(12, 5, meshes["1"])


def test_make_train_step_refuses_non_positive_accum_steps(meshes):
    with pytest.raises(StepError, match=r"accum_steps=0 must be >= 1"):
        make_train_step(_model(), _tx(), meshes["8"], StepSpec(accum_steps=0))


# ------------------------------------------------------------------ memory and communication

def test_accumulation_needs_less_temporary_memory(meshes):
    """XLA's own accounting: on a 4096-example batch of a 64-512-512-10 MLP, where activations
    dominate, 4 micro-batches of 1024 need less temporary memory than the whole batch at once.

    Only compiled, never run. Activations scale with the micro-batch (measured 34.6 MB for
    k=1, 12.0 MB for k=4); parameters and optimizer state are arguments, not temporaries.
    We demand at most half, a bound far from both measurements.
    """
    mesh = meshes["1"]
    model = models.build_model("mlp", features=(512, 512))
    tx = _tx()
    example = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    state = _abstract(jax.eval_shape(lambda: init_train_state(model, tx, example, 0, mesh)), mesh_lib.replicated(mesh))
    sharded = mesh_lib.batch_sharding(mesh)
    batch = {"inputs": jax.ShapeDtypeStruct((4096, 64), jnp.float32, sharding=sharded),
             "labels": jax.ShapeDtypeStruct((4096,), jnp.int32, sharding=sharded)}
    temp = {}
    for k in (1, 4):
        step = make_train_step(model, tx, mesh, StepSpec(driver="shard_map", accum_steps=k))
        temp[k] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    assert temp[4] < temp[1] / 2, temp


_COLLECTIVES = ("psum", "pmean", "all_reduce", "all_gather", "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")
_LOOPS = ("scan", "while")


def _walk(jaxpr, enclosing=()):
    """Every equation of a jaxpr and of its sub-jaxprs, with the primitives that enclose it."""
    for eqn in jaxpr.eqns:
        yield eqn, enclosing
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from _walk(inner, enclosing + (eqn.primitive.name,))


def _is_collective(eqn):
    return eqn.primitive.name.startswith(_COLLECTIVES)


def _all_reduce_ops(hlo_text):
    """All-reduce instructions in compiled HLO (sync ``all-reduce(`` or async ``all-reduce-start(``)."""
    return re.findall(r"\ball-reduce(?:-start)?\(", hlo_text)


def test_one_gradient_all_reduce_per_step_whatever_k(runs, meshes, digits):
    """shard_map driver: accumulation adds no communication — the compiled step has as many
    all-reduces for k=4 as for k=1, and none of them inside the micro-batch loop."""
    mesh = meshes["8"]
    step_1, state, _ = runs("8", "shard_map", 1)
    step_4, _, _ = runs("8", "shard_map", 4)
    abstract_state = _abstract(state, mesh_lib.replicated(mesh))
    sharded = mesh_lib.batch_sharding(mesh)
    batch = {"inputs": jax.ShapeDtypeStruct((BATCH,) + digits.train.inputs.shape[1:], jnp.float32, sharding=sharded),
             "labels": jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sharded)}
    counts = {k: len(_all_reduce_ops(step.lower(abstract_state, batch).compile().as_text()))
              for k, step in ((1, step_1), (4, step_4))}
    assert counts[1] >= 1, "the data-parallel step must all-reduce its gradients"
    assert counts[4] == counts[1], counts
    # A static count alone would miss an all-reduce moved *into* the loop (run k times):
    # in the traced step, no collective sits inside the scan over micro-batches.
    eqns = list(_walk(jax.make_jaxpr(step_4)(abstract_state, batch).jaxpr))
    assert any(eqn.primitive.name in _LOOPS for eqn, _ in eqns), "k=4 should loop over micro-batches"
    in_loop = [eqn.primitive.name for eqn, enclosing in eqns if _is_collective(eqn) and set(enclosing) & set(_LOOPS)]
    assert not in_loop, in_loop
    param_shapes = {leaf.shape for leaf in jax.tree.leaves(state.params)}
    gradient_reductions = [eqn for eqn, _ in eqns
                           if _is_collective(eqn) and tuple(eqn.invars[0].aval.shape) in param_shapes]
    assert len(gradient_reductions) == len(jax.tree.leaves(state.params))  # one reduction per gradient leaf


def test_both_drivers_reduce_once_per_step_whatever_k(runs, meshes, digits):
    """Read from the compiled program as it runs (each collective once per trip of its loop): under both
    drivers the k=4 step sends the bytes of the k=1 step, none of them inside the micro-batch loop. (Under
    ``jit`` XLA once reduced every micro-batch's gradient inside the loop: 4× the bytes; see
    tests/test_accumulate.py for every layout.)"""
    from dtx.comm import hlo

    mesh = meshes["8"]
    sharded = mesh_lib.batch_sharding(mesh)
    batch = {"inputs": jax.ShapeDtypeStruct((BATCH,) + digits.train.inputs.shape[1:], jnp.float32, sharding=sharded),
             "labels": jax.ShapeDtypeStruct((BATCH,), jnp.int32, sharding=sharded)}
    totals, trips = {}, {}
    for driver in ("jit", "shard_map"):
        for k in (1, 4):
            step, state, _ = runs("8", driver, k)
            compiled = step.lower(_abstract(state, mesh_lib.replicated(mesh)), batch).compile()
            totals[driver, k] = hlo.total(compiled)
            trips[driver, k] = sorted({c.trips for c in hlo.collectives(compiled)})
    for driver in ("jit", "shard_map"):
        assert trips[driver, 4] == [1] and totals[driver, 4].unknown_trips == 0
        assert totals[driver, 4].bytes_sent == totals[driver, 1].bytes_sent > 0
