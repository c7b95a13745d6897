"""Time to 97% test accuracy on digits: dtx vs the plain flax + optax loop a user would write.

Each contender runs as a fresh process and is timed from its launch (start-up,
imports, compilation included) to the moment its first test evaluation at or above
the target is seen: the plain loop (benchmarks/plain_loop.py --eval-each-epoch)
prints its accuracy after every epoch; dtx evaluates every epoch
(``--config.eval_every`` = steps per epoch) into ``metrics.jsonl``, which is watched.
Both then stop. Runs are interleaved ``--repeats`` times; medians are compared.

    python benchmarks/time_to_accuracy.py [--repeats 3] [--target 0.97] [--update-docs]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
STEPS_PER_EPOCH = 11  # 1,437 training digits // batch 128, as experiments/digits_mlp.py trains them
DTX = [sys.executable, "-m", "dtx.tools.cli", "train", os.path.join(REPO, "experiments", "digits_mlp.py"),
       "--config.progress=False", f"--config.eval_every={STEPS_PER_EPOCH}"]
CONTENDERS = {
    "plain flax + optax loop, 1 device (`benchmarks/plain_loop.py`)":
        [sys.executable, os.path.join(HERE, "plain_loop.py"), "--eval-each-epoch"],
    "dtx, 1 device (`--config.emulate_cpu_devices=1`)": DTX + ["--config.emulate_cpu_devices=1"],
    "dtx, 8 emulated devices (default, shard_map)": DTX,
}
TIMEOUT_S = 300.0


def _stop(process):
    if process.poll() is None:
        process.kill()
    process.wait()


def time_plain(command, target):
    """Seconds from launch to the first printed epoch accuracy >= target, and that epoch."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        for line in process.stdout:  # "epoch E test_accuracy A", flushed after every epoch
            words = line.split()
            if words[:1] == ["epoch"] and float(words[3]) >= target:
                return time.perf_counter() - start, int(words[1])
    finally:
        _stop(process)
    raise RuntimeError(f"{command} never reached {target}")


def time_dtx(command, target):
    """Seconds from launch to the first ``test_accuracy >= target`` record in metrics.jsonl, and its epoch."""
    with tempfile.TemporaryDirectory() as workdir:
        records = os.path.join(workdir, "run", "metrics.jsonl")
        start = time.perf_counter()
        process = subprocess.Popen(command + ["--workdir", os.path.join(workdir, "run")], cwd=REPO,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen = 0
        try:
            while time.perf_counter() - start < TIMEOUT_S:
                if os.path.exists(records):
                    with open(records, encoding="utf-8") as f:
                        lines = f.read().splitlines()
                    for line in lines[seen:]:
                        if not line.endswith("}"):
                            break  # a line still being written
                        seen += 1
                        record = json.loads(line)
                        if record.get("test_accuracy", 0.0) >= target:
                            return time.perf_counter() - start, record["step"] // STEPS_PER_EPOCH
                if process.poll() is not None and seen == len(lines if os.path.exists(records) else []):
                    break
                time.sleep(0.01)
        finally:
            _stop(process)
    raise RuntimeError(f"{command} never reached {target}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args = parser.parse_args()
    seconds = {name: [] for name in CONTENDERS}
    epochs = {name: [] for name in CONTENDERS}
    for _ in range(args.repeats):
        for name, command in CONTENDERS.items():
            timer = time_plain if "plain_loop" in command[1] else time_dtx
            wall, epoch = timer(command, args.target)
            seconds[name].append(wall)
            epochs[name].append(epoch)
            print(f"{name}: {wall:.2f} s (epoch {epoch})", file=sys.stderr, flush=True)
    base = statistics.median(next(iter(seconds.values())))
    lines = [f"| run | median seconds to {100 * args.target:.0f}% | vs plain | epoch reached |", "|---|---|---|---|"]
    for name in CONTENDERS:
        median = statistics.median(seconds[name])
        lines.append(f"| {name} | {median:.2f} | {median / base:.2f}× | {statistics.median(epochs[name]):g} |")
    table = "\n".join(lines)
    print(table)
    import report

    report.write("time_to_accuracy", (
        f"`python benchmarks/time_to_accuracy.py --repeats {args.repeats}` "
        f"({report.machine('8 emulated CPU devices or 1')}) — wall-clock from process launch (start-up, imports, "
        f"compilation included) to the first test evaluation ≥ {100 * args.target:.0f}% on digits (360 "
        "held-out images), evaluating after every epoch; same model (MLP 256-256), optimizer (Adam 2e-3) and "
        "batch (128) in both; fresh processes, interleaved, medians."), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
