"""``dtx simulate``: predicted scaling of a model on a cluster, from the analytic model alone.

    dtx simulate --model vgg_a --global-batch 512 --nodes 1,2,4,8,16,32,64,128 \\
        --node-flops 2.3e12 --memory-bandwidth 1.36e11 --bandwidth 6.8e9 --latency 2e-6
    dtx simulate --model overfeat_fast --cluster haswell_fdr --per-node-batch 4 --plan hybrid --json

Analyses the model abstractly (:func:`dtx.perf.layers.analyze`; nothing full-size
runs), plans each node count (:func:`dtx.perf.model.make_plan`), prints a table of
iteration time under both overlap bounds, speedup, efficiency and the per-layer plan,
then the per-layer analysis (Das et al., arXiv 1602.06709 §3) at the largest node
count, and, given ``--out DIR``, writes a PNG speedup plot there (nothing is written
without it), named by the model, the cluster, the node list and the settings
(:meth:`dtx.perf.report.ScalingReport.file_name`), so two commands never overwrite each other's plot.
From Python, :func:`dtx.perf.report.simulate` returns the study, which prints as these tables. ``--json`` prints the same as
JSON instead of tables. ``--verify`` then compiles every plan of 2 to
``--devices`` nodes (default 8, up to 4096) on that many emulated CPU devices, compile only, and prints, per
layer, per layer group and for the whole training step, the predicted and the compiled per-device
FLOPs and bytes with their ratio (:mod:`dtx.run.verify`), and the step's per-device memory, modelled
and compiled, with fits or OOM against the node's memory; it exits with status 1 when a FLOPs
or bytes figure is more than 2 % off (memory is reported, flagged past 15 %; :mod:`dtx.tools.plancheck`). ``--memory`` prints, per node count and layout (data,
ZeRO-1/2, FSDP, model, hybrid and the planner's plan), the per-device bytes of
:mod:`dtx.perf.memory` and whether they fit the node (``Cluster.device_memory``); the
planner then picks, per node count, the fastest plan that fits (a node count where
none does is reported as refused). ``--plan auto`` also prints the data × pipeline table
(:mod:`dtx.tools.pipeline_sim`): per node count the fastest pipeline that fits beside that plan, the faster of
the two with why, and the ``dtx train`` overrides of a chosen pipeline; ``--verify`` compiles its pipelines too.
Bad input exits with status 2 and a message naming the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence

from dtx import parallel
from dtx.comm import algorithms
from dtx.perf import model as perfmodel
from dtx.perf import report as report_lib
from dtx.perf.report import plan_overrides  # noqa: F401 - documented here too
from dtx.perf import layers as layers_lib
from dtx.perf import memory as memory_lib
from dtx.perf.clusters import LAYER_KINDS, PRESETS, Cluster, ClusterError, get_cluster
from dtx.tools import lm_sim, pipeline_sim, plancheck

_PHYSICAL = ("node_flops", "memory_bandwidth", "bandwidth", "latency")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
        return value
    return parse


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4,8, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"node counts must be positive integers like 1,2,4,8, got {text!r}")
    return values


def _efficiency(text: str) -> dict[str, float]:
    """``0.7`` (every layer kind) or ``conv=0.8,dense=0.6``."""
    try:
        if "=" not in text:
            return {kind: float(text) for kind in LAYER_KINDS}
        pairs = dict(item.split("=", 1) for item in text.split(","))
        unknown = sorted(set(pairs) - set(LAYER_KINDS))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown layer kind {unknown[0]!r}; use {', '.join(LAYER_KINDS)}")
        return {kind: float(value) for kind, value in pairs.items()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0.7 or conv=0.8,dense=0.6, got {text!r}") from None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtx simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name from models/ (vgg_a, overfeat_fast, speech_dnn, "
                   "resnet18, resnet50, ...), or your flax module by import path, package.module:Class (with "
                   "--input-shape), or a transformer experiment file (experiments/gpt2_small.py: planned over "
                   "data x tensor x pipeline x ZeRO x remat, dtx.tools.lm_sim)")
    p.add_argument("--input-shape", type=_int_list, help="one example's shape, e.g. 224,224,3 (default: the model's)")
    p.add_argument("--seq-len", type=_positive(int),
                   help="a transformer experiment's sequence length to plan (default: its dataset.seq_len); long "
                        "sequences bring in context parallelism, a context axis of C devices and its attention "
                        "kernel (dtx.perf.lm_plan; --verify compiles at the twin's own 128 positions)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch", type=_positive(int), help="strong scaling at this global batch (default 512)")
    batch.add_argument("--per-node-batch", type=_positive(int), help="weak scaling at this per-node batch")
    p.add_argument("--nodes", type=_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128], help="node counts, e.g. 1,2,4,8")
    p.add_argument("--cluster", help=f"preset: {', '.join(sorted(PRESETS))} (flags below override its numbers)")
    p.add_argument("--node-flops", type=_positive(float), help="peak FLOP/s per node")
    p.add_argument("--memory-bandwidth", type=_positive(float), help="memory bandwidth per node, bytes/s")
    p.add_argument("--bandwidth", type=_positive(float), help="network bandwidth per node, bytes/s")
    p.add_argument("--latency", type=float, help="network latency alpha, seconds")
    p.add_argument("--efficiency", type=_efficiency, help="fraction of peak: 0.7 or conv=0.8,dense=0.6")
    p.add_argument("--bytes-per-element", type=int, choices=(1, 2, 4, 8), help="4 = fp32, 2 = bf16")
    p.add_argument("--algorithm", default="ring", choices=[a for a, declared in algorithms.ALGORITHMS.items() if declared.levels == 1],
                   help="allreduce algorithm (alpha-beta formulas of dtx.comm.costmodel)")
    p.add_argument("--overlap", default="none", choices=perfmodel.OVERLAPS,
                   help="bound that speedup and plan use; both are printed")
    p.add_argument("--plan", default="auto", choices=perfmodel.PLANS, help="per-layer parallelism")
    p.add_argument("--group-size", type=_positive(int), help="fix the model-parallel group size G")
    p.add_argument("--fc-pairs", action="store_true",
                   help="also consider a fully connected layer split by its input rows after a column-split one "
                        "(Megatron's pairing: no gather between them; dtx.perf.row_split, parallel.fc_pairs)")
    p.add_argument("--out", help="folder for the PNG speedup plot (default: no plot is written)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    p.add_argument("--verify", action="store_true",
                   help="compile each printed plan of up to --devices nodes on emulated CPU devices (nothing runs) and "
                        "print per layer the predicted and the compiled per-device FLOPs and bytes, and the step's "
                        "memory, modelled and compiled, with fits or OOM (dtx.run.verify, dtx.tools.plancheck)")
    p.add_argument("--memory", action="store_true",
                   help="print per-device memory (params, grads, optimizer, activations, buffers) per layout and "
                        "node count, and whether it fits the cluster's device memory (dtx.perf.memory)")
    p.add_argument("--optimizer", default="adam", choices=sorted(memory_lib.SLOTS),
                   help="optimizer whose state the memory model counts (default adam)")
    p.add_argument("--precision", help="dtx precision policy for the memory model, e.g. p=f32,c=bf16 "
                                       "(default: float32, or p=f32,c=bf16,r=bf16 on a 2-byte cluster)")
    p.add_argument("--memory-backend", default="xla_cpu", choices=memory_lib.BACKENDS,
                   help="buffers as XLA:CPU compiles the step (checked, default) or without its CPU-only copies "
                        "and with a true reduce-scatter (gpu, unchecked)")
    p.add_argument("--device-memory", type=_positive(float), help="memory per node, bytes (overrides the preset)")
    p.add_argument("--devices", "--verify-devices", dest="devices", type=plancheck.device_count,
                   help=f"CPU devices to emulate for --verify, e.g. 64 (up to {plancheck.MAX_DEVICES}); every node "
                        f"count of --nodes must fit them (default {plancheck.DEFAULT_DEVICES}: larger plans are "
                        "not compiled)")
    return p


def build_cluster(args: argparse.Namespace) -> Cluster:
    """The preset (or nothing) with the command line's numbers applied."""
    given = {field: getattr(args, field) for field in _PHYSICAL if getattr(args, field) is not None}
    if args.cluster is None:
        missing = [f"--{field.replace('_', '-')}" for field in _PHYSICAL if field not in given]
        if missing:
            raise ClusterError(f"without --cluster, give {', '.join(missing)} too "
                               f"(or pick a preset: --cluster {'|'.join(sorted(PRESETS))})")
        cluster = Cluster(name="custom", description="command-line cluster", **given)
    else:
        cluster = get_cluster(args.cluster).replace(**given)
    if args.efficiency is not None:
        cluster = cluster.replace(efficiency={**cluster.efficiency, **args.efficiency})
    if args.bytes_per_element is not None:
        cluster = cluster.replace(bytes_per_element=args.bytes_per_element)
    if getattr(args, "device_memory", None) is not None:
        cluster = cluster.replace(device_memory=args.device_memory)
    return cluster


def _analyze(name: str, input_shape: Sequence[int] | None) -> tuple[layers_lib.Layer, ...]:
    from dtx.models import build_model  # the model zoo imports flax modules: only when simulating

    model = build_model(name)
    shape = input_shape or getattr(type(model), "default_input_shape", None)
    if shape is None:
        raise layers_lib.PerfModelError(f"model {name!r} has no default input shape; pass --input-shape, "
                                       "e.g. --input-shape 28,28,1")
    return layers_lib.analyze(model, shape)


def _memory_setup(args, cluster: Cluster):
    """``estimate(layers, layout, nodes=, global_batch=, ...)`` for the model, its terms traced once."""
    from dtx.precision import parse_policy
    from dtx.models import build_model

    model = build_model(args.model)
    shape = args.input_shape or type(model).default_input_shape
    default = "p=f32,c=bf16,r=bf16" if cluster.bytes_per_element == 2 else "p=f32"
    common = dict(memory_lib.model_terms(model, shape), optimizer=args.optimizer,
                  policy=parse_policy(args.precision or default), backend=args.memory_backend)
    return lambda layers, layout, **kw: memory_lib.estimate(layers, layout, **common, **kw)


def _memory_rows(estimate, layers, points) -> list[dict]:
    """Per node count: each registered layout (but user rules) and the planner's plan, per-device bytes.

    A layout splitting every kernel runs its ``model`` group over all ``n`` devices; one splitting the dense
    layers only (Das et al.'s hybrid) over the plan's group (2 when the plan has none)."""
    rows = []
    layouts = [lay for lay in sorted(parallel.LAYOUTS.values(), key=lambda lay: lay.cost_rank)
               if lay.by_layer_kind and not lay.stages]  # (nor stages and Megatron's pairs yet)
    for point in points:
        n, batch, plan = point.nodes, point.global_batch, point.plan
        hybrid = plan.group_size if plan.group_size > 1 else 2
        for lay in layouts:
            g = {"all": n, "dense": hybrid}.get(lay.kernels, 1)
            split = [layer for layer in layers if lay.splits(layer.kind)]
            if lay.needs_model_axis and (n % g or g == 1 or any(x.kernel_shape[-1] % g for x in split)):
                continue  # dtx.parallel refuses a split that does not divide (or there is no group)
            e = estimate(layers, lay, nodes=n, global_batch=batch, group_size=g)
            rows.append(_memory_row(n, lay.name, g, e))
        e = estimate(layers, parallel.rules_layout(), nodes=n, global_batch=batch, group_size=plan.group_size,
                     sharded=plan.sharded)
        rows.append(_memory_row(n, f"plan ({perfmodel.plan_text(plan)})", plan.group_size, e))
    return rows


def _memory_row(nodes: int, layout: str, group_size: int, e) -> dict:
    return dict(nodes=nodes, layout=layout, group_size=group_size, params=e.params, grads=e.grads,
                optimizer=e.optimizer, activations=e.activations, buffers=e.buffers, total=e.total,
                outside=e.outside)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _print_memory(rows: list[dict], cluster: Cluster, args) -> None:
    capacity = "unknown" if cluster.device_memory == float("inf") else _size(cluster.device_memory)
    print(f"\nmemory per device (dtx.perf.memory, {args.memory_backend} buffers; {args.optimizer}; total = the step's peak: "
          f"state + the largest of forward, backward, update), node memory {capacity}:")
    print(f"{'nodes':>6} {'layout':<28} {'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>11} "
          f"{'buffers':>10} {'total':>10}  fits")
    for r in rows:
        fits = "-" if cluster.device_memory == float("inf") else "yes" if r["total"] <= cluster.device_memory else "no"
        print(f"{r['nodes']:>6} {r['layout'][:28]:<28} {_size(r['params']):>10} {_size(r['grads']):>10} "
              f"{_size(r['optimizer']):>10} {_size(r['activations']):>11} {_size(r['buffers']):>10} "
              f"{_size(r['total']):>10}  {fits}")
    for why in dict.fromkeys(r["outside"] for r in rows if r.get("outside")):  # dtx.perf.memory.outside_regime
        where = ", ".join(f"{r['nodes']} {r['layout'].split(' (')[0]}" for r in rows if r.get("outside") == why)
        print(f"warning: outside the memory model's measured regime, may be off by more than 15 % ({where}): {why} "
              "(docs/memory.md)")


def _finite(record: dict) -> dict:
    """Strict JSON has no Infinity: an absent local link (bandwidth inf) becomes null."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in record.items()}


def _point_json(point: perfmodel.ScalingPoint) -> dict:
    plan = point.plan
    return dict(
        nodes=point.nodes, per_node_batch=point.per_node_batch, global_batch=point.global_batch,
        iteration_time=point.time, iteration_time_no_overlap=plan.times["none"],
        iteration_time_ideal_overlap=plan.times["ideal"], speedup=point.speedup, efficiency=point.efficiency,
        group_size=plan.group_size, mesh=plan.mesh_spec, model_parallel_layers=list(plan.sharded),
        rules=[[regex, list(spec)] for regex, spec in plan.rules()],
    )


def _print_tables(study, plot) -> None:
    print(study)  # dtx.perf.report.ScalingReport: the same tables from Python
    print(f"\nplot: {plot}" if plot else "\n(pass --out DIR to save the speedup plot)")


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """Run ``dtx simulate`` with ``argv`` (without the program name); returns the exit status."""
    parser = make_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse has printed usage and the error (or --help)
        return int(e.code or 0)
    if args.global_batch is None and args.per_node_batch is None:
        args.global_batch = 512
    try:  # before anything starts JAX: the devices the plans are compiled for
        plancheck.start_devices(args)
    except ValueError as e:  # VerifyError, CacheError
        print(f"dtx simulate: error: {e}", file=sys.stderr)
        return 2
    try:
        cluster = build_cluster(args)
        if args.seq_len is not None and not args.model.endswith(".py"):
            raise layers_lib.PerfModelError(f"--seq-len {args.seq_len} sets a transformer experiment's sequence "
                                            "length: give --model EXPERIMENT.py (e.g. experiments/gpt2_small.py)")
        if args.model.endswith(".py"):  # a transformer experiment: data x tensor x pipeline x ZeRO x remat
            return lm_sim.main(args, cluster)
        layers = _analyze(args.model, args.input_shape)
        setting = dict(global_batch=args.global_batch, per_node_batch=args.per_node_batch, mode=args.plan,
                       overlap=args.overlap, algorithm=args.algorithm, group_size=args.group_size)
        points = perfmodel.scaling(layers, cluster, args.nodes, **setting, pairs=args.fc_pairs)
        memory_rows, refused = [], {}
        if args.memory:  # the planner then picks, per node count, the fastest plan that fits
            estimate = _memory_setup(args, cluster)
            fitted = []
            for point in points:
                try:
                    fitted += perfmodel.scaling(layers, cluster, [point.nodes], **setting, pairs=args.fc_pairs,
                                                memory=lambda plan: estimate(
                        plan.layers, "rules", nodes=plan.nodes, global_batch=plan.global_batch,
                        group_size=plan.group_size, sharded=plan.sharded).total)
                except layers_lib.PerfModelError as e:
                    refused[point.nodes] = str(e)
            chosen = {point.nodes: point for point in fitted}
            memory_rows = _memory_rows(estimate, layers, [chosen.get(point.nodes, point) for point in points])
            if not fitted:
                raise layers_lib.PerfModelError(" ".join(refused.values()))
            points = fitted
    except ValueError as e:  # ModelConfigError, ClusterError, PerfModelError, CollectiveError
        print(f"dtx simulate: error: {e}", file=sys.stderr)
        return 2
    # The data x pipeline table of --plan auto (dtx.tools.pipeline_sim); a tensor-parallel factor would join there.
    pipelines = pipeline_sim.rows(args, cluster, layers, points, args.optimizer) if args.plan == "auto" else []
    memory_rows += pipeline_sim.memory_rows(pipelines) if args.memory else []
    study = report_lib.report(args.model, layers, cluster, points, **setting)
    strong = study.strong
    # A file only where asked (a command run in a checkout must not litter it), named by the node list and
    # the settings, so two commands writing into one folder never overwrite each other's plot.
    plot = study.plot(args.out) if args.out else None

    if args.verify:  # compiles plans: JAX and the model zoo only when asked
        verified = plancheck.verify_plans(args, cluster, points)
        piped = pipeline_sim.verify(args, cluster, pipelines)
    else:
        verified, piped = [], []
    if args.json:
        print(json.dumps(dict(
            model=args.model, cluster=_finite(dataclasses.asdict(cluster)),
            scaling="strong" if strong else "weak", global_batch=args.global_batch,
            per_node_batch=args.per_node_batch, algorithm=args.algorithm, overlap=args.overlap, plan=args.plan,
            speedup={str(p.nodes): p.speedup for p in points}, points=[_point_json(p) for p in points],
            layers=list(study.layers), plot=plot, **({"verify": verified} if args.verify else {}),
            **({"memory": memory_rows, "refused": {str(n): m for n, m in refused.items()}} if args.memory else {}),
            **({"pipeline": pipeline_sim.as_json(pipelines), "verify_pipeline": piped} if pipelines else {})),
            indent=1, default=float))
    else:
        _print_tables(study, plot)
        if pipelines:
            pipeline_sim.print_rows(pipelines, cluster)
        if args.memory:
            _print_memory(memory_rows, cluster, args)
            for message in refused.values():
                print(f"refused: {message}")
        if args.verify:
            plancheck.print_checks(verified)
            pipeline_sim.print_verified(piped)
    return 1 if plancheck.outside(verified) or not all(row["within"] for row in piped) else 0


if __name__ == "__main__":
    sys.exit(simulate_main())
