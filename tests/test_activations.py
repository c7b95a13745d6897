"""dtx.parallel.activations: where a partitioned model's activations live and travel, read off the compiled program.

Equal numbers cannot see redundant compute or hidden communication: these tests read the compiled
program. A conv-dominated VGG-A twin (widths divisible by 8), global batch 64 on 8 devices. And a right
program can compute wrong numbers: the last test holds every split layer's output, the logits, the loss
and the gradients of a model-parallel LeNet to one device's.
"""

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from dtx.perf import flops
from dtx.comm import hlo
from dtx import models
from dtx import mesh as mesh_lib

from dtx.data import TrainLoader
from dtx.parallel import get_layout
from dtx.step.state import abstract_train_state, init_train_state
from dtx.step import StepSpec, make_train_step
from numerics import assert_sums_close, magnitude

WORK_MESHES = {"data8": ("data", [("data", 8)]), "hybrid4x2": ("hybrid", [("data", 4), ("model", 2)]),
               "hybrid2x4": ("hybrid", [("data", 2), ("model", 4)]), "hybrid1x8": ("hybrid", [("data", 1), ("model", 8)]),
               "model2x4": ("model", [("data", 2), ("model", 4)]), "fsdp4x2": ("fsdp", [("data", 4), ("model", 2)])}


@pytest.fixture(scope="module")
def vgg_twin():
    return models.build_model("vgg_a", width=0.125, fc_features=64, num_classes=16)


@pytest.fixture(scope="module")
def compiled_steps(vgg_twin):
    """The jit-driver train step of each layout, compiled once (nothing runs)."""
    example = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32)
    tx = optax.sgd(0.1, momentum=0.9)
    out = {}
    for key, (name, spec) in WORK_MESHES.items():
        mesh = mesh_lib.make_mesh(spec)
        abstract = abstract_train_state(vgg_twin, tx, example)
        placement = get_layout(name).place(abstract, mesh)
        shardings = placement.state
        step = make_train_step(vgg_twin, tx, mesh, StepSpec(driver="jit", placement=placement))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        split = mesh_lib.batch_sharding(mesh)
        batch = {"inputs": jax.ShapeDtypeStruct(example.shape, jnp.float32, sharding=split),
                 "labels": jax.ShapeDtypeStruct((64,), jnp.int32, sharding=split)}
        out[key] = (mesh, shardings, placement.activations, flops.compile_to_read(step.lower(state, batch)))
    return out


@pytest.mark.parametrize("key", ["hybrid4x2", "hybrid2x4", "hybrid1x8", "model2x4", "fsdp4x2"])
def test_every_device_does_one_eighth_of_the_work(compiled_steps, key):
    """Das et al. §3.3: convolutions see B/N examples on each of the N devices, whatever the group size.
    (Before the fix, hybrid computed the convolutions G times over: 1.5x, 2.6x, 4.8x data x8's FLOPs.)"""
    data = flops.compiled_flops(compiled_steps["data8"][3])
    other = flops.compiled_flops(compiled_steps[key][3])
    assert abs(other / data - 1) < 0.10, (key, other / data)


def test_parameters_and_activations_live_where_the_plan_says(vgg_twin, compiled_steps):
    mesh, shardings, layout, _ = compiled_steps["hybrid2x4"]
    assert shardings.params["conv3_1"]["kernel"].spec == PartitionSpec()
    assert shardings.params["fc6"]["kernel"].spec == PartitionSpec(None, "model")
    assert shardings.params["fc6"]["bias"].spec == PartitionSpec("model")
    seen = {}

    def spy(next_fun, args, kwargs, context):  # the sharding XLA gave each layer's output
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, (nn.Dense, nn.Conv)) and context.module.path:
            name = "/".join(context.module.path)
            jax.debug.inspect_array_sharding(out, callback=lambda s, name=name: seen.setdefault(name, s.spec))
        return out

    def loss(params, x):
        with nn.intercept_methods(spy), layout():
            return vgg_twin.apply({"params": params}, x, train=False).sum()

    abstract = jax.eval_shape(vgg_twin.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    x = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.float32, sharding=mesh_lib.batch_sharding(mesh))
    flops.compile_to_read(jax.jit(jax.grad(loss), in_shardings=(shardings.params, x.sharding)).lower(abstract, x))
    for name in ("conv1", "conv3_2", "conv5_2"):  # data parallel: the batch over all 8 devices
        assert seen[name] == PartitionSpec(("data", "model")), name
    for name in ("fc6", "fc7", "fc8"):  # model parallel: the group's batch, 1/G of the features
        assert seen[name] == PartitionSpec("data", "model"), name


def test_gradients_and_activations_travel_where_the_plan_says(vgg_twin, compiled_steps):
    """Conv gradients are all-reduced over all 8 devices, the fc slices over the N/G = 2 groups, and
    activations move only inside a group of G = 4 (all-gather forward, reduce-scatter backward)."""
    *_, compiled = compiled_steps["hybrid2x4"]
    found = hlo.collectives(compiled)
    sizes = {(c.kind, c.group_size) for c in found if c.bytes_sent}
    assert ("all-gather", 4) in sizes and ("reduce-scatter", 4) in sizes
    # Beyond these, only the loss's softmax over the group-split logits talks inside the group (< 1 KiB).
    assert all(c.operand_bytes < 1024 for c in found if c.kind == "all-reduce" and c.group_size not in (8, 2))
    grad_bytes = {g: sum(c.operand_bytes for c in found if c.kind == "all-reduce" and c.group_size == g)
                  for g in (8, 2)}
    abstract = jax.eval_shape(vgg_twin.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))["params"]
    layer_bytes = {name: sum(4 * leaf.size for leaf in jax.tree.leaves(layer)) for name, layer in abstract.items()}
    conv_bytes = sum(b for name, b in layer_bytes.items() if name.startswith("conv"))
    fc_bytes = sum(b for name, b in layer_bytes.items() if name.startswith("fc"))
    # Every conv parameter (kernel + bias, float32) is in an 8-device all-reduce, with the loss's scalars;
    # each device's quarter of every fc layer in a 2-device one, and nothing else is.
    assert conv_bytes <= grad_bytes[8] < conv_bytes + 64
    assert grad_bytes[2] == fc_bytes // 4
    # No device gathers the whole batch: data x8 has no all-gather at all.
    assert not any(c.kind == "all-gather" and c.bytes_sent for c in hlo.collectives(compiled_steps["data8"][3]))


# ----------------------------------------------------------------------------- values
# Equal numbers, layer by layer: the compiled-program checks above cannot see a split layer that computes the
# wrong values (its gathered rows reversed, its gathered feature halves swapped), nor can a comparison of the
# loss, logits or gradients alone: in LeNet under `model` two layers gather the batch (Conv_0 and Dense_0, whose
# inputs arrive batch-split) and two gather features (Conv_1 and Dense_1), so a reversal of the gathered rows
# in every layer undoes itself — per-example layers commute with a permutation of the examples, and batch norm's
# statistics and the loss's mean do not see one. Every split layer's own output is compared too.
# Tolerance: each device's slice of a layer contracts its whole (gathered) input, as one device does, but XLA may
# order the float32 sums differently, and XLA:CPU's code differs between CPUs: the tolerances of tests/numerics.py,
# from each value's reduction length and how many reductions precede it (a fixed atol=1e-6 failed on an AMD EPYC by
# 1.3e-6, on an element of -0.0076 among values of order 1).
LENET_ORDER = ("Conv_0", "Conv_1", "Dense_0", "Dense_1")  # the forward's chain of reductions


def _contraction(kernel) -> int:
    """The terms each output of a Dense (``(in, out)``) or Conv (``(kh, kw, in, out)``) kernel sums."""
    return int(np.prod(kernel.shape[:-1]))
SPLIT_MESHES = {"model4x2": [("data", 4), ("model", 2)], "model2x4": [("data", 2), ("model", 4)]}


def _keep_gradient():
    """An optimizer that applies nothing and keeps the step's gradient in its state (as the parameters are laid
    out): the gradient the train step computed, exactly, and a state the layout places like the parameters."""
    return optax.GradientTransformation(
        lambda params: {"grad": jax.tree.map(jnp.zeros_like, params)},
        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), {"grad": updates}))


@pytest.fixture(scope="module")
def split_lenet(digits):
    """LeNet on digits, every kernel's widths divisible by 2 and 4: ``run(layout, mesh spec)`` gives one jit-driver
    train step's loss and gradients and, from a jitted forward pass inside the placement's activation layout,
    the logits and every Dense/Conv layer's output, on a batch of 64."""
    model = models.build_model("lenet", conv_features=(4, 8), dense_features=(32,), num_classes=12)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    tx = _keep_gradient()

    def run(name, spec, devices=None):
        mesh = mesh_lib.make_mesh(spec, devices=devices)
        abstract = abstract_train_state(model, tx, example)
        placement = get_layout(name).place(abstract, mesh)
        state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
        batch = TrainLoader(digits.train, 64, mesh, seed=0).batch(0)
        layout = placement.activations or (lambda: contextlib.nullcontext())

        def forward(params, model_state, x):
            outputs = {}

            def spy(next_fun, args, kwargs, context):  # outside the layout: what each layer hands on
                out = next_fun(*args, **kwargs)
                if (isinstance(context.module, (nn.Dense, nn.Conv)) and context.module.path
                        and context.method_name == "__call__"):
                    outputs["/".join(context.module.path)] = out
                return out

            with nn.intercept_methods(spy), layout():
                logits, _ = model.apply({"params": params, **model_state}, x, train=True, mutable=["batch_stats"])
            return logits, outputs

        logits, outputs = jax.device_get(jax.jit(forward)(state.params, state.model_state, batch["inputs"]))
        params, host_batch = jax.device_get((state.params, batch))  # before the step donates them
        step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement))
        after, metrics = step(state, batch)
        return dict(placement=placement, logits=logits, outputs=outputs, loss=float(metrics["loss"]),
                    grads=jax.device_get(after.opt_state["grad"]), params=params, batch=host_batch)

    return run


@pytest.fixture(scope="module")
def one_device(split_lenet):
    return split_lenet("data", [("data", 1)], devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh_name", sorted(SPLIT_MESHES))
def test_split_convolutions_compute_what_one_device_computes(split_lenet, one_device, mesh_name):
    """`model` on (data 4, model 2) and (data 2, model 4): both convolutions (Conv_1's input arriving split by
    features) and both dense layers split by output features, run by the activation layout's shard_map. Every
    split layer's output, the logits, the train step's loss and every gradient equal one device's."""
    got = split_lenet("model", SPLIT_MESHES[mesh_name])
    kernels = got["placement"].activations.kernels
    assert sorted(kernels) == ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]
    assert kernels["Conv_1"] == PartitionSpec(None, None, None, "model")
    np.testing.assert_array_equal(got["params"]["Conv_0"]["kernel"], one_device["params"]["Conv_0"]["kernel"])
    np.testing.assert_array_equal(got["batch"]["labels"], one_device["batch"]["labels"])
    assert sorted(got["outputs"]) == sorted(one_device["outputs"]) == sorted(kernels)
    params, outputs = one_device["params"], one_device["outputs"]
    longest = max(_contraction(params[name]["kernel"]) for name in LENET_ORDER)
    for name, want in outputs.items():
        # a layer's output: its own contraction, after the layers below it
        assert_sums_close(got["outputs"][name], want, _contraction(params[name]["kernel"]),
                          depth=LENET_ORDER.index(name) + 1, err_msg=name)
        # Not symmetric data: reversing the examples, or the features, changes every layer's output by far more.
        assert np.abs(want - want[::-1]).max() > 0.1 and np.abs(want - want[..., ::-1]).max() > 0.1, name
    assert_sums_close(got["logits"], one_device["logits"], longest, depth=len(LENET_ORDER))
    # the loss: the softmax over the classes and the batch's mean, after the forward
    batch = len(one_device["logits"])
    assert_sums_close(got["loss"], one_device["loss"], batch * one_device["logits"].shape[-1],
                      depth=len(LENET_ORDER) + 1)
    widest = [int(np.prod(out.shape[:-1])) for out in outputs.values()]
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(got["grads"]), jax.tree.leaves(one_device["grads"])):
        # a kernel's gradient sums over the batch and its output's positions (batch norm's, over the largest map's),
        # after the forward and the backward
        positions = [int(np.prod(out.shape[:-1])) for name, out in outputs.items() if name == path[0].key]
        assert_sums_close(g, want, max(positions or widest), depth=2 * len(LENET_ORDER) + 1,
                          err_msg=jax.tree_util.keystr(path), scale=magnitude(one_device["grads"]))
    assert np.abs(one_device["grads"]["Conv_0"]["kernel"]).max() > 1e-3  # gradients that are not all ~0


def test_fsdp_gathers_parameters_and_keeps_activations_on_the_batch():
    """FSDP of a small transformer LM whose vocabulary (250) the 8 devices do not divide, so its embedding
    table is split along the features. Without the lookup pinned to the batch (``lookup_layout``) XLA
    carried that split into the residual stream: every block exchanged activations by all-to-all and the
    step sent 2.27× FSDP's bytes (the 7B-shape row of ``dtx simulate --verify`` 13×). With it the compiled
    step is FSDP's: each parameter
    all-gathered and its gradient reduced, at most ``3(n-1)/n`` of the parameters' bytes. The embedding
    alone is looked up where it lies (an all-to-all of the looked-up rows, cheaper than gathering the
    table), so its gradient needs no reduction: the all-reduce carries every other parameter's gradient."""
    from dtx.data.tasks import make_task
    from dtx.run import verify

    n, seq, vocab = 8, 32, 250
    model = models.build_model("transformer", num_layers=2, d_model=64, num_heads=4, max_len=seq, num_classes=vocab)
    compiled = verify.compile_layout_step(model, (seq,), "fsdp", [("data", n)], n, optimizer="adam", dtype=jnp.int32,
                                          task=make_task("next_token"), labels_shape=(seq,))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))["params"]
    total = 4 * sum(x.size for x in jax.tree.leaves(params))
    embedding = 4 * params["Embed_0"]["embedding"].size
    collectives = hlo.collectives(compiled)
    assert not [c.op_name for c in collectives if c.kind == "all-to-all" and "Embed_0" not in c.op_name]
    assert hlo.total(compiled).bytes_sent <= 3 * (n - 1) / n * total
    reduced = sum(c.operand_bytes * c.trips for c in collectives if c.kind in ("all-reduce", "reduce-scatter"))
    assert 0 <= reduced - (total - embedding) <= 16  # (the loss's scalars ride along)


def test_a_row_split_dense_after_a_column_split_one_needs_no_gather():
    """Megatron's pairing in the activation layout (``parallel.rules``): ``Dense_0`` split by columns, ``Dense_1`` by
    rows. ``Dense_1`` takes the features where ``Dense_0`` left them and reduce-scatters its partial sums onto the
    batch (one reduce-scatter forward, the all-gather of its output gradient backward), which sends half the bytes
    that splitting it by columns sends (its input gathered, the gradient reduce-scattered); loss and gradients
    equal one device's."""
    from dtx.data.tasks import cross_entropy

    model = models.build_model("mlp", features=(64, 32), num_classes=16)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 24)).astype(np.float32), rng.integers(0, 16, 64)
    abstract = abstract_train_state(model, optax.sgd(0.1), jax.ShapeDtypeStruct(x.shape, x.dtype))
    params = jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 24)))["params"])()
    mesh = mesh_lib.make_mesh([("data", 4), ("model", 2)])
    batch = mesh_lib.batch_sharding(mesh)

    def loss_and_grads(layout):
        def loss(p, x, y):
            with layout():
                return cross_entropy(model.apply({"params": p}, x), y).mean()
        return jax.value_and_grad(loss)

    want = jax.jit(loss_and_grads(contextlib.nullcontext))(params, x, y)
    column = [("Dense_0/kernel", (None, "model")), ("Dense_0/bias", ("model",))]
    sent = {}
    for name, second in (("row", [("Dense_1/kernel", ("model", None))]),
                         ("column", [("Dense_1/kernel", (None, "model")), ("Dense_1/bias", ("model",))])):
        placement = get_layout("rules").place(abstract, mesh, column + second)
        compiled = jax.jit(loss_and_grads(placement.activations), in_shardings=(placement.state.params, batch, batch)
                           ).lower(params, x, y).compile()
        mine = [c for c in hlo.collectives(compiled)  # Dense_1's own (not the merged gradient all-reduce's)
                if re.match(r"jit\([^)]*\)/(transpose\()?jvp\(MLP\)\)?/Dense_1/", c.op_name)]
        sent[name] = sum(c.bytes_sent for c in mine)
        if name == "row":
            assert sorted((c.kind, "transpose" in c.op_name, c.group_size) for c in mine) == [
                ("all-gather", True, 2), ("reduce-scatter", False, 2)]
            got = compiled(jax.device_put(params, placement.state.params), x, y)
            # three layers forward, the loss over 16 classes and 64 examples, three back; the longest sum is
            # Dense_0's 64 hidden features or a gradient's 64 examples
            assert_sums_close(got[0], want[0], 64 * 16, depth=4)
            for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1])):
                assert_sums_close(g, w, 64, depth=7, err_msg=jax.tree_util.keystr(path), scale=magnitude(want[1]))
    assert 2 * sent["row"] == sent["column"]
