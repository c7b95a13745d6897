"""``dtx simulate --plan auto``'s data × pipeline table, its ``--memory`` rows and its ``--verify`` of pipelines.

Per node count, :func:`dtx.parallel.pipeline.plan.best` sets the fastest pipeline that fits the node's memory
(``P`` stages × ``N/P`` data shards, ``M`` micro-batches, 1F1B or interleaved) beside Das et al.'s plan of the
same nodes (:mod:`dtx.perf.model`), keeps the faster, says why, and prints the ``dtx train`` overrides that run it.
``--verify`` compiles each printed pipeline of 2 to 8 nodes on emulated CPU devices (nothing runs): the step :mod:`dtx.parallel.pipeline.step` builds, whose bytes (the HLO's collectives, loop trip counts
included: :mod:`dtx.comm.hlo`) are held to the planner's; and each stage's forward and backward slot (the
forward re-run and the vector-Jacobian product the step runs) on one micro-batch, whose FLOPs (XLA's cost
analysis) times ``M`` are held to the planner's busiest stage — the whole step's cost analysis counts each
loop's body once and cannot tell which stage a device is, so its FLOPs are read per slot.
"""

from __future__ import annotations

import math
import time

from dtx.parallel.pipeline import costs as pipeline_estimate
from dtx.parallel.pipeline import plan as pipeline_plan
from dtx.perf import memory as memory_lib
from dtx.perf import model as perfmodel
from dtx.perf.clusters import Cluster
from dtx.tools.plancheck import VERIFY_TOLERANCE

FIXES = {"dropout_rate": 0.0}  # model settings a pipeline refuses (dtx.parallel.pipeline.stages), set by a plan's overrides


def pipeline_model(model_name: str):
    """``(model, fixes)``: ``model_name`` as a pipeline runs it (dropout off) and the overrides that say so."""
    from dtx.models import (
        build_model,  # the model zoo imports flax modules: only when simulating
    )

    model = build_model(model_name)
    changed = {key: value for key, value in FIXES.items() if getattr(model, key, value) != value}
    return model.clone(**changed), tuple(f"--config.model.{key}={value:g}" for key, value in changed.items())


def runnable(model_name: str, layers) -> tuple[bool, tuple[str, ...]]:
    """Whether dtx can run a pipeline of ``model_name`` as planned — its declared pieces are the analysed layers in
    order — and the overrides it needs (:func:`pipeline_model`)."""
    model, fixes = pipeline_model(model_name)
    declare = getattr(model, "pipeline_layers", None)
    try:
        pieces = declare() if declare is not None else None
    except ValueError:  # a setting the pipeline refuses (batch norm)
        pieces = None
    names = None if pieces is None else tuple(p if isinstance(p, str) else p[0][0] for p in pieces)
    return names == tuple(layer.name for layer in layers), fixes


def rows(args, cluster: Cluster, layers, points, optimizer: str = "adam") -> list[dict]:
    """Per scaling point: Das et al.'s plan and its memory, the pipelines that fit, the choice and why."""
    can_run, fixes = runnable(args.model, layers)
    out = []
    for point in points:
        das, n = point.plan, point.nodes
        das_memory = memory_lib.estimate_plan(das, optimizer=optimizer).total
        chosen, fitting = pipeline_plan.best(layers, cluster, n, point.global_batch, das, das_memory,
                                             args.overlap, optimizer=optimizer, algorithm=args.algorithm,
                                             runnable=can_run, fixes=fixes)
        out.append(dict(nodes=n, global_batch=point.global_batch, das=das, das_memory=das_memory, chosen=chosen,
                        pipeline=fitting[0] if fitting else None,
                        outside=pipeline_estimate.planner_outside(fitting[0]) if fitting else "",
                        why=pipeline_plan.why(chosen, das, das_memory, fitting, cluster, args.overlap)))
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def print_rows(table: list[dict], cluster: Cluster) -> None:
    print(f"\ndata x pipeline (dtx.parallel.pipeline.plan; 1F1B or interleaved, stages balanced by the roofline; "
          f"{cluster.name}, "
          f"node memory {'unknown' if math.isinf(cluster.device_memory) else f'{cluster.device_memory / 2**30:.1f} GiB'}):")
    print(f"{'nodes':>6} {'Das plan':<28} {'time':>10} {'best pipeline':<24} {'bubble':>7} {'time':>10} "
          f"{'memory':>10}  chosen")
    for row in table:
        p, das = row["pipeline"], row["das"]
        pipe = ("-", "-", "-", "-") if p is None else (p.text(), f"{p.bubble:.0%}", _ms(p.time),
                                                       f"{p.memory_bytes / 2**30:.2f} GiB")
        chosen = "nothing fits" if row["chosen"] is None else pipeline_plan.text(row["chosen"])
        print(f"{row['nodes']:>6} {perfmodel.plan_text(das)[:28]:<28} {_ms(das.times['none']):>10} {pipe[0]:<24} "
              f"{pipe[1]:>7} {pipe[2]:>10} {pipe[3]:>10}  {chosen}: {row['why']}")
        if isinstance(row["chosen"], pipeline_plan.PipelinePlan):
            if row["chosen"].runnable:
                print(f"{'':>6} dtx train ... {' '.join(row['chosen'].overrides())}")
            else:
                print(f"{'':>6} (modelled only: the model declares no pipeline pieces matching these layers, "
                      "pipeline_layers())")


def memory_rows(table: list[dict]) -> list[dict]:
    """``--memory``'s rows for the pipelines of ``table`` (dtx.parallel.pipeline.costs's model, by category)."""
    out = []
    for row in table:
        p = row["pipeline"]
        if p is not None:
            out.append(dict(nodes=row["nodes"], layout=p.text(), group_size=1, **p.memory, total=p.memory_bytes,
                            outside=row.get("outside", "")))
    return out


VERIFY_NODES = 8  # the printed pipelines of at most 8 nodes are compiled (the issue: plans of <= 8 devices)


def verify(args, cluster: Cluster, table: list[dict]) -> list[dict]:
    """Compile each runnable pipeline of ``table`` with 2 to 8 nodes (module docstring); each check
    ``within`` :data:`dtx.tools.plancheck.VERIFY_TOLERANCE`."""
    import jax

    devices = jax.devices("cpu")  # emulated ones (dtx.tools.plancheck.start_devices): compile only
    out = []
    for row in table:
        p = row["pipeline"]
        if p is None or not p.runnable or p.nodes > min(len(devices), VERIFY_NODES):
            continue
        start = time.perf_counter()
        flops, sent = compiled_figures(args.model, args.input_shape, p, devices)
        predicted = compiled_bytes_sent(p, cluster)
        ratios = (flops / p.stage_flops, sent / predicted)
        out.append(dict(nodes=p.nodes, plan=p.text(), predicted_flops=p.stage_flops, compiled_flops=flops,
                        flops_ratio=ratios[0], predicted_bytes=predicted, compiled_bytes=sent, bytes_ratio=ratios[1],
                        within=all(abs(r - 1) <= VERIFY_TOLERANCE for r in ratios),
                        compile_s=time.perf_counter() - start))
    return out


COMPILED_BYTES_PER_ELEMENT = 4  # the verified step is compiled in float32 (compile_pipeline_step)


def compiled_bytes_sent(p: pipeline_plan.PipelinePlan, cluster: Cluster) -> float:
    """The bytes ``p`` sends per device per step in the program ``--verify`` compiles: that program is float32
    whatever the preset, so the activations and gradients that the planner counts at ``cluster.bytes_per_element``
    (the stage messages and the rows' all-reduce) are counted at 4 bytes; the batch's gather is float32 inputs and
    int32 labels in both. On a 2-byte preset (bfloat16: ``h100_nvlink_ndr``) the scaling tables' figures are half of
    these, as :func:`dtx.tools.plancheck.verify_plans` says of Das et al.'s plans."""
    scale = COMPILED_BYTES_PER_ELEMENT / cluster.bytes_per_element
    return (p.p2p_bytes + p.allreduce_bytes) * scale + p.gather_bytes


def print_verified(verified: list[dict]) -> None:
    print("\nverify pipelines: each printed pipeline compiled on emulated CPU devices (nothing runs); per device per "
          "step: the busiest stage's FLOPs (its slots compiled, times M) and the bytes the step sends (HLO "
          "collectives, loop trip counts included), predicted by dtx.parallel.pipeline.plan")
    if not verified:
        print("  no runnable pipeline of 2..8 nodes was printed (dtx runs pipelines of models that declare "
              "pipeline_layers())")
    for row in verified:
        flag = "" if row["within"] else f"  outside {VERIFY_TOLERANCE:.0%}"
        print(f"{row['nodes']:>6} {row['plan']:<24} GFLOP model {row['predicted_flops'] / 1e9:.4f} XLA "
              f"{row['compiled_flops'] / 1e9:.4f} ratio {row['flops_ratio']:.3f}; MB model "
              f"{row['predicted_bytes'] / 1e6:.3f} XLA {row['compiled_bytes'] / 1e6:.3f} ratio "
              f"{row['bytes_ratio']:.3f}{flag} (compiled in {row['compile_s']:.1f} s)")


def as_json(table: list[dict]) -> list[dict]:
    """``table`` for ``--json``."""
    out = []
    for row in table:
        p, chosen = row["pipeline"], row["chosen"]
        out.append(dict(nodes=row["nodes"], das_plan=perfmodel.plan_text(row["das"]),
                        das_time=row["das"].times["none"], das_memory=row["das_memory"],
                        pipeline=None if p is None else dict(
                            stages=p.stages, data=p.data, micro=p.micro, boundaries=list(p.boundaries),
                            bubble=p.bubble, time=p.time, bytes_sent=p.bytes_sent, memory=p.memory_bytes,
                            runnable=p.runnable),
                        chosen=None if chosen is None else pipeline_plan.text(chosen), why=row["why"],
                        overrides=chosen.overrides() if isinstance(chosen, pipeline_plan.PipelinePlan)
                        and chosen.runnable else None))
    return out


def compile_pipeline_step(model, shape, p: pipeline_plan.PipelinePlan, *, optimizer: str = "adam",
                          learning_rate: float = 1e-3, devices=None):
    """``(compiled train step, stage plan)`` of the pipeline ``p`` for ``model`` on inputs of ``shape``, from
    abstract state and batch (nothing runs), on the first ``p.nodes`` of ``devices`` (default: JAX's)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dtx import mesh as mesh_lib
    from dtx import optim
    from dtx.parallel.pipeline import step as pp
    from dtx.parallel.pipeline.schedules import make_schedule
    from dtx.parallel.pipeline.stages import make_plan
    from dtx.perf import flops as flops_lib

    shape = tuple(shape)
    example = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, *shape)))["params"])
    plan = make_plan(model, abstract, p.stages, p.boundaries, p.chunks, example)
    devices = jax.devices() if devices is None else devices
    mesh = mesh_lib.make_mesh([("stage", p.stages), ("data", p.data)], devices=devices[:p.nodes])
    tx = optim.make_optimizer(optimizer, learning_rate)
    state = pp.abstract_state(model, tx, example, plan)
    state = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), state,
                         pp.state_shardings(state, mesh, plan))
    split = NamedSharding(mesh, PartitionSpec(mesh_lib.batch_axes(mesh)))
    batch = {"inputs": jax.ShapeDtypeStruct((p.global_batch, *shape), jnp.float32, sharding=split),
             "labels": jax.ShapeDtypeStruct((p.global_batch,), jnp.int32, sharding=split)}
    schedule = make_schedule(p.schedule, p.stages, p.micro, p.chunks)
    step = pp.make_pipeline_step(tx, mesh, pp.Pipeline(plan, schedule))
    return flops_lib.compile_to_read(step.lower(state, batch)), plan


def _read_flops(lowered) -> float:
    """XLA's FLOPs of a lowered slot program, compiled only to be read."""
    from dtx.perf import flops as flops_lib

    return flops_lib.compiled_flops(flops_lib.compile_to_read(lowered)) or 0.0


def compiled_figures(model_name: str, input_shape, p: pipeline_plan.PipelinePlan, devices) -> tuple[float, float]:
    """``(busiest stage's FLOPs per step, bytes one device sends per step)`` of the compiled pipeline ``p``."""
    import jax
    import jax.numpy as jnp

    from dtx.comm import hlo
    from dtx.data import tasks
    from dtx.parallel.pipeline import step as pp

    model, _ = pipeline_model(model_name)
    compiled, plan = compile_pipeline_step(model, input_shape or type(model).default_input_shape, p, devices=devices)
    sent = hlo.total(compiled).bytes_sent
    forward, backward = pp.slot_functions(plan, tasks.classification(), p.micro)  # the step's own slot functions
    row = jax.ShapeDtypeStruct((plan.row,), jnp.float32)
    x0 = jax.ShapeDtypeStruct((p.micro_batch, *plan.layers[0].in_shape), jnp.float32)  # as the step shapes it
    buffer = jax.ShapeDtypeStruct((p.micro_batch, plan.width), jnp.float32)
    labels = jax.ShapeDtypeStruct((p.micro_batch,), jnp.int32)
    work = []
    for s in range(plan.num_stages):  # the slots a stage runs M times: its forward; the forward re-run and the vjp
        work.append(_read_flops(jax.jit(forward[s]).lower(row, x0, buffer, labels))
                    + _read_flops(jax.jit(backward[s]).lower(row, x0, buffer, labels, buffer, 1.0)))
    # A device runs its V virtual stages c·P + d (interleaved), each M times.
    busiest = max(sum(work[c * p.stages + d] for c in range(p.chunks)) for d in range(p.stages)) * p.micro
    return busiest, sent
