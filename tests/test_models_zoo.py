"""Tests for the model zoo of Das et al.'s study: VGG-A, OverFeat-FAST, the speech DNN, ResNet-18/50.

Full-size models are only ever evaluated abstractly (``jax.eval_shape``); the runs on
CPU use the width/resolution knobs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dtx.mesh import make_mesh
from dtx.models import MODELS, build_model

ZOO = ("vgg_a", "overfeat_fast", "speech_dnn", "resnet18", "resnet50")
# Small enough to compile and run forward + backward in about a second each on 2 cores.
SMALL = {
    "vgg_a": (dict(width=1 / 16, fc_features=32), (32, 32, 3)),
    "overfeat_fast": (dict(width=1 / 16, fc_features=(32, 32)), (67, 67, 3)),
    "speech_dnn": (dict(hidden=(32,) * 6), (440,)),
    "resnet18": (dict(width=4), (32, 32, 3)),
    # One bottleneck block per stage: the same code paths as ResNet-50's (3, 4, 6, 3), a third of the compile
    # time; the full depth is checked abstractly (parameter count) below.
    "resnet50": (dict(width=4, stage_sizes=(1, 1, 1, 1)), (32, 32, 3)),
}


def _abstract(model, shape):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    return variables, jax.eval_shape(model.apply, variables, x)


def _variables(model, x):
    """Concrete variables drawn with numpy: compiling ``model.init``'s random initialisers costs
    seconds per model on CPU, and the tests only need some fixed, well-scaled weights."""
    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        if "'var'" in name or "'scale'" in name:
            return jnp.asarray(rng.uniform(0.5, 1.5, leaf.shape), leaf.dtype)
        fan_in = int(np.prod(leaf.shape[:-1])) or 1
        return jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(fan_in), leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


def _count(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def test_registered_by_name():
    assert set(ZOO) <= set(MODELS)
    for name in ZOO:
        model = build_model(name)
        assert model.num_classes == (9304 if name == "speech_dnn" else 1000)
        assert tuple(type(model).default_input_shape) == {"speech_dnn": (440,), "overfeat_fast": (231, 231, 3)}.get(
            name, (224, 224, 3))


@pytest.mark.parametrize("name, params", [
    # Totals published with the architectures: VGG-A 133 M (Simonyan & Zisserman Table 2; exact count of
    # config A's 11 layers with biases), OverFeat-fast 145.9 M, torchvision's resnet18 / resnet50.
    ("vgg_a", 132_863_336), ("overfeat_fast", 145_920_872), ("resnet18", 11_689_512), ("resnet50", 25_557_032),
    # 440*2048 + 5*2048*2048 + 2048*9304 weights + 6*2048 + 9304 biases.
    ("speech_dnn", 40_948_824),
])
def test_full_size_parameter_counts(name, params):
    model = build_model(name)
    variables, logits = _abstract(model, (1, *type(model).default_input_shape))
    assert _count(variables["params"]) == params
    assert logits.shape == (1, model.num_classes)


def test_layer_names_are_stable_paths():
    shape = (1, 224, 224, 3)
    vgg, _ = _abstract(build_model("vgg_a"), shape)
    assert list(vgg["params"]) == ["conv1", "conv2", "conv3_1", "conv3_2", "conv4_1", "conv4_2", "conv5_1",
                                   "conv5_2", "fc6", "fc7", "fc8"]
    assert vgg["params"]["fc6"]["kernel"].shape == (7 * 7 * 512, 4096)
    overfeat, _ = _abstract(build_model("overfeat_fast"), (1, 231, 231, 3))
    assert overfeat["params"]["fc6"]["kernel"].shape == (6 * 6 * 1024, 3072)
    speech, _ = _abstract(build_model("speech_dnn"), (1, 440))
    assert [k for k in speech["params"]] == [f"fc{i}" for i in range(1, 8)]
    resnet, _ = _abstract(build_model("resnet50"), shape)
    block = resnet["params"]["stage2_block1"]
    assert set(block) == {"conv1", "conv2", "conv3", "bn1", "bn2", "bn3", "proj", "proj_bn"}
    assert block["conv2"]["kernel"].shape == (3, 3, 128, 128) and block["proj"]["kernel"].shape == (1, 1, 256, 512)
    assert resnet["params"]["fc"]["kernel"].shape == (2048, 1000)
    assert set(resnet["batch_stats"]["stage4_block3"]) == {"bn1", "bn2", "bn3"}


@pytest.mark.parametrize("name", ZOO)
def test_small_models_train_step_on_cpu(name):
    kwargs, shape = SMALL[name]
    model = build_model(name, num_classes=5, **kwargs)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, *shape)).astype(np.float32)
    labels = jnp.asarray([0, 3, 4])
    variables = _variables(model, x)

    @jax.jit
    def step(variables, x):
        def loss_fn(params):
            logits, updates = model.apply({**variables, "params": params}, x, train=True,
                                          mutable=["batch_stats"], rngs={"dropout": jax.random.key(1)})
            log_probs = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1)), (logits, updates)
        (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        return loss, logits, grads, updates

    loss, logits, grads, updates = step(variables, x)
    assert logits.shape == jax.eval_shape(model.apply, variables, x).shape == (3, 5)
    assert np.isfinite(float(loss))
    flat = jax.tree.leaves(grads)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in flat)
    assert sum(float(jnp.sum(jnp.abs(g))) for g in flat) > 0
    # Batch statistics exist exactly for the ResNets and move in training.
    assert ("batch_stats" in variables) == name.startswith("resnet")
    if name.startswith("resnet"):
        before, after = variables["batch_stats"]["stem_bn"]["mean"], updates["batch_stats"]["stem_bn"]["mean"]
        assert not np.allclose(before, after)


@pytest.mark.parametrize("name", ZOO)
def test_precision_policy_fields(name):
    kwargs, shape = SMALL[name]
    model = build_model(name, dtype=jnp.bfloat16, param_dtype=jnp.float32, **kwargs)
    variables, logits = _abstract(model, (2, *shape))
    assert logits.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(variables))


def test_width_knob_scales_channels():
    narrow, _ = _abstract(build_model("vgg_a", width=0.5), (1, 32, 32, 3))
    assert narrow["params"]["conv1"]["kernel"].shape == (3, 3, 3, 32)
    assert narrow["params"]["conv5_2"]["kernel"].shape == (3, 3, 256, 256)
    resnet, _ = _abstract(build_model("resnet18", width=16), (1, 32, 32, 3))
    assert resnet["params"]["stage4_block2"]["conv2"]["kernel"].shape == (3, 3, 128, 128)


def test_resnet_synchronised_batch_norm_matches_the_whole_batch():
    """With norm_axis_name set (the shard_map driver does it), 8 devices normalise like one."""
    kwargs = dict(width=4, stage_sizes=(1, 1))
    whole = build_model("resnet18", num_classes=4, **kwargs)
    synced = build_model("resnet18", num_classes=4, norm_axis_name="data", **kwargs)
    x = (np.random.default_rng(3).normal(size=(16, 16, 16, 3)) * 2 + 0.5).astype(np.float32)  # 2 per device
    variables = _variables(whole, x)
    expected, expected_stats = jax.jit(lambda v, x: whole.apply(v, x, train=True, mutable=["batch_stats"]))(
        variables, x)
    mesh = make_mesh([("data", -1)])
    run = jax.jit(jax.shard_map(lambda v, x: synced.apply(v, x, train=True, mutable=["batch_stats"]), mesh=mesh,
                                in_specs=(P(), P("data")), out_specs=(P("data"), P()), check_vma=False))
    logits, stats = run(variables, x)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, expected_stats)
