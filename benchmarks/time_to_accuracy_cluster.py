"""Time to accuracy on a modelled cluster: every technique on one task, simulated seconds to a target.

Each technique trains once (``dtx.train``, 8 emulated workers, the same experiment,
steps and evaluations; ``log_every=1`` so every step's bytes are its own) and its
records are then timed by the simulated clock (:mod:`dtx.simclock`) on each cluster
preset and straggler model with :func:`dtx.simclock.retime`: a run's bytes and rounds
do not depend on the cluster or the stragglers, so it needs no retraining. Backup
workers are the exception — which gradients a step applies depends on the straggler
model — so they train once per straggler model. The table gives, per technique,
preset and straggler model, the simulated seconds to the first evaluation at or above
``--target`` (``-`` where it is never reached), the final test accuracy and the bytes
per step; the plot, test accuracy against simulated time per preset.

    python benchmarks/time_to_accuracy_cluster.py [--only sync,backup_b2] [--target 0.9] [--steps N]
        [--experiment experiments/large_batch.py:momentum] [--seeds 0,1] [--out DIR] [--update-docs]

Everything is modelled (docs/simulated_clock.md): compute from the perf model's
roofline, communication from the accountant's bytes and rounds (α-β-γ), no overlap,
stragglers as drawn. Differences below a seed-to-seed spread mean nothing: use
``--seeds`` to repeat.
"""

import argparse
import csv
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PRESETS = ("h100_nvlink_ndr", "cloud_10gbe")  # a fast NVLink/InfiniBand cluster and a 10 GbE cloud cluster
STRAGGLERS = {"none": {}, "lognormal σ=0.5": {"cluster.straggler": "lognormal", "cluster.sigma": 0.5}}
# (label, overrides): the techniques, each at one representative setting.
TECHNIQUES = [
    ("sync", {}),
    ("cast bf16", {"compression.name": "cast"}),
    ("topk 1%", {"compression.name": "topk"}),
    ("sign", {"compression.name": "sign"}),
    ("terngrad", {"compression.name": "terngrad"}),
    ("qsgd s=16", {"compression.name": "qsgd"}),
    ("powersgd r=4", {"compression.name": "powersgd"}),
    ("async τ=4", {"strategy.name": "async", "strategy.staleness": 4}),
    ("ssp s=4", {"strategy.name": "ssp", "strategy.staleness": 4}),
    ("local_sgd H=16", {"strategy.name": "local_sgd", "strategy.period": 16}),
    ("diloco H=16", {"strategy.name": "diloco", "strategy.period": 16}),
    ("easgd τ=4", {"strategy.name": "easgd", "strategy.period": 4}),
    ("gossip ring", {"strategy.name": "gossip"}),
    ("backup b=1", {"strategy.name": "backup", "strategy.backup_workers": 1}),
    ("backup b=2", {"strategy.name": "backup", "strategy.backup_workers": 2}),
    ("streaming_diloco H=16 P=4 4-bit", {"strategy.name": "streaming_diloco", "strategy.period": 16,
                                         "strategy.fragments": 4, "strategy.outer_bits": 4}),
    ("onebit_adam", {"strategy.name": "onebit_adam", "optimizer.name": "sgd"}),
]


def _key(label: str) -> str:
    return label.split()[0] + ("_" + label.split()[1].replace("=", "") if len(label.split()) > 1 else "")


def train_records(experiment: str, overrides: dict, seed: int, steps: int, eval_every: int) -> tuple[list, object]:
    """Train one technique; its records and config."""
    from dtx import config as config_lib
    from dtx import metrics as metrics_lib
    from dtx.trainer import train

    flags = [f"--config.{k}={v}" for k, v in {**overrides, "seed": seed, "num_steps": steps, "log_every": 1,
                                              "eval_every": eval_every, "progress": False}.items()]
    config = config_lib.load(experiment, flags)
    with tempfile.TemporaryDirectory() as workdir:
        train(config, workdir)
        return metrics_lib.read_metrics(workdir), config


def clock_model(config, preset: str, stragglers: dict):
    """The clock of ``config`` on ``preset`` with ``stragglers`` (config.cluster overridden)."""
    from dtx import config as config_lib
    from dtx import datasets, models, simclock, strategies

    config = config_lib.override(config, **{"cluster.name": preset, **stragglers})
    data = datasets.load_dataset(config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
                                 synthetic=config.dataset.synthetic.to_dict(), seq_len=config.dataset.seq_len)
    model = models.build_model(config.model.name, num_classes=data.num_classes,
                               **{k: v for k, v in config.model.items() if k != "name"})
    settings = {k: v for k, v in config.strategy.to_dict().items() if k != "name"}
    caps = strategies.make_strategy(config.strategy.name, **settings).caps
    return simclock.model_for_run(config, model, data.train.inputs.shape[1:], "float32", workers=8, caps=caps)


def time_to_target(records: list, times: dict, target: float) -> float | None:
    """Simulated seconds at the first evaluation with test_accuracy >= target (None: never)."""
    for record in sorted((r for r in records if "test_accuracy" in r), key=lambda r: r["step"]):
        if record["test_accuracy"] >= target:
            return times[record["step"]]
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default=os.path.join(REPO, "experiments", "large_batch.py") + ":momentum")
    parser.add_argument("--only", default="", help="comma-separated technique keys: the label's first word, _ and "
                                                   "its setting (sync, backup_b2, topk_1%%)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--eval-every", type=int, default=32)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default=None, help="folder for the CSV and the plot (default: see --update-docs)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report

    report.add_output_arguments(parser)
    args = parser.parse_args()
    from dtx import simclock
    from dtx.tools.plots import Panel, panels_plot

    only = {k for k in args.only.split(",") if k}
    chosen = [(label, o) for label, o in TECHNIQUES if not only or _key(label) in only]
    rows, curves = [], {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for label, overrides in chosen:
            depends = overrides.get("strategy.name") == "backup"
            trained = {}
            for straggler, noise in STRAGGLERS.items():
                if depends or not trained:  # backup's updates depend on the stragglers; the others' do not
                    trained = dict(zip(("records", "config"), train_records(
                        args.experiment, {**overrides, **{f"{k}": v for k, v in noise.items()}} if depends
                        else overrides, seed, args.steps, args.eval_every)))
                records = trained["records"]
                final = [r["test_accuracy"] for r in records if "test_accuracy" in r][-1]
                per_step = [r["comm_bytes_per_step"] for r in records if "comm_bytes_per_step" in r][-1]
                for preset in PRESETS:
                    times = simclock.retime(records, clock_model(trained["config"], preset, noise))
                    if straggler == "none" and seed == int(args.seeds.split(",")[0]):
                        curves.setdefault(preset, {})[label] = [
                            (times[r["step"]], r["test_accuracy"]) for r in records if "test_accuracy" in r]
                    rows.append(dict(technique=label, seed=seed, preset=preset, stragglers=straggler,
                                     time_to_target_s=time_to_target(records, times, args.target),
                                     sim_time_total_s=times[max(times)], final_test_accuracy=final,
                                     bytes_per_step=per_step))
                    print(rows[-1], flush=True)
    out = report.figures_dir(args.update_docs, args.out)
    path = os.path.join(out, "time_to_accuracy_cluster.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    panels_plot([Panel({label: ([t for t, _ in xy], [a for _, a in xy]) for label, xy in by.items()}, preset,
                       "simulated seconds", "test accuracy", logx=True) for preset, by in curves.items()],
                os.path.join(out, "time_to_accuracy_cluster.png"),
                title=f"time to {args.target:.0%} on a modelled cluster")
    head = ("| technique | " + " | ".join(f"{p}, {s}" for p in PRESETS for s in STRAGGLERS)
            + " | final acc. | KiB/step |")
    lines = [head, "|" + "---|" * (len(PRESETS) * len(STRAGGLERS) + 3)]
    for label, _ in chosen:
        mine = [r for r in rows if r["technique"] == label]
        cells = []
        for preset in PRESETS:
            for straggler in STRAGGLERS:
                got = [r["time_to_target_s"] for r in mine if r["preset"] == preset and r["stragglers"] == straggler]
                cells.append("-" if None in got else f"{sum(got) / len(got):.3g} s")
        accuracy = sum(r["final_test_accuracy"] for r in mine) / len(mine)
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {100 * accuracy:.2f} | {mine[0]['bytes_per_step'] / 1024:.1f} |")
    preamble = (f"Simulated seconds to test accuracy >= {args.target} ({args.experiment.split(os.sep)[-1]}, "
                f"{args.steps} steps, evaluations every {args.eval_every}, seeds {args.seeds}; mean over seeds, '-' "
                "where a seed never reaches it). Modelled: docs/simulated_clock.md.")
    print(report.write("time_to_accuracy_cluster", preamble, "\n".join(lines), update_docs=args.update_docs))
    print(path)


if __name__ == "__main__":
    main()
