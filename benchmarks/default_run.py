"""Whole-process wall time of the default experiment vs the plain flax + optax loop, with the persistent
compilation cache cold and warm.

Each command runs as a fresh process (start-up, imports and compilation included), interleaved
``--repeats`` times; medians are compared within this one run because the machine is noisy. Each dtx
command runs twice per round: *cold* (an empty compilation-cache folder: every program compiles) and
*warm* (a folder an earlier launch of the same command filled: the programs are read back). The
start-up compile times are JAX's own (its monitoring events, as each run's first record holds them:
``startup_compile_s``, ``startup_compiles``, ``startup_cache_hits``).

    python benchmarks/default_run.py [--repeats 5] [--update-docs]   # --update-docs: into BENCHMARKS.md
"""

import argparse
import json
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
# How each run appears in BENCHMARKS.md: the command a reader can paste, and its target (cold, warm).
SHOWN = {
    PLAIN: ("plain flax + optax loop, 1 device", "", ""),
    "dtx default, 1 device": ("`dtx train experiments/digits_mlp.py --config.emulate_cpu_devices=1`",
                              "target ≤ 1.1×", "target ≤ 1.1×"),
    "dtx default, 8 emulated devices (shard_map)": ("`dtx train experiments/digits_mlp.py` (8 emulated devices, "
                                                    "shard_map)", "target ≤ 2.5×", "target ≤ 1.5×"),
    "dtx default, 8 emulated devices (jit)": ("`dtx train experiments/digits_mlp.py --config.driver=jit` "
                                              "(8 emulated devices)", "", ""),
}
WARM_TARGET = 0.20  # a warm launch spends at most this share of a cold one's start-up compile time


def run_once(command, cache=None):
    """(wall seconds, test accuracy, the run's first record or {}) of one fresh process."""
    with tempfile.TemporaryDirectory() as workdir:
        extra = []
        if "dtx.tools.cli" in command:
            extra = ["--workdir", os.path.join(workdir, "run"), f"--config.compilation_cache={cache}"]
        start = time.perf_counter()
        out = subprocess.run(command + extra, capture_output=True, text=True, check=True, cwd=REPO,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
        wall = time.perf_counter() - start
        first = {}
        if extra:
            with open(os.path.join(workdir, "run", "metrics.jsonl"), encoding="utf-8") as f:
                first = json.loads(f.readline())
    accuracy = float(re.search(r"test_accuracy (\d\.\d+)", out.stdout + out.stderr).group(1))
    return wall, accuracy, first


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args = parser.parse_args()
    runs = [(name, kind) for name in COMMANDS for kind in (("",) if name == PLAIN else ("cold", "warm"))]
    walls = {run: [] for run in runs}
    compile_s = {run: [] for run in runs if run[0] != PLAIN}
    counts, accuracy = {}, {}
    with tempfile.TemporaryDirectory() as caches:
        warm = {name: os.path.join(caches, f"warm{i}") for i, name in enumerate(COMMANDS)}
        for name in COMMANDS:  # fill each warm folder once, untimed
            if name != PLAIN:
                run_once(COMMANDS[name], warm[name])
        for repeat in range(args.repeats):
            for name, kind in runs:
                cache = os.path.join(caches, f"cold-{repeat}-{len(walls[(name, kind)])}-{abs(hash(name))}") \
                    if kind == "cold" else warm.get(name)
                wall, accuracy[name, kind], first = run_once(COMMANDS[name], cache)
                walls[name, kind].append(wall)
                if first:
                    compile_s[name, kind].append(first["startup_compile_s"])
                    counts[name, kind] = (first["startup_compiles"], first["startup_cache_hits"])
    base = statistics.median(walls[PLAIN, ""])
    lines = ["| run | cache | median wall (s) | vs plain | start-up compile (s) | programs compiled / read back "
             "| test accuracy |", "|---|---|---|---|---|---|---|"]
    for name, kind in runs:
        median = statistics.median(walls[name, kind])
        shown, cold_target, warm_target = SHOWN[name]
        target = cold_target if kind == "cold" else warm_target
        ratio = f"**{median / base:.2f}×** ({target})" if target else f"{median / base:.2f}×"
        compiled = f"{statistics.median(compile_s[name, kind]):.2f}" if kind else ""
        programs = "{} / {}".format(*counts[name, kind]) if kind else ""
        lines.append(f"| {shown} | {kind or '—'} | {median:.2f} | {ratio} | {compiled} | {programs} "
                     f"| {accuracy[name, kind]:.4f} |")
    table = "\n".join(lines)
    warm_lines = ["| run | warm ÷ cold start-up compile time |", "|---|---|"]
    for name in COMMANDS:
        if name != PLAIN:
            share = statistics.median(compile_s[name, "warm"]) / statistics.median(compile_s[name, "cold"])
            warm_lines.append(f"| {SHOWN[name][0]} | **{share:.0%}** (target ≤ {WARM_TARGET:.0%}) |")
    table += "\n\n" + "\n".join(warm_lines)
    print(table)
    import report

    report.write("default_run", (
        f"`python benchmarks/default_run.py --repeats {args.repeats}` "
        f"({report.machine('8 emulated CPU devices or 1')})"
        " — whole-process wall time (start-up, imports, compilation, training to the end, evaluation), each "
        "command a fresh process, interleaved, medians. The baseline, `benchmarks/plain_loop.py`, is the "
        "obvious single-device flax + optax loop on the same split, model, optimizer (Adam 2e-3), batch (128) "
        "and epochs (20). Each dtx command runs cold (an empty compilation-cache folder) and warm (a folder "
        "an earlier launch of the same command filled: the second launch of an experiment). Start-up compile "
        "time is JAX's own (its monitoring events; XLA compiling plus reading programs back, the model's "
        "init and train steps), as each run's first record holds it."), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
