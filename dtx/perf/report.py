"""``dtx simulate`` from Python: a scaling study that prints as the command's tables and draws its plot.

    >>> from dtx.perf import report
    >>> study = report.simulate("speech_dnn", "cloud_10gbe", [1, 4], global_batch=512)
    >>> [point.nodes for point in study.points]
    [1, 4]
    >>> print(study)  # doctest: +ELLIPSIS
    speech_dnn on cloud_10gbe (...): strong scaling, global batch 512, ring allreduce, ...

:func:`simulate` analyses the model (:func:`dtx.perf.layers.analyze`), plans every node count
(:func:`dtx.perf.model.scaling`) and reports the per-layer analysis at the largest one
(:func:`dtx.perf.model.layer_report`). The :class:`ScalingReport` it returns keeps the raw objects
(``points``: :class:`dtx.perf.model.ScalingPoint`, ``layers``: the per-layer rows), prints as the CLI's
tables (``print(study)``, or the cell's value in a notebook), and :meth:`ScalingReport.plot` writes
the speedup plot: ``study.plot("plots")`` writes ``plots/`` + :meth:`ScalingReport.file_name`, a name
carrying the model, the cluster, the node list and every setting away from its default, so two
studies never write the same file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Sequence
from typing import Any

from dtx import figures
from dtx.perf import model as perfmodel
from dtx.perf.clusters import Cluster, get_cluster
from dtx.perf.layers import Layer, PerfModelError, analyze


@dataclasses.dataclass(frozen=True)
class ScalingReport:
    """One scaling study: its setting, a :class:`dtx.perf.model.ScalingPoint` per node count, the
    per-layer rows at the largest, and the one-node times of both overlap bounds (the speedups' base)."""

    model: str
    cluster: Cluster
    points: tuple[perfmodel.ScalingPoint, ...]
    layers: tuple[dict[str, Any], ...]
    base_times: dict[str, float]
    global_batch: int | None = None
    per_node_batch: int | None = None
    algorithm: str = "ring"
    overlap: str = "none"
    plan: str = "auto"
    group_size: int | None = None

    @property
    def strong(self) -> bool:
        return self.per_node_batch is None

    def speedups(self) -> dict[str, tuple[list[int], list[float]]]:
        """``"predicted, overlap=B"`` -> (nodes, speedups) for both overlap bounds, and ``"linear"``."""
        nodes = [p.nodes for p in self.points]
        series = {f"predicted, overlap={bound}": (nodes, [(1 if self.strong else p.nodes) * self.base_times[bound]
                                                          / p.plan.times[bound] for p in self.points])
                  for bound in perfmodel.OVERLAPS}
        series["linear"] = (nodes, nodes)
        return series

    def file_name(self) -> str:
        """``simulate_<model>_<cluster>_nodes-1-2-4_batch-512[_plan-hybrid...].png``: the node list and every
        setting away from its default, so studies that differ never overwrite each other's plot."""
        batch = f"batch-{self.global_batch}" if self.strong else f"per-node-batch-{self.per_node_batch}"
        name = re.sub(r"[^\w.-]", "_", f"{self.model}_{self.cluster.name}")  # pkg.module:Class: no colon
        parts = [f"simulate_{name}", "nodes-" + "-".join(str(p.nodes) for p in self.points),
                 batch]
        defaults = dict(algorithm="ring", overlap="none", plan="auto", group_size=None)
        parts += [f"{key.replace('_', '-')}-{getattr(self, key)}" for key, default in defaults.items()
                  if getattr(self, key) != default]
        return "_".join(parts) + ".png"

    def plot(self, out: str | os.PathLike = ".") -> str:
        """Write the speedup plot (both overlap bounds against linear) into folder ``out``; returns its path."""
        setting = f"global batch {self.global_batch}" if self.strong else f"{self.per_node_batch} per node"
        return figures.line_plot(self.speedups(), os.path.join(out, self.file_name()),
                                 title=f"{self.model} on {self.cluster.name} ({setting})", xlabel="nodes (log2)",
                                 ylabel="speedup over 1 node (×)", logx=True)

    def __str__(self) -> str:
        """The tables ``dtx simulate`` prints: scaling per node count, the per-layer analysis, the plan's flags."""
        setting = (f"strong scaling, global batch {self.global_batch}" if self.strong
                   else f"weak scaling, {self.per_node_batch} per node")
        c = self.cluster
        lines = [f"{self.model} on {c.name} ({c.description}): {setting}, {self.algorithm} allreduce, "
                 f"{c.bytes_per_element} B/element, plan {self.plan}, speedup with overlap={self.overlap}",
                 f"{'nodes':>6} {'batch/node':>10} {'t_iter none':>12} {'t_iter ideal':>12} {'speedup':>8} "
                 f"{'efficiency':>10}  plan"]
        for p in self.points:
            lines.append(f"{p.nodes:>6} {p.per_node_batch:>10g} {p.plan.times['none']:>11.4f}s "
                         f"{p.plan.times['ideal']:>11.4f}s {p.speedup:>8.2f} {p.efficiency:>10.3f}  "
                         f"{perfmodel.plan_text(p.plan)}")
        last = self.points[-1]
        lines += ["", f"per layer at {last.nodes} nodes ({last.per_node_batch:g} per node; bytes sent per node per "
                      "iteration; balanced = data-parallel compute >= its allreduce, Das et al. §3):",
                  f"{'layer':>20} {'GFLOP/ex':>9} {'weights':>11} {'compute':>9} {'comm':>9} {'B data':>9} "
                  f"{'B model':>9} {'B hybrid':>9} {'balanced':>8} {'min b':>6}  choice"]
        for r in self.layers:
            hybrid = "-" if r["bytes_hybrid"] is None else f"{r['bytes_hybrid']:.2e}"
            lines.append(f"{r['layer']:>20} {r['gflop_per_example']:>9.3f} {r['weights']:>11,} {r['compute_s']:>8.4f}s "
                         f"{r['comm_s']:>8.4f}s {r['bytes_data']:>9.2e} {r['bytes_model']:>9.2e} {hybrid:>9} "
                         f"{'yes' if r['balanced'] else 'no':>8} {r['min_batch']:>6}  {r['choice']}")
        lines += ["", f"run the {last.nodes}-node plan: dtx train EXPERIMENT.py {' '.join(plan_overrides(last.plan))}"]
        return "\n".join(lines)

    def __repr__(self) -> str:  # a notebook cell's value shows the tables, not a wall of dataclass fields
        return str(self)


def plan_overrides(plan: perfmodel.Plan) -> list[str]:
    """``dtx train`` overrides that run ``plan``: its mesh, the jit driver and its partitioning rules."""
    mesh = tuple((name, size) for name, size in plan.mesh_spec)
    rules = tuple((regex, tuple(spec)) for regex, spec in plan.rules()[:-1])  # the trainer adds the catch-all

    def literal(value) -> str:  # a Python literal, double-quoted inside so the shell quoting stays readable
        text = repr(value)
        return shlex.quote(text.replace("'", '"')) if "'" in text and '"' not in text else shlex.quote(text)

    mesh_flag = "--config.mesh=" + literal(mesh)
    if not rules:
        return [mesh_flag]
    return [mesh_flag, "--config.driver=jit", "--config.parallel.name=rules", "--config.parallel.rules=" + literal(rules)]


def model_layers(name: str, input_shape: Sequence[int] | None = None) -> tuple[Layer, ...]:
    """The Dense/Conv layers of model ``name`` (``dtx.models``) at ``input_shape`` (default: the model's)."""
    from dtx.models import build_model  # the model zoo imports flax modules: only when simulating

    model = build_model(name)
    shape = input_shape or getattr(type(model), "default_input_shape", None)
    if shape is None:
        raise PerfModelError(f"model {name!r} has no default input shape; pass --input-shape, "
                             "e.g. --input-shape 28,28,1")
    return analyze(model, shape)


def report(model: str, layers: Sequence[Layer], cluster: Cluster, points: Sequence[perfmodel.ScalingPoint], *,
           global_batch: int | None = None, per_node_batch: int | None = None, mode: str = "auto",
           overlap: str = "none", algorithm: str = "ring", group_size: int | None = None) -> ScalingReport:
    """The :class:`ScalingReport` of ``points`` (from :func:`dtx.perf.model.scaling` with these settings)."""
    base = {bound: perfmodel.make_plan(layers, cluster, 1, global_batch or per_node_batch, mode=mode, overlap=bound,
                                       algorithm=algorithm).times[bound] for bound in perfmodel.OVERLAPS}
    rows = perfmodel.layer_report(points[-1].plan, cluster, algorithm)
    return ScalingReport(model, cluster, tuple(points), tuple(rows), base, global_batch, per_node_batch, algorithm,
                         overlap, mode, group_size)


def simulate(model: str, cluster: str | Cluster, nodes: Sequence[int], *, global_batch: int | None = None,
             per_node_batch: int | None = None, input_shape: Sequence[int] | None = None, mode: str = "auto",
             overlap: str = "none", algorithm: str = "ring", group_size: int | None = None,
             pairs: bool = False) -> ScalingReport:
    """``dtx simulate --model MODEL --cluster CLUSTER --nodes ...`` from Python (``mode`` is ``--plan``, ``pairs``
    ``--fc-pairs``: fully connected layers may be split by rows after a column layer, :mod:`dtx.perf.row_split`).

    ``cluster`` is a preset's name or a :class:`dtx.perf.clusters.Cluster`; without ``global_batch`` or
    ``per_node_batch``, strong scaling at global batch 512 (the command's default). Raises
    ``PerfModelError``/``ClusterError`` (``ValueError``s) naming the fix, as the command prints them.
    """
    if global_batch is None and per_node_batch is None:
        global_batch = 512
    cluster = get_cluster(cluster) if isinstance(cluster, str) else cluster
    layers = model_layers(model, input_shape)
    setting = dict(global_batch=global_batch, per_node_batch=per_node_batch, mode=mode, overlap=overlap,
                   algorithm=algorithm, group_size=group_size)
    return report(model, layers, cluster, perfmodel.scaling(layers, cluster, list(nodes), **setting, pairs=pairs),
                  **setting)
