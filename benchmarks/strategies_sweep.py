"""Strategies study: final test accuracy vs communication per step, for every strategy.

Every run trains experiments/sync_strategies.py:<strategy> for the same 220 steps (20
epochs of the digits task, 8 emulated workers); only the strategy and its setting
change. Reads each run's metrics.jsonl (final ``test_accuracy``, ``comm_bytes_per_step``,
``comm_rounds_per_step``, ``comm_ratio``: dtx.comm.costmodel's accountant, summed over every
step) and writes strategies.csv, strategies.png (accuracy vs bytes per step),
strategies_rounds.png (accuracy vs message rounds per step) and its table (section
"strategies") into a results folder (printed); with ``--update-docs`` into docs/ and
BENCHMARKS.md, the files docs/strategies.md shows (its table too, section "strategies_table").

    python benchmarks/strategies_sweep.py [--only sync,gossip] [--set KEY=VALUE ...] [--out DIR] [--update-docs]
"""

import argparse
import csv
import datetime
import os
import platform
import sys
import tempfile
import time

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# (strategy, label, overrides): each strategy at its experiment setting and a lighter/heavier one.
VARIANTS = [
    ("sync", "every step", {}),
    ("async", "τ=4 random", {}),
    ("async", "τ=16 random", {"strategy.staleness": 16}),
    # Asynchrony adds implicit momentum (Mitliagkas et al. 2016): lower Adam's b1 to compensate.
    ("async", "τ=4 random, Adam b1=0.5", {"optimizer.momentum": 0.5}),
    ("ssp", "s=4", {}),
    ("ssp", "s=16", {"strategy.staleness": 16}),
    ("local_sgd", "H=4", {"strategy.period": 4}),
    ("local_sgd", "H=16", {}),
    ("local_sgd", "H=64", {"strategy.period": 64}),
    ("diloco", "H=4", {"strategy.period": 4}),
    ("diloco", "H=16", {}),
    ("diloco", "H=64", {"strategy.period": 64}),
    ("easgd", "τ=1", {"strategy.period": 1}),
    ("easgd", "τ=4", {}),
    ("easgd", "τ=16", {"strategy.period": 16}),
    ("gossip", "exponential", {"strategy.topology": "exponential"}),
    ("gossip", "ring", {}),
    ("gossip", "complete", {"strategy.topology": "complete"}),
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="folder for the CSV and the plots (default: docs/ with --update-docs, "
                                      "else a results folder)")
    parser.add_argument("--only", default="", help="comma-separated strategies (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run, e.g. --set num_epochs=5")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the CSV, the plots and the BENCHMARKS.md section into the repository (default: a "
                             "results folder, printed)")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report
    jax.config.update("jax_num_cpu_devices", 8)
    import dtx
    from dtx.run import metrics
    from dtx.tools import plots

    only = set(filter(None, args.only.split(",")))
    experiment = os.path.join(REPO, "experiments", "sync_strategies.py")
    rows = []
    started = time.perf_counter()
    for name, label, overrides in VARIANTS:
        if only and name not in only:
            continue
        flags = [f"--config.{k}={v}" for k, v in overrides.items()]
        flags += ["--config.progress=False"] + [f"--config.{kv}" for kv in args.set]
        config = dtx.load(f"{experiment}:{name}", flags)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            result = dtx.train(config, os.path.join(workdir, "run"))
            records = metrics.read_metrics(os.path.join(workdir, "run"))
        comm = [r for r in records if "comm_bytes_per_step" in r][-1]  # the totals after the last step
        rows.append(dict(strategy=name, setting=label, steps=int(result.state.step),
                         test_accuracy=result.metrics["test_accuracy"],
                         comm_bytes_per_step=comm["comm_bytes_per_step"],
                         comm_rounds_per_step=comm["comm_rounds_per_step"], comm_ratio=comm.get("comm_ratio", 0.0),
                         seconds=time.perf_counter() - start))
        print(rows[-1], file=sys.stderr, flush=True)
    total = time.perf_counter() - started

    args.out = report.figures_dir(args.update_docs, args.out)
    with open(os.path.join(args.out, "strategies.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    for key, what, file in (("comm_bytes_per_step", "bytes sent per worker per step", "strategies.png"),
                            ("comm_rounds_per_step", "message rounds per worker per step", "strategies_rounds.png")):
        series = {}
        for n in names:
            points = sorted((r[key], 100 * r["test_accuracy"]) for r in rows if r["strategy"] == n)
            series[n] = ([x for x, _ in points], [y for _, y in points])
        plots.line_plot(series, os.path.join(args.out, file), logx=True, xlabel=f"{what} (log2)",
                        ylabel="test accuracy (%)",
                        title=f"Digits MLP, 8 workers, {rows[0]['steps']} steps: accuracy vs communication")

    command = "python benchmarks/strategies_sweep.py" + "".join(f" --set {kv}" for kv in args.set)
    machine = f"{os.cpu_count()}-core CPU ({platform.machine()}), 8 emulated devices, jax {jax.__version__}"
    lines = [
        "## Synchronous, asynchronous and relaxed SGD: accuracy vs communication",
        "",
        f"`{command}` ({machine}, {datetime.date.today().isoformat()}; {total / 60:.1f} min) — every run is "
        f"`experiments/sync_strategies.py:<strategy>` for {rows[0]['steps']} steps (digits, MLP 256-256, "
        "Adam 2e-3 (DiLoCo: inner AdamW), global batch 128 over 8 workers), one seed. Bytes and rounds are what "
        "one worker sends per step, averaged over the run, from `dtx.comm.costmodel`'s accountant (async/ssp: a "
        "parameter server sharded over the workers; see docs/strategies.md); ratio = float32 ring allreduce "
        "bytes ÷ bytes sent. Plots: `docs/strategies.png` (bytes), `docs/strategies_rounds.png` (rounds).",
        "",
        "| strategy | setting | test accuracy (%) | KiB / step | rounds / step | ratio | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['setting']} | {100 * r['test_accuracy']:.2f} | "
                     f"{r['comm_bytes_per_step'] / 1024:.1f} | {r['comm_rounds_per_step']:.2f} | "
                     f"{r['comm_ratio']:.2f}× | {r['seconds']:.1f} |")
    lines += ["", "Wall seconds include start-up and compilation, on 2 shared cores: not a measure of the "
              "strategies' speed (the emulated mesh has no network). What the figures show: docs/strategies.md."]
    markdown = "\n".join(lines)
    print(markdown)
    report.save_section("strategies", markdown, update_docs=args.update_docs)
    table = lines[lines.index("| strategy | setting | test accuracy (%) | KiB / step | rounds / step | ratio | wall s |"):]
    report.save_doc_table("strategies_table", "strategies.md", "\n".join(
        [f"`{command}`, {datetime.date.today().isoformat()} ({machine}):", ""] + table[:-2]),
        update_docs=args.update_docs)
    print(f"CSV and plots: {args.out}")


if __name__ == "__main__":
    main()
