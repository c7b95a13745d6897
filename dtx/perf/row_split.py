"""The Das model's row-split layer, and the planner's choice among data, column and row (``--fc-pairs``).

A fully connected layer split by its input features inside a group of ``G`` (the partner of a column-split
one, :mod:`dtx.parallel.fc_pairs`) on ``N`` nodes, global batch ``B``, ``e`` bytes per element: the group's
``b = B·G/N`` examples each device multiplies by its ``in/G`` rows (the column layer's FLOPs: ``1/G`` of the
group's work), and

* forward: its ``b × out`` partial sums reduce-scattered onto the batch; backward: the output gradient
  all-gathered back — together one allreduce's bytes of ``b·out·e`` over ``G`` (a column layer: of
  ``b·in·e``), and no all-to-all of an output layer's logits (they land on the batch split);
* the ``W_k·e/G`` kernel slice's gradient allreduced over the ``N/G`` groups, as a column layer's; its bias,
  whole on every device (added after the reduction), allreduced over all ``N``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dtx.comm import costmodel
from dtx.parallel.fc_pairs import choose as choose_kinds
from dtx.perf.clusters import Cluster
from dtx.perf.layers import Layer


def chains(layers: Sequence[Layer]) -> list[bool]:
    """Per layer: whether it can be a row layer, taking the previous layer's output features as they are (two
    Dense layers, the first's output width the second's input)."""
    return [i > 0 and layer.kind == "dense" == layers[i - 1].kind and len(layer.kernel_shape) == 2
            and layers[i - 1].kernel_shape[-1] == layer.kernel_shape[0] for i, layer in enumerate(layers)]


def _split(layer: Layer) -> tuple[int, int]:
    kernel = math.prod(layer.kernel_shape)
    return kernel, layer.weights - kernel


def row_bytes(layer: Layer, nodes: int, global_batch: int, group: int, bytes_per_element: int = 4,
              algorithm: str = "ring") -> tuple[float, float]:
    """``(activation bytes, weight-gradient bytes)`` one node sends for a row-split ``layer`` (module docstring),
    :func:`dtx.perf.model.layer_bytes`'s counterpart."""
    e, (kernel, bias) = bytes_per_element, _split(layer)
    group_batch = global_batch * group / nodes
    act = costmodel.cost_terms(algorithm, group_batch * layer.out_elements * e, group).path_bytes
    grad = costmodel.cost_terms(algorithm, kernel * e / group, nodes // group).path_bytes
    return act, grad + (costmodel.cost_terms(algorithm, bias * e, nodes).path_bytes if bias else 0.0)


def row_cost(layer: Layer, cluster: Cluster, nodes: int, global_batch: int, group: int, algorithm: str,
             compute: float, cost_type: type) -> tuple:
    """The :class:`dtx.perf.model.LayerCost` (``cost_type``) of a row-split ``layer``; ``compute``: its
    seconds, a column split's (the same FLOPs per device)."""
    e, (kernel, bias) = cluster.bytes_per_element, _split(layer)
    group_batch = global_batch * group / nodes
    gradient = cluster.allreduce_time(kernel * e / group, nodes // group, max(1, cluster.local_size // group),
                                      algorithm)
    if bias:
        gradient += cluster.allreduce_time(bias * e, nodes, cluster.local_size, algorithm)
    return cost_type(compute, cluster.allreduce_time(group_batch * layer.out_elements * e, group, group, algorithm),
                     gradient, *row_bytes(layer, nodes, global_batch, group, e, algorithm))


def choose(layers: Sequence[Layer], data: Sequence, model: Sequence, mode: str,
           rows: Sequence | None = None) -> tuple[list, list[str], list[str]]:
    """Per layer the cheapest of its data-parallel cost ``data[i]``, its column-split cost ``model[i]`` (``None``
    where it cannot split; plan ``hybrid`` takes it wherever it can) and, with ``rows``, its row-split cost
    ``rows[i]`` (``None`` where it cannot be one): ``(costs, split layers, row layers)``."""
    options = []
    for i in range(len(layers)):
        option = {} if mode == "hybrid" and model[i] is not None else {"data": sum(data[i][:3])}
        if model[i] is not None:
            option["column"] = sum(model[i][:3])
        if rows is not None and rows[i] is not None:
            option["row"] = sum(rows[i][:3])
        options.append(option)
    kinds = choose_kinds(options, chains(layers) if rows is not None else [False] * len(layers))
    costs = [{"data": data, "column": model, "row": rows}[kind][i] for i, kind in enumerate(kinds)]
    return (costs, [layer.name for layer, kind in zip(layers, kinds) if kind != "data"],
            [layer.name for layer, kind in zip(layers, kinds) if kind == "row"])


def row_costs(layers: Sequence[Layer], cluster: Cluster, nodes: int, global_batch: int, group: int,
              algorithm: str, compute: Callable[[Layer, float, int], float], cost_type: type) -> list:
    """Each layer's row-split cost where it can be a row layer in groups of ``group`` (else ``None``);
    ``compute(layer, examples, shards)``: seconds of its forward and backward."""
    return [row_cost(layer, cluster, nodes, global_batch, group, algorithm,
                     compute(layer, global_batch * group / nodes, group), cost_type)
            if ok and group > 1 and layer.kernel_shape[0] % group == 0 else None
            for layer, ok in zip(layers, chains(layers))]
