"""Image sources and augmentation (dtx.data.images): pixels as written, CIFAR-10 binary and MNIST IDX files equal to
the in-memory readers, the crop / flip / normalisation against a numpy reference, refusals, and the CIFAR-10
experiment (its download message without files, a short run on generated ones)."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

from dtx.data import datasets, images, inputs
from dtx.data.datasets import DatasetError


def write_folder(root, sizes=(("train", 12), ("test", 4)), classes=("cat", "dog", "emu"), shape=(6, 5, 3), seed=0):
    """A small image folder of PNGs: ``root/<split>/<class>/<i>.png``; returns {split: (pixels, labels)} in the
    order the folder is read (classes sorted, files sorted)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = {}
    for split, per_class in sizes:
        pixels, labels = [], []
        for label, name in enumerate(sorted(classes)):
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            for i in range(per_class):
                image = rng.integers(0, 256, shape, dtype=np.uint8)
                Image.fromarray(image.squeeze(-1) if shape[-1] == 1 else image).save(
                    os.path.join(root, split, name, f"{i:03d}.png"))
                pixels.append(image)
                labels.append(label)
        out[split] = (np.stack(pixels), np.asarray(labels, np.int32))
    return out


def write_cifar_bins(folder, per_file=6, test=10, seed=0):
    """The CIFAR-10 binary version's six files with random records (1 label byte + 3072 CHW pixel bytes)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for name, n in [(f"data_batch_{i}.bin", per_file) for i in range(1, 6)] + [("test_batch.bin", test)]:
        labels = rng.integers(0, 10, n).astype(np.uint8)
        np.concatenate([labels[:, None], rng.integers(0, 256, (n, 3072)).astype(np.uint8)], axis=1).tofile(
            os.path.join(folder, name))


def write_mnist_idx(folder, train=20, test=8, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    opener = gzip.open if gz else open
    for prefix, n in (("train", train), ("t10k", test)):
        x = rng.integers(0, 256, (n, 28, 28)).astype(np.uint8)
        y = rng.integers(0, 10, n).astype(np.uint8)
        suffix = ".gz" if gz else ""
        with opener(os.path.join(folder, f"{prefix}-images-idx3-ubyte{suffix}"), "wb") as f:
            f.write((2051).to_bytes(4, "big") + np.array([n, 28, 28], ">u4").tobytes() + x.tobytes())
        with opener(os.path.join(folder, f"{prefix}-labels-idx1-ubyte{suffix}"), "wb") as f:
            f.write((2049).to_bytes(4, "big") + np.array([n], ">u4").tobytes() + y.tobytes())


def block(**settings):
    from dtx import config as config_lib

    return config_lib.override(config_lib.base_config(), **settings).dataset


# ------------------------------------------------------------------ sources

def test_image_folder_reads_sorted_classes_and_the_pixels_written(tmp_path):
    written = write_folder(tmp_path)
    train, test, classes = images.open_sources("image_folder", str(tmp_path))
    assert classes == 3 and train.classes == ["cat", "dog", "emu"] and test.classes == train.classes
    for source, (pixels, labels) in ((train, written["train"]), (test, written["test"])):
        assert source.shape == pixels.shape and len(source) == len(pixels)
        np.testing.assert_array_equal(source.read(np.arange(len(source))), pixels)  # PNG is lossless
        np.testing.assert_array_equal(source.labels, labels)
        np.testing.assert_array_equal(source[5], pixels[5])


def test_grey_images_have_one_channel(tmp_path):
    written = write_folder(tmp_path, shape=(4, 4, 1))
    train, _, _ = images.open_sources("image_folder", str(tmp_path))
    assert train.shape == (36, 4, 4, 1)
    np.testing.assert_array_equal(train.read(np.array([7, 0])), written["train"][0][[7, 0]])


@pytest.mark.parametrize("layout", ["flat", "cifar-10-batches-bin"])
def test_cifar10_binary_through_the_image_source_equals_the_reader(tmp_path, layout):
    write_cifar_bins(tmp_path if layout == "flat" else tmp_path / layout)
    reference = datasets.load_dataset("cifar10", data_dir=str(tmp_path))
    mine = inputs.load_dataset(block(**{"dataset.name": "cifar10", "dataset.data_dir": str(tmp_path)}), seed=0)
    assert isinstance(mine.train.inputs.source, images.CifarBinary)  # memory-mapped, read by record
    for ours, theirs in ((mine.train, reference.train), (mine.test, reference.test)):
        assert ours.inputs.shape == theirs.inputs.shape and ours.inputs.dtype == theirs.inputs.dtype
        np.testing.assert_array_equal(ours.inputs[np.arange(len(ours))], theirs.inputs)  # bit for bit
        np.testing.assert_array_equal(ours.labels, theirs.labels)
    index = np.array([29, 0, 6, 13])  # across files, out of order
    np.testing.assert_array_equal(mine.train.inputs[index], reference.train.inputs[index])


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_through_the_image_source_equals_the_reader(tmp_path, gz):
    write_mnist_idx(tmp_path, gz=gz)
    reference = datasets.load_dataset("mnist", data_dir=str(tmp_path))
    mine = inputs.load_dataset(block(**{"dataset.name": "mnist", "dataset.data_dir": str(tmp_path)}), seed=0)
    if not gz:  # an uncompressed IDX file is mapped from disk, not read
        assert isinstance(mine.train.inputs.source.images.base, np.memmap)
    for ours, theirs in ((mine.train, reference.train), (mine.test, reference.test)):
        np.testing.assert_array_equal(ours.inputs[:], theirs.inputs)
        np.testing.assert_array_equal(ours.labels, theirs.labels)


def test_memory_mapped_sources_reach_a_worker_as_paths_not_contents(tmp_path):
    """A worker process receives its source pickled: a memory-mapped one must map its file again there, not travel
    as a copy of the file."""
    import pickle

    write_cifar_bins(tmp_path / "cifar", per_file=64, test=8)
    write_mnist_idx(tmp_path / "mnist", train=600, test=8)
    cifar, _, _ = images.open_sources("cifar10", str(tmp_path / "cifar"))
    mnist, _, _ = images.open_sources("mnist", str(tmp_path / "mnist"))
    index = np.array([300, 3, 64, 129])
    for source, size in ((cifar, 320 * 3073), (mnist, 600 * 784)):
        blob = pickle.dumps(source)
        assert len(blob) < size // 20, (type(source).__name__, len(blob), size)
        np.testing.assert_array_equal(pickle.loads(blob).read(index), source.read(index))


# ------------------------------------------------------------------ augmentation against numpy

def _splitmix(z):
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def reference_draws(seed, epoch, index, padding):
    """The crop offsets and flip of one example, written out from the definition: SplitMix64 of (seed, epoch,
    index); dy from the low bits, dx from bits 21.., the flip from bit 42."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        key = _splitmix(np.array([seed], np.uint64) + golden)
        key = _splitmix(key ^ (np.array([epoch], np.uint64) + golden))
        h = int(_splitmix(key ^ (np.array([index], np.uint64) * golden))[0])
    span = 2 * padding + 1
    return h % span, (h >> 21) % span, bool((h >> 42) & 1)


def reference_augment(image, dy, dx, flip, padding, mean=None, std=None):
    """One image: zero padding, a crop at (dy, dx), a left-right mirror, then ÷ 255 and (x - mean) / std."""
    padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
    crop = padded[dy:dy + image.shape[0], dx:dx + image.shape[1]]
    crop = crop[:, ::-1] if flip else crop
    x = crop.astype(np.float32) / np.float32(255)
    return x if mean is None else (x - mean) / std


@pytest.mark.parametrize("seed, epoch, padding", [(0, 0, 2), (7, 3, 1), (123456789, 11, 4)])
def test_draws_are_a_hash_of_seed_epoch_and_index(seed, epoch, padding):
    index = np.array([0, 1, 2, 99, 5000, 2**40])
    dy, dx, flip = images.draws(seed, epoch, index, padding)
    expected = [reference_draws(seed, epoch, int(i), padding) for i in index]
    assert [(int(a), int(b), bool(c)) for a, b, c in zip(dy, dx, flip)] == expected


def test_draws_cover_every_offset_and_change_with_seed_and_epoch():
    index = np.arange(4000)
    dy, dx, flip = images.draws(0, 0, index, 2)
    assert set(dy) == set(dx) == set(range(5)) and 0.45 < flip.mean() < 0.55
    assert abs(np.corrcoef(dy, dx)[0, 1]) < 0.05  # the two offsets are not tied to each other
    for other in (images.draws(1, 0, index, 2), images.draws(0, 1, index, 2)):
        changed = (other[0] != dy) | (other[1] != dx) | (other[2] != flip)
        assert changed.mean() > 0.9  # another seed (or epoch) draws anew, example by example


def test_augment_matches_the_numpy_reference_for_crop_and_flip():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (16, 5, 7, 3), dtype=np.uint8)
    for padding in (0, 1, 3):
        dy, dx, flip = images.draws(5, 2, np.arange(100, 116), padding)
        out = images.augment(pixels, dy, dx, flip, padding)
        for b in range(len(pixels)):
            want = reference_augment(pixels[b], int(dy[b]), int(dx[b]), bool(flip[b]), padding)
            np.testing.assert_array_equal(images.to_float(out[b], None, None), want)
    corner = images.augment(pixels[:1], np.array([0]), np.array([0]), np.array([False]), 2)[0]
    assert not corner[:2].any() and not corner[:, :2].any()  # the padding is zeros
    np.testing.assert_array_equal(corner[2:, 2:], pixels[0, :3, :5])


def test_normalisation_is_per_channel_with_the_training_statistics(tmp_path):
    written = write_folder(tmp_path)
    config = block(**{"dataset.name": "image_folder", "dataset.data_dir": str(tmp_path),
                      "dataset.augment.normalize": True})
    dataset = inputs.load_dataset(config, seed=0)
    x = written["train"][0].astype(np.float64) / 255  # fewer than 2048 images: all of them
    mean, std = x.mean(axis=(0, 1, 2)), x.std(axis=(0, 1, 2))
    np.testing.assert_allclose(dataset.train.inputs.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(dataset.train.inputs.std, std, rtol=1e-6)
    mean, std = dataset.train.inputs.mean, dataset.train.inputs.std
    for split in ("train", "test"):  # the test images with the training statistics, without crop or flip
        got = getattr(dataset, split).inputs[:]
        want = np.stack([reference_augment(p, 0, 0, False, 0, mean, std) for p in written[split][0]])
        np.testing.assert_array_equal(got, want)
    assert abs(dataset.train.inputs[:].mean(axis=(0, 1, 2))).max() < 1e-5
    given = block(**{"dataset.name": "image_folder", "dataset.data_dir": str(tmp_path), "dataset.augment.normalize": True,
                     "dataset.augment.mean": (0.5, 0.25, 0.0), "dataset.augment.std": (0.5, 0.5, 1.0)})
    rows = inputs.load_dataset(given, seed=0).test.inputs
    want = reference_augment(written["test"][0][3], 0, 0, False, 0, np.float32([0.5, 0.25, 0.0]),
                             np.float32([0.5, 0.5, 1.0]))
    np.testing.assert_array_equal(rows[3], want)


# ------------------------------------------------------------------ refusals

def test_an_image_folder_without_folders_or_images_is_refused_naming_the_fix(tmp_path):
    def load(root):
        return inputs.load_dataset(block(**{"dataset.name": "image_folder", "dataset.data_dir": str(root)}), seed=0)

    with pytest.raises(DatasetError, match="data_dir is empty"):
        inputs.load_dataset(block(**{"dataset.name": "image_folder"}), seed=0)
    with pytest.raises(DatasetError, match="is not a directory"):
        load(tmp_path / "nowhere")
    with pytest.raises(DatasetError, match=r"train.*is not a directory.*<class>"):
        load(tmp_path)
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError, match=r"no images \(\.png, \.jpg, \.jpeg\)"):
        load(tmp_path)
    write_folder(tmp_path / "two", sizes=(("train", 2),))
    with pytest.raises(DatasetError, match=r"test.*is missing; put the test images"):
        load(tmp_path / "two")
    write_folder(tmp_path / "extra", sizes=(("train", 2),), classes=("a", "b"))
    write_folder(tmp_path / "extra", sizes=(("test", 1),), classes=("a", "c"))
    with pytest.raises(DatasetError, match=r"class folders \['c'\] that train/ lacks"):
        load(tmp_path / "extra")


def test_an_image_of_another_size_is_refused_naming_the_file(tmp_path):
    from PIL import Image

    write_folder(tmp_path)
    odd = tmp_path / "train" / "dog" / "zzz.png"
    Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(odd)
    train, _, _ = images.open_sources("image_folder", str(tmp_path))
    with pytest.raises(DatasetError, match=rf"{odd} is 9x9 but the folder's images are 5x6; resize"):
        train.read(np.arange(len(train)))


@pytest.mark.parametrize("settings, message", [
    ({"dataset.augment.crop_padding": -1}, r"dataset\.augment\.crop_padding=-1 must be an int >= 0"),
    ({"dataset.augment.mean": (0.5,)}, r"mean / std are set but dataset\.augment\.normalize=False"),
    ({"dataset.augment.normalize": True, "dataset.augment.mean": (0.5, 0.5), "dataset.augment.std": (0.5,)},
     r"one mean and one std > 0 per channel"),
    ({"dataset.workers": -2}, r"dataset\.workers=-2 must be an int >= 0"),
])
def test_bad_augment_settings_are_refused_at_load_time(tmp_path, settings, message):
    from dtx import config as config_lib

    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.override(config_lib.base_config(), **{"dataset.name": "cifar10", **settings})


def test_an_unknown_augment_key_and_augmenting_non_image_data_are_refused():
    from ml_collections import ConfigDict

    from dtx import config as config_lib

    base = config_lib.override(config_lib.base_config(), **{"dataset.name": "image_folder"})
    with pytest.raises(config_lib.ConfigError, match=r"dataset\.augment has unknown key\(s\) \['rotate'\]; its keys"):
        config_lib.override(base, **{"dataset.augment": ConfigDict(dict(flip=True, rotate=15))})
    with pytest.raises(config_lib.ConfigError, match=r"unknown.*dataset\.augment\.rotate|rotate"):
        config_lib.load(os.path.join(os.path.dirname(__file__), "..", "experiments", "digits_mlp.py"),
                        ["--config.dataset.augment.rotate=15"])
    for name in ("digits", "synthetic", "python_docs"):
        with pytest.raises(config_lib.ConfigError, match=rf"dataset\.augment applies to the image datasets read "
                                                         rf"through grain \(cifar10, mnist, image_folder\), not "
                                                         rf"dataset\.name='{name}'"):
            config_lib.override(config_lib.base_config(), **{"dataset.name": name, "dataset.augment.flip": True})
    with pytest.raises(config_lib.ConfigError, match=r"dataset\.workers applies to the image datasets"):
        config_lib.override(config_lib.base_config(), **{"dataset.workers": 2})


def test_normalising_with_the_wrong_number_of_channels_is_refused(tmp_path):
    write_folder(tmp_path, shape=(4, 4, 1))
    config = block(**{"dataset.name": "image_folder", "dataset.data_dir": str(tmp_path),
                      "dataset.augment.normalize": True, "dataset.augment.mean": (0.5, 0.5, 0.5),
                      "dataset.augment.std": (0.2, 0.2, 0.2)})
    with pytest.raises(ValueError, match=r"mean has 3 values but the images have 1 channel"):
        inputs.load_dataset(config, seed=0)


# ------------------------------------------------------------------ the CIFAR-10 experiment

def _experiment(**settings):
    from dtx import config as config_lib
    from dtx.experiments import cifar10_resnet18

    return config_lib.override(cifar10_resnet18.get_config(), **settings)


def test_the_cifar10_experiment_without_files_says_what_to_download_and_where(tmp_path):
    import dtx

    folder = tmp_path / "cifar"
    for data_dir in (folder, tmp_path):  # missing, and present but empty
        with pytest.raises(DatasetError) as error:
            dtx.train(_experiment(**{"dataset.data_dir": str(data_dir)}), tmp_path / "run")
        message = str(error.value)
        assert "download https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz" in message
        assert f"extract it into {data_dir}" in message and f"tar xzf cifar-10-binary.tar.gz -C {data_dir}" in message
        assert os.path.join(str(data_dir), "cifar-10-batches-bin") in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_cifar10_experiment_trains_on_generated_binary_files(tmp_path):
    """The experiment as shipped (data, augmentation, prefetch workers, optimizer), on a few generated records and a
    one-block ResNet, so that it compiles in seconds."""
    import json

    import dtx

    write_cifar_bins(tmp_path / "data" / "cifar-10-batches-bin", per_file=16, test=16)
    config = _experiment(**{"dataset.data_dir": str(tmp_path / "data"), "num_steps": 3, "global_batch_size": 16,
                            "eval_batch_size": 16, "eval_every": 0, "optimizer.warmup_epochs": 0.0, "progress": False,
                            "log_every": 1, "model.width": 4, "model.stage_sizes": (1,)})
    assert config.dataset.workers == 2 and config.dataset.augment.crop_padding == 4
    result = dtx.train(config, tmp_path / "run")
    assert result.metrics["test_examples"] == 16 and np.isfinite(result.metrics["test_loss"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
