"""dtx.step.state: the train state is born in its layout (replicated on a data mesh), matches its abstract twin leaf
for leaf, starts at step 0, and its parameters come from the seed."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dtx import mesh as mesh_lib
from dtx import models
from dtx.precision import LossScaler
from dtx.step.state import (INIT_COMPILER_OPTIONS, _init_fn, abstract_train_state, init_train_state, num_params,
                            replicated_shardings)

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
