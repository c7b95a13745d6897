"""dtx.step.state: the train state is born in its layout (replicated on a data mesh), matches its abstract twin leaf
for leaf, starts at step 0, and its parameters come from the seed."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dtx import mesh as mesh_lib
from dtx import models
from dtx.step.state import abstract_train_state, init_train_state, num_params

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
