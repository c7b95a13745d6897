"""Input pipeline rate vs train-step rate (goal: batches ≥ 20× faster than steps).

Two pipelines, each against the model it feeds:

* the default experiment (digits MLP): :class:`dtx.data.TrainLoader` indexes the epoch's permutation,
  gathers the rows of in-memory arrays and places them on the devices;
* ResNet-18 on 32×32 images (``experiments/cifar10_resnet18.py``: global batch 512, He et al.'s
  augmentation): :class:`dtx.data.inputs.GrainLoader` reads each batch through grain from files
  written to a temporary folder (CIFAR-10 binary records of random pixels, memory-mapped, and the
  same images as a PNG image folder, decoded by Pillow), pads, crops, flips and normalises them, and
  places them; in the training process (``dataset.workers=0``) and with two prefetching processes.

The training loop asks for one batch per step on its main thread, so that call must be much
faster than the step it feeds or it becomes the step. Timed in one process, interleaved in
rounds: ``loader.batch(step)`` waited on until placed, the host's share of it (``host_batch``: the
grain element, without the placement; with workers, the wait for the next prefetched batch), and
the train step with pre-placed batches, each waiting on the previous one (lag-1).

    python benchmarks/input_pipeline.py [--steps 50] [--rounds 7] [--resnet-steps 4] [--resnet-rounds 3]
        [--update-docs] [--config.KEY=VALUE ...]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

HEADER = ("| experiment | input | global batch | devices | `loader.batch` (ms) | of which host (ms) | train step (ms) "
          "| ratio (goal ≥ 20×) |\n|---|---|---|---|---|---|---|---|")


def interleaved(loader, step, state, batches, rounds, host_batch):
    """Median seconds per batch (placed), per host batch and per train step over ``rounds`` interleaved rounds, and
    the state after them (the step donates its input state)."""
    import jax

    n = len(batches)

    def load(offset):
        for i in range(offset, offset + n):
            jax.block_until_ready(loader.batch(i))

    def host_only(offset):
        for i in range(offset, offset + n):
            host_batch(i)

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
    load(n)  # the steps after the pre-placed ones: a prefetching loader goes on in order, never restarts
    batch_s, host_s, step_s = [], [], []
    for r in range(rounds):
        start = time.perf_counter()
        load((2 * r + 2) * n)  # new positions each round: every epoch's permutation is computed as in training
        batch_s.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        host_only((2 * r + 3) * n)
        host_s.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        train()
        step_s.append((time.perf_counter() - start) / n)
    return tuple(statistics.median(t) for t in (batch_s, host_s, step_s)), state


def row(experiment, source, batch_size, devices, times):
    batch, host, step_time = times
    return (f"| {experiment} | {source} | {batch_size} | {devices} | {batch * 1e3:.3f} | {host * 1e3:.3f} "
            f"| {step_time * 1e3:.2f} | **{step_time / batch:.1f}×** |")


def digits_row(args, overrides):
    from dtx import config as config_lib
    from dtx import mesh as mesh_lib
    from dtx.data import TrainLoader, datasets
    from dtx.tools import bench

    config = config_lib.load(os.path.join(REPO, "experiments", "digits_mlp.py"), overrides)
    steps, states, _, _ = bench.build_steps(config)  # emulates the configured CPU devices first
    dataset = datasets.load_dataset(config.dataset.name, data_dir=config.dataset.data_dir, seed=config.seed,
                                    synthetic=config.dataset.synthetic.to_dict())
    mesh = mesh_lib.make_mesh(config.mesh)
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    batches = [loader.batch(i) for i in range(args.steps)]  # the steps' inputs, placed beforehand

    def host_batch(i):  # the host's share of loader.batch: the order and the gather, no placement
        index = loader.indices(i)
        return dataset.train.inputs[index], dataset.train.labels[index]

    times, _ = interleaved(loader, steps["full"], states["full"], batches, args.rounds, host_batch)
    return row(f"digits_mlp{' ' + ' '.join(overrides) if overrides else ''}", "arrays in memory",
               config.global_batch_size, mesh.size, times)


def write_images(root, train, test, seed=0):
    """Random 32×32 RGB images as the CIFAR-10 binary files and, the same pixels, as a PNG image folder."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    bins = os.path.join(root, "cifar", "cifar-10-batches-bin")
    os.makedirs(bins)
    files = [(f"data_batch_{i}.bin", train // 5) for i in range(1, 6)] + [("test_batch.bin", test)]
    for name, n in files:
        labels = rng.integers(0, 10, n).astype(np.uint8)
        pixels = rng.integers(0, 256, (n, 3, 32, 32)).astype(np.uint8)
        np.concatenate([labels[:, None], pixels.reshape(n, -1)], axis=1).tofile(os.path.join(bins, name))
        split = "test" if name == "test_batch.bin" else "train"
        for i, (label, image) in enumerate(zip(labels, pixels.transpose(0, 2, 3, 1))):
            folder = os.path.join(root, "folder", split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(image).save(os.path.join(folder, f"{name[:-4]}_{i:05d}.png"))
    return os.path.join(root, "cifar"), os.path.join(root, "folder")


def resnet_rows(args):
    from dtx import config as config_lib
    from dtx.run import setup
    from dtx.tools import bench

    root = tempfile.mkdtemp(prefix="dtx-input-pipeline-")
    cifar, folder = write_images(root, train=5 * args.resnet_batch, test=64)
    variants = [("CIFAR-10 binary files", "cifar10", cifar, 0), ("PNG image folder", "image_folder", folder, 0),
                ("PNG image folder", "image_folder", folder, 2)]
    step = state = mesh = None
    rows = []
    for source, name, data_dir, workers in variants:
        config = config_lib.load(os.path.join(REPO, "experiments", "cifar10_resnet18.py"), [
            f"--config.dataset.name={name}", f"--config.dataset.data_dir={data_dir}",
            f"--config.dataset.workers={workers}", f"--config.global_batch_size={args.resnet_batch}"])
        if step is None:  # one compiled step for every input: the images are the same shape
            steps, states, _, _ = bench.build_steps(config)
            step, state = steps["full"], states["full"]
            mesh = setup.make_mesh(config)
        loader = setup.load_data(config, mesh).loader
        batches = [loader.batch(i) for i in range(args.resnet_steps)]
        times, state = interleaved(loader, step, state, batches, args.resnet_rounds, loader.host_batch)
        loader.close()
        augment = config.dataset.augment
        rows.append(row("cifar10_resnet18", f"{source}, grain, crop {augment.crop_padding} + flip + normalise, "
                                            f"workers {workers}", config.global_batch_size, mesh.size, times))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50, help="digits MLP: batches / steps per timed block")
    parser.add_argument("--rounds", type=int, default=7, help="digits MLP: interleaved rounds")
    parser.add_argument("--resnet-steps", type=int, default=4, help="ResNet-18: batches / steps per timed block")
    parser.add_argument("--resnet-rounds", type=int, default=3, help="ResNet-18: interleaved rounds")
    parser.add_argument("--resnet-batch", type=int, default=512, help="ResNet-18: global batch (the experiment's)")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (default: a results folder, printed)")
    args, overrides = parser.parse_known_args()
    load_at_start, started = os.getloadavg()[0], time.perf_counter()

    rows = [digits_row(args, overrides)]
    print(rows[0], flush=True)
    for line in resnet_rows(args):
        print(line, flush=True)
        rows.append(line)
    table = HEADER + "\n" + "\n".join(rows)
    print(table)
    import report

    report.write("input_pipeline", (
        f"`python benchmarks/input_pipeline.py` ({report.machine()}) — median per batch / per step of "
        f"{args.rounds} interleaved rounds of {args.steps} (digits MLP) and {args.resnet_rounds} rounds of "
        f"{args.resnet_steps} (ResNet-18 on 32×32 images, the cifar10_resnet18 experiment); the loader's batches "
        "are waited on until placed, the steps run on pre-placed batches with the lag-1 wait; \"host\" is the "
        "loader's own work without the placement on the devices: the epoch order and row gather for arrays, the "
        "grain element (read or decode, pad and crop, flip, normalise) for images, the wait for the next "
        "prefetched batch with workers. The images are random pixels written to a temporary folder, "
        f"{5 * args.resnet_batch} training images, as CIFAR-10 binary records and as PNG files. "
        f"{time.perf_counter() - started:.0f} s, load average {load_at_start:.1f} at the start (other jobs share "
        "the machine's cores)."),
        table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
