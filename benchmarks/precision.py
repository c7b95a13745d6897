"""bfloat16 vs float32 compute: accuracy of the default experiment, and step memory from XLA.

Accuracy: experiments/digits_mlp.py trained with each policy (same seed, data and
steps). Memory: XLA's compiled memory analysis of the train step (temp bytes hold
the activations kept for the backward pass), for the default model and a larger
MLP batch where activations dominate.

    python benchmarks/precision.py [--update-docs]      # --update-docs: into BENCHMARKS.md (precision)
"""

import argparse
import os
import sys
import tempfile

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
POLICIES = {"float32": "p=f32,c=f32,o=f32", "bfloat16": "p=f32,c=bf16,o=f32"}


def step_memory(spec, features, batch, in_features):
    import numpy as np
    import optax

    from dtx import models
    from dtx import mesh as mesh_lib
    from dtx.precision import parse_policy
    from dtx.step.state import init_train_state
    from dtx.step import StepSpec, make_train_step

    policy = parse_policy(spec)
    mesh = mesh_lib.make_mesh([("data", -1)])
    model = models.build_model("mlp", features=features, dtype=policy.compute, param_dtype=policy.params)
    tx = optax.adam(1e-3)
    example = jax.ShapeDtypeStruct((batch, in_features), np.float32)
    state = init_train_state(model, tx, example, 0, mesh)
    batch_arrays = {"inputs": jax.ShapeDtypeStruct((batch, in_features), np.float32),
                    "labels": jax.ShapeDtypeStruct((batch,), np.int32)}
    step = make_train_step(model, tx, mesh, StepSpec(policy=policy))
    analysis = step.lower(state, batch_arrays).compile().memory_analysis()
    return analysis.temp_size_in_bytes  # per device


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    import dtx

    experiment = os.path.join(REPO, "experiments", "digits_mlp.py")
    lines = ["| compute dtype | test accuracy (digits, 8 devices) | temp bytes/device: default MLP, batch 128 "
             "| temp bytes/device: MLP 1024-1024, batch 8192 |", "|---|---|---|---|"]
    for name, spec in POLICIES.items():
        config = dtx.load(experiment, [f"--config.precision={spec}", "--config.progress=False"])
        with tempfile.TemporaryDirectory() as workdir:
            accuracy = dtx.train(config, os.path.join(workdir, "run")).metrics["test_accuracy"]
        small = step_memory(spec, (256, 256), 128, 64)
        large = step_memory(spec, (1024, 1024), 8192, 784)
        lines.append(f"| {name} | {100 * accuracy:.2f}% | {small:,} | {large:,} |")
        print(lines[-1], flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import report

    report.write("precision", (
        f"`python benchmarks/precision.py` ({report.machine()}) — the default experiment with "
        "`--config.precision=p=f32,c=f32,o=f32` and `p=f32,c=bf16,o=f32`, and XLA's compiled memory analysis "
        "of the train step (`temp_size_in_bytes` per device: the activations kept for the backward pass and "
        "other scratch)."), "\n".join(lines), update_docs=args.update_docs)


if __name__ == "__main__":
    main()
