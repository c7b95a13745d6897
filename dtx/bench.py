"""``dtx bench collectives``: time every allreduce algorithm and set it beside the α-β model.

    dtx bench collectives [--sizes 4KiB..64MiB] [--algorithms ring tree ...]
                          [--alpha 5e-6 --bandwidth 1.25e9 --gamma 0] [--out DIR]
                          [--repeats N] [--devices N]

For each message size (bytes per device, float32) and algorithm it prints and saves
the measured time, the algorithm bandwidth ``n/t``, the bus bandwidth
``algbw·2(p−1)/p`` (NCCL-tests' convention: comparable with link bandwidth whatever
p), the bytes each device sends (counted from the schedule, :func:`dtx.collectives.
count_traffic`), and the time the α-β-γ model predicts for the network given by the
flags (Thakur, Rabenseifner & Gropp 2005; :mod:`dtx.costmodel`). Flat algorithms use
all devices on one ``data`` axis; ``hierarchical`` uses a 2D ``(node, local)`` mesh,
``(2, 4)`` on 8 devices. On an emulated CPU mesh the devices share the host's cores,
so measured times show the software cost of each schedule, not a network
(DESIGN.md §2); the predicted column is the network.
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

from dtx import collectives, costmodel
from dtx import mesh as mesh_lib

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
    if "hierarchical" in algorithms and not two_level:
        log(f"  hierarchical skipped: {p} device(s) have no 2D factorisation")
        algorithms = [a for a in algorithms if a != "hierarchical"]
    for size in sizes:
        n = size // 4
        for algorithm in algorithms:
            mesh, axes, inner = meshes["2d" if algorithm == "hierarchical" else "flat"]
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
                "predicted_s": collectives.predict_time(algorithm, size, p, alpha, beta, gamma, inner),
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
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    FigureCanvasAgg(fig)
    ax_time, ax_bw = fig.subplots(1, 2)
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        sizes = [r["size_bytes"] for r in mine]
        (line,) = ax_time.plot(sizes, [r["time_s"] for r in mine], "o-", label=f"{algorithm} measured")
        ax_time.plot(sizes, [r["predicted_s"] for r in mine], "--", color=line.get_color(), label=f"{algorithm} α-β")
        ax_bw.plot(sizes, [r["busbw_Bps"] / 1e9 for r in mine], "o-", color=line.get_color(), label=algorithm)
    for ax, ylabel in ((ax_time, "seconds per allreduce"), (ax_bw, "bus bandwidth, GB/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per device")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7, ncol=2)
    ax_bw.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def collectives_main(argv: list[str]) -> int:
    """Entry point of ``dtx bench collectives``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="dtx bench collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4KiB..64MiB", help="bytes per device: A..B (powers of 4) or a,b,c")
    parser.add_argument("--algorithms", nargs="+", default=list(collectives.ALGORITHMS),
                        help=f"any of {', '.join(collectives.ALGORITHMS)} (space or comma separated)")
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
            costmodel.check_algorithm(algorithm)
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
          f"{collectives.bandwidth_lower_bound(sizes[-1], p, beta) * 1e3:.3f}ms")
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


if __name__ == "__main__":
    sys.exit(collectives_main(sys.argv[1:]))
