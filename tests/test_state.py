"""dtx.step.state: the train state is born in its layout (replicated on a data mesh), matches its abstract twin leaf
for leaf, starts at step 0, and its parameters come from the seed."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dtx import mesh as mesh_lib
from dtx import compress, models, strategies
from dtx.precision import LossScaler
from dtx.step import StepSpec
from dtx.step.state import (INIT_COMPILER_OPTIONS, _drawn_shardings, _init_fn, _init_parts, abstract_train_state,
                            init_train_state, num_params, replicated_shardings)

EXAMPLE = jax.ShapeDtypeStruct((8, 8, 8, 1), jnp.float32)


def test_state_is_born_replicated_like_its_abstract_twin_from_the_seed():
    model, tx = models.build_model("mlp", features=(16,)), optax.sgd(0.1, momentum=0.9)
    mesh = mesh_lib.make_mesh([("data", -1)])
    state = init_train_state(model, tx, EXAMPLE, seed=3, mesh=mesh)
    abstract = abstract_train_state(model, tx, EXAMPLE)
    assert jax.tree.structure(state) == jax.tree.structure(abstract)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)]
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in jax.tree.leaves(state))
    assert int(state.step) == 0
    assert num_params(state) == 8 * 8 * 16 + 16 + 16 * 10 + 10  # Dense(64 -> 16) and Dense(16 -> 10)
    other = init_train_state(model, tx, EXAMPLE, seed=4, mesh=mesh)
    assert not np.array_equal(state.params["Dense_0"]["kernel"], other.params["Dense_0"]["kernel"])


def test_init_compiled_at_o1_gives_the_default_levels_values_bit_for_bit():
    """Init is compiled at LLVM -O1 (INIT_COMPILER_OPTIONS: it runs once, and -O2 spends seconds per 4-D random
    kernel on XLA:CPU). The values must be what the default level gives: the same program compiled without the
    options, for a convolution (truncated normal over 4-D kernels), batch norm and an embedding (normal draws)."""
    mesh = mesh_lib.make_mesh([("data", -1)])
    cases = [(models.build_model("lenet", conv_features=(2, 4), dense_features=(8,), use_batch_norm=True), EXAMPLE),
             (models.build_model("transformer", num_layers=1, d_model=8, num_heads=2, max_len=8, num_classes=16),
              jax.ShapeDtypeStruct((2, 8), jnp.int32))]
    for model, example in cases:
        tx = optax.adam(1e-3)
        init = _init_fn(model, tx, example, LossScaler())
        shardings = replicated_shardings(jax.eval_shape(init, 5), mesh)
        default = jax.jit(init, out_shardings=shardings)(5)
        state = init_train_state(model, tx, example, seed=5, mesh=mesh)
        for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert INIT_COMPILER_OPTIONS == {"xla_backend_optimization_level": 1}


def test_the_models_draw_is_one_program_whatever_the_rest_of_the_state():
    """init_train_state compiles the model's random draw apart from the state built from it, so that a run changing
    the optimizer, the strategy or the compressor reads the draw (nearly all of init's compile) back from the
    persistent cache: its program is the same text for SGD and for Adam with local SGD and error-feedback top-k;
    and the two programs give the one-program init's state bit for bit, also when each worker keeps its own batch
    statistics (local SGD moves them into ``worker``) and when the parameters are split (FSDP)."""
    from dtx.parallel import get_layout

    model = models.build_model("lenet", conv_features=(2,), dense_features=(8,), use_batch_norm=True)
    mesh = mesh_lib.make_mesh([("data", -1)])
    local, topk = strategies.make_strategy("local_sgd", period=2), compress.make_compressor("topk")
    texts = []
    for tx, strategy, compressor, layout in ((optax.sgd(0.1), None, None, None), (optax.adam(1e-3), local, topk, None),
                                             (optax.adam(1e-3), None, None, "fsdp")):
        workers = mesh_lib.data_parallel_size(mesh)
        init = _init_fn(model, tx, EXAMPLE, LossScaler(), strategy, compressor, workers)
        abstract = jax.eval_shape(init, 2)
        shardings = (get_layout(layout).place(abstract, mesh).state if layout
                     else replicated_shardings(abstract, mesh))
        # (the one program at init's own level: the test above holds it equal to the default level's)
        one = jax.jit(init, out_shardings=shardings).lower(2).compile(INIT_COMPILER_OPTIONS)(2)
        with warnings.catch_warnings():  # "Some donated buffers were not usable": the draw wrote the parameters
            warnings.simplefilter("error")  # elsewhere than where they live, and init held them twice
            state = init_train_state(model, tx, EXAMPLE, seed=2, mesh=mesh, shardings=shardings,
                                     per_worker=StepSpec(strategy=strategy, compressor=compressor))
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding == b.sharding
        if layout is None:
            draw, _ = _init_parts(model, tx, EXAMPLE, LossScaler(), strategy, compressor, workers)
            texts.append(jax.jit(draw, out_shardings=_drawn_shardings(jax.eval_shape(draw, 2), shardings, mesh))
                         .lower(2).as_text())
    assert texts[0] == texts[1]
    # FSDP split the larger kernels (the draw wrote them where they live, donated through: no warning above)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params))
