"""dtx's train step vs a hand-written ``jax.jit`` data-parallel step: same model, mesh, batch.

All steps are timed in one process, interleaved in blocks, each waiting on the
previous step's output (lag-1, docs/data_parallel.md); the ratio of medians is what counts
(the machine is noisy, absolute times are not comparable across runs). Also timed:
dtx's steps with ``grad_norm=True`` (``--config.log_grad_norm``), the opt-in cost.

    python benchmarks/step_overhead.py [--update-docs] # 8 and 1 devices
    python benchmarks/step_overhead.py --devices 8 --batch 256 --rounds 15   # one row, printed only
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
RUNNERS = ("handwritten", "jit", "shard_map", "jit+grad_norm", "shard_map+grad_norm")


def measure(devices, batch_size, rounds, steps):
    """Median seconds per step of every runner, on ``devices`` emulated CPU devices (or the accelerators)."""
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import numpy as np
    import optax

    from dtx import models
    from dtx import mesh as mesh_lib
    from dtx.step.state import init_train_state
    from dtx.step import StepSpec, make_train_step
    from dtx.data.tasks import cross_entropy

    mesh = mesh_lib.make_mesh([("data", -1)])
    model = models.build_model("mlp", features=(512, 512))
    tx = optax.sgd(0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((batch_size, 28, 28, 1), dtype=np.float32)
    labels = rng.integers(0, 10, batch_size).astype(np.int32)
    batch = jax.device_put({"inputs": inputs, "labels": labels}, mesh_lib.batch_sharding(mesh))

    # -- the hand-written baseline: what a user writes with plain jax.jit + NamedSharding
    def handwritten_step(params, opt_state, batch):
        def loss_fn(p):
            return cross_entropy(model.apply({"params": p}, batch["inputs"]), batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    replicated = mesh_lib.replicated(mesh)
    handwritten = jax.jit(handwritten_step, in_shardings=(replicated, replicated, mesh_lib.batch_sharding(mesh)),
                          out_shardings=replicated, donate_argnums=(0, 1))

    def make_runner(name):
        state = init_train_state(model, tx, jax.ShapeDtypeStruct(inputs.shape, inputs.dtype), 0, mesh)
        if name == "handwritten":
            carry = [state.params, state.opt_state]

            def run(count):
                out = None
                for _ in range(count):
                    params, opt_state, loss = handwritten(*carry, batch)
                    if out is not None:
                        out.block_until_ready()
                    carry[:] = [params, opt_state]
                    out = loss
                out.block_until_ready()
            return run
        driver, _, extra = name.partition("+")
        step = make_train_step(model, tx, mesh, StepSpec(driver=driver, grad_norm=extra == "grad_norm"))
        box = [state]

        def run(count):
            out = None
            for _ in range(count):
                box[0], metrics = step(box[0], batch)
                if out is not None:
                    out.block_until_ready()
                out = metrics["loss"]
            out.block_until_ready()
        return run

    runners = {name: make_runner(name) for name in RUNNERS}
    for run in runners.values():
        run(3)  # compile and warm up
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run(steps)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}, jax.devices()[0].platform


def row(devices, batch_size, medians, platform):
    base = medians["handwritten"]
    cells = [f"{medians[name] * 1e3:.2f} (**{medians[name] / base:.3f}×**)" if name in ("jit", "shard_map")
             else f"{medians[name] * 1e3:.2f} ({medians[name] / base:.3f}×)" for name in RUNNERS[1:]]
    where = f"{devices} emulated" if platform == "cpu" and devices > 1 else ("1" if platform == "cpu" else platform)
    return f"| {where} | {batch_size} | {base * 1e3:.2f} | " + " | ".join(cells) + " |"


HEADER = ("| devices | batch | hand-written (ms/step) | dtx `jit` driver | dtx `shard_map` driver | `jit` + grad_norm "
          "| `shard_map` + grad_norm |\n|---|---|---|---|---|---|---|")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, help="measure one device count and print its row (no BENCHMARKS.md)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # child-process protocol
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args = parser.parse_args()
    if args.devices:
        medians, platform = measure(args.devices, args.batch, args.rounds, args.steps)
        print(json.dumps({"medians": medians, "platform": platform}) if args.json
              else HEADER + "\n" + row(args.devices, args.batch, medians, platform))
        return
    import report

    rows = []
    for devices in (8, 1):  # one process each: the device count is fixed when JAX starts
        out = subprocess.run([sys.executable, __file__, "--devices", str(devices), "--batch", str(args.batch),
                              "--rounds", str(args.rounds), "--steps", str(args.steps), "--json"],
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row(devices, args.batch, result["medians"], result["platform"]))
        print(rows[-1], flush=True)
    devices_text = "8 emulated CPU devices and 1" if result["platform"] == "cpu" else result["platform"]
    markdown = (f"`python benchmarks/step_overhead.py` ({report.machine(devices_text)}) — MLP 784-512-512-10, "
                f"SGD-momentum, global batch {args.batch}; interleaved blocks of {args.steps} steps, each step "
                f"waiting on the previous one (lag-1), median of {args.rounds} rounds; ratio to the hand-written "
                "step in brackets. Target: ≤ 1.03.")
    report.write("step_overhead", markdown, HEADER + "\n" + "\n".join(rows), update_docs=args.update_docs)


if __name__ == "__main__":
    main()
