"""Whole-process wall time of the default experiment vs the plain flax + optax loop.

Each command runs as a fresh process (start-up, imports and compilation
included), interleaved ``--repeats`` times; medians are compared within this one
run because the machine is noisy.

    python benchmarks/default_run.py [--repeats 5] [--update-docs]   # --update-docs: into BENCHMARKS.md
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PLAIN = "plain flax+optax loop, 1 device"
DTX = [sys.executable, "-m", "dtx.tools.cli", "train", os.path.join(REPO, "experiments", "digits_mlp.py"),
       "--config.progress=False"]

COMMANDS = {
    PLAIN: [sys.executable, os.path.join(HERE, "plain_loop.py")],
    "dtx default, 1 device": DTX + ["--config.emulate_cpu_devices=1"],
    "dtx default, 8 emulated devices (shard_map)": DTX,
    "dtx default, 8 emulated devices (jit)": DTX + ["--config.driver=jit"],
}
# How each run appears in BENCHMARKS.md: the command a reader can paste, and its target.
SHOWN = {
    PLAIN: ("plain flax + optax loop, 1 device", ""),
    "dtx default, 1 device": ("`dtx train experiments/digits_mlp.py --config.emulate_cpu_devices=1`",
                              "target ≤ 1.1×"),
    "dtx default, 8 emulated devices (shard_map)": ("`dtx train experiments/digits_mlp.py` (8 emulated devices, "
                                                    "shard_map)", "target ≤ 2.5×"),
    "dtx default, 8 emulated devices (jit)": ("`dtx train experiments/digits_mlp.py --config.driver=jit` "
                                              "(8 emulated devices)", ""),
}


def run_once(command):
    with tempfile.TemporaryDirectory() as workdir:
        extra = ["--workdir", os.path.join(workdir, "run")] if "dtx.tools.cli" in command else []
        start = time.perf_counter()
        out = subprocess.run(command + extra, capture_output=True, text=True, check=True, cwd=REPO,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall = time.perf_counter() - start
    accuracy = float(re.search(r"test_accuracy (\d\.\d+)", out.stdout + out.stderr).group(1))
    return wall, accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args = parser.parse_args()
    walls = {name: [] for name in COMMANDS}
    accuracy = {}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            wall, accuracy[name] = run_once(command)
            walls[name].append(wall)
    base = statistics.median(walls[PLAIN])
    lines = ["| run | median wall (s) | vs plain | test accuracy |", "|---|---|---|---|"]
    for name in COMMANDS:
        median = statistics.median(walls[name])
        shown, target = SHOWN[name]
        ratio = f"**{median / base:.2f}×** ({target})" if target else f"{median / base:.2f}×"
        lines.append(f"| {shown} | {median:.2f} | {ratio} | {accuracy[name]:.4f} |")
    table = "\n".join(lines)
    print(table)
    import report

    report.write("default_run", (
        f"`python benchmarks/default_run.py --repeats {args.repeats}` "
        f"({report.machine('8 emulated CPU devices or 1')})"
        " — whole-process wall time (start-up, imports, compilation, training to the end, evaluation), each "
        "command a fresh process, interleaved, medians. The baseline, `benchmarks/plain_loop.py`, is the "
        "obvious single-device flax + optax loop on the same split, model, optimizer (Adam 2e-3), batch (128) "
        "and epochs (20)."), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
