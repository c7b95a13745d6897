"""Parameter paths as strings (``params/Dense_0/kernel``): the one spelling that partitioning rules,
optimizer masks, checkpoint manifests and memory reports match against each other."""

from __future__ import annotations

from typing import Any

import jax


def path_str(keypath) -> str:
    """``"Dense_0/kernel"`` for a pytree key path (as ``jax.tree_util.tree_leaves_with_path`` yields it)."""
    return jax.tree_util.keystr(keypath, simple=True, separator="/")


def named_leaves(tree: Any, is_leaf=None) -> list[tuple[str, Any]]:
    """``(path string, leaf)`` for every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [(path_str(keypath), leaf) for keypath, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)]
