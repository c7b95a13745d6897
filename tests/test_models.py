"""Tests for models: lookup by name, shapes, precision, batch norm and synchronised batch norm."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dtx.mesh import make_mesh
from dtx.models import MODELS, ModelConfigError, build_model, model_fields
from dtx.models.lenet import LeNet
from dtx.models.mlp import MLP

TINY = {"mlp": dict(features=(16,)), "lenet": dict(conv_features=(2, 4), dense_features=(8,))}


def _abstract(model, shape):
    """Variables and logits as shapes only: no compilation, so default-sized models are cheap."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    logits = jax.eval_shape(model.apply, variables, x)
    return variables, logits


def _variables(model, shape, seed=0):
    """Concrete variables of ``model``'s structure, drawn with numpy.

    Compiling ``model.init`` (random initialisers) costs seconds on CPU; the tests only
    need some fixed weights. Running means are random and running variances positive
    so the momentum update is checked from a non-trivial start.
    """
    rng = np.random.default_rng(seed)
    abstract, _ = _abstract(model, shape)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if "'var'" in name:
            value = rng.uniform(0.5, 2.0, leaf.shape)
        elif "'scale'" in name:
            value = rng.uniform(0.5, 1.5, leaf.shape)
        else:
            fan_in = int(np.prod(leaf.shape[:-1])) or 1
            value = rng.normal(0.0, 1.0 / np.sqrt(fan_in), leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


# --------------------------------------------------------------- lookup

def test_registry():
    assert MODELS["mlp"] is MLP and MODELS["lenet"] is LeNet
    assert {"vgg_a", "overfeat_fast", "speech_dnn", "resnet18", "resnet50"} <= set(MODELS)
    assert isinstance(build_model("mlp"), MLP)
    assert isinstance(build_model("lenet"), LeNet)


def test_unknown_model_lists_the_choices():
    with pytest.raises(ModelConfigError, match=r"unknown model 'resnet' \(config key model\.name\); "
                                                r"choose one of \[.*'lenet', 'mlp'.*'vgg_a'\]"):
        build_model("resnet")
    with pytest.raises(ModelConfigError, match=r"unknown model 'resnet'"):
        model_fields("resnet")


def test_unknown_setting_names_the_config_key():
    with pytest.raises(ModelConfigError, match=r"model 'mlp' has no setting 'featurs' \(config key model\.featurs\); "
                                                r"valid settings: features$"):
        build_model("mlp", featurs=(3,))
    with pytest.raises(ModelConfigError, match=r"config key model\.features\b.*"
                                                r"valid settings: conv_features, dense_features, use_batch_norm"):
        build_model("lenet", features=(3,))


def test_model_fields_lists_user_settings_only():
    assert model_fields("mlp") == {"features": (256, 256)}
    assert model_fields("lenet") == {"conv_features": (6, 16), "dense_features": (120, 84), "use_batch_norm": True}
    for name in TINY:  # the zoo's large models: tests/test_models_zoo.py
        for reserved in ("dtype", "param_dtype", "num_classes", "norm_axis_name", "parent", "name"):
            assert reserved not in model_fields(name)


def test_build_model_passes_settings_and_policy_fields():
    model = build_model("mlp", features=(7, 5), num_classes=3, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert (model.features, model.num_classes, model.dtype, model.param_dtype) == ((7, 5), 3, jnp.bfloat16, jnp.float32)
    model = build_model("lenet", use_batch_norm=False, norm_axis_name="data")
    assert model.use_batch_norm is False and model.norm_axis_name == "data"


# --------------------------------------------------------------- shapes

@pytest.mark.parametrize("shape", [(4, 8, 8, 1), (2, 28, 28, 1)], ids=["digits", "mnist"])
def test_mlp_shapes(shape):
    variables, logits = _abstract(build_model("mlp"), shape)
    assert logits.shape == (shape[0], 10) and logits.dtype == jnp.float32
    params = variables["params"]
    assert set(variables) == {"params"}
    pixels = shape[1] * shape[2] * shape[3]
    assert params["Dense_0"]["kernel"].shape == (pixels, 256)
    assert params["Dense_1"]["kernel"].shape == (256, 256)
    assert params["Dense_2"]["kernel"].shape == (256, 10)


@pytest.mark.parametrize("shape, spatial", [((4, 8, 8, 1), 2), ((2, 28, 28, 1), 7)], ids=["digits", "mnist"])
def test_lenet_shapes(shape, spatial):
    # 8x8 -> pool 4x4 -> pool 2x2; 28x28 -> 14x14 -> 7x7.
    variables, logits = _abstract(build_model("lenet", num_classes=7), shape)
    assert logits.shape == (shape[0], 7)
    params = variables["params"]
    assert params["Conv_0"]["kernel"].shape == (5, 5, 1, 6)
    assert params["Conv_1"]["kernel"].shape == (5, 5, 6, 16)
    assert params["Dense_0"]["kernel"].shape == (spatial * spatial * 16, 120)
    assert params["Dense_2"]["kernel"].shape == (84, 7)
    assert variables["batch_stats"]["BatchNorm_0"]["mean"].shape == (6,)
    assert variables["batch_stats"]["BatchNorm_1"]["var"].shape == (16,)


@pytest.mark.parametrize("name", sorted(TINY))
def test_real_forward_pass_on_both_input_sizes(name):
    rng = np.random.default_rng(1)
    model = build_model(name, **TINY[name])

    @jax.jit
    def run(variables, x):
        return model.apply(variables, x), model.apply(variables, x[::-1])

    for shape in [(3, 8, 8, 1), (2, 28, 28, 1)]:
        logits, reversed_logits = run(_variables(model, shape), rng.normal(size=shape).astype(np.float32))
        assert logits.shape == (shape[0], 10)
        assert np.all(np.isfinite(np.asarray(logits)))
        # Examples are independent in eval mode: reordering the batch reorders the logits.
        np.testing.assert_allclose(reversed_logits, logits[::-1], rtol=1e-5, atol=1e-6)


def test_lenet_without_batch_norm_has_no_batch_stats():
    variables, _ = _abstract(build_model("lenet", use_batch_norm=False), (2, 8, 8, 1))
    assert set(variables) == {"params"}


# ------------------------------------------------------------ precision

@pytest.mark.parametrize("name", sorted(TINY))
def test_bfloat16_compute_keeps_float32_params(name):
    model = build_model(name, dtype=jnp.bfloat16, param_dtype=jnp.float32, **TINY[name])
    x = np.random.default_rng(4).uniform(size=(2, 8, 8, 1)).astype(np.float32)
    abstract, abstract_logits = _abstract(model, x.shape)
    for leaf in jax.tree.leaves(abstract):  # params and running statistics
        assert leaf.dtype == jnp.float32
    assert abstract_logits.dtype == jnp.bfloat16

    variables = _variables(model, x.shape)
    full_model = build_model(name, **TINY[name])
    logits, full = jax.jit(lambda v, x: (model.apply(v, x), full_model.apply(v, x)))(variables, x)
    assert logits.dtype == jnp.bfloat16 and full.dtype == jnp.float32
    # Same function, computed in bf16 (8 mantissa bits): close, not equal.
    np.testing.assert_allclose(np.asarray(logits, np.float32), full, rtol=0.05, atol=0.05)
    assert not np.array_equal(np.asarray(logits, np.float32), full)


# ------------------------------------------------------------ batch norm

def test_lenet_train_updates_batch_stats_with_the_batch_moments():
    model = build_model("lenet", **TINY["lenet"])
    x = (np.random.default_rng(2).normal(size=(6, 8, 8, 1)) * 3.0 + 1.0).astype(np.float32)
    abstract, _ = _abstract(model, x.shape)
    assert set(abstract["batch_stats"]) == {"BatchNorm_0", "BatchNorm_1"}
    assert abstract["batch_stats"]["BatchNorm_0"]["mean"].shape == (2,)
    variables = _variables(model, x.shape)
    stats = variables["batch_stats"]

    @jax.jit
    def run(variables, x):
        # Eval mode reads the running averages and changes nothing.
        eval_logits, unchanged = model.apply(variables, x, train=False, mutable=["batch_stats"])
        train_logits, updates = model.apply(
            variables, x, train=True, mutable=["batch_stats", "intermediates"], capture_intermediates=True
        )
        return eval_logits, unchanged, train_logits, updates

    eval_logits, unchanged, train_logits, updates = run(variables, x)
    jax.tree.map(np.testing.assert_array_equal, unchanged["batch_stats"], stats)

    new = updates["batch_stats"]["BatchNorm_0"]
    conv = np.asarray(updates["intermediates"]["Conv_0"]["__call__"][0], np.float64)
    old = stats["BatchNorm_0"]
    # Running averages with momentum 0.9 towards the (biased) moments of the batch.
    np.testing.assert_allclose(new["mean"], 0.9 * old["mean"] + 0.1 * conv.mean(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new["var"], 0.9 * old["var"] + 0.1 * conv.var(axis=(0, 1, 2)), rtol=1e-5, atol=1e-5)
    for layer in ("BatchNorm_0", "BatchNorm_1"):
        for stat in ("mean", "var"):
            assert not np.allclose(updates["batch_stats"][layer][stat], stats[layer][stat], atol=1e-4)

    # Train mode normalises with the batch's statistics, so it differs from eval mode.
    assert not np.allclose(eval_logits, train_logits, atol=1e-3)


def test_synchronised_batch_norm_matches_the_whole_batch():
    mesh = make_mesh([("data", -1)])
    x = (np.random.default_rng(3).normal(size=(16, 8, 8, 1)) * 2.0 + 0.5).astype(np.float32)  # 2 per device
    whole = build_model("lenet", **TINY["lenet"])
    synced = build_model("lenet", norm_axis_name="data", **TINY["lenet"])
    variables = _variables(whole, x.shape)

    expected_logits, expected = jax.jit(lambda v, x: whole.apply(v, x, train=True, mutable=["batch_stats"]))(
        variables, x
    )

    def step(variables, x):
        return synced.apply(variables, x, train=True, mutable=["batch_stats"])

    logits, updates = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
    )(variables, x)
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-5, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
        updates["batch_stats"], expected["batch_stats"],
    )

    # Without synchronisation each device normalises with its own 2 examples: different numbers.
    def local(variables, x):
        return whole.apply(variables, x, train=True, mutable=["batch_stats"])[0]

    unsynced = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))(variables, x)
    assert not np.allclose(unsynced, expected_logits, rtol=1e-3, atol=1e-3)


def test_transformer_attention_is_causal_dot_product_attention():
    """models/transformer.py attends with jax.nn.dot_product_attention (is_causal): the same numbers as flax's own
    attention under the causal mask it used before, and no position sees a later one (changing the last token
    leaves every earlier logit as it was)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from dtx.models.transformer import causal_attention

    q, k, v = (jax.random.normal(key, (2, 16, 4, 8)) for key in jax.random.split(jax.random.key(0), 3))
    mask = nn.make_causal_mask(jnp.zeros((2, 16)))
    np.testing.assert_allclose(causal_attention(q, k, v), nn.dot_product_attention(q, k, v, mask=mask),
                               rtol=1e-5, atol=1e-6)
    model = build_model("transformer", num_layers=2, d_model=16, num_heads=2, max_len=16, num_classes=32)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 32)
    variables = model.init(jax.random.key(2), tokens)
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 32)
    apply = jax.jit(model.apply)  # one program (run eagerly, each of the model's operations compiled its own)
    a, b = apply(variables, tokens), apply(variables, changed)
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.allclose(a[:, -1], b[:, -1])
