"""Column/row pairs for the fully connected stacks of the ``model`` and ``hybrid`` layouts (``parallel.fc_pairs``).

Das et al. (arXiv 1602.06709, §3.2) split every fully connected layer by its output features (columns) and
gather its input first. Megatron (Shoeybi et al., arXiv 1909.08053, §3) pairs a column-split layer with a
row-split one: the second layer is split by its *input* features, takes them where the first left them (no
gather between the pair) and the layout reduces its partial sums — here reduce-scattered onto the batch, as
:meth:`dtx.parallel.activations.ActivationLayout._row_parallel` runs it (the ``parallel.rules`` row split; a
following column layer's gather of the batch is the other half of an all-reduce, a following data-parallel
layer or the loss needs no more). Per example a column layer exchanges its input width (all-gather forward,
reduce-scatter of the input gradient backward), a row layer its output width (reduce-scatter forward,
all-gather of the output gradient backward); the weights are split ``1/G`` either way.

Which layers become rows: :func:`choose`, a shortest path over the layers (a row only right after a column
whose output it takes), used twice — by the layout on the parameters' widths (:func:`row_layers`, each
layer's exchanged elements per example; :func:`dtx.parallel.rules.split_kernels` splits them), and by the planner on modelled seconds (:mod:`dtx.perf.row_split`).
For a VGG-A head ``25088 → 4096 → 4096 → 1000`` it splits fc6 and fc7 by columns and fc8 by rows:
``25088 + 4096 + 1000`` elements per example instead of ``25088 + 4096 + 4096`` (and no all-to-all of the
logits); a chain ``a → b → c`` with ``c < b`` always gains ``b − c``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from dtx.parallel.rules import PartitionError
from dtx.paths import named_leaves

KEY = "parallel.fc_pairs"
KINDS = ("data", "column", "row")  # a layer's ways to run; ties go to the earlier


def choose(options: Sequence[Mapping[str, float]], chains: Sequence[bool]) -> list[str]:
    """The cheapest way to run each layer, in order: ``options[i]`` maps the ways layer ``i`` can run
    (:data:`KINDS`) to their costs; a ``"row"`` is taken only when ``chains[i]`` (layer ``i`` takes layer
    ``i − 1``'s output features as they are) and layer ``i − 1`` runs as a ``"column"``. Without rows each
    layer takes its own cheapest way."""
    best: dict[str | None, tuple[float, list[str]]] = {None: (0.0, [])}
    for i, option in enumerate(options):
        step: dict[str | None, tuple[float, list[str]]] = {}
        for previous, (total, path) in best.items():
            for kind in KINDS:
                if kind not in option or (kind == "row" and not (chains[i] and previous == "column")):
                    continue
                cost = total + option[kind]
                if kind not in step or cost < step[kind][0] - 1e-12 * abs(step[kind][0]):
                    step[kind] = (cost, path + [kind])
        if not step:
            raise ValueError(f"layer {i} has no way to run: {dict(option)}")
        best = step
    total = min(cost for cost, _ in best.values())
    return next(best[kind][1] for kind in KINDS if kind in best and best[kind][0] <= total + 1e-12 * abs(total))


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def dense_chains(abstract_params: Any) -> list[list[tuple[str, tuple[int, int]]]]:
    """Each module's Dense layers (rank-2 ``kernel``) in the natural order of their names (flax's
    ``Dense_0, Dense_1, …``, the zoo's ``fc6, fc7, fc8``), cut where a width does not chain (one layer's
    output features are not the next one's input): ``[[(path, (in, out)), ...], ...]``."""
    parents: dict[str, list[tuple[str, tuple[int, int]]]] = {}
    for path, leaf in named_leaves(abstract_params):
        if path.endswith("/kernel") and len(leaf.shape) == 2:
            layer = path[: -len("/kernel")]
            parents.setdefault(layer.rpartition("/")[0], []).append((layer, tuple(leaf.shape)))
    chains = []
    for layers in parents.values():
        layers.sort(key=lambda item: _natural(item[0].rpartition("/")[2]))
        for layer in layers:
            if chains and chains[-1][-1] in layers and chains[-1][-1][1][1] == layer[1][0]:
                chains[-1].append(layer)
            else:
                chains.append([layer])
    return chains


def row_layers(abstract_params: Any, layout: str) -> list[str]:
    """The Dense layers to split by their input features: in each chain (:func:`dense_chains`), :func:`choose` on
    the elements each layer exchanges per example (a column its input width, a row its output width). Refuses a
    model with no two chaining Dense layers, naming the key."""
    chains = dense_chains(abstract_params)
    if not any(len(chain) > 1 for chain in chains):
        raise PartitionError(
            f"{KEY}=True pairs consecutive fully connected layers (one's output features the next one's input), "
            f"and this model has none (its Dense layers: {[layer for chain in chains for layer, _ in chain] or 'none'}"
            f"); leave {KEY} at its default False with parallel.name={layout!r}")
    rows = []
    for chain in chains:
        kinds = choose([{"column": i_o[0], "row": i_o[1]} for _, i_o in chain], [i > 0 for i in range(len(chain))])
        rows += [layer for (layer, _), kind in zip(chain, kinds) if kind == "row"]
    return rows
