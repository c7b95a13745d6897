"""Tests for the analytic performance model and the planner (Das et al., arXiv 1602.06709); the layer analysis
is tested in test_layers.py, ``dtx simulate`` in test_simulate.py."""
import dataclasses
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtx.comm import costmodel
from dtx.perf import model as perfmodel
from dtx.perf import layers as layers_lib
from dtx.perf.clusters import PRESETS, get_cluster
from dtx.mesh import make_mesh
from dtx.models import build_model
from test_layers import _ValidCNN  # an unpadded CNN: its conv layers are what the rules split

HASWELL = get_cluster("haswell_fdr")

# ------------------------------------------------------------------ roofline, communication, balance

def test_roofline_fully_connected_is_memory_bound_at_small_batch():
    fc6 = layers_lib.analyze(build_model("vgg_a"), (224, 224, 3))[8]
    peak = HASWELL.node_flops * HASWELL.efficiency["dense"]
    small, large = perfmodel.compute_time(fc6, HASWELL, 4), perfmodel.compute_time(fc6, HASWELL, 1024)
    # At 4 images the 3 passes over 411 MB of weights dominate; at 1024 the arithmetic does.
    assert small == pytest.approx(3 * 4 * (4 * (25088 + 4096) + fc6.weights) / HASWELL.memory_bandwidth)
    assert small > 5 * 4 * fc6.train_flops / peak
    assert large == pytest.approx(1024 * fc6.train_flops / peak)


def test_layer_costs_follow_the_alpha_beta_formulas():
    fc7 = layers_lib.analyze(build_model("vgg_a"), (224, 224, 3))[9]
    alpha, beta, e = HASWELL.latency, 1 / HASWELL.bandwidth, 4
    gamma = 3 / HASWELL.memory_bandwidth
    data = perfmodel.layer_cost(fc7, HASWELL, 16, 256)
    assert data.gradient_comm == pytest.approx(costmodel.predict_time("ring", fc7.weights * e, 16, alpha, beta, gamma))
    assert data.activation_comm == 0 and data.gradient_bytes == pytest.approx(2 * 15 / 16 * fc7.weights * e)
    # Hybrid G=4: 4 groups of 64 images; activations exchanged inside groups, 1/4 of the gradients across.
    hybrid = perfmodel.layer_cost(fc7, HASWELL, 16, 256, group=4, sharded=True)
    assert hybrid.activation_comm == pytest.approx(costmodel.predict_time("ring", 64 * 4096 * e, 4, alpha, beta, gamma))
    assert hybrid.gradient_comm == pytest.approx(
        costmodel.predict_time("ring", fc7.weights * e / 4, 4, alpha, beta, gamma))
    # Model parallel (G = N): every node sees all 256 images, no weight gradients to exchange.
    model = perfmodel.layer_cost(fc7, HASWELL, 16, 256, group=16, sharded=True)
    assert model.gradient_comm == 0 and model.activation_bytes == pytest.approx(2 * 15 / 16 * 256 * 4096 * e)
    # G = 1 is data parallelism.
    assert perfmodel.layer_cost(fc7, HASWELL, 16, 256, group=1, sharded=True) == data


def test_two_level_allreduce_uses_nvlink_inside_a_node():
    h100 = get_cluster("h100_nvlink_ndr")
    n = 1e8
    inside = h100.allreduce_time(n, 8, local=8)
    assert inside == pytest.approx(costmodel.predict_time("ring", n, 8, h100.local_latency, 1 / h100.local_bandwidth,
                                                          3 / h100.memory_bandwidth))
    across = h100.allreduce_time(n, 64, local=8)
    assert across == pytest.approx(inside + costmodel.predict_time("ring", n / 8, 8, h100.latency, 1 / h100.bandwidth,
                                                                   3 / h100.memory_bandwidth))
    assert inside < across < h100.allreduce_time(n, 64, local=1)


@pytest.mark.parametrize("nodes", [2, 16, 128])
def test_balance_condition_and_minimum_batch_are_consistent(nodes):
    for layer in layers_lib.analyze(build_model("vgg_a"), (224, 224, 3)):
        bal = perfmodel.balance(layer, HASWELL, nodes, 4)
        assert bal.balanced == (bal.compute >= bal.communication) == (4 >= bal.min_batch)
        at_min = perfmodel.balance(layer, HASWELL, nodes, bal.min_batch)
        assert at_min.balanced
        if bal.min_batch > 1:
            assert not perfmodel.balance(layer, HASWELL, nodes, bal.min_batch - 1).balanced
    # Das et al. §3: convolutions balance at a handful of images per node, fully connected layers need hundreds.
    by_name = {l.name: perfmodel.balance(l, HASWELL, 128, 4) for l in
               layers_lib.analyze(build_model("vgg_a"), (224, 224, 3))}
    assert by_name["conv3_2"].min_batch <= 4 < 100 < by_name["fc6"].min_batch


def test_ideal_overlap_is_a_lower_bound_of_no_overlap():
    costs = [perfmodel.LayerCost(3.0, 0.0, 1.0, 0, 0), perfmodel.LayerCost(3.0, 0.4, 2.0, 0, 0)]
    times = perfmodel.iteration_times(costs)
    assert times["none"] == pytest.approx(9.4)
    # fwd 1 + (1 + 0.2) ; bwd layer 2: 2 + 0.2 -> t=4.4, its allreduce 4.4..6.4; bwd layer 1 ends 6.4,
    # then its allreduce 6.4..7.4.
    assert times["ideal"] == pytest.approx(7.4)


# ------------------------------------------------------------------ scaling and planning

@pytest.mark.parametrize("cluster", sorted(PRESETS))
@pytest.mark.parametrize("name", ["vgg_a", "speech_dnn"])
def test_scaling_never_beats_linear(cluster, name):
    """Strong scaling, any plan: each node's share of every layer is >= 1/N of one node's work, so
    speedup <= N. Weak scaling with data parallelism: each node does the one-node work plus communication.
    (Weak scaling *with* model parallelism can beat linear: a memory-bound layer split G ways streams
    1/G of its weights per node — aggregate memory bandwidth, a real effect the model keeps.)"""
    model = build_model(name)
    layers = layers_lib.analyze(model, type(model).default_input_shape)
    nodes = [1, 2, 4, 8, 16, 32, 64]
    for overlap in perfmodel.OVERLAPS:
        for kwargs in (dict(global_batch=256, mode="auto"), dict(global_batch=256, mode="hybrid"),
                       dict(per_node_batch=8, mode="data")):
            points = perfmodel.scaling(layers, get_cluster(cluster), nodes, overlap=overlap, **kwargs)
            assert [p.nodes for p in points] == nodes and points[0].speedup == pytest.approx(1)
            for p in points:
                assert 0 < p.speedup <= p.nodes * (1 + 1e-9) and 0 < p.efficiency <= 1 + 1e-9
                assert p.plan.times["ideal"] <= p.plan.times["none"] * (1 + 1e-12)
                assert p.per_node_batch * p.nodes == p.global_batch


def test_planner_splits_fc_layers_of_vgg_a_and_keeps_convolutions_data_parallel():
    layers = layers_lib.analyze(build_model("vgg_a"), (224, 224, 3))
    for nodes, batch in [(32, 128), (128, 512)]:  # 4 images per node
        plan = perfmodel.make_plan(layers, HASWELL, nodes, batch)
        assert 1 < plan.group_size <= nodes
        assert {"fc6", "fc7"} <= set(plan.sharded)
        assert not [name for name in plan.sharded if name.startswith("conv")]
        assert all(plan.choice(f"conv{i}") == "data" for i in (1, 2))
        data = perfmodel.make_plan(layers, HASWELL, nodes, batch, mode="data")
        assert plan.times["none"] < 0.7 * data.times["none"]  # hybrid pays off (Das et al. §5)
    # One node: nothing to communicate, nothing to split.
    assert perfmodel.make_plan(layers, HASWELL, 1, 64).group_size == 1


def test_plan_rules_run_as_partitioning_that_matches_the_unsharded_model():
    from dtx.parallel import param_specs

    model = build_model("speech_dnn", hidden=(64, 32), num_classes=16)
    layers = layers_lib.analyze(model, (24,))
    plan = perfmodel.make_plan(layers, HASWELL, 8, 64, mode="hybrid", group_size=2)
    assert plan.mesh_spec == [("data", 4), ("model", 2)]
    rules = plan.rules()
    assert rules[-1] == (".*", P())
    assert rules[:-1] == [rule for name in ("fc1", "fc2", "fc3")
                          for rule in ((f"^{name}/kernel$", P(None, "model")), (f"^{name}/bias$", P("model")))]
    mesh = make_mesh(plan.mesh_spec)
    x = np.random.default_rng(0).normal(size=(64, 24)).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    specs = param_specs(rules, params, mesh)
    sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs,
                           is_leaf=lambda s: isinstance(s, P))
    assert sharded["fc1"]["kernel"].sharding.spec == P(None, "model")
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
    expected = apply(params, x)
    got = apply(sharded, jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_conv_rules_split_output_channels():
    layers = layers_lib.analyze(_ValidCNN(), (20, 20, 3))
    plan = perfmodel.make_plan(layers, HASWELL, 4, 8, mode="auto", group_size=4)
    specs = dict(plan.rules())
    for name in plan.sharded:
        kernel = next(l.kernel_shape for l in layers if l.name == name)
        assert specs[f"^{name}/kernel$"] == P(*([None] * (len(kernel) - 1)), "model")


def test_rules_of_bias_free_layers_name_only_parameters_that_exist():
    """ResNet's convolutions have no bias: a plan splitting them names their kernels only, so its rules
    match the model (once: `dtx simulate --model resnet18 --verify` failed on nonexistent conv biases)."""
    from dtx.parallel import rules as rules_lib

    model = build_model("resnet18", width=4, stage_sizes=(1, 1), num_classes=10)
    layers = layers_lib.analyze(model, (16, 16, 3))
    plan = perfmodel.make_plan(layers, HASWELL, 8, 64, mode="hybrid", group_size=2)
    plan = dataclasses.replace(plan, sharded=tuple(layer.name for layer in layers))  # every layer split
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3))))["params"]
    assert any(name.startswith("stage") for name in plan.sharded)  # bias-free convolutions among them
    rules_lib.check_rules_match(plan.rules(), params)  # raises naming a rule that matches nothing
    assert not [r for r, _ in plan.rules() if r.endswith("/bias$") and "conv" in r]


# ------------------------------------------------------------------ bad input

def test_bad_input_is_refused_with_the_fix():
    layers = layers_lib.analyze(build_model("speech_dnn"), (440,))
    with pytest.raises(layers_lib.PerfModelError, match=r"group size 3 does not divide the 8 nodes.*\[1, 2, 4, 8\]"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, group_size=3)
    uneven = r"global batch 100 does not split evenly over 8 nodes; use a multiple of 8 \(e\.g\. 96 or 104\)"
    with pytest.raises(layers_lib.PerfModelError, match=uneven):
        perfmodel.make_plan(layers, HASWELL, 8, 100)
    with pytest.raises(layers_lib.PerfModelError, match=r"plan 'data' has no model axis"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, mode="data", group_size=2)
    with pytest.raises(layers_lib.PerfModelError, match=r"unknown plan 'pipeline'"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, mode="pipeline")
    with pytest.raises(costmodel.CollectiveError, match=r"unknown allreduce algorithm 'mesh'"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, algorithm="mesh")
    with pytest.raises(layers_lib.PerfModelError, match=r"exactly one of global_batch"):
        perfmodel.scaling(layers, HASWELL, [1, 2], global_batch=8, per_node_batch=2)


# ------------------------------------------------------------------ calibration: measured layers into a step

class _SmallCNN(nn.Module):
    """A VGG-like CNN: conv-ReLU-maxpool twice, two dense layers (benchmarks/calibration.py times it)."""

    @nn.compact
    def __call__(self, x, train=False):
        for name, channels in (("conv1", 32), ("conv2", 64)):
            x = nn.max_pool(nn.relu(nn.Conv(channels, (3, 3), name=name)(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(256, name="fc1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="fc2")(x)


# Seconds per example of each layer's forward + backward, as a calibration would measure them
# (made up, of the order a 2-core CPU takes; nothing is timed here: benchmarks/calibration.py measures).
PER_EXAMPLE = {"conv1": 40e-6, "conv2": 100e-6, "fc1": 30e-6, "fc2": 2e-6}


def test_calibration_turns_measured_layer_times_into_the_step_the_formulas_give():
    """The calibration path (``make_plan(..., per_example=)``): measured per-layer compute replaces the
    roofline layer by layer, scaled by the examples a node computes, and composes into the step as
    ``iteration_times`` says; every figure below is worked out by hand from the formulas."""
    layers = layers_lib.analyze(_SmallCNN(), (32, 32, 3))
    names = [layer.name for layer in layers]
    assert names == ["conv1", "conv2", "fc1", "fc2"]
    weights = {layer.name: layer.weights for layer in layers}
    assert weights == {"conv1": 896, "conv2": 18496, "fc1": 1048832, "fc2": 2570}

    # One device, batch 32: each layer is 32 examples' measured time; no communication, nothing to
    # overlap, so both bounds are the sum: 32 × (40 + 100 + 30 + 2) µs = 5.504 ms.
    one = perfmodel.make_plan(layers, HASWELL, 1, 32, per_example=PER_EXAMPLE)
    assert [c.compute for c in one.costs] == pytest.approx([1.28e-3, 3.2e-3, 0.96e-3, 0.064e-3], rel=1e-12)
    assert [c.activation_comm + c.gradient_comm for c in one.costs] == [0.0] * 4
    assert one.times["none"] == pytest.approx(5.504e-3, rel=1e-12)
    assert one.times["ideal"] == pytest.approx(5.504e-3, rel=1e-12)

    # A layer without a measurement keeps its roofline.
    partial = perfmodel.make_plan(layers, HASWELL, 1, 32, per_example={k: v for k, v in PER_EXAMPLE.items()
                                                                        if k != "fc1"})
    assert partial.costs[2].compute == perfmodel.compute_time(layers[2], HASWELL, 32)
    assert partial.costs[2].compute != pytest.approx(0.96e-3, rel=0.01)
    assert partial.times["none"] == pytest.approx(5.504e-3 - 0.96e-3 + partial.costs[2].compute, rel=1e-12)

    # 4 nodes of cloud_10gbe, global batch 128, data parallel: each node computes 32 examples (the same
    # compute as above) and allreduces each layer's float32 gradient, 4·W bytes, by ring: 2(p−1) = 6
    # rounds of α, 2(p−1)/p = 1.5× the bytes over the link, (p−1)/p = 0.75× the bytes reduced at
    # γ = 3 / memory bandwidth.
    cloud = get_cluster("cloud_10gbe")
    alpha, bandwidth, gamma = 50e-6, 1.25e9, 3 / 1.36e11
    assert (cloud.latency, cloud.bandwidth, 3 / cloud.memory_bandwidth, cloud.local_size) == (alpha, bandwidth,
                                                                                               gamma, 1)
    grad = {n: 6 * alpha + 1.5 * 4 * w / bandwidth + 0.75 * 4 * w * gamma for n, w in weights.items()}
    four = perfmodel.make_plan(layers, cloud, 4, 128, mode="data", per_example=PER_EXAMPLE)
    compute = dict(zip(names, [1.28e-3, 3.2e-3, 0.96e-3, 0.064e-3]))
    assert [c.compute for c in four.costs] == pytest.approx([compute[n] for n in names], rel=1e-12)
    assert [c.gradient_comm for c in four.costs] == pytest.approx([grad[n] for n in names], rel=1e-12)
    # No overlap: compute then every allreduce, one after the other.
    assert four.times["none"] == pytest.approx(5.504e-3 + sum(grad.values()), rel=1e-12)
    # Ideal overlap: the forward pass (1/3 of each layer's compute), then backward last layer first
    # (2/3 each); a layer's allreduce starts when its backward ends and the link is free. fc2's
    # allreduce ends before fc1's backward does, so fc1's starts when fc1's backward ends; it outlasts
    # the backward of both convolutions, so conv2's and then conv1's follow it back to back.
    fc1_backward_done = 5.504e-3 / 3 + 2 / 3 * (compute["fc2"] + compute["fc1"])
    assert grad["fc2"] < 2 / 3 * compute["fc1"] and grad["fc1"] > 2 / 3 * (compute["conv2"] + compute["conv1"])
    ideal = fc1_backward_done + grad["fc1"] + grad["conv2"] + grad["conv1"]
    assert four.times["ideal"] == pytest.approx(ideal, rel=1e-12)
    # In digits: 2.5173 ms + 5.4038 + 0.3900 + 0.3044 ms (fc1, conv2, conv1 allreduces).
    assert four.times["ideal"] == pytest.approx(8.6155e-3, rel=1e-4)

    # Model parallel in groups of 2 (hybrid: fc1 and fc2 split): a group computes B·G/N = 64 examples on
    # 1/G of the output features, so a node's measured compute is still 32 examples' worth.
    hybrid = perfmodel.make_plan(layers, cloud, 4, 128, mode="hybrid", group_size=2, per_example=PER_EXAMPLE)
    assert hybrid.sharded == ("fc1", "fc2")
    assert [c.compute for c in hybrid.costs] == pytest.approx([compute[n] for n in names], rel=1e-12)


def test_the_trainer_runs_the_planners_rules(tmp_path):
    """The planner's choice, emitted as `dtx train` overrides, trains as-is: same result as data parallel."""
    import shlex

    from dtx import models
    from dtx import config as config_lib
    from dtx.perf import model as pm
    from dtx.perf.clusters import get_cluster
    from dtx.tools.simulate import plan_overrides
    from dtx.run.trainer import train

    experiment = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                              "digits_mlp.py")
    model = models.build_model("mlp", features=(32,))
    plan = pm.make_plan(layers_lib.analyze(model, (8, 8, 1)), get_cluster("haswell_fdr"), 8, 64, mode="hybrid", group_size=2)
    assert plan.sharded, "the hybrid plan must split some layer"
    overrides = [arg for item in plan_overrides(plan) for arg in shlex.split(item)]
    base = ["--config.model.features=(32,)", "--config.num_steps=5", "--config.progress=False",
            "--config.global_batch_size=64", "--config.optimizer.name=momentum", "--config.optimizer.learning_rate=0.1"]
    planned = train(config_lib.load(experiment, base + overrides), tmp_path / "planned")
    data = train(config_lib.load(experiment, base), tmp_path / "data")
    kernel = planned.state.params["Dense_0"]["kernel"]
    assert not kernel.sharding.is_fully_replicated  # the plan's layout is what ran
    for a, b in zip(jax.tree.leaves(planned.state.params), jax.tree.leaves(data.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
