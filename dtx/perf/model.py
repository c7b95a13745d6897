"""Analytic iteration-time model, scaling simulator and per-layer parallelism planner.

Das et al., *Distributed Deep Learning Using Synchronous SGD* (arXiv 1602.06709), scale synchronous SGD
by comparing, layer by layer, compute with communication (§3): data parallelism communicates a layer's
**weight gradients**, model parallelism its **activations**, so convolutions (few weights, large
activations) go data-parallel and fully connected layers (many weights, small activations) model- or
hybrid-parallel. This module makes that analysis executable for any flax model:

1. :func:`analyze` (:mod:`dtx.perf.layers`) — per-layer FLOPs, weights and activation sizes by
   abstract evaluation; forward = 2·MACs FLOPs, a training step 6·MACs.
2. :func:`compute_time` — a roofline (Williams, Waterman & Patterson, CACM 2009):
   ``max(FLOPs / (peak·efficiency), bytes / memory bandwidth)``, where bytes is the
   compulsory traffic of the three GEMMs, ``3·e·(b·in + b·out/s + W/s)`` for ``b``
   examples, ``W`` weights and output features split ``s`` ways. At small per-node
   batches fully connected layers are memory-bound (the ``3W`` term) — Das et al. §2.
3. :func:`layer_cost` — one layer on ``N`` nodes, global batch ``B``, mesh
   ``(data N/G, model G)`` (Das et al. §3.1-3.3; ``e`` = bytes per element):

   * data parallel: ``B/N`` examples per node; allreduce of the ``W·e`` gradient bytes
     over ``N`` nodes (α-β formula of the chosen algorithm, :mod:`dtx.comm.costmodel`).
   * model parallel inside a group of ``G`` (``G = N``: pure model parallelism;
     ``1 < G < N``: hybrid): a group works on ``B·G/N`` examples, each node computes
     ``1/G`` of the output features. Forward all-gathers the layer's input
     (``B·G/N·in·e`` bytes), backward reduce-scatters the input gradient of the same
     size — together one allreduce's cost over ``G`` (§3.2: communication scales with
     activations, not weights) — and the ``W·e/G`` weight gradients are allreduced
     across the ``N/G`` groups (§3.3).
4. :func:`balance` — §3's balance condition for data parallelism, compute ≥ communication, and the
   minimum per-node minibatch it implies.
5. :func:`make_plan` — per layer data or model parallel (``pairs``: or split by rows after a column-split
   layer, :mod:`dtx.perf.row_split`) and one group size ``G`` for the whole mesh, minimising predicted
   time; :meth:`Plan.rules` emits the choice as the ``(regex, PartitionSpec)`` rules :mod:`dtx.parallel` runs.
6. :func:`scaling` — iteration time, speedup and efficiency against node count, at
   fixed global batch (strong) or fixed per-node batch (weak).

Overlap: ``none`` adds every communication to the compute; ``ideal`` lets each layer's gradient allreduce
run, on one channel, while the backward pass of the layers below it continues (activation exchanges stay
blocking). The truth lies between the two bounds; both are reported. Gradients are allreduced per layer, as in
Das et al.; for many layers on many nodes the ring's ``2(p−1)α`` latency then dominates — compare
``algorithm="halving_doubling"`` or ``"tree"``.

Calibration (``benchmarks/calibration.py``, its section in BENCHMARKS.md): fed with measured single-device
per-layer forward+backward times of a small VGG-like CNN, the model predicts the measured training step
(goal: within 25 %; its last run, on a shared 2-core host, 95.33 vs 87.47 ms, 1.090). That checks the
composition of per-layer costs into a step, not the cluster presets; ``tests/test_perfmodel.py`` checks the
arithmetic on given times.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec as P

from dtx.comm import costmodel
from dtx.comm.algorithms import get_algorithm
from dtx.perf.clusters import Cluster
from dtx.perf import row_split
from dtx.perf import layers as layers_lib
from dtx.perf.layers import Layer, PerfModelError

OVERLAPS = ("none", "ideal")
PLANS = ("data", "hybrid", "auto")


def compute_time(layer: Layer, cluster: Cluster, batch: float, shards: int = 1,
                 per_example: Mapping[str, float] | None = None) -> float:
    """Roofline seconds for forward + backward of ``batch`` examples, output features split ``shards`` ways.

    ``per_example`` (seconds per example, by layer name) replaces the roofline with a
    measurement, scaled linearly in the work this node does.
    """
    if per_example is not None and layer.name in per_example:
        return per_example[layer.name] * batch / shards
    flops = layer.train_flops * batch / shards
    elements = batch * layer.in_elements + (batch * layer.out_elements + layer.weights) / shards
    traffic = 3 * cluster.bytes_per_element * elements
    return max(flops / (cluster.node_flops * efficiency(cluster, layer)), traffic / cluster.memory_bandwidth)


def efficiency(cluster: Cluster, layer: Layer) -> float:
    """The fraction of peak ``layer`` sustains: a convolution's, else a matrix multiply's (``dense``: Dense layers,
    and the projections and attention products of :func:`dtx.perf.layers.matmuls`)."""
    return cluster.efficiency["conv" if layer.kind == "conv" else "dense"]


class LayerCost(NamedTuple):
    """One layer's share of an iteration on one node (seconds; bytes sent per node)."""

    compute: float
    activation_comm: float  # blocking: model-parallel all-gather + reduce-scatter
    gradient_comm: float  # overlappable: weight-gradient allreduce
    activation_bytes: float
    gradient_bytes: float


def layer_cost(layer: Layer, cluster: Cluster, nodes: int, global_batch: int, group: int = 1,
               sharded: bool = False, algorithm: str = "ring",
               per_example: Mapping[str, float] | None = None, last: bool = False) -> LayerCost:
    """Cost of ``layer`` data-parallel (``sharded=False``) or model-parallel in groups of ``group``.

    ``last``: the network's output layer, whose split outputs a model-parallel plan must
    bring together for the loss (see :func:`layer_bytes`).
    """
    e = cluster.bytes_per_element
    activation_bytes, gradient_bytes = layer_bytes(layer, nodes, global_batch, group, sharded, e, algorithm, last)
    if not sharded or group == 1:
        grad = layer.weights * e
        return LayerCost(compute_time(layer, cluster, global_batch / nodes, 1, per_example), 0.0,
                         cluster.allreduce_time(grad, nodes, cluster.local_size, algorithm), 0.0, gradient_bytes)
    group_batch = global_batch * group / nodes
    act, grad, groups = group_batch * layer.in_elements * e, layer.weights * e / group, nodes // group
    # An all-to-all costs what the reduce-scatter half of a ring allreduce of the same bytes costs.
    output = cluster.allreduce_time(group_batch * layer.out_elements * e / group, group, group, algorithm) / 2
    return LayerCost(
        compute_time(layer, cluster, group_batch, group, per_example),
        # The model axis is the inner mesh axis: a group of G lies within one machine when G <= local_size.
        cluster.allreduce_time(act, group, group, algorithm) + (output if last else 0.0),
        cluster.allreduce_time(grad, groups, max(1, cluster.local_size // group), algorithm),
        activation_bytes, gradient_bytes,
    )


def layer_bytes(layer: Layer, nodes: int, global_batch: int, group: int = 1, sharded: bool = False,
                bytes_per_element: int = 4, algorithm: str = "ring", last: bool = False) -> tuple[float, float]:
    """``(activation bytes, weight-gradient bytes)`` one node sends for ``layer`` per iteration.

    The bytes of :func:`layer_cost`, which need no cluster: data parallel sends the
    ``W·e`` gradient allreduce over ``nodes``; model parallel in groups of ``group``
    exchanges the group's input activations (all-gather + reduce-scatter, one
    allreduce's bytes over the group) and allreduces its ``W·e/G`` slice over the
    ``nodes/G`` groups. A model-parallel output layer (``last``) also hands its split
    outputs to the loss, which needs whole rows: an all-to-all inside the group of
    ``(G−1)/G`` of the node's ``B·G/N × out/G`` slice.
    """
    e = bytes_per_element
    if not sharded or group == 1:
        return 0.0, costmodel.cost_terms(algorithm, layer.weights * e, nodes).path_bytes
    group_batch = global_batch * group / nodes
    act = group_batch * layer.in_elements * e
    output = (group - 1) / group * group_batch * layer.out_elements * e / group if last else 0.0
    return (costmodel.cost_terms(algorithm, act, group).path_bytes + output,
            costmodel.cost_terms(algorithm, layer.weights * e / group, nodes // group).path_bytes)


def redistribution(layers: Sequence[Layer], split: Sequence[str], nodes: int, global_batch: int, group: int,
                   bytes_per_element: int = 4) -> tuple[dict[str, float], float]:
    """The bytes a residual network's graph adds to a plan: ``({layer: bytes one node sends}, step bytes)``.

    A chain (every :attr:`Layer.source` ``None``) adds none. In a residual network (:func:`dtx.perf.layers.sources`)
    an add joining a branch whose features are split over ``model`` (a column-split layer's output, ``split``) with
    one on the batch split (a data-parallel shortcut, or the block's input) is done on the batch split
    (:mod:`dtx.parallel.activations`): the split branch is moved there, an all-to-all inside the group of the
    node's ``B/N·out·e`` bytes, of which it sends ``(G−1)/G``, and its gradient moved back, another. Both are
    charged to the branch's layer (:func:`dtx.perf.layers.moved`). The whole step moves that gradient once more: a
    batch norm's backward (ResNet's ``bn2`` before the add) takes it twice, and XLA moves it for each use — charged
    to the step only, as the layer alone (what :mod:`dtx.run.verify` compiles per layer) has no norm. An add of two
    split branches, or of two batch-split ones, moves nothing."""
    if group == 1 or all(layer.source is None for layer in layers):
        return {}, 0.0
    graph = {layer.name: layer.source for layer in layers}
    by_name = {layer.name: layer for layer in layers}
    each, step = {}, 0.0
    for name in sorted(layers_lib.moved(graph, set(split)), key=list(by_name).index):
        moved = (group - 1) / group * global_batch / nodes * by_name[name].out_elements * bytes_per_element
        each[name] = 2 * moved
        step += moved
    # A data-parallel layer fed by a column-split one alone (ResNet-50's conv3 after a split conv2, inside a
    # bottleneck): its input arrives split by features and is moved to the batch split, an all-to-all in the group,
    # and its input gradient moved back, another -- charged to the layer that takes it (its program does the move).
    for layer in layers:
        if layer.name not in split and isinstance(layer.source, str) and layer.source in split:
            moved = (group - 1) / group * global_batch / nodes * layer.in_elements * bytes_per_element
            each[layer.name] = each.get(layer.name, 0.0) + 2 * moved
    return each, step


def _with_redistribution(layers, costs, sharded, rows, cluster: Cluster, nodes: int, global_batch: int, group: int,
                         algorithm: str) -> list:
    """``costs`` with each moved branch's all-to-alls (:func:`redistribution`) in its activation exchange; the step's
    extra move goes to the layer too (an all-to-all costs half a ring allreduce of its bytes, as an output layer's)."""
    split = [name for name in sharded if name not in rows]
    each, _ = redistribution(layers, split, nodes, global_batch, group, cluster.bytes_per_element)
    if not each:
        return costs
    out = []
    for layer, cost in zip(layers, costs):
        if layer.name in each:
            size = global_batch / nodes * layer.out_elements * cluster.bytes_per_element
            seconds = 3 * cluster.allreduce_time(size, group, group, algorithm) / 2
            cost = cost._replace(activation_comm=cost.activation_comm + seconds,
                                 activation_bytes=cost.activation_bytes + each[layer.name])
        out.append(cost)
    return out


def iteration_times(costs: Sequence[LayerCost]) -> dict[str, float]:
    """Predicted seconds per iteration: ``{"none": no-overlap, "ideal": ideal-overlap bound}``.

    Forward is 1/3 of each layer's compute, backward 2/3 (the FLOP convention); the
    activation exchange is half in each. In ``ideal``, layer ``l``'s gradient
    allreduce starts when its backward ends and the channel is free (back-propagation
    runs last layer first), so it hides behind the backward pass of layers ``< l``.
    """
    none = sum(c.compute + c.activation_comm + c.gradient_comm for c in costs)
    t = sum(c.compute / 3 + c.activation_comm / 2 for c in costs)
    channel = 0.0
    for c in reversed(costs):
        t += 2 * c.compute / 3 + c.activation_comm / 2
        channel = max(channel, t) + c.gradient_comm
    return {"none": none, "ideal": max(t, channel)}


class Balance(NamedTuple):
    """Das et al. §3's balance of a data-parallel layer at a per-node batch."""

    compute: float  # seconds of forward + backward at the per-node batch
    communication: float  # seconds of the weight-gradient allreduce
    balanced: bool  # compute >= communication: the allreduce can hide behind compute
    min_batch: int  # smallest per-node batch with compute >= communication


def balance(layer: Layer, cluster: Cluster, nodes: int, per_node_batch: int, algorithm: str = "ring") -> Balance:
    """Compute vs gradient communication of ``layer`` under data parallelism on ``nodes`` nodes.

    The allreduce does not depend on the batch and both roofs of the compute grow
    linearly in it, so the minimum batch solves ``max(flop roof, memory roof) = comm``:
    ``b* = ⌈min(T·peak·eff / F, (T·bw / 3e − W) / (in + out))⌉`` (at least 1).
    """
    comm = cluster.allreduce_time(layer.weights * cluster.bytes_per_element, nodes, cluster.local_size, algorithm)
    compute = compute_time(layer, cluster, per_node_batch)
    by_flops = comm * cluster.node_flops * efficiency(cluster, layer) / layer.train_flops
    by_bytes = (comm * cluster.memory_bandwidth / (3 * cluster.bytes_per_element) - layer.weights) / (
        layer.in_elements + layer.out_elements)
    min_batch = max(1, math.ceil(min(by_flops, by_bytes) * (1 - 1e-12)))
    return Balance(compute, comm, compute >= comm, min_batch)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A parallelisation of a model on ``nodes`` nodes over the mesh ``(data, model)``.

    Attributes:
      nodes / global_batch: the setting planned for.
      group_size: size ``G`` of the ``model`` mesh axis (1: pure data parallelism).
      sharded: names of the layers split over ``model``; the others are data-parallel.
      layers / costs: the analysed layers and each one's :class:`LayerCost`.
      times: ``{"none": s, "ideal": s}`` predicted iteration time per overlap bound.
    """

    nodes: int
    global_batch: int
    group_size: int
    sharded: tuple[str, ...]
    layers: tuple[Layer, ...]
    costs: tuple[LayerCost, ...]
    times: Mapping[str, float]
    rows: tuple[str, ...] = ()  # the split layers split by their input rows (:mod:`dtx.perf.row_split`)

    @property
    def mesh_spec(self) -> list[tuple[str, int]]:
        """The mesh as :func:`dtx.mesh.make_mesh` takes it: ``[("data", N/G), ("model", G)]``."""
        return [("data", self.nodes // self.group_size), ("model", self.group_size)]

    def choice(self, name: str) -> str:
        """``"data"``, ``"model"`` (``G = N``) or ``"hybrid"`` (``1 < G < N``) for layer ``name``."""
        if name not in self.sharded:
            return "data"
        return "model" if self.group_size == self.nodes else "hybrid"

    def rules(self) -> list[tuple[str, P]]:
        """The plan as partitioning rules over the mesh ``("data", "model")``, first match wins.

        Each model-parallel layer's kernel is split along its output features (column split): Dense
        ``(in, out)`` → ``P(None, "model")``, Conv ``(kh, kw, in, out)`` → ``P(None, None, None, "model")``, and
        its bias with them (``P("model")``); a row layer's (:attr:`rows`) by its input, ``P("model", None)``, its
        bias whole; every data-parallel layer stays replicated, and the list ends with ``(".*", P())``::

            [("^fc6/kernel$", P(None, "model")), ("^fc6/bias$", P("model")), ..., (".*", P())]
        """
        by_name = {layer.name: layer for layer in self.layers}
        rules = []
        for name in self.sharded:
            row, kernel = name in self.rows, by_name[name].kernel_shape
            rules.append((f"^{re.escape(name)}/kernel$", P("model", None) if row else
                          P(*[None] * (len(kernel) - 1), "model")))
            if not row and by_name[name].weights > math.prod(kernel):  # a bias (ResNet's convs have none)
                rules.append((f"^{re.escape(name)}/bias$", P("model")))
        return rules + [(".*", P())]


def _check_setting(nodes: int, global_batch: int) -> None:
    if not isinstance(nodes, int) or nodes < 1:
        raise PerfModelError(f"node count must be a positive integer, got {nodes!r}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise PerfModelError(f"global batch must be a positive integer, got {global_batch!r}")
    if global_batch % nodes:
        lower = global_batch // nodes * nodes
        nearest = " or ".join(str(b) for b in (lower, lower + nodes) if b)
        raise PerfModelError(
            f"global batch {global_batch} does not split evenly over {nodes} nodes; use a multiple of {nodes} "
            f"(e.g. {nearest}) or fewer nodes")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_plan(layers: Sequence[Layer], cluster: Cluster, nodes: int, global_batch: int, *, mode: str = "auto",
              group_size: int | None = None, overlap: str = "none", algorithm: str = "ring",
              per_example: Mapping[str, float] | None = None,
              memory: Callable[[Plan], float] | None = None, pairs: bool = False) -> Plan:
    """Choose per layer data or model parallelism and the group size that minimise iteration time.

    Args:
      layers: from :func:`analyze`.
      cluster: the machine (:mod:`dtx.perf.clusters`).
      nodes / global_batch: ``global_batch`` must divide evenly over ``nodes``.
      mode: ``"data"`` (every layer data-parallel, ``G = 1``); ``"hybrid"`` (Das et al. §3.3: convolutions
        data-parallel, every Dense layer model-parallel in groups of the best ``G > 1``); ``"auto"`` (each
        layer whichever costs it less at each candidate ``G``, then the best ``G``, possibly 1).
      group_size: fix ``G`` instead of searching the divisors of ``nodes``.
      overlap: which bound (:data:`OVERLAPS`) the plan minimises.
      algorithm: allreduce algorithm of :mod:`dtx.comm.costmodel`.
      per_example: measured seconds per example by layer name (see :func:`compute_time`).
      memory: per-device bytes of a plan (``dtx.perf.memory.estimate_plan(plan, ...).total``); a group size
        whose plan needs more than ``cluster.device_memory`` is not chosen.

    A layer can be split only if ``G`` divides its output features (else it stays data-parallel, as in
    :mod:`dtx.parallel`). Ties go to the smaller ``G``. ``pairs``: a Dense layer may also be split by its
    input rows after a column-split one (``--fc-pairs``).
    """
    _check_setting(nodes, global_batch)
    if mode not in PLANS:
        raise PerfModelError(f"unknown plan {mode!r}; choose one of {', '.join(PLANS)}")
    if overlap not in OVERLAPS:
        raise PerfModelError(f"unknown overlap {overlap!r}; choose one of {', '.join(OVERLAPS)}")
    get_algorithm(algorithm)
    if group_size is not None:
        if not isinstance(group_size, int) or group_size < 1 or nodes % group_size:
            raise PerfModelError(
                f"group size {group_size!r} does not divide the {nodes} nodes of the (data, model) mesh; "
                f"choose one of {_divisors(nodes)}")
        if mode == "data" and group_size > 1:
            raise PerfModelError(f"plan 'data' has no model axis; drop the group size {group_size} or use "
                                 "plan 'hybrid' or 'auto'")
        candidates = [group_size]
    elif mode == "data":
        candidates = [1]
    else:
        candidates = [g for g in _divisors(nodes) if g > 1 or mode == "auto" or nodes == 1]
    layers = tuple(layers)
    best, smallest = None, math.inf
    for g in candidates:
        data = [layer_cost(layer, cluster, nodes, global_batch, 1, False, algorithm, per_example) for layer in layers]
        model = [layer_cost(layer, cluster, nodes, global_batch, g, True, algorithm, per_example,
                            last=i == len(layers) - 1)
                 if layer.kernel_shape[-1] % g == 0 and g > 1 and (mode == "auto" or layer.kind == "dense") else None
                 for i, layer in enumerate(layers)]
        rows = row_split.row_costs(layers, cluster, nodes, global_batch, g, algorithm, lambda layer, b, s: compute_time(
            layer, cluster, b, s, per_example), LayerCost) if pairs else None
        costs, sharded, split_rows = row_split.choose(layers, data, model, mode, rows)
        costs = _with_redistribution(layers, costs, sharded, split_rows, cluster, nodes, global_batch, g, algorithm)
        plan = Plan(nodes, global_batch, g, tuple(sharded), layers, tuple(costs), iteration_times(costs),
                    tuple(split_rows))
        need = memory(plan) if memory is not None else 0.0
        if need > cluster.device_memory:  # it would not fit: never the plan, however fast
            smallest = min(smallest, need)
            continue
        if best is None or plan.times[overlap] < best.times[overlap] * (1 - 1e-12):
            best = plan
    if best is None:
        raise PerfModelError(
            f"no plan of {nodes} nodes at global batch {global_batch} fits the {cluster.device_memory / 2**30:.1f} "
            f"GiB of a {cluster.name} node: the smallest needs {smallest / 2**30:.1f} GiB per node; use more nodes, "
            "a smaller batch, or another layout (dtx simulate --memory)")
    return best


class ScalingPoint(NamedTuple):
    """One node count of a scaling study; ``time``, speedup and efficiency use the chosen overlap bound."""

    nodes: int
    per_node_batch: float
    global_batch: int
    time: float
    speedup: float
    efficiency: float
    plan: Plan


def scaling(layers: Sequence[Layer], cluster: Cluster, node_counts: Sequence[int], *,
            global_batch: int | None = None, per_node_batch: int | None = None, mode: str = "auto",
            overlap: str = "none", algorithm: str = "ring", group_size: int | None = None,
            memory: Callable[[Plan], float] | None = None, pairs: bool = False) -> list[ScalingPoint]:
    """Predicted iteration time, speedup and efficiency per node count.

    Strong scaling (``global_batch`` fixed): speedup ``T(1)/T(N)``, efficiency
    ``speedup/N``. Weak scaling (``per_node_batch`` fixed, global batch ``b·N``):
    speedup is the throughput ratio ``N·T(1)/T(N)``, efficiency ``T(1)/T(N)``.
    ``T(1)`` is one node with the same (strong) or per-node (weak) batch, a reference
    whether or not it fits; ``memory`` (see :func:`make_plan`) applies to the node counts.
    """
    if (global_batch is None) == (per_node_batch is None):
        raise PerfModelError("give exactly one of global_batch (strong scaling) or per_node_batch (weak scaling)")
    if not node_counts:
        raise PerfModelError("node_counts is empty; give e.g. [1, 2, 4, 8]")
    if per_node_batch is not None and (not isinstance(per_node_batch, int) or per_node_batch < 1):
        raise PerfModelError(f"per-node batch must be a positive integer, got {per_node_batch!r}")
    kwargs = dict(mode=mode, overlap=overlap, algorithm=algorithm, pairs=pairs)
    strong = global_batch is not None
    base_batch = global_batch if strong else per_node_batch
    base = make_plan(layers, cluster, 1, base_batch, **kwargs).times[overlap]
    points = []
    for n in node_counts:
        batch = global_batch if strong else per_node_batch * n
        g = group_size if group_size is not None and n > 1 else None
        plan = make_plan(layers, cluster, n, batch, group_size=g, memory=memory, **kwargs)
        t = plan.times[overlap]
        speedup = base / t if strong else n * base / t
        points.append(ScalingPoint(n, batch / n, batch, t, speedup, speedup / n, plan))
    return points


def layer_report(plan: Plan, cluster: Cluster, algorithm: str = "ring") -> list[dict[str, Any]]:
    """Per layer of ``plan``: FLOPs, weights, compute, the three parallelisms' bytes, balance, choice."""
    n, b, g = plan.nodes, plan.global_batch, plan.group_size
    rows = []
    for i, (layer, cost) in enumerate(zip(plan.layers, plan.costs)):
        last = i == len(plan.layers) - 1
        volume = {
            "data": layer_cost(layer, cluster, n, b, 1, False, algorithm).gradient_bytes,
            "model": sum(layer_cost(layer, cluster, n, b, n, True, algorithm, last=last)[3:]),
            "hybrid": sum(layer_cost(layer, cluster, n, b, g, True, algorithm, last=last)[3:]) if g > 1 else None,
        }
        bal = balance(layer, cluster, n, b // n, algorithm)
        rows.append(dict(
            layer=layer.name, kind=layer.kind, gflop_per_example=layer.train_flops / 1e9, weights=layer.weights,
            activations=layer.out_elements, compute_s=cost.compute, comm_s=cost.activation_comm + cost.gradient_comm,
            bytes_data=volume["data"], bytes_model=volume["model"], bytes_hybrid=volume["hybrid"],
            balanced=bal.balanced, min_batch=bal.min_batch, choice=plan.choice(layer.name)))
    return rows


def plan_text(plan: Plan) -> str:
    """One line for a plan: ``data``, or ``G=<group> model|hybrid: <split layers>``."""
    if not plan.sharded:
        return "data"
    kind = "model" if plan.group_size == plan.nodes else "hybrid"
    names = [f"{name} rows" if name in plan.rows else name for name in plan.sharded]
    names = names if len(names) <= 4 else (*names[:2], "...", names[-1])
    more = f" ({len(plan.sharded)} layers)" if len(plan.sharded) > 4 else ""
    return f"G={plan.group_size} {kind}: {', '.join(names)}{more}"
