"""MFU of a bfloat16 ResNet train step on one accelerator (run by benchmarks/gpu.sh).

dtx's ``shard_map`` step on a one-device mesh, precision ``p=f32,c=bf16,o=f32``
(float32 master weights, bfloat16 activations and matmuls), SGD-momentum, synthetic
224×224×3 images. FLOPs per step come from XLA's cost analysis of the compiled
step (:mod:`dtx.perf.flops`) and are checked against the textbook count (3 × 2 × the
model's multiply-adds per image: forward, and a backward pass twice as costly); the
peak is the device kind's bf16 entry in :data:`dtx.perf.flops.PEAK_FLOPS` unless
``--peak`` is given. Prints a markdown table row for BENCHMARKS.md.

    python benchmarks/gpu_mfu.py [--model resnet50] [--batch 128] [--steps 30] [--peak FLOP/s]
    python benchmarks/gpu_mfu.py --model resnet18 --image 32 --batch 8 --steps 2 --peak 1e11   # CPU smoke test
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MULTIPLY_ADDS_224 = {"resnet18": 1.8e9, "resnet50": 4.1e9}  # per image at 224², He et al. Table 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(MULTIPLY_ADDS_224))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image", type=int, default=224, help="image side (224 standard)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (after 3 warm-up steps)")
    parser.add_argument("--peak", type=float, default=0.0, help="peak FLOP/s per device (default: the table's)")
    args = parser.parse_args()

    import jax
    import numpy as np
    import optax

    from dtx import models
    from dtx.perf import flops
    from dtx import mesh as mesh_lib
    from dtx.precision import parse_policy
    from dtx.step.state import init_train_state
    from dtx.step import StepSpec, make_train_step

    device = jax.devices()[0]
    mesh = mesh_lib.make_mesh([("data", 1)], devices=[device])
    policy = parse_policy("p=f32,c=bf16,o=f32")
    model = models.build_model(args.model, num_classes=1000, dtype=policy.compute, param_dtype=policy.params)
    tx = optax.sgd(0.1, momentum=0.9)
    shape = (args.batch, args.image, args.image, 3)
    state = init_train_state(model, tx, jax.ShapeDtypeStruct(shape, np.float32), 0, mesh)
    rng = np.random.default_rng(0)
    batch = jax.device_put({"inputs": rng.standard_normal(shape, dtype=np.float32),
                            "labels": rng.integers(0, 1000, args.batch).astype(np.int32)},
                           mesh_lib.batch_sharding(mesh))
    step = make_train_step(model, tx, mesh, StepSpec(policy=policy))
    start = time.perf_counter()
    per_step = flops.step_flops(step, state, batch)  # compiles; the loop reuses it
    compile_s = time.perf_counter() - start

    def run(count):
        nonlocal state
        previous, times = None, []
        for _ in range(count):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            if previous is not None:
                jax.block_until_ready(previous)
                times.append(time.perf_counter() - start)
            previous = metrics
        jax.block_until_ready(previous)
        return times

    run(3)
    start = time.perf_counter()
    run(args.steps)
    step_s = (time.perf_counter() - start) / args.steps
    peak = flops.device_peak_flops(policy.compute, args.peak, device)
    textbook = 3 * 2 * MULTIPLY_ADDS_224[args.model] * (args.image / 224) ** 2 * args.batch
    utilisation = flops.mfu(per_step, step_s, peak)
    print(f"{device.device_kind}: {args.model} bf16, batch {args.batch} at {args.image}², compile {compile_s:.1f} s, "
          f"{step_s * 1e3:.2f} ms/step; XLA {per_step / 1e9:.2f} GFLOP/step "
          f"(textbook 6 x multiply-adds: {textbook / 1e9:.2f}); jax {jax.__version__}", file=sys.stderr)
    print("| device | model | batch | ms/step | TFLOP/step (XLA) | achieved TFLOP/s | peak TFLOP/s (bf16) | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {device.device_kind} | {args.model} bf16 {args.image}² | {args.batch} | {step_s * 1e3:.2f} "
          f"| {per_step / 1e12:.3f} | {per_step / step_s / 1e12:.1f} | "
          f"{'n/a' if peak is None else f'{peak / 1e12:.4g}'} | "
          f"{'n/a' if utilisation is None else f'**{100 * utilisation:.1f}%**'} |")


if __name__ == "__main__":
    main()
