"""``dtx simulate --model EXPERIMENT.py``: a transformer experiment planned over data × tensor × pipeline × ZeRO ×
remat (:mod:`dtx.perf.lm_plan`), and ``--verify`` of the printed plans compiled on up to ``--devices`` (8, or 64 …).

Per node count: the fastest plan that fits the device's memory, why, and the ``dtx train`` overrides that run it
(pipelines as dtx runs them: :mod:`dtx.parallel.pipeline.lm_costs`). ``--verify`` compiles, on emulated CPU devices
(nothing runs), every plan it printed of 2 up to ``--devices`` nodes (8 unless given: ``--devices 64`` compiles the
64-node plans on 64, their twin's batch scaled by ``N/8``) and, on 8, one of
each kind dtx runs (data, ZeRO over an ``fsdp`` axis, tensor, SP, ZeRO with tensor, each remat policy, a pipeline of ``M = P``
micro-batches with its stages split over ``model``, without and with SP, and with ZeRO-1; and the context kinds,
:data:`CONTEXT_KINDS`, data × context and tensor × context), as overrides of the
experiment at a width-scaled shape (:data:`TWIN`, the printed overrides' batch and accumulation set to the
twin's), and holds each one's per-device FLOPs (XLA's cost analysis) and bytes sent (the HLO's collectives,
loop trip counts included: :mod:`dtx.comm.hlo`; a pipeline's as its last stage runs them, its FLOPs from that
stage's slots: :func:`_pipeline_figures`) to the planner's within
:data:`dtx.tools.plancheck.VERIFY_TOLERANCE`; the per-device memory, modelled over XLA:CPU's compiled peak, is
reported beside them (not held: the planner's activation terms are Korthikanti et al.'s GPU figures).
"""

from __future__ import annotations

import dataclasses
import math
import time

from dtx.perf import lm_plan
from dtx.perf.clusters import Cluster
from dtx.tools.plancheck import VERIFY_TOLERANCE

# The width-scaled twin --verify compiles: 2 blocks of width 256, 8 heads, 128 positions, 16 sequences (seconds).
TWIN = dict(layers=2, width=256, heads=8, seq=128)
TWIN_BATCH = 16
VERIFY_NODES = 8
# XLA:CPU upcasts bf16 collectives: the tensor layout's activation collectives, bf16 in the program JAX hands it
# (tests/test_tensor_parallel.py reads them), move as float32 in what it compiles, so --verify charges 4 bytes.
CPU_TENSOR_ELEMENT = 4
# One plan of each kind dtx runs, as (tensor, zero, policy, sp, stages), compiled beside the printed ones; a
# pipeline with M = P micro-batches, its stages split over model (dtx.parallel.pipeline.tensor_stages), without and with SP
# (dtx.parallel.pipeline.positions), and with ZeRO-1 over an fsdp axis (dtx.parallel.pipeline.zero).
KINDS = ((1, 0, "none", False, 1), (1, 1, "none", False, 1), (1, 3, "none", False, 1), (1, 0, "full", False, 1),
         (2, 0, "none", False, 1), (4, 1, "dots", True, 1), (8, 0, "full", True, 1), (2, 0, "none", False, 2),
         (2, 0, "none", True, 2), (2, 1, "none", False, 2))
# XLA:CPU upcasts the context kernels' bf16 keys and values too: their collective-permutes, all-gathers and
# all-to-alls move float32 in what it compiles (the twins' HLO: f32 operands after a convert), so --verify charges 4.
CPU_CONTEXT_ELEMENT = 4
# Context plans (dtx.perf.lm_plan, **context**) compiled beside KINDS at 8 devices, as (tensor, zero, policy, sp,
# stages, context, attention): the development twins the context rules were read from (the gradients' two
# all-reduces with the tied table's two gradients, ZeRO's, each micro-batch's, the recomputed forward's collectives).
CONTEXT_KINDS = ((1, 0, "none", False, 1, 4, "ring"), (1, 0, "none", False, 1, 8, "ring"),
                 (1, 0, "none", False, 1, 2, "allgather"), (1, 0, "none", False, 1, 4, "ulysses"),
                 (1, 1, "none", False, 1, 4, "ring"), (1, 3, "none", False, 1, 4, "ring"),
                 (1, 0, "full", False, 1, 4, "ring"), (1, 0, "dots", False, 1, 4, "ring"),
                 # Megatron's pairs beside the context axis (T x C, P = 1): the twins the T x C gradients were read
                 # from (dtx.perf.lm_plan._tensor_context_gradients), TP and SP, each kernel, ZeRO-1 and ZeRO-3 over
                 # fsdp; and under remat dots and full (compiled after the tensor layout's fix for remat's lifted
                 # calls, to check the recomputed collectives: nothing was read from them).
                 (2, 0, "none", False, 1, 4, "ring"), (2, 0, "none", True, 1, 2, "ring"),
                 (2, 0, "none", False, 1, 2, "ulysses"), (2, 1, "none", False, 1, 2, "ring"),
                 (2, 3, "none", True, 1, 2, "allgather"), (2, 0, "dots", False, 1, 2, "ring"),
                 (2, 0, "full", True, 1, 2, "allgather"))
# Context rows held out, written here before they were first compiled: other depths, widths, heads, sequence lengths
# and batches than the twin, each kernel, ZeRO 2 and 3 (no development case has ZeRO-2), accumulation with ZeRO-3,
# as HELD_OUT's rows: (shape, sequences, kind, micro).
CONTEXT_HELD_OUT = (
    (dict(layers=4, width=192, heads=6, seq=96), 16, (1, 2, "none", False, 1, 2, "ulysses"), 1),
    (dict(layers=2, width=128, heads=4, seq=256), 8, (1, 3, "dots", False, 1, 4, "allgather"), 2),
    (dict(layers=3, width=320, heads=10, seq=64), 16, (1, 0, "full", False, 1, 8, "ring"), 1),
    # T x C rows (Megatron's pairs beside the context axis), written here before they were first compiled: another
    # depth, width, head count (12: Ulysses over T·C = 4), sequence length and batch each, ZeRO-2 (no development T x C
    # twin has it), accumulation (M = 2; none has it either) and T = 4.
    (dict(layers=3, width=192, heads=12, seq=96), 16, (2, 2, "none", True, 1, 2, "ulysses"), 1),
    (dict(layers=2, width=320, heads=10, seq=64), 16, (2, 0, "none", False, 1, 4, "allgather"), 2),
    (dict(layers=4, width=128, heads=4, seq=256), 8, (4, 0, "none", True, 1, 2, "ring"), 1),
)
# The kinds whose compiles at the twin the planner's constants were read from (tests/test_lm_plan.py's docstring:
# ELEMENTWISE, the bytes' rules; lm_pipeline's stage terms from the pipelines): --verify marks their rows "fitted".
FITTED = KINDS
# Held-out rows, chosen and committed before they were first compiled (commit "lm_sim: held-out --verify rows"):
# other depths, widths, heads, sequence lengths, batches and micro-batch counts than the twin the constants were read
# from, each with a kind of plan dtx runs, as (shape, sequences, (tensor, zero, policy, sp, stages), micro). The
# vocabulary stays GPT-2's: the experiment's dataset fixes it (experiments/gpt2_small.py).
HELD_OUT = (
    (dict(layers=2, width=192, heads=6, seq=64), 16, (2, 1, "none", False, 1), 1),
    (dict(layers=4, width=320, heads=10, seq=96), 32, (1, 2, "dots", False, 1), 1),
    (dict(layers=2, width=128, heads=4, seq=256), 8, (4, 0, "full", True, 1), 1),
    (dict(layers=4, width=256, heads=4, seq=64), 32, (2, 0, "none", True, 2), 4),
    (dict(layers=2, width=192, heads=6, seq=128), 32, (1, 0, "dots", False, 1), 2),
    # Added with the ZeRO-3 pipeline's rows (dtx.parallel.pipeline.lm_costs), committed before its first compile.
    (dict(layers=4, width=192, heads=6, seq=64), 16, (2, 3, "none", False, 2), 2),
)


def load_shape(path: str) -> tuple[lm_plan.LMShape, object]:
    """The experiment's shape and config."""
    import os

    from dtx import config as config_lib

    config = config_lib.load(path, [])
    return lm_plan.LMShape.from_config(config, os.path.splitext(os.path.basename(path))[0]), config


def reduce_bytes(config) -> int:
    import numpy as np

    from dtx.precision import parse_policy

    return np.dtype(parse_policy(config.precision).reduce).itemsize


def rows(shape: lm_plan.LMShape, cluster: Cluster, nodes, global_batch: int, reduce: int = 4,
         optimizer: str = "adamw") -> list[dict]:
    """:func:`dtx.perf.lm_plan.best` per node count; ``optimizer``: the config's (LARS/LAMB: no ZeRO-1 with stages,
    which dtx refuses for them)."""
    from dtx.optim import declared

    out = []
    for n in nodes:
        found = lm_plan.best(shape, cluster, n, global_batch, reduce_bytes=reduce,
                             pipeline_zero=not declared(optimizer).whole_tensors)
        out.append(dict(nodes=n, why=lm_plan.why(found, cluster), **found))
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def print_rows(shape: lm_plan.LMShape, cluster: Cluster, table: list[dict], global_batch: int) -> None:
    print(f"{shape.name}: {shape.layers} blocks of width {shape.width}, {shape.heads} heads, {shape.seq} positions, "
          f"vocabulary {shape.vocab}, {shape.params / 1e6:.1f} M parameters; {global_batch} sequences per step on "
          f"{cluster.name} ({_gib(cluster.device_memory)} per GPU; dtx.perf.lm_plan)")
    print(f"{'GPUs':>6} {'chosen':<34} {'step':>9} {'memory':>10}  why")
    for row in table:
        p = row["chosen"]
        if p is None:
            print(f"{row['nodes']:>6} {'nothing fits':<34}")
            continue
        print(f"{row['nodes']:>6} {p.text():<34} {p.time * 1e3:>6.4g} ms {_gib(p.memory_bytes):>10}  {row['why']}")
        runs = row["runnable"]
        if not p.runnable:
            print(f"{'':>6} (modelled only: the planned pipeline takes no ZeRO 2-3 or remat policy)")
            if runs is not None:
                print(f"{'':>6} fastest dtx runs: {runs.text()}, {runs.time * 1e3:.4g} ms, {_gib(runs.memory_bytes)}")
        if runs is not None:
            print(f"{'':>6} dtx train ... {' '.join(runs.overrides())}")
        slower = fewer_and_faster(table, row)
        if slower is not None:
            print(f"{'':>6} more GPUs do not help here: {slower['nodes']} GPUs take {slower['chosen'].time * 1e3:.4g} "
                  f"ms a step ({slower['chosen'].text()}); at {global_batch} sequences a step use those, or a "
                  "larger global batch")


def fewer_and_faster(table: list[dict], row: dict) -> dict | None:
    """The fastest row of ``table`` at fewer GPUs than ``row`` whose chosen plan is faster than ``row``'s (``None``:
    none is): more GPUs that do not shorten the step at this batch."""
    if row["chosen"] is None:
        return None
    faster = [r for r in table if r["nodes"] < row["nodes"] and r["chosen"] is not None
              and r["chosen"].time < row["chosen"].time]
    return min(faster, key=lambda r: r["chosen"].time) if faster else None


def as_json(table: list[dict]) -> list[dict]:
    def one(p):
        return None if p is None else dict(plan=p.text(), data=p.data, tensor=p.tensor, stages=p.stages,
                                           context=p.context, attention=p.attention or None,
                                           zero=p.zero, remat=p.policy, sequence_parallel=p.sp, micro=p.micro,
                                           time=p.time, memory=p.memory_bytes, runnable=p.runnable,
                                           overrides=p.overrides() if p.runnable else None)
    return [dict(nodes=r["nodes"], chosen=one(r["chosen"]), runnable=one(r["runnable"]), why=r["why"])
            for r in table]


def kind_of(p: lm_plan.LMPlan) -> tuple:
    """``p`` as a --verify kind: ``(tensor, zero, policy, sp, stages)``, and ``context, attention`` for ``C > 1``."""
    return (p.tensor, p.zero, p.policy, p.sp, p.stages) + ((p.context, p.attention) if p.context > 1 else ())


def compiles_at(shape: lm_plan.LMShape, kind: tuple) -> bool:
    """Whether the kind splits ``shape``: the stages its blocks, a context axis its sequence (``2C`` chunks) and, for
    Ulysses, its heads."""
    if shape.layers % kind[4]:
        return False
    if len(kind) > 5:  # Ulysses splits a device's h/T heads over C; SP a context chunk's positions over T
        context, attention = kind[5:]
        tensor, sp = kind[0], kind[3]
        return (shape.seq % (2 * context) == 0 and (attention != "ulysses" or shape.heads % (tensor * context) == 0)
                and (not sp or shape.seq % (tensor * context) == 0))
    return True


def verify_plans(path: str, cluster: Cluster, table: list[dict], reduce: int = 4, held_out: bool = True,
                 devices: int = VERIFY_NODES, context: bool = True) -> list[dict]:
    """Compile the printed runnable plans of 2 to ``devices`` nodes at the twin's shape (its batch
    :func:`twin_batch`); where the table has 8-node rows, :data:`KINDS` at 8 nodes beside them, then (``held_out``)
    the :data:`HELD_OUT` rows at theirs (module
    docstring); each row says whether its kind was ``fitted`` at the twin (the planner's constants were read from
    it), is the ``twin`` of a printed plan, or is ``held_out``."""
    base = load_shape(path)[0]
    twin = dataclasses.replace(base, **TWIN)
    wanted = []  # (nodes, kind)
    for row in table:
        if 2 <= row["nodes"] <= devices and row["runnable"] is not None:
            p = row["runnable"]
            wanted.append((row["nodes"], kind_of(p)))
    beside = devices >= VERIFY_NODES and any(row["nodes"] == VERIFY_NODES for row in table)  # the 8-node rows'
    every = KINDS + (CONTEXT_KINDS if context else ())
    wanted += [(VERIFY_NODES, k) for k in every if (VERIFY_NODES, k) not in wanted and beside]
    fitted = FITTED + CONTEXT_KINDS
    # A pipeline's micro-batches are its stages (M = P), a context plan's one; the twin's 2 blocks take pipelines of
    # 2 stages, its 128 positions and 8 heads context axes of up to 64 (Ulysses up to 8).
    cases = [(twin, twin_batch(nodes), kind, kind[4], "fitted" if kind in fitted and nodes == VERIFY_NODES
              else "twin", nodes) for nodes, kind in wanted if compiles_at(twin, kind)]
    if held_out and beside:
        cases += [(dataclasses.replace(base, **shape), batch, kind, micro, "held out", VERIFY_NODES)
                  for shape, batch, kind, micro in HELD_OUT + (CONTEXT_HELD_OUT if context else ())]
    return [verify_one(path, cluster, shape, batch, kind, micro, reduce, role, nodes)
            for shape, batch, kind, micro, role, nodes in cases]


def twin_batch(nodes: int) -> int:
    """The twin's sequences per step at ``nodes``: :data:`TWIN_BATCH` up to 8 nodes, ``nodes/8`` times it above
    (every data shard keeps a whole number of micro-batches)."""
    return TWIN_BATCH * max(1, nodes // VERIFY_NODES)


def verify_one(path: str, cluster: Cluster, shape: lm_plan.LMShape, batch: int, kind: tuple, micro: int,
               reduce: int = 4, role: str = "held out", nodes: int = VERIFY_NODES) -> dict:
    """One ``--verify`` row: the plan ``kind`` = ``(tensor, zero, policy, sp, stages[, context, attention])`` of
    ``shape`` at ``nodes`` (emulated devices) with ``batch`` sequences in ``micro`` micro-batches, compiled and held
    to the model."""
    tensor, zero, policy, sp, stages, *rest = kind
    context, attention = rest or (1, "ring")
    p = lm_plan.plan(shape, cluster, nodes, batch, tensor=tensor, zero=zero, policy=policy, sp=sp,
                     stages=stages, micro=micro, reduce_bytes=reduce, tensor_element=CPU_TENSOR_ELEMENT,
                     backend="xla_cpu", context=context, attention=attention,
                     context_element=CPU_CONTEXT_ELEMENT)  # the program compiled here is XLA:CPU's (lm_plan)
    start = time.perf_counter()
    flops, sent, peak = compiled_figures(path, p)
    predicted = read_flops(p)
    ratios = (flops / predicted, sent / p.bytes_sent if p.bytes_sent else (1.0 if sent == 0 else math.inf))
    return dict(plan=p.text(), nodes=nodes, shape=shape_text(shape, batch), role=role, predicted_flops=predicted,
                compiled_flops=flops, flops_ratio=ratios[0], predicted_bytes=p.bytes_sent, compiled_bytes=sent,
                bytes_ratio=ratios[1], predicted_memory=p.memory_bytes, compiled_memory=peak,
                memory_ratio=p.memory_bytes / peak, within=all(abs(r - 1) <= VERIFY_TOLERANCE for r in ratios),
                compile_s=time.perf_counter() - start)


def read_flops(p: lm_plan.LMPlan) -> float:
    """The FLOPs per device of ``p`` as :func:`compiled_figures` reads them: XLA's cost analysis counts a loop's
    body once (:mod:`dtx.perf.flops`), so a step accumulating ``M`` micro-batches (``P = 1``) reads as one
    micro-batch's work and the update outside the loop; a pipeline's slots are read apart and times ``M``."""
    if p.stages > 1 or p.micro == 1:
        return p.flops
    return (p.flops - p.update_flops) / p.micro + p.update_flops


def shape_text(shape: lm_plan.LMShape, batch: int) -> str:
    """``L x d, a heads, S positions, B sequences``: a verify row's shape."""
    return f"{shape.layers}x{shape.width}, {shape.heads} heads, {shape.seq} positions, {batch} sequences"


def twin_overrides(p: lm_plan.LMPlan) -> list[str]:
    """The twin's shape as overrides of the experiment, then the plan's own."""
    s = p.shape
    return [f"--config.model.num_layers={s.layers}", f"--config.model.d_model={s.width}",
            f"--config.model.num_heads={s.heads}", f"--config.model.max_len={s.seq}",
            f"--config.dataset.seq_len={s.seq}", f"--config.eval_batch_size={p.global_batch}",  # splits as the step's
            ] + [o.replace("'", "") for o in p.overrides()]


def compiled_figures(path: str, p: lm_plan.LMPlan) -> tuple[float, float, float]:
    """``(FLOPs, bytes sent, peak memory)`` per device of the plan's compiled step (``dtx train``'s own parts;
    the peak as :func:`dtx.perf.memory.compiled_peak` reads XLA's ``memory_analysis``)."""
    from dtx.comm import hlo
    from dtx.perf import flops as flops_lib
    from dtx.perf import memory as memory_lib

    parts, mesh, compiled = compile_plan(path, p)
    if p.stages > 1:
        return _pipeline_figures(parts, mesh, p, compiled) + (float(memory_lib.compiled_peak(compiled)),)
    return (float(flops_lib.compiled_flops(compiled)), float(hlo.total(compiled).bytes_sent),
            float(memory_lib.compiled_peak(compiled)))


def compile_plan(path: str, p: lm_plan.LMPlan):
    """``(parts, mesh, compiled step)`` of the plan ``p`` at its shape: the experiment at ``path`` with the plan's
    overrides, built and compiled by ``dtx train``'s own parts from the state's shapes (nothing runs)."""
    import jax

    from dtx import config as config_lib
    from dtx.run import setup

    config = config_lib.load(path, twin_overrides(p))
    mesh = setup.make_mesh(config, devices=jax.devices()[:p.nodes])  # --devices may emulate more
    inputs = setup.load_data(config, mesh)
    parts = setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), parts.abstract_state,
                         parts.placement.state)
    return parts, mesh, setup.compile_step(setup.make_step(config, parts, mesh), state, inputs.loader.batch(0))


def _pipeline_figures(parts, mesh, p: lm_plan.LMPlan, compiled) -> tuple[float, float]:
    """A pipeline plan's ``(FLOPs, bytes sent)`` per device of the last (busiest) stage: its forward and backward
    slots (the step's own functions, over the ``model`` axis) compiled on one micro-batch, times ``M``, plus the
    planner's update (the whole step's cost analysis counts each loop's body once, whichever stage a device is);
    the bytes as that stage sends them (:func:`dtx.parallel.pipeline.tensor_stages.step_bytes`)."""
    from dtx.comm import hlo
    from dtx.parallel.pipeline import tensor_stages

    pipeline = parts.placement.runner
    slots = slot_flops(pipeline.plan, parts.task, parts.policy, mesh, p)
    sent = tensor_stages.step_bytes(hlo.collectives(compiled), pipeline.schedule, p.tensor)
    return float(slots * p.micro + p.update_flops), float(sent)


def slot_flops(plan, task, policy, mesh, p: lm_plan.LMPlan) -> float:
    """XLA's FLOPs of one micro-batch's forward and backward slots of the pipeline's last stage (its ``plan``, a
    :class:`dtx.parallel.pipeline.stages.StagePlan`), compiled over the ``model`` axis of ``p``'s tensor group."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from dtx import mesh as mesh_lib
    from dtx.parallel.pipeline import step as pp
    from dtx.perf import flops as flops_lib

    forward, backward = pp.slot_functions(plan, task, p.micro, policy)
    b, last = p.global_batch // (p.data * p.micro), plan.num_stages - 1
    row = jax.ShapeDtypeStruct((plan.row,), jnp.float32)
    tokens = jax.ShapeDtypeStruct((b, *plan.layers[0].in_shape), jnp.int32)
    buffer = jax.ShapeDtypeStruct((b, plan.width), policy.compute)
    labels = jax.ShapeDtypeStruct((b, *plan.layers[-1].out_shape[:-1]), jnp.int32)
    seed = jax.ShapeDtypeStruct((), jnp.float32)
    group = mesh_lib.make_mesh([("model", p.tensor)], devices=mesh.devices.flat[:p.tensor])

    def compiled_slot(fn, *args):
        mapped = jax.shard_map(fn, mesh=group, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False)
        return flops_lib.compiled_flops(flops_lib.compile_to_read(jax.jit(mapped).lower(*args))) or 0.0

    return (compiled_slot(forward[last], row, tokens, buffer, labels)
            + compiled_slot(backward[last], row, tokens, buffer, labels, buffer, seed))


def print_verified(verified: list[dict]) -> None:
    print(f"\nverify: each plan compiled on as many emulated CPU devices as it has GPUs (nothing runs), at the "
          f"width-scaled twin ({TWIN}, {TWIN_BATCH} sequences up to {VERIFY_NODES} devices, N/{VERIFY_NODES} times "
          "that on N above); per device per step, XLA's FLOPs and the HLO's bytes sent against dtx.perf.lm_plan")
    print("  (fitted: a kind the planner's constants were read from, at the twin; held out: chosen and committed "
          "before it was first compiled, at another shape)")
    for row in verified:
        flag = "" if row["within"] else f"  outside {VERIFY_TOLERANCE:.0%}"
        print(f"  [{row['role']}: {row['shape']}, {row['nodes']} devices]")
        print(f"  {row['plan']:<30} GFLOP model {row['predicted_flops'] / 1e9:.4f} XLA "
              f"{row['compiled_flops'] / 1e9:.4f}"
              f" ratio {row['flops_ratio']:.4f}; MB model {row['predicted_bytes'] / 1e6:.3f} XLA "
              f"{row['compiled_bytes'] / 1e6:.3f} ratio {row['bytes_ratio']:.4f}{flag}; memory model/XLA:CPU "
              f"{row['memory_ratio']:.3f} ({row['compile_s']:.0f} s)")


def main(args, cluster: Cluster) -> int:
    """``dtx simulate --model EXPERIMENT.py [--global-batch B | --per-node-batch b] [--verify] [--json]``."""
    import json

    shape, config = load_shape(args.model)
    if getattr(args, "seq_len", None):  # --seq-len: the planned sequence length (--verify still compiles TWIN's)
        shape = dataclasses.replace(shape, seq=args.seq_len)
    reduce = reduce_bytes(config)
    table = []
    for n in args.nodes:
        batch = args.global_batch if args.per_node_batch is None else args.per_node_batch * n
        table += rows(shape, cluster, [n], batch, reduce, config.optimizer.name)
    devices = args.devices or VERIFY_NODES  # dtx.tools.plancheck.start_devices emulated them
    verified = verify_plans(args.model, cluster, table, reduce, devices=devices) if args.verify else []
    if args.json:
        print(json.dumps(dict(model=args.model, cluster=cluster.name, plans=as_json(table),
                              **({"verify": verified} if args.verify else {})), indent=1, default=float))
    else:
        print_rows(shape, cluster, table, args.global_batch or args.per_node_batch)
        if args.verify:
            print_verified(verified)
    return 0 if all(row["within"] for row in verified) else 1
