"""``dtx bench step`` over every allreduce algorithm, compressor and strategy of the default experiment.

One row per setting (the rest of the experiment unchanged): the step's time, its
compute time (the same step with the gradient path's collectives removed), their
difference (communication), the bytes one worker sends per step, in one process.
Compressors and strategies are read from the registries, so new ones appear here
without editing this file.

    python benchmarks/step_breakdown.py [--steps 20] [--rounds 5] [--update-docs] [--config.KEY=VALUE ...]
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
EXPERIMENT = os.path.join(REPO, "experiments", "digits_mlp.py")


def settings():
    """``(row name, overrides)`` for every technique that changes what a step communicates."""
    from dtx import compress, strategies
    from dtx.comm import algorithms

    rows = []
    for algorithm in algorithms.ALGORITHMS:
        extra = ['--config.mesh=(("node", 2), ("local", 4))'] if algorithm == "hierarchical" else []
        rows.append((f"allreduce={algorithm}", [f"--config.allreduce={algorithm}", *extra]))
    rows += [(f"compression.name={name}", [f"--config.compression.name={name}"])
             for name in sorted(compress.COMPRESSORS) if name != "none"]
    for name in sorted(strategies.STRATEGIES):
        if name != "sync":  # a strategy doing the optimizer's work itself runs over plain SGD (its declaration)
            sgd = ["--config.optimizer.name=sgd"] if getattr(strategies.STRATEGIES[name], "replaces_optimizer",
                                                               None) else []
            rows.append((f"strategy.name={name}", [f"--config.strategy.name={name}", *sgd]))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args, overrides = parser.parse_known_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from dtx.tools import bench
    from dtx import config as config_lib

    started = time.perf_counter()
    lines = [bench.STEP_HEADER]
    for name, extra in settings():
        try:
            config = config_lib.load(EXPERIMENT, [*overrides, *extra, "--config.progress=False"])
            lines.append(bench.step_row(name, bench.measure_step(config, args.steps, args.rounds)))
        except ValueError as e:  # a combination dtx refuses: say so in the table
            lines.append(f"| {name} | refused: {' '.join(str(e).split())[:100]} | | | | | |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    import report

    command = " ".join(["python benchmarks/step_breakdown.py", *overrides])
    report.write("step_breakdown", (
        f"`{command}` ({report.machine()}; {(time.perf_counter() - started) / 60:.0f} min) — "
        f"`dtx bench step experiments/digits_mlp.py --config.KEY=VALUE` for each setting: MLP 256-256 on "
        f"digits, global batch 128, median of {args.rounds} interleaved blocks of {args.steps} steps. "
        "*Compute* is the same step with every collective of the gradient path removed "
        "(`make_train_step(..., communicate=False)`); *communication* is the difference; bytes are what one "
        "worker sends per step by the accountant of `dtx/comm/costmodel.py` (a mean over the steps: strategies "
        f"communicate on some steps only). {bench.STEP_NOTE}"), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
