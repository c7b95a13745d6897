"""Expert parallelism (dtx.parallel.expert) on 8 devices: ``data 2 × expert 4``, ``expert 8`` and ``fsdp 2 × expert 4``.

Values: an MoE layer of 8 experts routed over 8 sequences, with a small capacity (a third of the assignments
dropped), gives under the expert layout's all-to-alls the output of the float64 numpy reference of
tests/test_moe.py (so exactly its dropped tokens: a token routed otherwise is off by a gate times an MLP output),
its ``dropped`` record, and one device's gradients of every parameter, the router's included. Training: 20
SGD-momentum steps of a tiny MoE LM, dropless, on ``data 2 × expert 4``, ``expert 8`` and ``fsdp 2 × expert 4``
(ZeRO-3 over fsdp) give one device's parameters. Tolerances from the computation (tests/numerics.py): a gradient
sums ``B·S`` token terms through the model's layers, at the scale of the parameters' change. What runs, read from
the compiled step: four all-to-alls over ``expert`` per MoE layer (dispatch and combine, and their transposes), the
bytes of :func:`dtx.parallel.expert.costs.all_to_all_bytes`; the expert weights and their optimizer state split
``1/X`` over the axis, everything else whole (or split over fsdp). Refusals name the key before anything compiles.

Hand-breaks (each fails the tests named): the axis declared ``batch=False`` (the batch not carried over
``expert``: every device of an expert group would hold the same sequences and the region's transpose would sum
their copies of the gradient, X times over) -> shard_map refuses the region's outputs (their replication over
``expert`` cannot be inferred), so every layer, training, split and bytes test errors; the combine all-to-all
sending each device's experts' outputs back reversed (``outputs[::-1]``) ->
``test_layer_equals_the_reference_and_one_device[data2xexpert4-capacity]``,
``test_training_equals_one_device[data2xexpert4]`` and ``[fsdp2xexpert4]`` (on ``expert 8`` a device holds one
expert, which the reversal leaves in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import parallel
from dtx.comm import hlo
from dtx.data import tasks
from dtx.models import build_model, moe, sown
from dtx.parallel.expert import EXPERT_AXIS, costs
from dtx.parallel.expert import layout as expert_layout
from dtx.step import StepSpec, make_train_step
from dtx.step.state import abstract_train_state, init_train_state
from numerics import assert_sums_close, magnitude, sum_atol
from test_moe import reference

G, S, D, E, K, RATIO = 8, 16, 8, 8, 2, 2  # groups, tokens per group, width, experts, top-k, MLP ratio
MESHES = {"data2xexpert4": [("data", 2), (EXPERT_AXIS, 4)], "expert8": [(EXPERT_AXIS, 8)]}
MUTABLE = [moe.BALANCE, *sown.COLLECTIONS]


def _layer(capacity_factor):
    return moe.MoE(E, moe.Routing(K, capacity_factor=capacity_factor, aux_weight=0.1, z_weight=0.01),
                   mlp_ratio=RATIO)


def _layer_run(module, mesh, params, x, weights):
    """The layer's output, ``dropped`` record and gradients of ``Σ y·w`` plus its losses, jitted on ``mesh``
    (under the expert layout's activation context where the mesh has the axis: its weights split over it)."""
    context = expert_layout.ExpertSplit(mesh) if EXPERT_AXIS in mesh.axis_names else None

    def loss(params, x):
        if context is None:
            y, updated = module.apply({"params": params}, x, train=True, mutable=MUTABLE)
        else:
            with context():
                y, updated = module.apply({"params": params}, x, train=True, mutable=MUTABLE)
        _, losses, records = sown.take(updated)
        return jnp.sum(y * weights) + losses, (y, records["dropped"])

    specs = {**{name: P() for name in params}, **({name: P(EXPERT_AXIS) for name in moe.EXPERT_PARAMS}
                                                  if context is not None else {})}
    placed = {name: jax.device_put(value, NamedSharding(mesh, specs[name])) for name, value in params.items()}
    batch = NamedSharding(mesh, P(mesh_lib.batch_axes(mesh)))
    grads, (y, dropped) = jax.jit(jax.grad(loss, has_aux=True))(placed, jax.device_put(x, batch))
    return np.asarray(y), float(dropped), jax.device_get(grads)


@pytest.fixture(scope="module")
def layer_runs():
    """The layer at a small capacity (0.5: a third dropped), on one device and on each mesh (dropless: the training
    runs)."""
    x = jax.random.normal(jax.random.key(0), (G, S, D), jnp.float32)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(G, S, D)), jnp.float32)
    params = _layer(0.5).init(jax.random.key(1), x)["params"]
    one = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    out = {}
    for factor in (0.5,):
        for name, spec in {"one": None, **MESHES}.items():
            mesh = one if spec is None else mesh_lib.make_mesh(spec)
            out[factor, name] = _layer_run(_layer(factor), mesh, params, x, weights)
    return x, params, out


@pytest.mark.parametrize("factor", [0.5], ids=["capacity"])
@pytest.mark.parametrize("name", list(MESHES))
def test_layer_equals_the_reference_and_one_device(layer_runs, name, factor):
    """The output is the float64 reference's (its drops exactly), the ``dropped`` record its fraction, and every
    gradient one device's, the router's and the split experts' included."""
    x, params, out = layer_runs
    y, dropped, grads = out[factor, name]
    want = reference(params, x, moe.capacity(S, E, K, factor), K=K)
    assert want["gap"] > 1e-4  # no near-tie that float32 rounding could turn over
    assert_sums_close(y, want["y"], terms=RATIO * D, depth=3)
    assert dropped == pytest.approx(1 - want["kept"].mean(), abs=1e-7)
    assert dropped > 0.3
    _, _, one = out[factor, "one"]
    assert magnitude(one["router"]["kernel"]) > 1e-3
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want_grad = one
        for key in path:
            want_grad = want_grad[key.key]
        assert_sums_close(got, want_grad, terms=G * S * K, depth=4, err_msg=jax.tree_util.keystr(path),
                          scale=magnitude(one))


# ------------------------------------------------------------------ training: 20 steps against one device

LM = dict(num_layers=1, d_model=32, num_heads=4, mlp_ratio=2, max_len=16, num_classes=64,
          moe=dict(experts=E, top_k=K, capacity_factor=0.0, aux_weight=0.01, z_weight=0.001))
BATCH, STEPS = 16, 20


def _train(spec, stage=3):
    """STEPS SGD-momentum steps of the tiny MoE LM under the jit driver on mesh ``spec`` (the data preset composed
    with its axes): ``(initial params, final params, compiled step, final state as placed)``."""
    model, tx = build_model("transformer", **LM), optax.sgd(0.1, momentum=0.9)
    mesh = mesh_lib.make_mesh(spec, devices=jax.devices()[:int(np.prod([size for _, size in spec]))])
    tokens = np.random.default_rng(0).integers(0, LM["num_classes"], size=(BATCH, LM["max_len"] + 1))
    batch = jax.device_put({"inputs": tokens[:, :-1].astype(np.int32), "labels": tokens[:, 1:].astype(np.int32)},
                           mesh_lib.batch_sharding(mesh))
    example = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32)
    layout = parallel.compose(parallel.get_layout("data"), [name for name, _ in spec], stage)
    placement = layout.place(abstract_train_state(model, tx, example), mesh)
    state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
    start = jax.device_get(state.params)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token(),
                                                     donate=False))
    compiled = step.lower(state, batch).compile()
    for _ in range(STEPS):
        state, metrics = compiled(state, batch)
        float(metrics["loss"])  # waits on the step
    return start, jax.device_get(state.params), compiled, state


@pytest.fixture(scope="module")
def trained():
    return {"one": _train([("data", 1)]), **{name: _train(spec) for name, spec in MESHES.items()},
            "fsdp2xexpert4": _train([("fsdp", 2), (EXPERT_AXIS, 4)])}


@pytest.mark.parametrize("name", [*MESHES, "fsdp2xexpert4"])
def test_training_equals_one_device(trained, name):
    """20 dropless steps on the layout give one device's parameters (measured on data 2 x expert 4: 1.2e-7 apart
    after 5 steps, against a tolerance of the order of 1e-6)."""
    start, want = trained["one"][:2]
    got = trained[name][1]
    change = magnitude(jax.tree.map(np.subtract, want, start))
    atol = sum_atol(None, terms=BATCH * LM["max_len"], depth=2 * LM["num_layers"] + 2, scale=change)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))


def _experts_of(tree):
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
            if getattr(path[-1], "key", None) in moe.EXPERT_PARAMS}


@pytest.mark.parametrize("name", [*MESHES, "fsdp2xexpert4"])
def test_experts_and_their_optimizer_state_are_split(trained, name):
    """On each device the expert weights and their momentum are ``1/X`` of the experts (split over fsdp too at
    ZeRO-3); every other parameter is whole on the expert axis."""
    state = trained[name][3]
    size = dict(MESHES.get(name, [(EXPERT_AXIS, 4)]))[EXPERT_AXIS]
    params, momenta = _experts_of(state.params), _experts_of(state.opt_state)
    assert len(params) == 4 * LM["num_layers"] and len(momenta) == len(params)
    for leaf in (*params.values(), *momenta.values()):
        assert leaf.sharding.spec[0] == EXPERT_AXIS
        assert leaf.addressable_shards[0].data.shape[0] == E // size
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        if getattr(path[-1], "key", None) not in moe.EXPERT_PARAMS:
            assert EXPERT_AXIS not in jax.tree.leaves(tuple(leaf.sharding.spec)), jax.tree_util.keystr(path)
    if name.startswith("fsdp"):
        assert any("fsdp" in jax.tree.leaves(tuple(leaf.sharding.spec)) for leaf in params.values())


@pytest.mark.parametrize("name", list(MESHES))
def test_all_to_all_bytes_are_the_formula(trained, name):
    """The compiled step's all-to-alls: four per MoE layer, over the X devices of ``expert``, each sending
    ``(X − 1)/X`` of a device's buckets ``(E, g, C, d)`` (g its sequences, C = S dropless), equal in bytes to
    costs.layer_bytes; nothing else moves the tokens."""
    size = dict(MESHES[name])[EXPERT_AXIS]
    found = [c for c in hlo.collectives(trained[name][2].as_text()) if c.kind == "all-to-all"]
    assert len(found) == 4 * LM["num_layers"] and all(c.group_size == size for c in found)
    sent = sum(c.bytes_sent * c.trips for c in found)
    per_layer = costs.layer_bytes(E, K, 0.0, BATCH // 8, LM["max_len"], LM["d_model"], size)
    assert sent == LM["num_layers"] * per_layer == LM["num_layers"] * 4 * (size - 1) / size * (
        E * (BATCH // 8) * LM["max_len"] * LM["d_model"] * 4)


# ------------------------------------------------------------------ refusals, before anything compiles


def _config(**values):
    base = config_lib.override(config_lib.base_config(), **{"model.name": "transformer",
                                                           "dataset.name": "python_docs", "task.name": "next_token",
                                                           "driver": "jit"})
    return config_lib.override(base, **values)


REFUSED = [
    ({"model.moe.experts": 6, "mesh": (("data", 2), (EXPERT_AXIS, 4))},
     r"model\.moe\.experts=6 does not split over the 4 devices of the 'expert' mesh axis"),
    ({"mesh": (("data", 2), (EXPERT_AXIS, 4))}, r"model\.moe\.experts=0 keeps every MLP dense"),
    ({"model.name": "mlp", "dataset.name": "digits", "task.name": "classification",
      "mesh": (("data", 2), (EXPERT_AXIS, 4))}, r"model\.name='mlp' has no MoE layers"),
    ({"model.moe.experts": 8, "mesh": (("data", 2), (EXPERT_AXIS, 2), ("model", 2))},
     r"composes with data and fsdp axes, not with 'model' in --config\.mesh \(the experts' own MLPs"),
    ({"model.moe.experts": 8, "mesh": ((EXPERT_AXIS, 4), ("stage", 2))},
     r"not with 'stage' in --config\.mesh \(pipeline stages"),
    ({"model.moe.experts": 8, "parallel.name": "zero1", "mesh": (("data", 2), (EXPERT_AXIS, 4))},
     r"parallel\.name='zero1' splits the state over every batch axis.*add an 'fsdp' axis"),
]


@pytest.mark.parametrize("values, message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_refusals_name_the_key(values, message):
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate(_config(**values))


def test_a_model_without_moe_layers_is_refused_when_placed():
    """A user's module (no config block to read) is refused when its state is placed, before compiling."""
    model, tx = build_model("mlp", features=(8,), num_classes=4), optax.sgd(0.1)
    abstract = abstract_train_state(model, tx, jax.ShapeDtypeStruct((8, 4), jnp.float32))
    mesh = mesh_lib.make_mesh([("data", 2), (EXPERT_AXIS, 4)])
    layout = parallel.compose(parallel.get_layout("data"), ["data", EXPERT_AXIS])
    with pytest.raises(parallel.PartitionError if hasattr(parallel, "PartitionError") else ValueError,
                       match="no MoE layer"):
        layout.place(abstract, mesh)


def test_the_composition():
    """``expert`` makes the data preset the expert layout (jit driver), with an fsdp axis at its ZeRO stage."""
    compose = parallel.compose
    assert compose(parallel.get_layout("data"), ["data", EXPERT_AXIS]).name == "expert"
    assert compose(parallel.get_layout("data"), ["fsdp", EXPERT_AXIS], 1).zero_stage == 1
    assert compose(parallel.get_layout("zero2"), ["fsdp", EXPERT_AXIS]).zero_stage == 2
    assert parallel.get_layout("expert").drivers == ("jit",)
    axis = mesh_lib.AXES[EXPERT_AXIS]
    assert axis.batch and axis.replicas and not axis.state


def _memory_row(width, experts, size, data, seq=32, batch=8):
    """``(compiled peak, modelled)`` bytes per device of an Adam step of a 2-block MoE LM (top-2, capacity 1.25) on
    ``data × expert size``: the peak read from the compiled program (lowered from shapes; nothing runs), the model
    the memory check's (dtx.run.memory_check): the data-parallel estimate adjusted by the layout's ``memory``."""
    from dtx.perf import flops as flops_lib
    from dtx.perf import memory as memory_lib

    model = build_model("transformer", num_layers=2, d_model=width, num_heads=4, mlp_ratio=4, max_len=seq,
                        num_classes=256, moe=dict(experts=experts, top_k=2, capacity_factor=1.25))
    tx = optax.adam(1e-3)
    mesh = mesh_lib.make_mesh([("data", data), (EXPERT_AXIS, size)], devices=jax.devices()[:data * size])
    example = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    abstract = abstract_train_state(model, tx, example)
    placement = parallel.get_layout("expert").place(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token()))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
    peak = memory_lib.compiled_peak(flops_lib.compile_to_read(step.lower(state, {"inputs": tokens, "labels": tokens})))
    shape, sharing, adjust = placement.activations.memory(model, example, jnp.float32)
    found = memory_lib.estimate_model(model, shape, "data", dtype=jnp.int32, nodes=mesh.size // sharing,
                                      global_batch=batch, optimizer="adam")
    return peak, adjust(batch // mesh.size, found).total, found.total


# Chosen before they were compiled; the rule (1 - 1/X of the experts' share of the state off the data-parallel
# estimate) has no constant read from any row. The first row read, width 128, E 8 on data 2 x expert 4: 0.939.
MEMORY_HELD_OUT = [(96, 16, 8, 1), (192, 4, 2, 4)]


@pytest.mark.parametrize("width, experts, size, data", MEMORY_HELD_OUT)
def test_the_memory_model_puts_a_share_of_the_experts_on_each_device(width, experts, size, data):
    """The memory check's estimate of an expert-parallel Adam step is within 15 % of the compiled peak (measured
    0.978 at E 16 over 8, 0.905 at E 4 over 2), where the data-parallel estimate of the same model (every expert
    whole) is 1.5 to 5 times over it."""
    peak, modelled, whole = _memory_row(width, experts, size, data)
    assert abs(modelled / peak - 1) <= 0.15, (modelled / peak, peak)
    assert whole / peak > 1.4


def _step_flops(experts: int, layout: str, axes, width=64, seq=32, batch=16):
    """FLOPs per device of an SGD step of a 2-block LM (MoE top-2 at capacity 1.25 with ``experts``, else dense),
    read from the compiled program (lowered from shapes; nothing runs)."""
    from dtx.perf import flops as flops_lib

    settings = dict(num_layers=2, d_model=width, num_heads=4, mlp_ratio=4, max_len=seq, num_classes=256)
    model = build_model("transformer", **settings, **({"moe": dict(experts=experts, top_k=2, capacity_factor=1.25)}
                                                       if experts else {}))
    tx = optax.sgd(0.1)
    mesh = mesh_lib.make_mesh(axes)
    abstract = abstract_train_state(model, tx, jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    placement = parallel.get_layout(layout).place(abstract, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, placement.state)
    step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement, task=tasks.next_token()))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
    return flops_lib.compiled_flops(flops_lib.compile_to_read(step.lower(state, {"inputs": tokens, "labels": tokens})))


def test_a_devices_flops_are_its_buckets_and_the_router():
    """Per device, the expert-parallel step (data 2 x expert 4, 8 experts) computes the dense model's work without
    its MLPs, plus the experts on their capacity buckets (E·g·C slots of two d x 4d products: k/E of the tokens
    times the capacity factor) and the router (d x E a token), forward and backward (3 x the forward's products):
    equal within 5 % (measured 1.030: the routing's softmax and top-k, the buckets' gathers and scatters are not
    counted). And under plain data parallelism (jit, 8 devices) a device computes its own sequences' buckets only,
    as many FLOPs as under the expert layout within 5 % (measured 1.013; before dispatch and combine were mapped
    over the groups, XLA's partitioner computed every sequence's buckets on every device: 6.1 times)."""
    from dtx.models import moe as moe_lib

    width, seq, batch, experts = 64, 32, 16, 8
    groups, hidden = batch // 8, 4 * width
    slots = moe_lib.capacity(seq, experts, 2, 1.25)
    mlp = 3 * 2 * groups * seq * 2 * width * hidden * 2  # the dense twin's two MLPs, forward and backward
    buckets = 3 * 2 * experts * groups * slots * 2 * width * hidden * 2
    router = 3 * 2 * groups * seq * width * experts * 2
    split = _step_flops(experts, "expert", [("data", 2), (EXPERT_AXIS, 4)])
    sparse = split - _step_flops(0, "data", [("data", 8)])
    assert abs((sparse + mlp) / (buckets + router) - 1) < 0.05, (sparse + mlp) / (buckets + router)
    replicated = _step_flops(experts, "data", [("data", 8)])
    assert abs(replicated / split - 1) < 0.05, replicated / split
