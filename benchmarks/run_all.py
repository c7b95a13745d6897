"""Run every benchmark; with ``--update-docs`` each refreshes its own section of BENCHMARKS.md.

    python benchmarks/run_all.py                       # all of them (about an hour on 2 cores)
    python benchmarks/run_all.py --only step_overhead,input_pipeline
    python benchmarks/run_all.py --update-docs         # rewrite BENCHMARKS.md and the figures in docs/
    python benchmarks/run_all.py --list

Each benchmark runs as a fresh process (so each can fix its own device count
before JAX starts) and writes its section through ``benchmarks/report.py``
(``<!-- bench:NAME -->`` markers); text outside the markers is hand-written
analysis and stays. A benchmark that fails is reported and the others still run;
the exit status is non-zero if any failed. Timings are noisy on a shared machine:
run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name: (script and arguments, section(s) it writes, rough minutes on 2 cores, what it measures)
BENCHMARKS = {
    "step_overhead": (["step_overhead.py"], "step_overhead", 2,
                      "dtx step vs a hand-written jax.jit step (and the grad_norm cost)"),
    "step_breakdown": (["step_breakdown.py"], "step_breakdown", 6,
                       "dtx bench step: compute vs communication per allreduce, compressor, strategy"),
    "collectives": (["collectives.py"], "collectives", 4, "dtx bench collectives: allreduce algorithms vs psum"),
    "default_run": (["default_run.py"], "default_run", 3, "default experiment vs the plain flax+optax loop"),
    "time_to_accuracy": (["time_to_accuracy.py"], "time_to_accuracy", 2,
                         "digits: seconds to 97% test accuracy, dtx vs the plain loop"),
    "input_pipeline": (["input_pipeline.py"], "input_pipeline", 1, "TrainLoader.batch rate vs train-step rate"),
    "precision": (["precision.py"], "precision", 2, "bfloat16 vs float32: accuracy and step memory"),
    "large_batch_sweep": (["large_batch_sweep.py"], "large_batch", 4, "accuracy vs global batch: SGD, LARS, LAMB"),
    "compression_sweep": (["compression_sweep.py"], "compression", 15,
                          "compressors: bytes sent vs accuracy (docs/compression.md)"),
    "perfmodel_verify": (["perfmodel_verify.py"], "perfmodel_verify", 2,
                         "dtx simulate --verify: predicted vs compiled FLOPs and bytes of the planner's plans"),
    "plans_at_scale": (["plans_at_scale.py"], "plans_at_scale", 8,
                       "dtx simulate --verify --devices 64: 64-node plans compiled, FLOPs/bytes/memory, compile time, RSS"),
    "calibration": (["calibration.py"], "calibration", 1,
                    "the perf model fed measured per-layer times vs the measured step (Das et al. §2)"),
    "memory_model": (["memory_model.py"], "memory_model", 8,
                     "dtx.perf.memory's per-device peak vs XLA's memory analysis, every model x layout (docs/memory.md)"),
    "checkpoint_memory": (["checkpoint_memory.py"], "checkpoint_memory", 1,
                          "checkpoint save: host memory and blocking time vs local shard bytes, 1 and 2 processes"),
    "chaos": (["chaos.py"], "chaos", 20, "SIGKILL/SIGTERM at random moments, resumed, compared bit for bit"),
    "strategies_sweep": (["strategies_sweep.py"], "strategies", 15,
                         "sync/async/local SGD/...: accuracy, time and bytes (docs/strategies.md)"),
    "time_to_accuracy_cluster": (["time_to_accuracy_cluster.py", "--seeds", "0,1,2"], "time_to_accuracy_cluster", 45,
                                 "every technique: simulated time to a target perplexity on two modelled clusters "
                                 "(docs/simulated_clock.md)"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--update-docs", action="store_true",
                        help="each benchmark writes BENCHMARKS.md and docs/ (default: a results folder, printed)")
    args = parser.parse_args(argv)
    if args.list:
        for name, (command, section, minutes, what) in BENCHMARKS.items():
            print(f"{name:<18} ~{minutes:>2} min  section {section:<17} {what}  (benchmarks/{command[0]})")
        return 0
    names = list(BENCHMARKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    took, failed = {}, []
    for name in names:
        command, section, minutes, what = BENCHMARKS[name]
        script = os.path.join(HERE, command[0])
        print(f"== {name} (~{minutes} min): {what}", flush=True)
        if not os.path.exists(script):
            print(f"   missing: benchmarks/{command[0]} — skipped", flush=True)
            failed.append(name)
            continue
        start = time.perf_counter()
        flags = ["--update-docs"] if args.update_docs else []
        status = subprocess.run([sys.executable, script, *command[1:], *flags], cwd=REPO, env=env).returncode
        took[name] = time.perf_counter() - start
        print(f"== {name}: {'ok' if status == 0 else f'FAILED (exit {status})'} in {took[name]:.0f} s "
              f"(section {section})", flush=True)
        if status:
            failed.append(name)
    print("\n| benchmark | seconds | status |\n|---|---|---|")
    for name in names:
        status = "failed" if name in failed else "ok"
        print(f"| {name} | {took.get(name, 0):.0f} | {status} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
