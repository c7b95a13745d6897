"""dtx.paths: the one spelling of a parameter's path, shared by rules, masks and manifests."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dtx.paths import named_leaves, path_str


def test_paths_are_slash_joined_keys_in_leaf_order():
    tree = {"params": {"Dense_0": {"kernel": jnp.zeros(2), "bias": jnp.zeros(1)}}, "step": jnp.zeros(())}
    assert [name for name, _ in named_leaves(tree)] == ["params/Dense_0/bias", "params/Dense_0/kernel", "step"]
    assert [leaf.shape for _, leaf in named_leaves(tree)] == [leaf.shape for leaf in jax.tree.leaves(tree)]
    (keypath, _), *_ = jax.tree_util.tree_leaves_with_path({"a": [None, 1]})
    assert path_str(keypath) == "a/1"  # list positions are path components too


def test_is_leaf_stops_at_the_given_nodes():
    specs = {"fc6": {"kernel": PartitionSpec(None, "model")}}
    assert named_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) == [
        ("fc6/kernel", PartitionSpec(None, "model"))]
