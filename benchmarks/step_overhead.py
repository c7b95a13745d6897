"""dtx's train step vs a hand-written ``jax.jit`` data-parallel step: same model, mesh, batch.

Both steps are timed in one process, interleaved in blocks, each waiting on the
previous step's output (lag-1, DESIGN.md §2); the ratio of medians is what counts
(the machine is noisy, absolute times are not comparable across runs).

    python benchmarks/step_overhead.py [--devices 8] [--batch 256] [--rounds 15]
"""

import argparse
import statistics
import time

import jax

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=8)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--rounds", type=int, default=15)
parser.add_argument("--steps", type=int, default=20, help="steps per timed block")
args = parser.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import models  # noqa: E402
from dtx import mesh as mesh_lib  # noqa: E402
from dtx.state import init_train_state  # noqa: E402
from dtx.step import cross_entropy, make_train_step  # noqa: E402

mesh = mesh_lib.make_mesh([("data", -1)])
model = models.build_model("mlp", features=(512, 512))
tx = optax.sgd(0.01, momentum=0.9)
rng = np.random.default_rng(0)
inputs = rng.standard_normal((args.batch, 28, 28, 1), dtype=np.float32)
labels = rng.integers(0, 10, args.batch).astype(np.int32)
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

        def run(steps):
            out = None
            for _ in range(steps):
                params, opt_state, loss = handwritten(*carry, batch)
                if out is not None:
                    out.block_until_ready()
                carry[:] = [params, opt_state]
                out = loss
            out.block_until_ready()
        return run
    step = make_train_step(model, tx, mesh, driver=name)
    box = [state]

    def run(steps):
        out = None
        for _ in range(steps):
            box[0], metrics = step(box[0], batch)
            if out is not None:
                out.block_until_ready()
            out = metrics["loss"]
        out.block_until_ready()
    return run


runners = {name: make_runner(name) for name in ("handwritten", "jit", "shard_map")}
for run in runners.values():
    run(3)  # compile and warm up
times = {name: [] for name in runners}
for _ in range(args.rounds):
    for name, run in runners.items():
        start = time.perf_counter()
        run(args.steps)
        times[name].append((time.perf_counter() - start) / args.steps)

base = statistics.median(times["handwritten"])
print(f"MLP 784-512-512-10, global batch {args.batch}, {args.devices} devices ({jax.devices()[0].platform}), "
      f"{args.rounds} rounds x {args.steps} steps")
print("| step | median ms/step | ratio vs hand-written jit |\n|---|---|---|")
for name in runners:
    median = statistics.median(times[name])
    print(f"| {name} | {median * 1e3:.2f} | {median / base:.3f} |")
