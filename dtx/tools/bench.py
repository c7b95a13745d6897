"""``dtx bench``: what a step costs — allreduce algorithms alone, and a whole train step split in two.

    dtx bench collectives [--sizes 4KiB..64MiB] [--algorithms ring tree ...]
                          [--alpha 5e-6 --bandwidth 1.25e9 --gamma 0] [--out DIR]
                          [--repeats N] [--devices N]
    dtx bench step EXPERIMENT.py [--config.KEY=VALUE ...] [--vary KEY=V1,V2,...]
                          [--steps 20] [--rounds 5]

``collectives``: for each message size (bytes per device, float32) and algorithm it
prints and saves the measured time, the algorithm bandwidth ``n/t``, the bus bandwidth
``algbw·2(p−1)/p`` (NCCL-tests' convention: comparable with link bandwidth whatever
p), the bytes each device sends (counted from the schedule, :func:`dtx.comm.collectives.
count_traffic`), and the time the α-β-γ model predicts for the network given by the
flags (Thakur, Rabenseifner & Gropp 2005; :mod:`dtx.comm.costmodel`). Flat algorithms use
all devices on one ``data`` axis; ``hierarchical`` uses a 2D ``(node, local)`` mesh,
``(2, 4)`` on 8 devices. On an emulated CPU mesh the devices share the host's cores,
so measured times show the software cost of each schedule, not a network
(docs/data_parallel.md); the predicted column is the network.

``step``: times the experiment's train step as configured, and the same step built
with ``communicate=False`` (every collective of the gradient path removed, each
worker applying its own gradient): *compute* is the second, *communication* the
difference. It also reports the bytes each worker sends per step (the accountant
of :mod:`dtx.comm.costmodel` under ``shard_map``; the compiled program's collectives,
:mod:`dtx.comm.hlo`, under ``jit``) and HFU — XLA's FLOPs of the step over the
device's peak — when the peak is known (:mod:`dtx.perf.flops`).
``--vary allreduce=psum,ring`` measures one row per value.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dtx.comm import algorithms as algorithms_lib
from dtx.comm import collectives, costmodel
from dtx import mesh as mesh_lib
from dtx import xla_cache
from dtx.step import get_driver

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "kb": 10**3, "mb": 10**6, "gb": 10**9}
FIELDS = ("size_bytes", "algorithm", "devices", "mesh", "time_s", "algbw_Bps", "busbw_Bps", "messages",
          "bytes_sent", "predicted_s")


def parse_size(text: str) -> int:
    """``"4KiB"`` → 4096. Units: B, KiB/MiB/GiB (also K/M/G), KB/MB/GB (powers of 10)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; write e.g. 4096, 4KiB, 1MiB, 64MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_sizes(text: str) -> list[int]:
    """``"4KiB..64MiB"`` → powers of 4 from 4 KiB to 64 MiB; ``"4KiB,1MiB"`` → a list; both mix."""
    sizes: list[int] = []
    for part in text.split(","):
        if ".." in part:
            lo, hi = (parse_size(s) for s in part.split("..", 1))
            if lo < 1 or hi < lo:
                raise ValueError(f"bad size range {part!r}; write e.g. 4KiB..64MiB")
            size = lo
            while size <= hi:
                sizes.append(size)
                size *= 4
        else:
            sizes.append(parse_size(part))
    bad = [s for s in sizes if s < 4 or s % 4]
    if bad:
        raise ValueError(f"sizes must be positive multiples of 4 bytes (float32 elements), got {bad}")
    return sorted(set(sizes))


def _two_level(p: int) -> tuple[int, int] | None:
    """``(outer, inner)`` for the hierarchical mesh: smallest outer factor > 1 (8 → (2, 4))."""
    outer = next((f for f in range(2, p) if p % f == 0), None)
    return None if outer is None else (outer, p // outer)


def _time_call(fn, x, repeats: int) -> float:
    """Median seconds per call, waiting on every result: XLA:CPU deadlocks with many in flight."""
    fn(x).block_until_ready()  # warm-up (compiled already; first-run allocations)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(algorithms, sizes, repeats, alpha, beta, gamma, log=print) -> list[dict]:
    """Time each (algorithm, size) on all devices; return one row per pair (see FIELDS)."""
    devices = jax.devices()
    p = len(devices)
    meshes = {"flat": (mesh_lib.make_mesh([("data", p)], devices=devices), ("data",), None)}
    two_level = _two_level(p)
    if two_level:
        outer, inner = two_level
        meshes["2d"] = (mesh_lib.make_mesh([("node", outer), ("local", inner)], devices=devices),
                        ("node", "local"), inner)
    rows = []
    two_levels = [a for a in algorithms if algorithms_lib.get_algorithm(a).levels == 2]
    if two_levels and not two_level:
        log(f"  {', '.join(two_levels)} skipped: {p} device(s) have no 2D factorisation")
        algorithms = [a for a in algorithms if a not in two_levels]
    for size in sizes:
        n = size // 4
        for algorithm in algorithms:
            mesh, axes, inner = meshes["2d" if algorithm in two_levels else "flat"]
            reduce = collectives.make_allreduce(algorithm, axes, mean=False)
            spec = PartitionSpec(axes)
            fn = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=spec, out_specs=spec))
            x = jax.jit(lambda: jnp.ones((p * n,), jnp.float32), out_shardings=NamedSharding(mesh, spec))()
            seconds = _time_call(fn.lower(x).compile(), x, repeats)
            traffic = collectives.count_traffic(algorithm, jax.ShapeDtypeStruct((n,), jnp.float32), p, inner)
            algbw = size / seconds
            rows.append({
                "size_bytes": size, "algorithm": algorithm, "devices": p,
                "mesh": "x".join(str(mesh.shape[a]) for a in axes), "time_s": seconds, "algbw_Bps": algbw,
                "busbw_Bps": algbw * 2 * (p - 1) / p, "messages": traffic.messages,
                "bytes_sent": traffic.bytes_sent,
                "predicted_s": costmodel.predict_time(algorithm, size, p, alpha, beta, gamma, inner),
            })
            log(_format_row(rows[-1]))
            del x
    return rows


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g}{unit}"
    return f"{nbytes:.4g}B"


HEADER = (f"{'size':>9} {'algorithm':<18} {'mesh':>5} {'time':>10} {'algbw':>11} {'busbw':>11} "
          f"{'msgs':>5} {'sent/device':>11} {'predicted':>10}")


def _format_row(row: dict) -> str:
    return (f"{_human(row['size_bytes']):>9} {row['algorithm']:<18} {row['mesh']:>5} "
            f"{row['time_s'] * 1e3:>8.3f}ms {row['algbw_Bps'] / 1e9:>7.3f}GB/s {row['busbw_Bps'] / 1e9:>7.3f}GB/s "
            f"{row['messages']:>5} {_human(row['bytes_sent']):>11} {row['predicted_s'] * 1e3:>8.3f}ms")


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def write_plot(rows: list[dict], path: str, title: str) -> None:
    """Measured (solid) and predicted (dashed) time, and bus bandwidth, against size."""
    from dtx.tools import plots

    times, bandwidths = {}, {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        sizes = [r["size_bytes"] for r in mine]
        times[f"{algorithm} measured"] = (sizes, [r["time_s"] for r in mine])
        times[f"{algorithm} α-β"] = plots.Line(sizes, [r["predicted_s"] for r in mine], style="--",
                                             same_color_as=f"{algorithm} measured")
        bandwidths[algorithm] = (sizes, [r["busbw_Bps"] / 1e9 for r in mine])
    axes = dict(xlabel="bytes per device", logx=True, logy=True)
    plots.panels_plot([plots.Panel(times, ylabel="seconds per allreduce", **axes),
                       plots.Panel(bandwidths, ylabel="bus bandwidth, GB/s", **axes)], path, title=title)


def collectives_main(argv: list[str]) -> int:
    """Entry point of ``dtx bench collectives``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="dtx bench collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4KiB..64MiB", help="bytes per device: A..B (powers of 4) or a,b,c")
    parser.add_argument("--algorithms", nargs="+", default=list(algorithms_lib.ALGORITHMS),
                        help=f"any of {', '.join(algorithms_lib.ALGORITHMS)} (space or comma separated)")
    parser.add_argument("--alpha", type=float, default=5e-6, help="model latency per message, s (default 5e-6)")
    parser.add_argument("--bandwidth", type=float, default=1.25e9, help="model link bandwidth, bytes/s (10 Gb/s)")
    parser.add_argument("--gamma", type=float, default=0.0, help="model reduction cost, s per byte")
    parser.add_argument("--out", help="directory for collectives.csv and collectives.png")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per point (median reported)")
    parser.add_argument("--devices", type=int, default=8,
                        help="CPU devices to emulate (default 8; accelerators are used as they are)")
    args = parser.parse_args(argv)
    algorithms = [a for item in args.algorithms for a in item.split(",") if a]
    try:
        sizes = parse_sizes(args.sizes)
        for algorithm in algorithms:
            algorithms_lib.get_algorithm(algorithm)
        if args.repeats < 1 or args.bandwidth <= 0 or min(args.alpha, args.gamma) < 0:
            raise ValueError("need --repeats >= 1, --bandwidth > 0, --alpha >= 0 and --gamma >= 0")
        if args.devices is not None:
            mesh_lib.emulate_cpu_devices(args.devices)
    except ValueError as e:  # CollectiveError and MeshError are ValueErrors
        print(f"dtx bench collectives: error: {e}", file=sys.stderr)
        return 2
    p = len(jax.devices())
    beta = 1.0 / args.bandwidth
    print(f"allreduce on {p} {jax.devices()[0].platform} device(s); model: α={args.alpha:g}s, "
          f"bandwidth={args.bandwidth / 1e9:g} GB/s, γ={args.gamma:g}s/B; "
          f"bandwidth bound for {_human(sizes[-1])}: "
          f"{costmodel.bandwidth_lower_bound(sizes[-1], p, beta) * 1e3:.3f}ms")
    print(HEADER)
    rows = measure(algorithms, sizes, args.repeats, args.alpha, beta, args.gamma)
    if args.out and rows:
        os.makedirs(args.out, exist_ok=True)
        write_csv(rows, os.path.join(args.out, "collectives.csv"))
        write_plot(rows, os.path.join(args.out, "collectives.png"),
                   f"allreduce, {p} {jax.devices()[0].platform} devices (dashed: α-β model)")
        print(f"wrote {os.path.join(args.out, 'collectives.csv')} and collectives.png")
    elif not args.out:
        print("(pass --out DIR to save collectives.csv and collectives.png)")
    return 0


# ------------------------------------------------------------------ dtx bench step

STEP_HEADER = ("| setting | step (ms) | compute (ms) | communication (ms) | comm share | comm bytes/step/worker "
               "| HFU |\n|---|---|---|---|---|---|---|")
STEP_NOTE = ("Times: median [min, max] over the rounds. Communication is each round's step time minus its "
             "compute twin's (the two run interleaved); where the rounds disagree on its sign it is within the "
             "machine's noise and shown as ≈0 with its range, never as a negative time.")


def build_steps(config):
    """The experiment's train step and its no-collective twin, with a state for each and a batch.

    Built by :mod:`dtx.run.setup`, as :func:`dtx.train` builds a run (same mesh, data, model,
    optimizer, policy, compressor and strategy). Returns ``(steps, states, batch, policy)``
    where ``steps``/``states`` map ``"full"`` and (``shard_map`` driver only) ``"compute"``
    to the step and its own state.
    """
    from dtx.run import setup  # the same readings of the config as a run's

    if config.emulate_cpu_devices:
        mesh_lib.emulate_cpu_devices(config.emulate_cpu_devices)
    xla_cache.enable(config.compilation_cache)
    mesh = setup.make_mesh(config)
    inputs = setup.load_data(config, mesh)
    parts = setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps,
                              task=inputs.task)
    explicit = get_driver(config.driver).explicit  # only a driver placing its collectives can leave them out
    kinds = {"full": True, "compute": False} if explicit else {"full": True}
    steps = {kind: setup.make_step(config, parts, mesh, communicate=communicate) for kind, communicate in kinds.items()}
    states = {kind: setup.init_state(config, parts, mesh) for kind in steps}
    return steps, states, inputs.loader.batch(0), parts.policy


def measure_step(config, steps: int = 20, rounds: int = 5) -> dict:
    """Median seconds per step with and without the gradient collectives, bytes per step, HFU.

    Each round times ``steps`` calls of each step in turn (interleaved, so machine
    noise hits both alike), every call waiting on the previous one's output (lag-1:
    XLA:CPU deadlocks with many steps in flight, docs/data_parallel.md).
    """
    from dtx.perf import flops
    from dtx.comm import hlo
    from dtx.run import setup

    step_fns, states, batch, policy = build_steps(config)
    compiled = setup.compile_step(step_fns["full"], states["full"], batch)  # the first call reuses it
    per_device_flops = setup.step_flops(config, compiled)
    program_bytes = float(hlo.total(compiled).bytes_sent)  # under jit the step cannot count what XLA places
    times = {kind: [] for kind in step_fns}
    comm_bytes = []

    def run(kind, count):
        previous = None
        for _ in range(count):
            states[kind], out = step_fns[kind](states[kind], batch)
            if previous is not None:
                jax.block_until_ready(previous)
            previous = out
            if kind == "full":
                comm_bytes.append(out.get("comm_bytes"))
        jax.block_until_ready(previous)

    for kind in step_fns:
        run(kind, 2)  # compile and warm up
    comm_bytes.clear()
    for _ in range(rounds):
        for kind in step_fns:
            start = time.perf_counter()
            run(kind, steps)
            times[kind].append((time.perf_counter() - start) / steps)
    step_s = statistics.median(times["full"])
    compute_s = statistics.median(times["compute"]) if "compute" in times else None
    # Paired by round: each round's two blocks ran back to back, under the same load.
    paired = [f - c for f, c in zip(times["full"], times["compute"])] if compute_s is not None else None
    sent = [float(b) for b in comm_bytes if b is not None]
    peak = flops.device_peak_flops(policy.compute, config.peak_flops)
    return {
        "step_s": step_s, "compute_s": compute_s, "comm_s": None if paired is None else statistics.median(paired),
        "spread": {"step_s": _range(times["full"]), "compute_s": _range(times.get("compute")),
                   "comm_s": _range(paired)},
        "comm_bytes_per_step": statistics.fmean(sent) if sent else program_bytes,
        "flops_per_device": per_device_flops, "peak_flops": peak, "hfu": flops.mfu(per_device_flops, step_s, peak),
        "devices": jax.device_count(), "platform": jax.devices()[0].platform,
    }


def _range(values):
    return None if not values else (min(values), max(values))


def within_noise(result: dict) -> bool:
    """Whether the communication time cannot be told from zero: its rounds disagree on the sign (or all
    say the step without collectives was the slower: it cannot be, so that too is noise)."""
    spread = result.get("spread", {}).get("comm_s")
    return result["comm_s"] is not None and (result["comm_s"] <= 0 or (spread is not None and spread[0] <= 0))


def describe(config) -> str:
    """The settings that decide what a step communicates, e.g. ``shard_map psum, none, sync``."""
    text = f"{config.driver} {config.allreduce}" if get_driver(config.driver).explicit else config.driver
    return f"{text}, {config.compression.name}, {config.strategy.name}"


def step_row(name: str, result: dict) -> str:
    """One markdown row of :data:`STEP_HEADER`."""
    spread = result.get("spread", {})

    def ms(key):
        seconds, bounds = result[key], spread.get(key)
        if seconds is None:
            return "n/a"
        if key == "comm_s" and within_noise(result):
            return f"≈0 [{bounds[0] * 1e3:.2f}, {bounds[1] * 1e3:.2f}]" if bounds else "≈0"
        text = f"{seconds * 1e3:.2f}"
        return f"{text} [{bounds[0] * 1e3:.2f}, {bounds[1] * 1e3:.2f}]" if bounds else text

    share = ("n/a" if result["comm_s"] is None else "within noise" if within_noise(result)
             else f"{100 * result['comm_s'] / result['step_s']:.0f}%")
    sent = result["comm_bytes_per_step"]
    hfu = "n/a" if result["hfu"] is None else f"{100 * result['hfu']:.2f}%"
    return (f"| {name} | {ms('step_s')} | {ms('compute_s')} | {ms('comm_s')} | {share} "
            f"| {'n/a' if sent is None else f'{sent:,.0f}'} | {hfu} |")


def _top_level_split(text: str) -> list[str]:
    """``"psum,ring"`` → two values; commas inside brackets stay: ``"(64,),(64, 64)"`` → two tuples."""
    values, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            values.append(text[start:i])
            start = i + 1
    return [v for v in values + [text[start:]] if v]


def step_main(argv: list[str]) -> int:
    """Entry point of ``dtx bench step``; returns the exit status."""
    from dtx import config as config_lib

    parser = argparse.ArgumentParser(
        prog="dtx bench step", description="Time a train step with and without its gradient collectives.",
        epilog="Other arguments are config overrides: --config.KEY=VALUE.")
    parser.add_argument("experiment", help="experiment file (experiments/digits_mlp.py) or the name of one "
                        "that ships with dtx (digits_mlp)")
    parser.add_argument("--vary", metavar="KEY=V1,V2,...", help="one row per value of a config key, e.g. "
                        "allreduce=psum,ring or compression.name=none,topk")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved blocks per step kind (median; default 5)")
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (config overrides are --config.KEY=VALUE)")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1")
    variants = {None: []}
    if args.vary:
        key, _, values = args.vary.partition("=")
        if not key or not values:
            parser.error(f"--vary {args.vary!r}: write KEY=V1,V2,... e.g. allreduce=psum,ring")
        variants = {f"{key}={value}": [f"--config.{key}={value}"] for value in _top_level_split(values)}
    configs = {}
    try:
        for name, extra in variants.items():
            configs[name] = config_lib.load(args.experiment, rest + extra + ["--config.progress=False"])
    except config_lib.ConfigError as e:
        print(f"dtx bench step: config error: {e}", file=sys.stderr)
        return 2
    first = True
    for name, config in configs.items():
        try:
            result = measure_step(config, args.steps, args.rounds)
        except ValueError as e:  # bad combinations (StepError, MeshError, ...) before anything runs
            print(f"dtx bench step: error: {e}", file=sys.stderr)
            return 2
        if first:
            print(f"{args.experiment} ({describe(config)}): global batch {config.global_batch_size} on "
                  f"{result['devices']} {result['platform']} device(s); median of {args.rounds} x {args.steps} steps")
            print(STEP_NOTE)
            print(STEP_HEADER)
            first = False
        print(step_row(name or describe(config), result), flush=True)
    if not get_driver(config.driver).explicit:
        print(f"(compute/communication split needs --config.driver=shard_map: under {config.driver} XLA places the "
              "collectives)")
    if result["peak_flops"] is None:
        print(f"(HFU: no peak FLOP/s known for device kind {jax.devices()[0].device_kind!r}; "
              "set --config.peak_flops)")
    return 0


if __name__ == "__main__":
    sys.exit(collectives_main(sys.argv[1:]))
