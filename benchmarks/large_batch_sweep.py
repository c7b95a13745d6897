"""Large-batch study: final test accuracy vs global batch for SGD-momentum, LARS and LAMB.

Every run trains experiments/large_batch.py for the same 20 epochs with the linear
scaling rule and 2 warmup epochs; only the global batch (128 ... 8192, i.e. up to
64x the base batch) and the optimizer change. Prints a Markdown table and writes a
CSV and a PNG into a results folder (or ``--out DIR``).

    python benchmarks/large_batch_sweep.py [--batches 128,256,...] [--optimizers momentum,lars,lamb]
        [--set KEY=VALUE ...] [--out DIR] [--update-docs]

The full default sweep also writes its section (large_batch); with ``--update-docs``
that section goes into BENCHMARKS.md and the CSV and PNG into docs/. A partial sweep
(other batches, optimizers or --set) only prints its table.
"""

import argparse
import csv
import os
import sys
import tempfile
import time

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="folder for large_batch.csv and .png (default: docs/ with --update-docs, "
                                      "else a results folder)")
    parser.add_argument("--batches", default="128,256,512,1024,2048,4096,8192")
    parser.add_argument("--optimizers", default="momentum,lars,lamb")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run, e.g. --set optimizer.learning_rate=0.25")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the CSV, the plot and the BENCHMARKS.md section into the repository (the full "
                             "default sweep only; default: a results folder, printed)")
    args = parser.parse_args()
    default = (args.batches, args.optimizers, args.set) == ("128,256,512,1024,2048,4096,8192", "momentum,lars,lamb", [])
    if args.update_docs and not default:
        parser.error("--update-docs records only the full default sweep: drop --batches, --optimizers and --set")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report
    started = time.perf_counter()
    jax.config.update("jax_num_cpu_devices", 8)
    import dtx
    from dtx.tools import plots

    batches = [int(b) for b in args.batches.split(",")]
    optimizers = args.optimizers.split(",")
    experiment = os.path.join(REPO, "experiments", "large_batch.py")
    rows = []
    for optimizer in optimizers:
        for batch in batches:
            overrides = [f"--config.global_batch_size={batch}", "--config.progress=False"]
            config = dtx.load(f"{experiment}:{optimizer}", overrides + [f"--config.{kv}" for kv in args.set])
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as workdir:
                result = dtx.train(config, os.path.join(workdir, "run"))
            rows.append(dict(optimizer=optimizer, global_batch=batch, steps=int(result.state.step),
                             peak_lr=dtx.optim.scaled_learning_rate(config.optimizer.learning_rate, batch,
                                                                    config.optimizer.base_batch_size, "linear"),
                             test_accuracy=result.metrics["test_accuracy"],
                             seconds=time.perf_counter() - start))
            print(rows[-1], file=sys.stderr, flush=True)

    args.out = report.figures_dir(args.update_docs, args.out)
    with open(os.path.join(args.out, "large_batch.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    series = {o: ([r["global_batch"] for r in rows if r["optimizer"] == o],
                  [100 * r["test_accuracy"] for r in rows if r["optimizer"] == o]) for o in optimizers}
    png = plots.line_plot(series, os.path.join(args.out, "large_batch.png"), logx=True,
                          title="Large-batch training: 20 epochs, linear LR scaling + warmup",
                          xlabel="global batch", ylabel="test accuracy (%)")
    names = {"momentum": "momentum", "lars": "LARS", "lamb": "LAMB"}
    lines = ["| global batch | steps | " + " | ".join(f"{names.get(o, o)} (peak lr, acc %)" for o in optimizers)
             + " |", "|---|---|" + "---|" * len(optimizers)]
    for batch in batches:
        cells = [r for r in rows if r["global_batch"] == batch]
        label = f"{batch} ({batch // batches[0]}×)" if batch != batches[0] else str(batch)
        lines.append(f"| {label} | {cells[0]['steps']} | "
                     + " | ".join(f"{r['peak_lr']:.3g}, {100 * r['test_accuracy']:.2f}" for r in cells) + " |")
    print("\n".join(lines))
    if default:
        report.write("large_batch", (
            f"`python benchmarks/large_batch_sweep.py` ({report.machine()}; "
            f"{(time.perf_counter() - started) / 60:.0f} min) — every run is "
            "`experiments/large_batch.py:<optimizer>` with only `global_batch_size` changed: the synthetic task "
            "(16,384 training / 4,096 held-out examples, 32 features, 10 classes of 4 clusters), MLP 256-256, "
            "20 epochs, linear scaling rule from base batch 128 (`optimizer.scaling=linear`), 2 warmup epochs, "
            "then polynomial (power 2) decay, weight decay 1e-4 with biases excluded. Base rates at batch 128: "
            "momentum 0.05, LARS 0.5 (η = 0.001), LAMB 0.002. Plot: `docs/large_batch.png`; CSV: "
            "`docs/large_batch.csv`."), "\n".join(lines), update_docs=args.update_docs)
        report.save_doc_table("large_batch_table", "large_batch.md", "\n".join(
            [f"`python benchmarks/large_batch_sweep.py` ({report.machine()}): peak learning rate from the linear "
             "rule, test accuracy (%).", ""] + lines), update_docs=args.update_docs)
    print(f"\nplot: {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
