"""The memory model's FSDP estimate of residual networks follows their graph (dtx.perf.memory, docs/memory.md).

Under ``fsdp`` XLA's SPMD partitioner runs each Dense/Conv layer on gathered weights, gathered activations or
contracted slices, depending on the layer's sizes and on how its input arrives (:func:`dtx.perf.memory._fsdp_mode`).
In a residual network the input is a layer's output, the model's input or the add of a block's branches
(:func:`dtx.perf.layers.sources`). Read from the compiled programs (each layer's forward product, :func:`_xla_modes`):

* ResNet-18 width 16, batch 32 (the held-out table's 1.414): stage 4's projection, whose kernel equals its
  whole-batch input (1·1·64·128 = 32·2·2·64), was counted on gathered weights, output split by examples, so the
  next block's 3×3 convolutions were too: two whole 590 KB kernels, their whole flipped copies before the forward
  pass and their whole gradients and all-reduce results at the update, none of which XLA holds (its projection
  reuses the activations its sibling, the block's first convolution, gathers; the next block contracts). 0.950.
* ResNet-50 width 16, two blocks a stage, batch 32 (written down as held out; 1.200 with the rules for the adds
  alone): stage 3's projection gathers the activations because the branch it is added to (the block's last 1×1
  convolution) leaves its output split by features. 1.047, every layer run as XLA runs it.

Development cases: those two and ResNet-50 width 8, batch 32 (1.047, unchanged). The held-out cases below were
written down before they were compiled.
"""

import dataclasses
import re

import pytest

from dtx import models
from dtx.perf import layers as layers_lib
from dtx.perf import memory
from dtx.perf.layers import Join, Layer
from dtx.run import verify

TOLERANCE = 0.15  # the memory model's stated goal


def _xla_modes(compiled, model, shape, batch) -> dict:
    """Per Dense/Conv layer, how the compiled ``fsdp`` step runs it, from its forward product's per-device output:
    the examples of one device and every feature (gathered weights), every example and a slice of the features
    (gathered activations), or every example and every feature (contracted slices, then all-reduced)."""
    layers = {layer.name: layer for layer in layers_lib.analyze(model, shape)}
    found = {}
    for line in compiled.as_text().splitlines():
        m = re.search(r'^\s*%(?:convolution|ynn_fusion|dot|fusion)[.0-9]* = f32\[([0-9,]+)\].*op_name="jit\(step\)/'
                      r'jvp\([A-Za-z0-9]+\)/([^"]+)/(?:conv_general_dilated|dot_general)"', line)
        if m and m.group(2) in layers and m.group(2) not in found:
            dims = [int(d) for d in m.group(1).split(",")]
            whole = (dims[0] == batch, dims[-1] == layers[m.group(2)].kernel_shape[-1])
            found[m.group(2)] = {(False, True): "gather_weights", (True, False): "gather_activations",
                                 (True, True): "contracting"}.get(whole, "?")
    return found


def test_a_graphs_layers_arrive_as_their_sources_left_them():
    # By hand, no compile, 8 devices, global batch 16 (B·in = 16·64 = 1024 for every layer here). a (kernel
    # 3·3·8·64 = 4608 > 1024) gathers the activations and leaves them split by features; r, split on its input
    # features (64 of 3·3·64·64), takes a's output and contracts (whole batch, replicated); p, a 1×1 projection of
    # the input (512 < 1024), gathers weights (split by examples). c, split on its input features, takes the add of
    # r and p: split by examples as p's is, so c gathers weights -- in either listed order of r and p (a chain
    # would follow the layer listed before c: after r, contract).
    a = Layer("a", "conv", 0, 4608, 64, 64, (3, 3, 8, 64), source="")
    r = Layer("r", "conv", 0, 36864, 64, 64, (3, 3, 64, 64), source="a")
    p = Layer("p", "conv", 0, 512, 64, 64, (1, 1, 8, 64), source="")
    c = Layer("c", "conv", 0, 9216, 64, 16, (3, 3, 64, 16), source=Join({"r", "p"}))
    expected = {"a": "gather_activations", "r": "contracting", "p": "gather_weights", "c": "gather_weights"}
    for order in ((a, r, p, c), (a, p, r, c)):
        assert dict(memory.estimate(order, "fsdp", nodes=8, global_batch=16).modes) == expected
    # A branch added to one split by features is asked for its output split so: q (the same 1×1 projection as p)
    # gathers the activations beside a, and the add, split by features, makes c contract.
    q = Layer("q", "conv", 0, 512, 64, 64, (1, 1, 8, 64), source="")
    c2 = dataclasses.replace(c, source=Join({"a", "q"}))
    assert dict(memory.estimate((a, q, c2), "fsdp", nodes=8, global_batch=16).modes) == {
        "a": "gather_activations", "q": "gather_activations", "c": "contracting"}
    # A tie (kernel = whole-batch input) gathers weights, unless a sibling (same source) already gathers that input.
    t = Layer("t", "conv", 0, 1024, 64, 128, (1, 1, 8, 128), source="")
    assert memory.estimate((t,), "fsdp", nodes=8, global_batch=16).modes["t"] == "gather_weights"
    assert memory.estimate((a, t), "fsdp", nodes=8, global_batch=16).modes["t"] == "gather_activations"
    # A chain (no sources) keeps the chain's rule: the tie to the weights, the layer before for the arriving input.
    chain = [dataclasses.replace(layer, source=None) for layer in (a, r, p, c)]
    assert memory.estimate(chain, "fsdp", nodes=8, global_batch=16).modes == {
        "a": "gather_activations", "r": "contracting", "p": "gather_weights", "c": "gather_weights"}


# Development cases, (name, settings, batch) at 32×32×3 on 8 devices:
# * ResNet-18 width 16, batch 32: the held-out table's row (1.414 before, with stage 4's last block counted on
#   gathered weights; 0.950 after);
# * ResNet-50's blocks, two per stage, width 16, batch 32 (first written down as held out, below; 1.200 with the
#   graph's adds alone): stage 3's projection (kernel 1·1·128·256 = 32768, half its whole-batch input) gathers the
#   activations because its block's last 1×1 convolution, which it is added to, leaves its output split by features;
#   the next block's convolutions then contract. 1.041 before this work (right for the wrong layers), 1.047 with
#   every layer run as XLA runs it.
DEVELOPMENT = {
    "resnet18-w16": ("resnet18", dict(width=16, num_classes=16), 32),
    "resnet50-w16-2222": ("resnet50", dict(width=16, num_classes=16, stage_sizes=(2, 2, 2, 2)), 32),
}


@pytest.mark.parametrize("case", sorted(DEVELOPMENT))
def test_fsdp_runs_each_layer_as_the_compiled_step_does_and_is_within_15_percent(case):
    name, settings, batch = DEVELOPMENT[case]
    model, shape = models.build_model(name, **settings), (32, 32, 3)
    estimate = memory.estimate_model(model, shape, "fsdp", nodes=8, global_batch=batch)
    compiled = verify.compile_layout_step(model, shape, "fsdp", [("data", 8)], batch)
    assert dict(estimate.modes) == _xla_modes(compiled, model, shape, batch)
    peak = memory.compiled_peak(compiled)
    assert abs(estimate.total / peak - 1) <= TOLERANCE, (estimate.total, peak)


# Held out: written down here before any was compiled; never used to write a rule. (name, settings, input, batch)
# First round (with the rule for the adds' arriving layout only): resnet34-w16 1.059 (1.059 before), resnet18-w32-64px
# 0.822 (1.235 before; missed, below), and ResNet-50 width 16 with two blocks a stage, batch 32, 1.200 (1.041
# before), from which the projection rule was written: now a development case, above.
HELD_OUT = {
    "resnet34-w16": ("resnet18", dict(width=16, num_classes=16, stage_sizes=(3, 4, 6, 3)), (32, 32, 3), 16),
    "resnet18-w32-64px": ("resnet18", dict(width=32, num_classes=16), (64, 64, 3), 16),
    # Second round, written down after the projection rule and before either was compiled.
    "resnet50-w8-b16": ("resnet50", dict(width=8, num_classes=16), (32, 32, 3), 16),
    "resnet18-w24-b32": ("resnet18", dict(width=24, num_classes=16), (32, 32, 3), 32),
}
# XLA runs stage 3's first convolution of resnet18-w32-64px (kernel 1.125 × its whole-batch input) on gathered
# weights, where ResNet-18 width 16 at 32×32, batch 32 -- every layer's kernel the same multiple of its input --
# gathers its activations: the per-layer choice, not the graph (docs/memory.md). 0.822 of the compiled peak.
MISSED = {"resnet18-w32-64px"}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.xfail(
    strict=True, reason="XLA's per-layer choice of gathered weights (docs/memory.md)")) if case in MISSED else case
    for case in sorted(HELD_OUT)])
def test_held_out_residual_networks_under_fsdp_are_within_15_percent(case):
    name, settings, shape, batch = HELD_OUT[case]
    model = models.build_model(name, **settings)
    estimate = memory.estimate_model(model, shape, "fsdp", nodes=8, global_batch=batch)
    peak = memory.compiled_peak(verify.compile_layout_step(model, shape, "fsdp", [("data", 8)], batch))
    assert abs(estimate.total / peak - 1) <= TOLERANCE, (case, estimate.total, peak, estimate.total / peak)
