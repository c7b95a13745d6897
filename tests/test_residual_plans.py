"""ResNet-18's plans verify as a graph (dtx.perf.layers.sources, dtx.perf.model.redistribution): each layer's
bytes and FLOPs and the whole step's bytes and FLOPs within 2 % of the Das model, the shortcut projections included.

Before the graph the model read the network as a chain: the shortcut projections' bytes were 17x and 3x the
model's, the step's 1.2-1.7x (``dtx simulate --model resnet18 --input-shape 32,32,3 --nodes 2,4,8 --verify``).
"""

import pytest

from dtx.perf import model as perfmodel
from dtx.tools import plancheck
from dtx.perf.clusters import get_cluster

TOL = 0.02
SHAPE = (32, 32, 3)
BATCH = 16


@pytest.fixture(scope="module")
def verified():
    from dtx.models import build_model
    from dtx.perf import report
    from dtx.run import verify

    import jax

    cluster = get_cluster("haswell_fdr")
    model = build_model("resnet18", dtype="float32", param_dtype="float32")
    layers = report.model_layers("resnet18", SHAPE)
    out = {}
    for nodes in (2, 4):
        plan = perfmodel.make_plan(layers, cluster, nodes, BATCH, group_size=nodes)
        devices = jax.devices("cpu")
        checks = verify.verify_layers(model, SHAPE, plan, cluster, devices=devices)
        step = verify.step_check(verify.compile_plan_step(model, SHAPE, plan, cluster, devices=devices), plan, cluster)
        out[nodes] = (plan, checks, step)
    return out


def test_graph_is_read():
    from dtx.perf import report

    layers = {layer.name: layer for layer in report.model_layers("resnet18", SHAPE)}
    assert layers["stage2_block1/proj"].source == layers["stage2_block1/conv1"].source  # the same block input
    assert isinstance(layers["stage2_block2/conv1"].source, frozenset)  # the add of conv2's and proj's branches


@pytest.mark.parametrize("nodes", [2, 4])
def test_layers_and_step_within_2_percent(verified, nodes):
    plan, checks, step = verified[nodes]
    moved, _ = perfmodel.redistribution(plan.layers, plan.sharded, plan.nodes, plan.global_batch, plan.group_size)
    assert moved, "the plan should split a branch that joins a batch-split one"
    for check in checks:
        assert abs(check.bytes_ratio - 1) <= TOL, (check.name, check.predicted_bytes, check.compiled_bytes)
        # stage 4's 3x3 convolutions over 1x1 maps included: one FLOP per parameter held for the gradient's
        # accumulation (dtx.run.verify.layer_flops; without it they read 1.023 at batch 64, more here)
        assert abs(check.flops_ratio - 1) <= TOL, (check.name, check.predicted_flops, check.compiled_flops)
    names = {check.name for check in checks}
    assert {"stage2_block1/proj", "stage3_block1/proj", "stage4_block1/proj"} <= names
    assert abs(step.bytes_ratio - 1) <= TOL, (step.predicted_bytes, step.compiled_bytes)
    # the whole step: no input gradient for the stem, and SGD's update (compile_plan_step's optimizer)
    whole = plancheck.with_update(step, plan, "sgd")
    assert abs(whole.flops_ratio - 1) <= TOL, (whole.predicted_flops, whole.compiled_flops)


def test_a_bottleneck_split_inside_verifies_by_bytes():
    """ResNet-50 on 32x32 images, 64 per step on 2 nodes (the plan ``dtx simulate --model resnet50 --input-shape
    32,32,3 --global-batch 64 --nodes 2 --cluster haswell_fdr`` prints): stages 2-3 split each bottleneck's 3x3
    conv2 over ``model`` and keep its 1x1 conv3 data-parallel, so conv3's input arrives split by features and moves
    to the batch split (an all-to-all in the group, and its gradient back: dtx.perf.model.redistribution charges
    it to conv3). Every layer's bytes and FLOPs and the step's bytes within 2 % (before: conv3 5.5x, the step
    1.13x; the partitioner gathered the output gradient over the batch instead of moving the input gradient back,
    which dtx.parallel.activations now pins). The step's FLOPs read 1.022: the batch norms' element-wise work is
    not in the Das model (docs/perfmodel.md), so they are not held here."""
    import jax

    from dtx.models import build_model
    from dtx.perf import report
    from dtx.run import verify

    cluster = get_cluster("haswell_fdr")
    layers = report.model_layers("resnet50", SHAPE)
    plan = perfmodel.make_plan(layers, cluster, 2, 64)
    kept = [name for name in plan.sharded if name.endswith("conv2") and name.replace("conv2", "conv3")
            not in plan.sharded]
    assert kept, plan.sharded  # the case: a split conv2 feeding a data-parallel conv3
    model = build_model("resnet50", dtype="float32", param_dtype="float32")
    devices = jax.devices("cpu")
    for check in verify.verify_layers(model, SHAPE, plan, cluster, devices=devices):
        assert abs(check.bytes_ratio - 1) <= TOL, (check.name, check.predicted_bytes, check.compiled_bytes)
        assert abs(check.flops_ratio - 1) <= TOL, (check.name, check.predicted_flops, check.compiled_flops)
    step = verify.step_check(verify.compile_plan_step(model, SHAPE, plan, cluster, devices=devices), plan, cluster)
    assert abs(step.bytes_ratio - 1) <= TOL, (step.predicted_bytes, step.compiled_bytes)
