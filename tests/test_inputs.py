"""The grain pipeline (dtx.data.inputs): a batch is a function of (seed, step) whatever the number of prefetch
workers, after a resume, and split over processes; its augmentation against a numpy reference; without augmentation
it is the plain loader's batch; dtx.train on a generated image folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dtx.data import images, inputs
from dtx.data.loader import TrainLoader

from test_images import block, reference_augment, reference_draws, write_cifar_bins, write_folder

AUGMENT = {"dataset.augment.crop_padding": 2, "dataset.augment.flip": True, "dataset.augment.normalize": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    return root, write_folder(root, sizes=(("train", 12), ("test", 4)), shape=(6, 5, 3))


def loader(root, mesh, *, seed=3, batch=16, workers=0, **settings):
    config = block(**{"dataset.name": "image_folder", "dataset.data_dir": str(root), "dataset.workers": workers,
                      **AUGMENT, **settings})
    dataset = inputs.load_dataset(config, seed=seed)
    return inputs.make_loader(dataset, batch, mesh, seed=seed, settings=config), dataset


def test_a_batch_is_the_numpy_reference_of_its_seed_and_step(folder, mesh):
    root, written = folder
    grain_loader, dataset = loader(root, mesh)
    assert isinstance(grain_loader, inputs.GrainLoader)
    pixels, labels = written["train"]
    mean, std = dataset.train.inputs.mean, dataset.train.inputs.std
    plain = TrainLoader(dataset.train, 16, mesh, seed=3)
    for step in (0, 1, 2, 5):  # two epochs of 2 steps (36 examples, 16 a step) and more
        epoch, index = step // 2, plain.indices(step)
        np.testing.assert_array_equal(grain_loader.indices(step), index)  # the plain loader's order
        want = np.stack([reference_augment(pixels[i], *reference_draws(3, epoch, int(i), 2), 2, mean, std)
                         for i in index])
        got = grain_loader.host_batch(step)
        np.testing.assert_array_equal(got["inputs"], want)
        np.testing.assert_array_equal(got["labels"], labels[index])
        placed = grain_loader.batch(step)
        np.testing.assert_array_equal(np.asarray(placed["inputs"]), want)


def test_without_augmentation_the_grain_batch_is_the_plain_loaders(tmp_path, mesh):
    from dtx.data import datasets

    write_cifar_bins(tmp_path, per_file=8, test=8)
    config = block(**{"dataset.name": "cifar10", "dataset.data_dir": str(tmp_path)})
    grain_loader = inputs.make_loader(inputs.load_dataset(config, seed=1), 16, mesh, seed=1, settings=config)
    plain = TrainLoader(datasets.load_dataset("cifar10", data_dir=str(tmp_path)).train, 16, mesh, seed=1)
    for step in range(5):
        ours, theirs = grain_loader.batch(step), plain.batch(step)
        for key in ("inputs", "labels"):
            np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]))
            assert ours[key].sharding == theirs[key].sharding


def test_worker_count_resume_and_processes_do_not_change_a_batch(folder, mesh):
    root, _ = folder
    steps = range(0, 6)
    in_process, _ = loader(root, mesh, workers=0)
    reference = [in_process.host_batch(s) for s in steps]
    prefetched, _ = loader(root, mesh, workers=2)
    try:
        for step in steps:  # two processes build alternate steps; grain returns them in order
            for key in ("inputs", "labels"):
                np.testing.assert_array_equal(prefetched.host_batch(step)[key], reference[step][key])
        resumed, _ = loader(root, mesh, workers=1)  # a resume on another worker count: first step 3
        resumed.num_steps = 6  # a run of 6 steps (dtx.run.setup sets it)
        for step in (3, 3, 4, 5):  # (the loop compiles on its first batch, then trains on it)
            np.testing.assert_array_equal(resumed.host_batch(step)["inputs"], reference[step]["inputs"])
        assert resumed._iterator is None  # the run's last batch read: its worker was stopped
    finally:
        prefetched.close()
    # Two processes with 4 devices each build rows [0, 8) and [8, 16) of every batch: together, the batch.
    whole = in_process.host
    halves = [inputs.HostBatches(in_process.split, 16, rows, 3, whole.augment) for rows in (slice(0, 8), slice(8, 16))]
    for step in steps:
        joined = np.concatenate([half(step)["inputs"] for half in halves])
        np.testing.assert_array_equal(joined, reference[step]["inputs"])


def test_the_augmentation_changes_with_the_seed_and_the_epoch_only(folder, mesh):
    root, _ = folder
    a, _ = loader(root, mesh, seed=3)
    b, _ = loader(root, mesh, seed=4)
    assert not np.array_equal(a.host_batch(0)["inputs"], b.host_batch(0)["inputs"])
    host = a.host  # the same example in two epochs: other draws; in the same epoch, the same ones
    index = host.indices(0)[:4]
    assert not all(np.array_equal(d0, d1) for d0, d1 in zip(images.draws(3, 0, index, 2), images.draws(3, 1, index, 2)))


def test_dtx_train_on_an_image_folder_with_augmentation_and_workers(tmp_path):
    """A tiny conv net on generated 8x8 images whose class is their bright colour learns, with two prefetch
    workers and augmentation on (that the workers' batches are the in-process ones is tested above)."""
    from ml_collections import ConfigDict

    import dtx

    write_folder(tmp_path / "images", sizes=(("train", 16), ("test", 8)), classes=("blue", "green", "red"),
                 shape=(8, 8, 3))
    colours = {"red": 0, "green": 1, "blue": 2}
    from PIL import Image

    for path in (tmp_path / "images").glob("*/*/*.png"):  # the class's channel bright, the others dark
        pixels = np.asarray(Image.open(path)) // 3
        pixels[..., colours[path.parent.name]] += 160
        Image.fromarray(pixels).save(path)
    config = dtx.override(dtx.base_config(), num_steps=16, global_batch_size=16, log_every=8, progress=False,
                          **{"dataset.name": "image_folder", "dataset.data_dir": str(tmp_path / "images"),
                             "dataset.workers": 2, **AUGMENT, "optimizer.learning_rate": 3e-2,
                             "model": ConfigDict(dict(name="lenet", conv_features=(4,), dense_features=(8,)))})
    result = dtx.train(config, tmp_path / "run")
    assert result.metrics["test_examples"] == 24 and result.metrics["test_accuracy"] >= 0.9
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [8, 16]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["dataset"]["workers"] == 2 and saved["dataset"]["augment"]["crop_padding"] == 2
