"""Whole-process wall time of the default experiment vs the plain flax + optax loop.

Each command runs as a fresh process (start-up, imports and compilation
included), interleaved ``--repeats`` times; medians are compared within this one
run because the machine is noisy.

    python benchmarks/default_run.py [--repeats 5]
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
DTX = [sys.executable, "-m", "dtx.cli", "train", os.path.join(REPO, "experiments", "digits_mlp.py"),
       "--config.progress=False"]

COMMANDS = {
    "plain flax+optax loop, 1 device": [sys.executable, os.path.join(HERE, "plain_loop.py")],
    "dtx default, 1 device": DTX + ["--config.emulate_cpu_devices=1"],
    "dtx default, 8 emulated devices (shard_map)": DTX,
    "dtx default, 8 emulated devices (jit)": DTX + ["--config.driver=jit"],
}


def run_once(command):
    with tempfile.TemporaryDirectory() as workdir:
        extra = ["--workdir", os.path.join(workdir, "run")] if "dtx.cli" in command else []
        start = time.perf_counter()
        out = subprocess.run(command + extra, capture_output=True, text=True, check=True, cwd=REPO,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall = time.perf_counter() - start
    accuracy = float(re.search(r"test_accuracy (\d\.\d+)", out.stdout + out.stderr).group(1))
    return wall, accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    walls = {name: [] for name in COMMANDS}
    accuracy = {}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            wall, accuracy[name] = run_once(command)
            walls[name].append(wall)
    base = statistics.median(walls["plain flax+optax loop, 1 device"])
    print(f"| run | median wall (s) | ratio vs plain | test accuracy |\n|---|---|---|---|")
    for name in COMMANDS:
        median = statistics.median(walls[name])
        print(f"| {name} | {median:.2f} | {median / base:.2f}x | {accuracy[name]:.4f} |")


if __name__ == "__main__":
    main()
