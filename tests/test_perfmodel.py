"""Tests for the analytic performance model, the planner and ``dtx simulate`` (Das et al., arXiv 1602.06709)."""
import math
import json
import os
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import costmodel, perfmodel
from dtx.clusters import PRESETS, Cluster, ClusterError, get_cluster
from dtx.mesh import make_mesh
from dtx.tools.simulate import simulate_main
from dtx.models import build_model

HASWELL = get_cluster("haswell_fdr")

# ------------------------------------------------------------------ hand counts from the layer tables
# Per layer: (name, forward multiply-adds per image, parameters incl. biases).
# MACs = H_out * W_out * C_out * (k * k * C_in); params = k * k * C_in * C_out + C_out.

# Simonyan & Zisserman 2015, Table 1 config A: 3x3 convs, padding 1, 2x2 pools; 224x224x3 input.
VGG_A_TABLE = [
    ("conv1", 86_704_128, 1_792),  # 224*224*64*(9*3);       9*3*64 + 64
    ("conv2", 924_844_032, 73_856),  # 112*112*128*(9*64);    9*64*128 + 128
    ("conv3_1", 924_844_032, 295_168),  # 56*56*256*(9*128);  9*128*256 + 256
    ("conv3_2", 1_849_688_064, 590_080),  # 56*56*256*(9*256); 9*256*256 + 256
    ("conv4_1", 924_844_032, 1_180_160),  # 28*28*512*(9*256); 9*256*512 + 512
    ("conv4_2", 1_849_688_064, 2_359_808),  # 28*28*512*(9*512); 9*512*512 + 512
    ("conv5_1", 462_422_016, 2_359_808),  # 14*14*512*(9*512)
    ("conv5_2", 462_422_016, 2_359_808),  # 14*14*512*(9*512)
    ("fc6", 102_760_448, 102_764_544),  # (7*7*512)*4096;      + 4096
    ("fc7", 16_777_216, 16_781_312),  # 4096*4096;             + 4096
    ("fc8", 4_096_000, 4_097_000),  # 4096*1000;               + 1000
]

# Sermanet et al. 2014, Table 1 (fast model), 231x231x3 input: conv1 11x11/4 -> 56 (pool 28), conv2 5x5 -> 24
# (pool 12), conv3-5 3x3 pad 1 -> 12 (pool 6), fc6 6*6*1024 -> 3072, fc7 -> 4096, fc8 -> 1000.
OVERFEAT_FAST_TABLE = [
    ("conv1", 109_283_328, 34_944),  # 56*56*96*(11*11*3);     363*96 + 96
    ("conv2", 353_894_400, 614_656),  # 24*24*256*(5*5*96);     2400*256 + 256
    ("conv3", 169_869_312, 1_180_160),  # 12*12*512*(9*256);    2304*512 + 512
    ("conv4", 679_477_248, 4_719_616),  # 12*12*1024*(9*512);   4608*1024 + 1024
    ("conv5", 1_358_954_496, 9_438_208),  # 12*12*1024*(9*1024); 9216*1024 + 1024
    ("fc6", 113_246_208, 113_249_280),  # 36864*3072;            + 3072
    ("fc7", 12_582_912, 12_587_008),  # 3072*4096;               + 4096
    ("fc8", 4_096_000, 4_097_000),  # 4096*1000;                 + 1000
]


@pytest.mark.parametrize("name, table, macs_total", [
    ("vgg_a", VGG_A_TABLE, 7_609_090_048),  # "7.6 G" (Simonyan & Zisserman Table 2 counts multiply-adds)
    ("overfeat_fast", OVERFEAT_FAST_TABLE, 2_801_403_904),  # "2.81 G" (Sermanet et al. Table 4)
])
def test_per_layer_flops_and_params_match_the_layer_tables(name, table, macs_total):
    model = build_model(name)
    layers = perfmodel.analyze(model, type(model).default_input_shape)
    assert [(l.name, l.macs, l.weights) for l in layers] == table
    assert all(l.forward_flops == 2 * l.computed_macs and l.train_flops == 6 * l.computed_macs for l in layers)
    assert sum(l.macs for l in layers) == macs_total
    # What runs skips the taps that fall on padding: fewer MACs for padded convolutions only.
    assert all(l.computed_macs == l.macs for l in layers if l.kind == "dense")
    assert all(l.computed_macs <= l.macs for l in layers)
    assert 0.9 * macs_total < sum(l.computed_macs for l in layers) < macs_total
    fc6 = layers[-3]
    assert (fc6.kind, fc6.in_elements, fc6.out_elements) == ("dense", fc6.kernel_shape[0], fc6.kernel_shape[1])


class _ValidCNN(nn.Module):
    """No padding: XLA's cost analysis counts only taps that hit real pixels, the papers count padded ones."""

    @nn.compact
    def __call__(self, x, train=False):
        x = nn.relu(nn.Conv(16, (5, 5), padding="VALID", name="conv1")(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2, padding="VALID", name="conv2")(x))
        x = nn.relu(nn.Dense(64, name="fc1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="fc2")(x)


def _xla_flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def test_flops_agree_with_xla_cost_analysis():
    model, batch = _ValidCNN(), 4
    layers = perfmodel.analyze(model, (20, 20, 3))
    x = jax.ShapeDtypeStruct((batch, 20, 20, 3), jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    forward = batch * sum(l.forward_flops for l in layers)
    # XLA also counts bias adds and ReLUs: within 2 %.
    assert _xla_flops(model.apply, variables, x) == pytest.approx(forward, rel=0.02)
    # Backward = 2x forward, except that nothing asks for the gradient of the input images.
    train = 3 * forward - batch * layers[0].forward_flops
    grad = jax.grad(lambda v, x: jnp.sum(model.apply(v, x)))
    assert _xla_flops(grad, variables, x) == pytest.approx(train, rel=0.02)


# ------------------------------------------------------------------ roofline, communication, balance

def test_roofline_fully_connected_is_memory_bound_at_small_batch():
    fc6 = perfmodel.analyze(build_model("vgg_a"), (224, 224, 3))[8]
    peak = HASWELL.node_flops * HASWELL.efficiency["dense"]
    small, large = perfmodel.compute_time(fc6, HASWELL, 4), perfmodel.compute_time(fc6, HASWELL, 1024)
    # At 4 images the 3 passes over 411 MB of weights dominate; at 1024 the arithmetic does.
    assert small == pytest.approx(3 * 4 * (4 * (25088 + 4096) + fc6.weights) / HASWELL.memory_bandwidth)
    assert small > 5 * 4 * fc6.train_flops / peak
    assert large == pytest.approx(1024 * fc6.train_flops / peak)


def test_layer_costs_follow_the_alpha_beta_formulas():
    fc7 = perfmodel.analyze(build_model("vgg_a"), (224, 224, 3))[9]
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
    for layer in perfmodel.analyze(build_model("vgg_a"), (224, 224, 3)):
        bal = perfmodel.balance(layer, HASWELL, nodes, 4)
        assert bal.balanced == (bal.compute >= bal.communication) == (4 >= bal.min_batch)
        at_min = perfmodel.balance(layer, HASWELL, nodes, bal.min_batch)
        assert at_min.balanced
        if bal.min_batch > 1:
            assert not perfmodel.balance(layer, HASWELL, nodes, bal.min_batch - 1).balanced
    # Das et al. §3: convolutions balance at a handful of images per node, fully connected layers need hundreds.
    by_name = {l.name: perfmodel.balance(l, HASWELL, 128, 4) for l in
               perfmodel.analyze(build_model("vgg_a"), (224, 224, 3))}
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
    layers = perfmodel.analyze(model, type(model).default_input_shape)
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
    layers = perfmodel.analyze(build_model("vgg_a"), (224, 224, 3))
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
    layers = perfmodel.analyze(model, (24,))
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
    layers = perfmodel.analyze(_ValidCNN(), (20, 20, 3))
    plan = perfmodel.make_plan(layers, HASWELL, 4, 8, mode="auto", group_size=4)
    specs = dict(plan.rules())
    for name in plan.sharded:
        kernel = next(l.kernel_shape for l in layers if l.name == name)
        assert specs[f"^{name}/kernel$"] == P(*([None] * (len(kernel) - 1)), "model")


# ------------------------------------------------------------------ bad input

def test_bad_input_is_refused_with_the_fix():
    layers = perfmodel.analyze(build_model("speech_dnn"), (440,))
    with pytest.raises(perfmodel.PerfModelError, match=r"group size 3 does not divide the 8 nodes.*\[1, 2, 4, 8\]"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, group_size=3)
    uneven = r"global batch 100 does not split evenly over 8 nodes; use a multiple of 8 \(e\.g\. 96 or 104\)"
    with pytest.raises(perfmodel.PerfModelError, match=uneven):
        perfmodel.make_plan(layers, HASWELL, 8, 100)
    with pytest.raises(perfmodel.PerfModelError, match=r"plan 'data' has no model axis"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, mode="data", group_size=2)
    with pytest.raises(perfmodel.PerfModelError, match=r"unknown plan 'pipeline'"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, mode="pipeline")
    with pytest.raises(costmodel.CollectiveError, match=r"unknown allreduce algorithm 'mesh'"):
        perfmodel.make_plan(layers, HASWELL, 8, 64, algorithm="mesh")
    with pytest.raises(perfmodel.PerfModelError, match=r"exactly one of global_batch"):
        perfmodel.scaling(layers, HASWELL, [1, 2], global_batch=8, per_node_batch=2)
    with pytest.raises(ClusterError, match=r"unknown cluster preset 'dgx'; choose one of cloud_10gbe, h100"):
        get_cluster("dgx")
    with pytest.raises(ClusterError, match=r"bandwidth must be a positive number, got -1"):
        Cluster("x", node_flops=1e12, memory_bandwidth=1e11, latency=1e-6, bandwidth=-1)
    with pytest.raises(ClusterError, match=r"efficiency\['conv'\] must be in \(0, 1\], got 1.5"):
        HASWELL.replace(efficiency={"conv": 1.5, "dense": 0.7})


# ------------------------------------------------------------------ CLI

def test_simulate_json_reports_speedup_per_node_count(tmp_path, capsys):
    argv = ["--model", "vgg_a", "--global-batch", "512", "--nodes", "1,2,4,8,16,32,64,128", "--node-flops", "2.3e12",
            "--memory-bandwidth", "1.36e11", "--bandwidth", "6.8e9", "--latency", "2e-6", "--out", str(tmp_path),
            "--json"]
    assert simulate_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    speedup = result["speedup"]
    assert list(speedup) == ["1", "2", "4", "8", "16", "32", "64", "128"]
    assert speedup["1"] == pytest.approx(1) and all(speedup[k] <= int(k) for k in speedup)
    assert 60 < speedup["128"] < 128  # Das et al. §5 measure 90x for VGG-A at 128 nodes, batch 512
    last = result["points"][-1]
    assert last["mesh"] == [["data", 128 // last["group_size"]], ["model", last["group_size"]]]
    assert last["rules"][-1] == [".*", []] and ["^fc6/kernel$", [None, "model"]] in last["rules"]
    assert [row["layer"] for row in result["layers"]][-3:] == ["fc6", "fc7", "fc8"]
    assert os.path.getsize(result["plot"]) > 0 and result["plot"].startswith(str(tmp_path))


def test_simulate_table_with_a_preset(tmp_path, capsys):
    argv = ["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--per-node-batch", "16", "--nodes", "1,4,16",
            "--overlap", "ideal", "--plan", "hybrid", "--out", str(tmp_path)]
    assert simulate_main(argv) == 0
    out = capsys.readouterr().out
    assert "weak scaling, 16 per node" in out and "G=" in out and "fc7" in out
    assert (tmp_path / "simulate_speech_dnn_cloud_10gbe.png").exists()


def test_simulate_writes_no_file_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert simulate_main(["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--nodes", "1,4"]) == 0
    assert "pass --out DIR to save the speedup plot" in capsys.readouterr().out
    assert simulate_main(["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--nodes", "1,4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--model", "alexnet", "--cluster", "haswell_fdr"], r"unknown model 'alexnet'.*vgg_a"),
    (["--model", "vgg_a", "--cluster", "nope"], r"unknown cluster preset 'nope'"),
    (["--model", "vgg_a", "--node-flops", "2.3e12"], r"without --cluster, give --memory-bandwidth, --bandwidth, "
                                                     r"--latency"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--bandwidth", "-5"], r"--bandwidth: must be a positive"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "1,two"], r"--nodes: expected comma-separated"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "1,3"], r"global batch 512 does not split evenly "
                                                                          r"over 3 nodes"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--group-size", "3", "--nodes", "1,2,4"],
     r"group size 3 does not divide the 2 nodes of the \(data, model\) mesh; choose one of \[1, 2\]"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "4", "--group-size", "8"],
     r"group size 8 does not divide the 4 nodes"),
    (["--model", "mlp", "--cluster", "haswell_fdr"], r"no default input shape; pass --input-shape"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--efficiency", "gpu=0.5"], r"unknown layer kind 'gpu'"),
])
def test_simulate_bad_input_exits_2_naming_the_fix(argv, message, capsys, tmp_path):
    assert simulate_main(argv + ["--out", str(tmp_path)]) == 2
    assert re.search(message, capsys.readouterr().err, flags=re.S)


# ------------------------------------------------------------------ calibration on this machine

class _SmallCNN(nn.Module):
    """A VGG-like CNN: conv-ReLU-maxpool twice, two dense layers. Segments of it are timed alone."""

    @nn.compact
    def __call__(self, x, train=False):
        for name, channels in (("conv1", 32), ("conv2", 64)):
            x = nn.max_pool(nn.relu(nn.Conv(channels, (3, 3), name=name)(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(256, name="fc1")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, name="fc2")(x)


def test_calibration_measured_layers_predict_the_measured_step():
    """The model fed with measured single-device per-layer compute predicts the measured step within 25 %.

    Each Dense/Conv layer is timed alone as its *segment*: the layer plus the
    element-wise ops that follow it up to the next layer (ReLU, max-pool, flatten),
    forward + backward (``jax.vjp`` with a random output gradient), the first without
    an input gradient since nothing asks for the images' gradient — the per-layer
    timing Das et al. §2 build their model from. The whole
    training step (loss, backward, SGD update) is jitted as one program, so the
    comparison includes what separate layers cannot share: fusion across layer
    boundaries, the loss and the update, and per-call dispatch. Times are medians
    over rounds that interleave the step and the segments, so a noisy shared
    machine slows both alike.
    """
    batch = 32
    model, shape = _SmallCNN(), (32, 32, 3)
    layers = perfmodel.analyze(model, shape)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, *shape)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, batch))
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]

    def segment(name, post):
        def apply(p, h):
            layer = nn.Conv(p["kernel"].shape[-1], (3, 3)) if p["kernel"].ndim == 4 else nn.Dense(p["kernel"].shape[-1])
            h = layer.apply({"params": p}, h if p["kernel"].ndim == 4 else h.reshape(h.shape[0], -1))
            return post(h)
        return apply

    pool = lambda h: nn.max_pool(nn.relu(h), (2, 2), strides=(2, 2))  # noqa: E731
    posts = {"conv1": pool, "conv2": pool, "fc1": nn.relu, "fc2": lambda h: h}
    timed, h = [], x
    for i, layer in enumerate(layers):
        fn = segment(layer.name, posts[layer.name])
        y = fn(params[layer.name], h)
        # A random cotangent, not ones: XLA must not simplify the backward pass of a constant.
        cotangent = jnp.asarray(rng.normal(size=y.shape), jnp.float32)
        if i == 0:
            fb = jax.jit(lambda p, h, ct, fn=fn: jax.vjp(lambda p: fn(p, h), p)[1](ct))
        else:
            fb = jax.jit(lambda p, h, ct, fn=fn: jax.vjp(fn, p, h)[1](ct))
        timed.append((layer.name, fb, (params[layer.name], h, cotangent)))
        h = y

    @jax.jit
    def step(params, x, labels):
        def loss_fn(p):
            log_probs = jax.nn.log_softmax(model.apply({"params": p}, x))
            return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))
        grads = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda w, g: w - 0.01 * g, params, grads)

    def seconds(fn, *args):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - start

    seconds(step, params, x, labels)  # compile
    for _, fb, args in timed:
        seconds(fb, *args)
    step_times, layer_times = [], {name: [] for name, *_ in timed}
    for _ in range(15):
        step_times.append(seconds(step, params, x, labels))
        for name, fb, args in timed:
            layer_times[name].append(seconds(fb, *args))
    per_example = {name: float(np.median(t)) / batch for name, t in layer_times.items()}
    predicted = perfmodel.make_plan(layers, HASWELL, 1, batch, per_example=per_example).times["none"]
    measured = float(np.median(step_times))
    print(f"calibration: predicted {predicted * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms")
    assert predicted == pytest.approx(measured, rel=0.25), (predicted, measured, per_example)


def test_the_trainer_runs_the_planners_rules(tmp_path):
    """The planner's choice, emitted as `dtx train` overrides, trains as-is: same result as data parallel."""
    import shlex

    from dtx import models
    from dtx import config as config_lib
    from dtx import perfmodel as pm
    from dtx.clusters import get_cluster
    from dtx.tools.simulate import plan_overrides
    from dtx.trainer import train

    experiment = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                              "digits_mlp.py")
    model = models.build_model("mlp", features=(32,))
    plan = pm.make_plan(pm.analyze(model, (8, 8, 1)), get_cluster("haswell_fdr"), 8, 64, mode="hybrid", group_size=2)
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


@pytest.mark.parametrize("padding, size, kernel, stride", [
    ("SAME", 8, 3, 1), ("VALID", 8, 3, 1), ("SAME", 2, 3, 1), (((1, 1), (1, 1)), 5, 3, 1), ("SAME", 9, 4, 2),
    ((2, 0), 7, 5, 2), ("CAUSAL", 6, 3, 1),
])
def test_conv_flops_are_what_xla_counts(padding, size, kernel, stride):
    """Forward FLOPs of a convolution == XLA's cost analysis of it (which counts only in-bounds taps),
    less the bias additions (one per output element), which the model leaves out."""

    class OneConv(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Conv(16, (kernel,) if padding == "CAUSAL" else (kernel, kernel), strides=stride,
                           padding=padding)(x)

    shape = (size, 8) if padding == "CAUSAL" else (size, size, 8)
    model, x = OneConv(), jnp.zeros((1, *shape))
    params = model.init(jax.random.key(0), x)
    out = jax.eval_shape(model.apply, params, x)
    xla = jax.jit(model.apply).lower(params, x).compile().cost_analysis()["flops"]
    (layer,) = perfmodel.analyze(model, shape)
    assert layer.forward_flops + math.prod(out.shape) == xla
