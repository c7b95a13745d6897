"""What a module adds to a train step besides its outputs: loss terms and records, sown into two collections.

A layer that has a loss of its own (a mixture of experts' load-balancing loss and router z-loss,
:mod:`dtx.models.moe`) or figures worth watching (its dropped tokens) sows them with flax's ``Module.sow``:

* ``losses``: scalars, already weighted, that the train step adds to the task's loss before differentiating;
* ``records``: scalars the step averages like the task's metrics and writes to the run's records (``metrics.jsonl``,
  TensorBoard, ``dtx plot --metrics``), named by the module's path and the value's name joined by dots
  (``Block_0.moe.dropped``).

dtx's step asks for both collections in every training forward pass (:func:`dtx.step.body.make_loss_fn`) and
takes them out of the model's state with :func:`take`; evaluation and ``model.init`` do not ask, so a module
sows only while training and not initialising (:func:`sowing`), and nothing it sows is ever kept in the train
state. Your own module uses the same two names, through :func:`add_loss` and :func:`add_record`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

LOSSES = "losses"
RECORDS = "records"
COLLECTIONS = (LOSSES, RECORDS)


def sowing(module: nn.Module, collection: str = RECORDS) -> bool:
    """Whether ``module`` runs in a pass that collects ``collection`` (a train step's), not in ``model.init``."""
    return module.is_mutable_collection(collection) and not module.is_initializing()


def add_loss(module: nn.Module, name: str, value) -> None:
    """Add the scalar ``value`` (weighted already) to the training loss, where the step collects losses."""
    if sowing(module, LOSSES):
        module.sow(LOSSES, name, jnp.asarray(value, jnp.float32))


def add_record(module: nn.Module, name: str, value) -> None:
    """Report the scalar ``value`` as record ``<module path>.<name>``, where the step collects records."""
    if sowing(module, RECORDS):
        module.sow(RECORDS, name, jnp.asarray(value, jnp.float32))


def take(variables: dict) -> tuple[dict, jax.Array | None, dict[str, jax.Array]]:
    """``(variables without the sown collections, the sum of the sown losses or None, {record name: value})``.

    A value sown twice under one name (a module called twice) is summed as a loss and averaged as a record."""
    variables = dict(variables)
    losses = jax.tree.leaves(variables.pop(LOSSES, {}))
    records = {}
    for path, values in _named(variables.pop(RECORDS, {})):
        records[path] = sum(values) / len(values)
    return variables, (sum(losses) if losses else None), records


def _named(tree, prefix: str = ""):
    """``(dotted path, tuple of sown values)`` of each name in a sown collection."""
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, tuple):
            yield path, value
        else:
            yield from _named(value, path)
