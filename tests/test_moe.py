"""The mixture-of-experts layer (dtx.models.moe) against a float64 numpy reference, and the MoE LM on 8 devices.

The reference routes as the layer's docstring says, written as loops: softmax of the router's logits, the top-k of
the probabilities plus the bias (ties to the lower index), gates renormalised over the chosen, and per group the
buckets filled with every token's first choice in token order, then every second choice, an assignment that finds
its expert's ``capacity`` slots full dropped; each token's output the gate-weighted sum of its kept experts' MLPs.
The layer's output equals it (so every dropped token is the reference's: a token routed otherwise is off by a
gate times an MLP output), its slot assignment equals it exactly, and so do its ``dropped`` and ``load_max``
records; its aux and z losses equal their formulas; the bias changes the selection, not the gates, and moves by
``rate · sign(mean load − load)``; the router's gradient equals central differences of the reference. The tiny
LM with MoE layers trains on 8 devices (``shard_map`` and ``jit``) as on one, drops and bias balancing included.
Tolerances from the computation (tests/numerics.py).

Hand-breaks (each fails the tests named): the priority token-major instead of choice-major (``assign_slots``
without its swap of the token and choice axes) -> ``test_output_and_drops_equal_the_reference[capacity, even]``,
``test_slots_equal_the_reference``, the bias and gradient tests; the aux loss without its factor ``E`` ->
``test_aux_and_z_losses`` and the gradient test; the gates taken from the biased scores ->
``test_bias_changes_selection_not_gates``; the loads not summed over the batch axes (no ``psum``) ->
``test_moe_lm_on_8_devices_trains_as_one[shard_map]`` (the jit driver's layer sees the whole batch).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dtx
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx.data import tasks
from dtx.models import build_model, moe, sown
from numerics import assert_sums_close, magnitude

G, S, D, E, K, RATIO = 4, 16, 8, 4, 2, 2  # groups (sequences), tokens per group, width, experts, top-k, MLP ratio
MUTABLE = [moe.BALANCE, *sown.COLLECTIONS]


def gelu(x):
    """flax's ``nn.gelu`` (the tanh approximation)."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def reference(params, x, capacity, bias=None, renormalize=True, K=K):
    """The layer in float64 numpy loops (module docstring): output, chosen experts, kept assignments, slots, aux and
    z losses, the loads and the smallest gap between a token's k-th and (k+1)-th scores. The groups, tokens and
    experts are read from the shapes (tests/test_expert.py routes 8 experts over 8 groups with it)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    (G, S, _), E = x.shape, p["router"]["kernel"].shape[1]
    logits = x @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    scores = probs + (0 if bias is None else np.asarray(bias, np.float64))
    order = np.argsort(-scores, axis=-1, kind="stable")
    chosen = order[..., :K]
    ranked = np.take_along_axis(scores, order, -1)
    gap = float((ranked[..., K - 1] - ranked[..., K]).min())
    gates = np.take_along_axis(probs, chosen, -1)
    if renormalize:
        gates /= gates.sum(-1, keepdims=True)
    kept = np.zeros(chosen.shape, bool)
    slots = np.full(chosen.shape, -1)
    y = np.zeros_like(x)
    for g in range(G):
        filled = np.zeros(E, int)
        for j in range(K):  # every first choice before any second choice
            for s in range(S):  # in token order
                e = chosen[g, s, j]
                if filled[e] < capacity:
                    kept[g, s, j], slots[g, s, j] = True, filled[e]
                    filled[e] += 1
                    hidden = gelu(x[g, s] @ p["wi"][e] + p["bi"][e])
                    y[g, s] += gates[g, s, j] * (hidden @ p["wo"][e] + p["bo"][e])
    counts = np.stack([np.bincount(chosen[g].ravel(), minlength=E) for g in range(G)])  # (G, E)
    aux = np.mean([E * np.sum(counts[g] / (S * K) * probs[g].mean(0)) for g in range(G)])
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return dict(y=y, chosen=chosen, kept=kept, slots=slots, aux=aux, z=np.mean(lse ** 2), load=counts.sum(0),
                gap=gap)


def layer(capacity_factor=0.5, balance="aux", **kwargs):
    return moe.MoE(E, moe.Routing(K, capacity_factor=capacity_factor, balance=balance, **kwargs), mlp_ratio=RATIO)


@pytest.fixture(scope="module")
def inputs():
    x = jax.random.normal(jax.random.key(0), (G, S, D), jnp.float32)
    variables = layer(balance="bias").init(jax.random.key(1), x)
    return x, variables


def run(module, variables, x):
    """``(output, {collection: ...})`` of a training pass, the sown collections taken apart."""
    y, updated = module.apply(variables, x, train=True, mutable=MUTABLE)
    state, losses, records = sown.take(updated)
    return np.asarray(y), state, losses, records


def test_capacity_formula():
    assert moe.capacity(S, E, K, 0.5) == 4 == math.ceil(0.5 * S * K / E)
    assert moe.capacity(S, E, K, 1.25) == 10
    assert moe.capacity(S, E, K, 0) == S  # dropless: every token fits its expert
    assert moe.capacity(S, E, K, 100.0) == S  # never more slots than tokens


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 0.0], ids=["capacity", "even", "dropless"])
def test_output_and_drops_equal_the_reference(inputs, capacity_factor):
    x, variables = inputs
    y, _, _, records = run(layer(capacity_factor), variables, x)
    want = reference(variables["params"], x, moe.capacity(S, E, K, capacity_factor))
    assert want["gap"] > 1e-4  # no near-tie that float32 rounding could turn over
    assert_sums_close(y, want["y"], terms=RATIO * D, depth=3)
    dropped = 1 - want["kept"].mean()
    assert float(records["dropped"]) == pytest.approx(dropped, abs=1e-7)
    assert (dropped > 0.3) if capacity_factor == 0.5 else (dropped == 0 if capacity_factor == 0 else True)
    assert float(records["load_max"]) == pytest.approx(want["load"].max() / want["load"].mean(), rel=1e-6)


def test_slots_equal_the_reference(inputs):
    """Which assignments are kept and in which slot: exactly the reference's priority."""
    x, variables = inputs
    capacity = moe.capacity(S, E, K, 0.5)
    want = reference(variables["params"], x, capacity)
    slot, kept = moe.assign_slots(jnp.asarray(want["chosen"], jnp.int32), E, capacity)
    np.testing.assert_array_equal(np.asarray(kept), want["kept"])
    np.testing.assert_array_equal(np.where(want["kept"], np.asarray(slot), -1), want["slots"])


def test_aux_and_z_losses(inputs):
    x, variables = inputs
    _, _, losses, records = run(layer(aux_weight=0.01, z_weight=0.001), variables, x)
    want = reference(variables["params"], x, 4)
    assert_sums_close(records["aux_loss"], want["aux"], terms=S * E, depth=2)
    assert_sums_close(records["z_loss"], want["z"], terms=G * S, depth=2)
    assert_sums_close(losses, 0.01 * want["aux"] + 0.001 * want["z"], terms=G * S, depth=3)
    _, _, none, _ = run(layer(aux_weight=0.0, z_weight=0.0), variables, x)
    assert none is None  # nothing added to the loss when both weights are 0


def test_bias_changes_selection_not_gates(inputs):
    """A bias on expert 3 puts it in every token's top-2; the gates stay the renormalised probabilities; the bias
    then moves by rate · sign(mean load − load)."""
    x, variables = inputs
    bias = np.array([0.0, 0.0, 0.0, 0.5], np.float32)
    biased = {**variables, moe.BALANCE: {"bias": jnp.asarray(bias)}}
    module = layer(1.0, balance="bias", bias_rate=0.01)
    y, state, _, _ = run(module, biased, x)
    want = reference(variables["params"], x, moe.capacity(S, E, K, 1.0), bias=bias)
    plain = reference(variables["params"], x, moe.capacity(S, E, K, 1.0))
    assert (want["chosen"] == 3).any(-1).all() and not (plain["chosen"] == 3).any(-1).all()
    assert_sums_close(y, want["y"], terms=RATIO * D, depth=3)
    moved = bias + 0.01 * np.sign(want["load"].mean() - want["load"])
    np.testing.assert_allclose(np.asarray(state[moe.BALANCE]["bias"]), moved, rtol=0, atol=1e-7)
    assert moved[3] < bias[3]  # the overloaded expert's bias falls
    evaluated = module.apply(biased, x)  # evaluation routes with the bias but moves nothing
    np.testing.assert_array_equal(np.asarray(evaluated), y)


def test_router_gradient_equals_central_differences(inputs):
    """d/d(router kernel) of ``Σ y·w + aux_weight·aux + z_weight·z``: nonzero, and the reference's central
    differences (float64, a step far below the selection's margin)."""
    x, variables = inputs
    weights = np.random.default_rng(2).normal(size=(G, S, D))
    module = layer(0.5, aux_weight=0.1, z_weight=0.01)

    def loss(params):
        y, updated = module.apply({"params": params}, x, train=True, mutable=MUTABLE)
        return jnp.sum(y * weights) + sown.take(updated)[1]

    grad = np.asarray(jax.grad(loss)(variables["params"])["router"]["kernel"])
    assert np.abs(grad).max() > 1e-3

    def ref(kernel):
        params = {**variables["params"], "router": {"kernel": kernel}}
        r = reference(params, x, 4)
        return np.sum(r["y"] * weights) + 0.1 * r["aux"] + 0.01 * r["z"]

    kernel, h = np.asarray(variables["params"]["router"]["kernel"], np.float64), 1e-6
    numeric = np.zeros_like(kernel)
    for i in np.ndindex(kernel.shape):
        step = np.zeros_like(kernel)
        step[i] = h
        numeric[i] = (ref(kernel + step) - ref(kernel - step)) / (2 * h)
    assert_sums_close(grad, numeric, terms=G * S * K * RATIO * D, depth=4)


# ------------------------------------------------------------------ the MoE LM on 8 devices


STEPS, BATCH, SEQ, VOCAB = 8, 16, 16, 32
SETTINGS = dict(experts=4, top_k=2, capacity_factor=1.0, aux_weight=0.01, z_weight=0.001, balance="bias",
                bias_rate=0.01)


@pytest.fixture(scope="module")
def runs():
    """STEPS SGD steps of a 2-block MoE LM (drops at capacity 1.0, bias balancing) on one device, and on 8 under
    each driver: ``{name: (params, model_state, [metrics per step])}``, and ``moved``: the largest change of a
    parameter over the run."""
    model = build_model("transformer", num_layers=2, d_model=32, num_heads=4, mlp_ratio=2, max_len=SEQ,
                        num_classes=VOCAB, moe=SETTINGS)
    tx = optax.sgd(0.5)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(STEPS, BATCH, SEQ + 1))
    example = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    out = {}
    for name, devices, driver in (("one", 1, "shard_map"), ("shard_map", 8, "shard_map"), ("jit", 8, "jit")):
        mesh = dtx.make_mesh([("data", devices)], devices=jax.devices()[:devices])
        state = dtx.init_train_state(model, tx, example, seed=0, mesh=mesh)
        initial = jax.device_get(state.params)
        step = dtx.make_train_step(model, tx, mesh, dtx.StepSpec(driver=driver, task=tasks.next_token()))
        history = []
        for t in range(STEPS):
            batch = {"inputs": jnp.asarray(tokens[t, :, :-1], jnp.int32), "labels": jnp.asarray(tokens[t, :, 1:],
                                                                                                   jnp.int32)}
            state, metrics = step(state, jax.device_put(batch, mesh_lib.batch_sharding(mesh)))
            history.append(jax.device_get(metrics))  # waits for each step (XLA:CPU's collectives need it)
        out[name] = jax.device_get((state.params, state.model_state)) + (history,)
    # The rounding is the updates': their scale is the training's largest change of a parameter.
    out["moved"] = magnitude(jax.tree.map(np.subtract, out["one"][0], initial))
    return out


@pytest.mark.parametrize("driver", ["shard_map", "jit"])
def test_moe_lm_on_8_devices_trains_as_one(runs, driver):
    params, model_state, history = runs[driver]
    want_params, want_state, want_history = runs["one"]
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want_params)):
        assert_sums_close(got, want, terms=BATCH * SEQ, depth=2 * STEPS, err_msg=jax.tree_util.keystr(path),
                          scale=runs["moved"])
    for got, want in zip(jax.tree.leaves(model_state), jax.tree.leaves(want_state)):  # the biases: ± rate steps
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for got, want in zip(history, want_history):
        for key in ("Block_0.moe.dropped", "Block_1.moe.load_max"):
            assert float(got[key]) == pytest.approx(float(want[key]), abs=1e-6), key
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)


def test_moe_lm_records_and_balance(runs):
    """Every MoE layer's four records in every step; drops happen at capacity 1.0; the bias moved."""
    _, model_state, history = runs["one"]
    for metrics in history:
        for block in ("Block_0", "Block_1"):
            assert {f"{block}.moe.{k}" for k in ("dropped", "load_max", "aux_loss", "z_loss")} <= set(metrics)
    assert max(float(m["Block_0.moe.dropped"]) for m in history) > 0
    biases = np.concatenate([np.ravel(b) for b in jax.tree.leaves(model_state[moe.BALANCE])])
    assert np.all(np.abs(biases) > 0) and np.all(np.abs(biases) <= STEPS * 0.01 + 1e-6)


# ------------------------------------------------------------------ the config


def test_transformer_blocks_and_dense_default():
    """``every=2``: only the second block's MLP is an MoE; ``experts=0`` (the default) builds the dense model."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    dense = build_model("transformer", num_layers=2, d_model=16, num_heads=2, max_len=8)
    mixed = build_model("transformer", num_layers=2, d_model=16, num_heads=2, max_len=8,
                        moe=dict(experts=4, every=2))
    dense_params = dense.init(jax.random.key(0), tokens)["params"]
    mixed_params = mixed.init(jax.random.key(0), tokens)["params"]
    assert "moe" in mixed_params["Block_1"] and "moe" not in mixed_params["Block_0"]
    assert "moe" not in dense_params["Block_0"] and "moe" not in dense_params["Block_1"]
    assert dense.moe == moe.MoESettings()


REFUSED = [
    ({"model.moe.experts": 4, "model.moe.top_k": 5}, r"model\.moe\.top_k=5.*--config\.model\.moe\.top_k=4"),
    ({"model.moe.experts": 4, "model.moe.top_k": 0}, r"model\.moe\.top_k=0"),
    ({"model.moe.experts": 8, "model.moe.capacity_factor": 0.4}, r"model\.moe\.capacity_factor=0\.4.*1/top_k"),
    ({"model.moe.experts": 8, "model.moe.every": 0}, r"model\.moe\.every=0"),
    ({"model.moe.experts": 8, "model.moe.balance": "sinkhorn"}, r"model\.moe\.balance='sinkhorn'"),
    ({"model.moe.top_k": 1}, r"model\.moe\.top_k=1 is set but model\.moe\.experts=0"),
    ({"model.moe.experts": 8, "parallel.name": "tensor", "driver": "jit", "mesh": (("data", 4), ("model", 2))},
     r"model\.moe\.experts=8 with parallel\.name='tensor'"),
    ({"model.moe.experts": 8, "mesh": (("data", 4), ("model", 2))}, r"model\.moe\.experts=8 on a mesh with the "
                                                                    r"'model' axis"),
]


@pytest.mark.parametrize("values, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_config_refusals_name_the_key(values, message):
    config = config_lib.override(config_lib.base_config(), **{"model.name": "transformer",
                                                              "dataset.name": "python_docs",
                                                              "task.name": "next_token"})
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(config_lib.override(config, **values))


def test_unknown_moe_key_is_refused():
    with pytest.raises(Exception, match="moe"):
        config_lib.override(config_lib.base_config(), **{"model.name": "transformer", "model.moe.expert": 8})


def test_experiment_records_reach_the_run(tmp_path):
    """experiments/moe_lm.py for 2 steps: the records of both layers are in metrics.jsonl, and dtx plot draws
    one of them."""
    from dtx.run.trainer import train
    from dtx.tools.plots import plot_main

    path = os.path.join(os.path.dirname(__file__), "..", "experiments", "moe_lm.py")
    config = config_lib.override(config_lib.load(path), num_steps=2, log_every=1, eval_batch_size=64,
                                 progress=False, global_batch_size=16, **{"optimizer.warmup_steps": 1})
    train(config, tmp_path)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    step = [r for r in records if r.get("step") == 2 and "loss" in r][0]
    assert {f"Block_{i}.moe.{k}" for i in (0, 1) for k in ("dropped", "load_max", "aux_loss", "z_loss")} <= set(step)
    assert plot_main([str(tmp_path), "--out", str(tmp_path), "--metrics", "Block_1.moe.load_max", "--x", "step"]) == 0
    assert (tmp_path / "Block_1.moe.load_max.png").exists()
