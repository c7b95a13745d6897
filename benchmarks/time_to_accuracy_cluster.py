"""Time to accuracy on a modelled cluster: every technique on one task, simulated seconds to a target.

Each technique trains once (``dtx.train``, 8 emulated workers, the same experiment,
steps and evaluations; a record at each evaluation, ``log_every = --eval-every``, as a
deployment logs: the steps between records run without the records' all-reduce, and each
record lists every step's own bytes and rounds, ``comm_steps``) and its
records are then timed by the simulated clock (:mod:`dtx.perf.simclock`) on each cluster
preset, compute regime and straggler model with :func:`dtx.perf.simclock.retime`: a run's
bytes and rounds do not depend on the cluster or the stragglers, so it needs no
retraining. Backup workers are the exception — which gradients a step applies depends
on the straggler model — so they train once per straggler model.

Two compute regimes per preset:

* ``roofline`` — the task's own compute from the perf model (tiny: microseconds, so
  the step is communication-bound on both presets);
* ``balanced`` — each worker computes for as long as a synchronous step communicates
  on that preset (``cluster.compute_s`` set to sync's communication time): the regime
  of a real model at a well-chosen batch, where stragglers cost as much as bytes.

The tables give, per preset, the simulated seconds to the first evaluation that
reaches ``--target`` on ``--metric`` (``-`` where never reached), the final metric and
the bytes per step; the plot, the metric against simulated time.

    python benchmarks/time_to_accuracy_cluster.py [--only sync,backup_b2] [--metric perplexity] [--target 10]
        [--steps N] [--experiment experiments/tiny_lm.py] [--seeds 0,1] [--out DIR] [--update-docs]

Everything is modelled (docs/simulated_clock.md): compute from the perf model's
roofline or as stated, communication from the accountant's bytes and rounds (α-β-γ),
no overlap, stragglers as drawn. Differences below a seed-to-seed spread mean nothing:
use ``--seeds`` to repeat.
"""

import argparse
import csv
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PRESETS = ("h100_nvlink_ndr", "cloud_10gbe")  # a fast NVLink/InfiniBand cluster and a 10 GbE cloud cluster
REGIMES = ("roofline", "balanced")
STRAGGLERS = {"none": {}, "σ=0.5": {"cluster.straggler": "lognormal", "cluster.sigma": 0.5}}
LOWER_IS_BETTER = ("perplexity", "test_loss")
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
    # its own Adam (optimizer sgd); eps 1e-6: at optax's 1e-8 the frozen variance divides by ~0 (docs/strategies.md)
    ("onebit_adam", {"strategy.name": "onebit_adam", "optimizer.name": "sgd", "strategy.adam_eps": 1e-6,
                     "strategy.warmup_steps": 50}),
]


def _key(label: str) -> str:
    return label.split()[0] + ("_" + label.split()[1].replace("=", "") if len(label.split()) > 1 else "")


def train_records(experiment: str, overrides: dict, seed: int, steps: int, eval_every: int) -> tuple[list, object]:
    """Train one technique; its records and config."""
    from dtx import config as config_lib
    from dtx.run import metrics as metrics_lib
    from dtx.run.trainer import train

    flags = [f"--config.{k}={v}" for k, v in {**overrides, "seed": seed, "num_steps": steps, "log_every": eval_every or steps,
                                              "eval_every": eval_every, "progress": False}.items()]
    config = config_lib.load(experiment, flags)
    with tempfile.TemporaryDirectory() as workdir:
        train(config, workdir)
        return metrics_lib.read_metrics(workdir), config


def analysed(config) -> tuple:
    """What the clock needs of a trained run, built once: its model, example shape and dtype, and the
    strategy's capabilities (who waits for whom)."""
    from dtx import config as config_lib
    from dtx import models, strategies
    from dtx.data import datasets

    data = datasets.load_dataset(config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
                                 synthetic=config.dataset.synthetic.to_dict(), seq_len=config.dataset.seq_len)
    model = models.build_model(config.model.name, num_classes=data.num_classes,
                               **{k: v for k, v in config.model.items() if k != "name"})
    settings = config_lib.chosen_settings(config.strategy, strategies.strategy_settings())
    caps = strategies.make_strategy(config.strategy.name, **settings).caps
    return model, data.train.inputs.shape[1:], data.train.inputs.dtype, caps


def clock_model(config, parts: tuple, preset: str, stragglers: dict, compute_s: float = 0.0):
    """The clock of ``config`` (``parts``: :func:`analysed`) on ``preset`` with ``stragglers`` and ``compute_s``
    (0: roofline)."""
    from dtx import config as config_lib
    from dtx.perf import simclock
    from dtx.run import setup

    model, shape, dtype, caps = parts
    config = config_lib.override(config, **{"cluster.name": preset, "cluster.compute_s": compute_s, **stragglers})
    return simclock.model_for_run(setup.cluster_spec(config), model, shape, dtype, workers=8,
                                  global_batch=config.global_batch_size, accum_steps=config.grad_accum_steps,
                                  algorithm=config.allreduce, caps=caps)


def time_to_target(records: list, times: dict, metric: str, target: float) -> float | None:
    """Simulated seconds at the first evaluation whose ``metric`` reaches ``target`` (None: never)."""
    lower = metric in LOWER_IS_BETTER
    for record in sorted((r for r in records if metric in r and r["step"] in times), key=lambda r: r["step"]):
        if record[metric] <= target if lower else record[metric] >= target:
            return times[record["step"]]
    return None


def sync_comm_seconds(records: list, model) -> float:
    """One synchronous step's communication on ``model``'s link: its recorded bytes and rounds, the metric
    averages riding in its gradient all-reduce included, as the clock charges them (α-β-γ)."""
    last = [r for r in records if "comm_bytes" in r][-1]
    return model.comm(last["comm_bytes"], last["comm_rounds"]).total


def _cell(seconds: float | None, reached: int, seeds: int, best: float | None) -> str:
    """A table cell: mean milliseconds over the seeds that reached the target, bold if fastest, ``(n/k)`` if
    only ``n`` of ``k`` seeds did, ``-`` if none."""
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    text = f"{ms:.3g} ms" if ms < 1000 else f"{ms:.0f} ms"
    text = f"**{text}**" if seconds == best and reached == seeds else text
    return text if reached == seeds else f"{text} ({reached}/{seeds})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default=os.path.join(REPO, "experiments", "tiny_lm.py"))
    parser.add_argument("--only", default="", help="comma-separated technique keys: the label's first word, _ and "
                                                   "its setting (sync, backup_b2, topk_1%%); sync always runs")
    parser.add_argument("--metric", default="perplexity", help="an evaluation record's key (perplexity, "
                                                               "test_loss: lower is better; else higher)")
    parser.add_argument("--target", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out", default=None, help="folder for the CSV and the plot (default: see --update-docs)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report

    report.add_output_arguments(parser)
    args = parser.parse_args()
    from dtx.perf import simclock
    from dtx.tools.plots import Panel, panels_plot

    only = {k for k in args.only.split(",") if k} | {"sync"}
    chosen = [(label, o) for label, o in TECHNIQUES if not args.only or _key(label) in only]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, curves, balanced = [], {}, {}
    for seed in seeds:
        for label, overrides in chosen:
            depends = overrides.get("strategy.name") == "backup"
            trained = {}
            for straggler, noise in STRAGGLERS.items():
                if depends or not trained:  # backup's updates depend on the stragglers; the others' do not
                    trained = dict(zip(("records", "config"), train_records(
                        args.experiment, {**overrides, **noise} if depends else overrides, seed, args.steps,
                        args.eval_every)))
                    trained["parts"] = analysed(trained["config"])
                records, config, parts = trained["records"], trained["config"], trained["parts"]
                final = [r[args.metric] for r in records if args.metric in r][-1]
                per_step = [r["comm_bytes_per_step"] for r in records if "comm_bytes_per_step" in r][-1]
                for preset in PRESETS:
                    if label == "sync" and preset not in balanced:  # sync trains first: the balanced compute
                        balanced[preset] = sync_comm_seconds(records, clock_model(config, parts, preset, {}))
                    for regime in REGIMES:
                        compute_s = balanced[preset] if regime == "balanced" else 0.0
                        times = simclock.retime(records, clock_model(config, parts, preset, noise, compute_s))
                        if seed == seeds[0] and (regime, straggler) in (("roofline", "none"), ("balanced", "σ=0.5")):
                            curves.setdefault((preset, regime, straggler), {})[label] = [
                                (times[r["step"]], r[args.metric]) for r in records if args.metric in r]
                        rows.append(dict(technique=label, seed=seed, preset=preset, regime=regime,
                                         stragglers=straggler, compute_s=compute_s or None,
                                         time_to_target_s=time_to_target(records, times, args.metric, args.target),
                                         sim_time_total_s=times[max(times)], final=final, bytes_per_step=per_step))
                        print(rows[-1], flush=True)
    out = report.figures_dir(args.update_docs, args.out)
    path = os.path.join(out, "time_to_accuracy_cluster.csv")
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    panels_plot([Panel({label: ([t for t, _ in xy], [m for _, m in xy]) for label, xy in by.items()},
                       f"{preset}, {regime}, stragglers {straggler}", "simulated seconds", args.metric, logx=True,
                       logy=args.metric == "perplexity")
                 for (preset, regime, straggler), by in curves.items()],
                os.path.join(out, "time_to_accuracy_cluster.png"),
                title=f"{args.metric} against simulated time (target {args.target:g})")
    tables = []
    columns = [(regime, straggler) for regime in REGIMES for straggler in STRAGGLERS]
    for preset in PRESETS:
        cells = {}
        for label, _ in chosen:
            for column in columns:
                got = [r["time_to_target_s"] for r in rows if r["technique"] == label and r["preset"] == preset
                       and (r["regime"], r["stragglers"]) == column]
                reached = [t for t in got if t is not None]
                cells[label, column] = (sum(reached) / len(reached) if reached else None, len(reached), len(got))
        # the fastest among techniques every seed brought to the target
        best = {c: min((v for (_, cc), (v, n, k) in cells.items() if cc == c and v is not None and n == k),
                       default=None) for c in columns}
        lines = [f"**{preset}** (balanced compute: {balanced[preset] * 1e3:.3g} ms per step)", "",
                 "| technique | " + " | ".join(f"{regime}, stragglers {straggler}" for regime, straggler in columns)
                 + f" | final {args.metric} | KiB/step |", "|" + "---|" * (len(columns) + 3)]
        for label, _ in chosen:
            mine = [r for r in rows if r["technique"] == label and r["preset"] == preset]
            text = [_cell(*cells[label, c], best[c]) for c in columns]
            final = sum(r["final"] for r in mine) / len(mine)
            lines.append(f"| {label} | " + " | ".join(text)
                         + f" | {final:.4g} | {mine[0]['bytes_per_step'] / 1024:.1f} |")
        tables.append("\n".join(lines))
    direction = "at or below" if args.metric in LOWER_IS_BETTER else "at or above"
    preamble = (f"Simulated time to {args.metric} {direction} {args.target:g} "
                f"({os.path.basename(args.experiment)}, 8 workers, {args.steps} steps, evaluations every "
                f"{args.eval_every}, seeds {args.seeds}; the mean over the seeds that reach it, (n/k) where only n of k do, "
                f"'-' where none does; "
                f"fastest per column in bold). Regimes: roofline = the task's own modelled compute; balanced = each "
                f"worker computes as long as a synchronous step communicates (cluster.compute_s). Stragglers: "
                f"none, or each worker's compute multiplied by a mean-1 lognormal with sigma 0.5 per step. "
                f"Modelled throughout: docs/simulated_clock.md.")
    print(report.write("time_to_accuracy_cluster", preamble, "\n\n".join(tables), update_docs=args.update_docs))
    report.save_doc_table("time_to_accuracy_ratios", "simulated_clock.md",
                          ratio_table(rows, [label for label, _ in chosen], args, report.machine()),
                          update_docs=args.update_docs)
    print(path)


# The columns docs/simulated_clock.md shows: (preset, regime, stragglers, heading).
DOC_COLUMNS = [("h100_nvlink_ndr", "roofline", "none", "NVLink, roofline"),
               ("cloud_10gbe", "roofline", "none", "10 GbE, roofline"),
               ("cloud_10gbe", "balanced", "none", "10 GbE, balanced"),
               ("cloud_10gbe", "balanced", "σ=0.5", "10 GbE, balanced, σ = 0.5")]


def ratio_table(rows: list, labels: list, args, machine: str) -> str:
    """Each technique's time to the target divided by synchronous SGD's in the same column (the mean over the
    seeds that reach it; "never" where none does, "(n/k seeds)" where only n of k do)."""
    def mean_time(label, preset, regime, straggler):
        got = [r["time_to_target_s"] for r in rows if r["technique"] == label and r["preset"] == preset
               and (r["regime"], r["stragglers"]) == (regime, straggler)]
        reached = [t for t in got if t is not None]
        return (sum(reached) / len(reached) if reached else None), len(reached), len(got)

    lines = [f"`python benchmarks/time_to_accuracy_cluster.py --seeds {args.seeds}` ({machine}): time to "
             f"{args.metric} {args.target:g}, divided by sync's in the same column.", "",
             "| technique | " + " | ".join(c[3] for c in DOC_COLUMNS) + f" | final {args.metric} |",
             "|" + "---|" * (len(DOC_COLUMNS) + 2)]
    for label in labels:
        cells = []
        for preset, regime, straggler, _ in DOC_COLUMNS:
            t, n, k = mean_time(label, preset, regime, straggler)
            sync, _, _ = mean_time("sync", preset, regime, straggler)  # n/a where --only left sync out
            cells.append("n/a" if sync is None else "never" if t is None else f"{t / sync:.2f}×"
                         + ("" if n == k else f" ({n}/{k} seeds)"))
        final = [r["final"] for r in rows if r["technique"] == label]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {sum(final) / len(final):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
