"""dtx.parallel.fc_pairs: the model layout's fully connected stacks as column/row pairs (``parallel.fc_pairs``).

Values: 3 steps with pairs equal one device's, for the digits MLP under the ``model`` layout on 4 x 2 devices
(its output layer a row layer) and a LeNet under ``hybrid`` on 2 x 4 (convolutions data parallel; a row layer
inside the stack, a column layer after it), at test_parallel.py's step tolerance (the ``jit`` driver: the only
one that runs these layouts). Compiled program: the MLP's step sends the bytes the Das model's formulas
say (:mod:`dtx.perf.row_split` for the row layer, :func:`dtx.perf.model.layer_bytes` for the rest: the
``--verify`` check, :func:`dtx.run.verify.step_check`), the row layer one reduce-scatter forward and one
all-gather backward, and fewer bytes than the gather-per-layer split. The planner (``dtx simulate
--fc-pairs``) splits VGG-A's fc8 by rows and prints the ``dtx train`` overrides; ``--verify``'s per-layer
programs compile the row layer to the model's bytes.
"""

import json
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx import models
from dtx.comm import hlo
from dtx.config import ConfigError, base_config, validate
from dtx.data import TrainLoader
from dtx.parallel import PartitionError, fc_pairs, get_layout
from dtx.perf import model as perfmodel
from dtx.perf import row_split
from dtx.perf.clusters import get_cluster
from dtx.perf.layers import analyze
from dtx.perf.report import model_layers, plan_overrides
from dtx.run import verify
from dtx.step import StepSpec, make_train_step
from dtx.step.state import abstract_train_state, init_train_state
from dtx.tools.plancheck import VERIFY_TOLERANCE

TOL = dict(rtol=1e-5, atol=1e-5)  # tests/test_parallel.py's whole-step tolerance (3 steps, SGD-momentum)
MODELS = {"mlp": dict(features=(64, 64)), "lenet": dict(conv_features=(4, 8), dense_features=(32, 16), num_classes=12)}
LAYOUTS = {"mlp": ("model", [("data", 4), ("model", 2)]), "lenet": ("hybrid", [("data", 2), ("model", 4)])}
ROWS = {"mlp": ["Dense_2"], "lenet": ["Dense_1"]}  # 64-64-64-10: the output layer; 392-32-16-12: the middle one


@pytest.fixture(scope="module")
def runs(digits):
    """Per model: 3 jit steps on one device (data) and on its mesh (its layout with pairs); the MLP's model layout
    without pairs compiled too."""
    tx = optax.sgd(0.1, momentum=0.9)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    one = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    out = {}
    for name, kwargs in MODELS.items():
        model = models.build_model(name, **kwargs)
        abstract = abstract_train_state(model, tx, example)
        layout, split = LAYOUTS[name]
        split = mesh_lib.make_mesh(split)
        for key, mesh, layout, pairs in (("one", one, "data", {}), ("pairs", split, layout, dict(fc_pairs=True)),
                                         ("columns", split, layout, {}))[:3 if name == "mlp" else 2]:
            placement = get_layout(layout).place(abstract, mesh, **pairs)
            state = init_train_state(model, tx, example, 0, mesh, shardings=placement.state)
            step = make_train_step(model, tx, mesh, StepSpec(driver="jit", placement=placement))
            loader = TrainLoader(digits.train, 64, mesh, seed=0)
            compiled = step.lower(state, loader.batch(0)).compile()
            if key != "columns":  # the gather-per-layer split: its program only
                for s in range(3):
                    state, metrics = compiled(state, loader.batch(s))
                    jax.block_until_ready(metrics)
            out[name, key] = (state, placement, compiled)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_pairs_train_as_one_device(runs, name):
    state, placement, _ = runs[name, "pairs"]
    reference, _, _ = runs[name, "one"]
    rows = sorted(layer for layer, spec in placement.activations.kernels.items() if tuple(spec) == ("model", None))
    assert rows == ROWS[name]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(reference.params)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))
    row = state.params[ROWS[name][0]]
    assert row["kernel"].sharding.spec == P("model", None) and row["bias"].sharding.is_fully_replicated


def _mlp_plan(rows=()):
    """The model layout on the MLP as a Das plan: every layer split in groups of 2 of 8 nodes, global batch 64."""
    layers = analyze(models.build_model("mlp", **MODELS["mlp"]), (64,))
    return perfmodel.Plan(8, 64, 2, tuple(layer.name for layer in layers), layers, (), {}, tuple(rows))


def test_compiled_pairs_send_what_the_model_says(runs):
    """The step's bytes against the model's per-layer formulas within --verify's tolerance, with and without pairs
    (less the first layer's reduce-scatter of its input gradient, which a step does not compute; the rest is the
    loss's scalars); the row layer's own collectives: one reduce-scatter of its partial sums forward, one
    all-gather of their gradient backward, in groups of 2, exactly the model's activation bytes — where the
    column split gathers its 64-wide input, reduce-scatters that gradient and hands its logits to the loss."""
    cluster = get_cluster("haswell_fdr")
    assert cluster.bytes_per_element == 4
    sent = {}
    for key, rows in (("pairs", ROWS["mlp"]), ("columns", ())):
        compiled, plan = runs["mlp", key][2], _mlp_plan(rows)
        check = verify.step_check(compiled, plan, cluster)
        unsent = perfmodel.layer_bytes(plan.layers[0], 8, 64, 2, True)[0] / 2
        assert abs(check.compiled_bytes / (check.predicted_bytes - unsent) - 1) <= VERIFY_TOLERANCE, (key, check)
        sent[key] = hlo.total(compiled).bytes_sent
        mine = sorted((c.kind, "transpose" in c.op_name, c.group_size, c.operand_bytes, c.bytes_sent)
                      for c in hlo.collectives(compiled) if re.search(r"/Dense_2/shard_map/", c.op_name))
        if key == "pairs":  # the group's 16 examples x 10 partial sums reduced; each device's 8 gathered back
            assert mine == [("all-gather", True, 2, 8 * 10 * 4, 8 * 10 * 4), ("reduce-scatter", False, 2, 16 * 10 * 4,
                                                                               8 * 10 * 4)]
            assert sum(c[-1] for c in mine) == row_split.row_bytes(plan.layers[-1], 8, 64, 2)[0]
        else:  # the column split: its input gathered (16 examples x 32 features each), the gradient scattered
            assert [c[:3] for c in mine] == [("all-gather", False, 2), ("reduce-scatter", True, 2)]
            assert sum(c[-1] for c in mine) == perfmodel.layer_bytes(plan.layers[-1], 8, 64, 2, True)[0]
    assert sent["pairs"] < sent["columns"]


def test_verify_compiles_the_row_layer_to_the_model(runs):
    """``--verify``'s per-layer programs (dtx.run.verify.verify_layers) of the MLP's plan with its row layer: each
    layer's FLOPs and bytes within the tolerance, the row layer predicted by its own formula (its 10-float bias's
    all-reduce over 8 is the 1.6 % off: the HLO count rounds a ring's chunks up to whole elements)."""
    plan = _mlp_plan(ROWS["mlp"])
    checks = verify.verify_layers(models.build_model("mlp", **MODELS["mlp"]), (64,), plan, get_cluster("haswell_fdr"))
    for check in checks:
        assert abs(check.bytes_ratio - 1) <= VERIFY_TOLERANCE and abs(check.flops_ratio - 1) <= VERIFY_TOLERANCE, check
    assert checks[-1].name == "Dense_2"
    assert checks[-1].predicted_bytes == sum(row_split.row_bytes(plan.layers[-1], 8, 64, 2))


def test_the_planner_splits_vgg_a_fc8_by_rows():
    """haswell_fdr, 8 nodes, global batch 512: with pairs fc8 (4096 -> 1000) is split by rows after fc7's columns
    (B·G/N·1000 elements reduced instead of 4096 gathered, and no all-to-all of the logits): a faster plan, whose
    rules and overrides say so; without pairs the planner is unchanged."""
    layers, cluster = model_layers("vgg_a"), get_cluster("haswell_fdr")
    plain = perfmodel.make_plan(layers, cluster, 8, 512)
    paired = perfmodel.make_plan(layers, cluster, 8, 512, pairs=True)
    assert plain.rows == () and paired.rows == ("fc8",) and paired.sharded == plain.sharded == ("fc6", "fc7", "fc8")
    assert paired.times["none"] < plain.times["none"]
    fc8 = layers[-1]
    assert paired.costs[-1].activation_bytes == 2 * 7 / 8 * (512 * 1000 * 4)  # ring: 2(G-1)/G of b·out·e, b = B
    assert plain.costs[-1].activation_bytes > 4 * paired.costs[-1].activation_bytes
    rules = dict(paired.rules())
    assert rules["^fc8/kernel$"] == P("model", None) and "^fc8/bias$" not in rules
    assert "(\"^fc8/kernel$\", (\"model\", None))" in plan_overrides(paired)[-1]
    assert perfmodel.plan_text(paired) == "G=8 model: fc6, fc7, fc8 rows"
    assert fc8.name == "fc8"


def test_simulate_fc_pairs_prints_the_row_split(capsys):
    """``dtx simulate --fc-pairs``: the plan's rules split fc8 by rows (its bias whole); without the flag, by
    columns."""
    from dtx.tools.simulate import simulate_main

    rules = {}
    for flags in ([], ["--fc-pairs"]):
        assert simulate_main(["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "8", "--json", *flags]) == 0
        rules[bool(flags)] = dict((regex, spec) for regex, spec in json.loads(capsys.readouterr().out)["points"][0]["rules"])
    assert rules[True]["^fc8/kernel$"] == ["model", None] and "^fc8/bias$" not in rules[True]
    assert rules[False]["^fc8/kernel$"] == [None, "model"] and rules[False]["^fc8/bias$"] == ["model"]
    # The same study from Python (dtx.perf.report.simulate's pairs= is --fc-pairs): its rows and printed table.
    from dtx.perf import report

    study = report.simulate("vgg_a", "haswell_fdr", [8], pairs=True)
    assert study.points[0].plan.rows == ("fc8",)
    assert simulate_main(["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "8", "--fc-pairs"]) == 0
    assert capsys.readouterr().out.startswith(str(study) + "\n")


def test_the_layout_pairs_to_exchange_the_fewest_elements():
    """Per chain, a column layer exchanges its input width and a row its output width per example: VGG-A's head
    25088-4096-4096-1000 pairs fc7 with fc8, an MLP 64-64-32-10 pairs Dense_0 with Dense_1."""
    assert fc_pairs.choose([{"column": 25088, "row": 4096}, {"column": 4096, "row": 4096},
                            {"column": 4096, "row": 1000}], [False, True, True]) == ["column", "column", "row"]
    assert fc_pairs.choose([{"column": 64, "row": 64}, {"column": 64, "row": 32},
                            {"column": 32, "row": 10}], [False, True, True]) == ["column", "row", "column"]
    assert fc_pairs.choose([{"data": 1.0, "column": 1.2}, {"data": 1.0, "row": 0.1}], [False, True]) == [
        "column", "row"]  # a dearer column pays for itself through its row partner


def test_fc_pairs_is_refused_where_it_does_not_apply(digits):
    config = base_config()
    config.parallel.name, config.parallel.fc_pairs, config.driver = "data", True, "jit"
    config.mesh = (("data", 4), ("model", 2))
    with pytest.raises(ConfigError, match=r"parallel.fc_pairs=True applies to parallel.name=hybrid or model"):
        validate(config)
    config.parallel.name = "model"
    validate(config)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    abstract = abstract_train_state(models.build_model("mlp", features=()), optax.sgd(0.1), example)
    with pytest.raises(PartitionError, match=r"parallel.fc_pairs=True pairs consecutive fully connected layers.*"
                                             r"\['Dense_0'\]"):
        get_layout("model").place(abstract, mesh_lib.make_mesh([("data", 4), ("model", 2)]), fc_pairs=True)
    with pytest.raises(PartitionError, match=r"parallel.fc_pairs=True .* not 'fsdp'"):
        get_layout("fsdp").place(abstract, mesh_lib.make_mesh([("data", 8)]), fc_pairs=True)
    # 10 classes do not split over 4 by columns; the output layer as a row layer splits its 64 inputs instead.
    abstract = abstract_train_state(models.build_model("mlp", **MODELS["mlp"]), optax.sgd(0.1), example)
    four = mesh_lib.make_mesh([("data", 2), ("model", 4)])
    with pytest.raises(PartitionError, match=r"layer 'Dense_2'\'s 10 output features"):
        get_layout("model").place(abstract, four)
    placement = get_layout("model").place(abstract, four, fc_pairs=True)
    assert placement.state.params["Dense_2"]["kernel"].spec == P("model", None)
