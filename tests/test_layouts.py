"""Layouts are declarations: what each places where follows from its fields, never from its name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import models, optim
from dtx.parallel import LAYOUTS, Layout, PartitionError, get_layout
from dtx.perf import layers as layers_lib
from dtx.perf import memory
from dtx.step.state import abstract_train_state


@pytest.fixture(scope="module")
def abstract():
    model = models.build_model("lenet", conv_features=(8, 16), dense_features=(32,), num_classes=16)
    return abstract_train_state(model, optim.make_optimizer("adam", 1e-3), jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32))


def _split(tree) -> set[str]:
    return {jax.tree_util.keystr(path, simple=True, separator="/") for path, s in
            jax.tree_util.tree_leaves_with_path(tree) if not s.is_fully_replicated}


# Stages: tests/test_pipeline_parallel.py; Megatron's pairs (a transformer's): tests/test_tensor_parallel.py; a
# layout that places some parameters its own way (the experts of an MoE model): tests/test_expert.py.
@pytest.mark.parametrize("name", [name for name, layout in LAYOUTS.items()
                                  if layout.kernels not in ("explicit", "paired") and not layout.stages
                                  and layout.own_rules is None])
def test_what_a_layout_places_follows_its_declaration(abstract, name):
    layout = LAYOUTS[name]
    # A layout that moves activations its own way (context parallelism) runs on the axis it splits sequences over.
    mesh = mesh_lib.make_mesh([("data", 4), ("model", 2)] if layout.needs_model_axis else
                              [("data", 2), ("context", 4)] if layout.activation_factory else [("data", 8)])
    placement = layout.place(abstract, mesh)
    params, opt = _split(placement.state.params), _split(placement.state.opt_state)
    kernels = {p for p in params if p.endswith("kernel")}
    conv = {p for p in kernels if p.startswith("Conv")}
    # Parameters: split over the model axis by the kernels it declares, over every device at ZeRO stage 3.
    assert bool(params) == (layout.kernels != "none" or layout.zero_stage == 3), name
    assert bool(conv) == (layout.kernels == "all" or layout.zero_stage == 3), name
    # The optimizer state is split wherever ZeRO says (stage >= 1) or follows its parameter.
    assert bool(opt) == (layout.zero_stage >= 1 or bool(params)), name
    assert (placement.gradients is not None) == (layout.zero_stage in (1, 2)), name
    assert placement.shard_accumulator == (layout.zero_stage == 2), name
    assert (placement.activations is not None) == (layout.needs_model_axis or bool(layout.activation_factory)), name
    assert layout.replicated == (name == "data")


def test_a_layout_is_known_by_its_fields_not_its_name(abstract):
    """An unregistered declaration with zero1's fields places the state as zero1 does, and the memory model
    charges it the same: nothing keys on the name."""
    mesh = mesh_lib.make_mesh([("data", 8)])
    twin = Layout("my_zero1", zero_stage=1, cost_rank=1)
    mine, zero1 = twin.place(abstract, mesh), get_layout("zero1").place(abstract, mesh)
    assert jax.tree.map(lambda s: s.spec, mine.state) == jax.tree.map(lambda s: s.spec, zero1.state)
    assert jax.tree.map(lambda s: s.spec, mine.gradients) == jax.tree.map(lambda s: s.spec, zero1.gradients)
    model = models.build_model("mlp", features=(64,))
    layers = layers_lib.analyze(model, (64,))
    ours, theirs = (memory.estimate(layers, layout, nodes=8, global_batch=64) for layout in (twin, "zero1"))
    assert (ours.params, ours.optimizer, ours.total) == (theirs.params, theirs.optimizer, theirs.total)
    assert ours.optimizer < memory.estimate(layers, "data", nodes=8, global_batch=64).optimizer


def test_layouts_refuse_what_they_cannot_run():
    with pytest.raises(PartitionError, match=r"unknown parallel.name 'megatron'; choose one of \['data'"):
        get_layout("megatron")
    with pytest.raises(PartitionError, match=r"parallel.name='hybrid' needs a 'model' mesh axis"):
        get_layout("hybrid").param_rules(mesh_lib.make_mesh([("data", 8)]))
    with pytest.raises(PartitionError, match="kernels must be one of"):
        Layout("odd", kernels="diagonal")
    base = config_lib.base_config()
    with pytest.raises(config_lib.ConfigError, match=r"parallel.rules=.* applies to parallel.name=rules only, "
                                                     r"not data \(parallel 'data' takes none\)"):
        config_lib.override(base, **{"parallel.rules": (("Dense_0/kernel", (None, "model")),)})
    with pytest.raises(config_lib.ConfigError, match="unknown parallel.name 'megatron'"):
        config_lib.override(base, **{"parallel.name": "megatron"})
    config_lib.override(base, **{"parallel.name": "rules", "parallel.rules": (("Dense_0/kernel", (None, "model")),)})
