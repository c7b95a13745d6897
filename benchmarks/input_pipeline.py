"""Input pipeline rate vs train-step rate on the default experiment (goal: batches ≥ 20× faster).

The loader (:class:`dtx.data.TrainLoader`) builds each global batch on the host
(index the epoch's permutation, gather the rows) and places it on the devices; the
training loop asks for one per step, on the main thread, so it must be much faster
than the step it feeds or it becomes the step. Timed in one process, interleaved in
rounds: ``loader.batch(step)`` waited on until placed, and the default experiment's
train step with pre-placed batches, each waiting on the previous one (lag-1).

    python benchmarks/input_pipeline.py [--steps 50] [--rounds 7] [--update-docs] [--config.KEY=VALUE ...]
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="batches / steps per timed block")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args, overrides = parser.parse_known_args()
    import jax

    from dtx.data import datasets
    from dtx.tools import bench
    from dtx import config as config_lib
    from dtx import mesh as mesh_lib
    from dtx.data import TrainLoader

    config = config_lib.load(os.path.join(REPO, "experiments", "digits_mlp.py"), overrides)
    steps, states, _, _ = bench.build_steps(config)  # emulates the configured CPU devices first
    step, state = steps["full"], states["full"]
    dataset = datasets.load_dataset(config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
                                    synthetic=config.dataset.synthetic.to_dict())
    mesh = mesh_lib.make_mesh(config.mesh)
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    batches = [loader.batch(i) for i in range(args.steps)]  # the steps' inputs, placed beforehand

    def load(offset):
        for i in range(offset, offset + args.steps):
            jax.block_until_ready(loader.batch(i))

    def host_only(offset):  # the host's share of loader.batch: the order and the gather, no placement
        for i in range(offset, offset + args.steps):
            index = loader.indices(i)
            dataset.train.inputs[index], dataset.train.labels[index]

    def train():
        nonlocal state
        previous = None
        for batch in batches:
            state, metrics = step(state, batch)
            if previous is not None:
                jax.block_until_ready(previous)
            previous = metrics
        jax.block_until_ready(previous)

    train()  # compile, warm up
    load(0)
    batch_s, host_s, step_s = [], [], []
    for r in range(args.rounds):
        start = time.perf_counter()
        load(r * args.steps)  # new positions each round: every epoch's permutation is computed as in training
        batch_s.append((time.perf_counter() - start) / args.steps)
        start = time.perf_counter()
        host_only(r * args.steps)
        host_s.append((time.perf_counter() - start) / args.steps)
        start = time.perf_counter()
        train()
        step_s.append((time.perf_counter() - start) / args.steps)
    batch, host, step_time = (statistics.median(t) for t in (batch_s, host_s, step_s))
    table = ("| experiment | global batch | devices | `loader.batch` (ms) | of which host (ms) | train step (ms) "
             "| ratio (goal ≥ 20×) |\n|---|---|---|---|---|---|---|\n"
             f"| digits_mlp{' ' + ' '.join(overrides) if overrides else ''} | {config.global_batch_size} | "
             f"{mesh.size} | {batch * 1e3:.3f} | {host * 1e3:.3f} | {step_time * 1e3:.2f} "
             f"| **{step_time / batch:.1f}×** |")
    print(table)
    import report

    report.write("input_pipeline", (
        f"`python benchmarks/input_pipeline.py` ({report.machine()}) — median per batch / per step of "
        f"{args.rounds} interleaved rounds of {args.steps}; the loader's batches are waited on until placed, "
        "the steps run on pre-placed batches with the lag-1 wait; \"host\" is the loader's own work "
        "(epoch order, row gather) without the placement on the devices."), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
