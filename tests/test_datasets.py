"""Tests for dtx.data.datasets: numpy only, with tiny fake MNIST/CIFAR-10 files."""
import gzip
import os

import numpy as np
import pytest

from dtx.data.datasets import DATASETS, Dataset, DatasetError, Split, load_dataset


# ----------------------------------------------------------------- helpers

def _write_idx(path, array, gz=False):
    """Writes a uint8 array in the real IDX format: magic, big-endian dims, bytes."""
    array = np.asarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    with (gzip.open if gz else open)(str(path), "wb") as f:
        f.write(header + array.tobytes())


def _fake_mnist(rng):
    return (rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), rng.integers(0, 10, 5, dtype=np.uint8),
            rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), rng.integers(0, 10, 3, dtype=np.uint8))


def _write_mnist_idx(folder, arrays, gz=False):
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    for name, array in zip(names, arrays):
        _write_idx(os.path.join(folder, name + (".gz" if gz else "")), array, gz)


def _check_images(split, images, labels, shape):
    assert split.inputs.dtype == np.float32 and split.labels.dtype == np.int32
    assert split.inputs.shape == shape and split.labels.shape == (shape[0],)
    np.testing.assert_array_equal(split.inputs, images.reshape(shape).astype(np.float32) / 255)
    # Exact round trip back to the stored bytes.
    np.testing.assert_array_equal(np.rint(split.inputs * 255).astype(np.uint8), images.reshape(shape))
    np.testing.assert_array_equal(split.labels, labels.reshape(-1))


def _write_cifar_bin(path, images_nhwc, labels):
    """Writes CIFAR-10 binary records: label byte then 3072 CHW pixel bytes."""
    chw = images_nhwc.transpose(0, 3, 1, 2).reshape(len(labels), -1)
    np.concatenate([labels.reshape(-1, 1).astype(np.uint8), chw], axis=1).tofile(str(path))


# ----------------------------------------------------------------- general

def test_registry_and_unknown_name():
    assert DATASETS == ("synthetic", "digits", "mnist", "cifar10", "python_docs")
    with pytest.raises(DatasetError, match=r"unknown dataset 'imagenet'.*synthetic, digits, mnist, cifar10, python_docs"):
        load_dataset("imagenet")
    assert issubclass(DatasetError, ValueError)


# ----------------------------------------------------------------- digits

def test_digits_shapes_ranges_and_split():
    ds = load_dataset("digits")
    assert isinstance(ds, Dataset) and ds.name == "digits" and ds.num_classes == 10
    assert ds.train.inputs.shape == (1437, 8, 8, 1) and ds.test.inputs.shape == (360, 8, 8, 1)
    assert len(ds.train) == 1437 and len(ds.test) == 360
    for split in (ds.train, ds.test):
        assert split.inputs.dtype == np.float32 and split.labels.dtype == np.int32
        assert split.inputs.min() == 0.0 and split.inputs.max() == 1.0
        assert set(np.unique(split.labels)) == set(range(10))
    # The split is fixed: independent of seed and identical across calls.
    other = load_dataset("digits", seed=123)
    np.testing.assert_array_equal(ds.train.inputs, other.train.inputs)
    np.testing.assert_array_equal(ds.test.labels, other.test.labels)
    # Train and test are disjoint and together cover all 1797 images once.
    flat = np.concatenate([ds.train.inputs, ds.test.inputs]).reshape(1797, -1)
    from sklearn.datasets import load_digits
    ref = load_digits().data.astype(np.float32) / 16
    assert sorted(map(bytes, flat)) == sorted(map(bytes, ref))


# ----------------------------------------------------------------- synthetic

def test_synthetic_defaults_and_determinism():
    a = load_dataset("synthetic", seed=3)
    b = load_dataset("synthetic", seed=3)
    c = load_dataset("synthetic", seed=4)
    assert a.num_classes == 10 and a.name == "synthetic"
    assert a.train.inputs.shape == (4096, 32) and a.test.inputs.shape == (1024, 32)
    assert a.train.inputs.dtype == np.float32 and a.train.labels.dtype == np.int32
    assert np.all(np.isfinite(a.train.inputs))
    assert set(np.unique(a.train.labels)) == set(range(10))
    np.testing.assert_array_equal(a.train.inputs, b.train.inputs)
    np.testing.assert_array_equal(a.test.labels, b.test.labels)
    assert not np.array_equal(a.train.inputs, c.train.inputs)
    assert not np.array_equal(a.train.labels, c.train.labels)


def test_synthetic_parameters():
    ds = load_dataset("synthetic", seed=0,
                      synthetic=dict(num_train=50, num_test=20, num_features=7, num_classes=3, noise=0.0))
    assert ds.num_classes == 3 and ds.train.inputs.shape == (50, 7) and ds.test.inputs.shape == (20, 7)
    assert ds.train.labels.max() < 3
    # The test set does not depend on the size of the training set.
    bigger = load_dataset("synthetic", synthetic=dict(num_train=60, num_test=20, num_features=7,
                                                      num_classes=3, noise=0.0))
    np.testing.assert_array_equal(ds.test.inputs, bigger.test.inputs)


def test_synthetic_learnable_by_nearest_centroid_above_chance():
    ds = load_dataset("synthetic", synthetic=dict(num_train=2000, num_test=500))
    centroids = np.stack([ds.train.inputs[ds.train.labels == k].mean(0) for k in range(10)])
    pred = np.argmin(((ds.test.inputs[:, None] - centroids) ** 2).sum(-1), axis=1)
    assert (pred == ds.test.labels).mean() > 0.3  # chance is 0.1


@pytest.mark.parametrize("bad, match", [
    (dict(nosie=0.1), r"\['nosie'\].*valid keys.*noise.*num_train"),
    (dict(num_train=0), "num_train must be a positive int"),
    (dict(num_classes=1), "num_classes must be >= 2"),
    (dict(noise=-1.0), "noise must be a finite number >= 0"),
    (dict(noise=float("inf")), "noise must be a finite number >= 0"),
])
def test_synthetic_bad_parameters(bad, match):
    with pytest.raises(DatasetError, match=match):
        load_dataset("synthetic", synthetic=bad)


# ----------------------------------------------------------------- mnist

def test_mnist_from_npz(tmp_path):
    x_tr, y_tr, x_te, y_te = _fake_mnist(np.random.default_rng(0))
    np.savez(tmp_path / "mnist.npz", x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
    ds = load_dataset("mnist", data_dir=str(tmp_path))
    assert ds.name == "mnist" and ds.num_classes == 10
    _check_images(ds.train, x_tr, y_tr, (5, 28, 28, 1))
    _check_images(ds.test, x_te, y_te, (3, 28, 28, 1))


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_idx(tmp_path, gz):
    arrays = _fake_mnist(np.random.default_rng(1))
    _write_mnist_idx(tmp_path, arrays, gz)
    ds = load_dataset("mnist", data_dir=str(tmp_path))
    _check_images(ds.train, arrays[0], arrays[1], (5, 28, 28, 1))
    _check_images(ds.test, arrays[2], arrays[3], (3, 28, 28, 1))


def test_mnist_missing_files_and_empty_data_dir(tmp_path):
    with pytest.raises(DatasetError, match="data_dir is empty.*--config.dataset.data_dir"):
        load_dataset("mnist")
    with pytest.raises(DatasetError) as err:
        load_dataset("mnist", data_dir=str(tmp_path))
    msg = str(err.value)
    assert "'mnist'" in msg and str(tmp_path / "mnist.npz") in msg
    assert str(tmp_path / "t10k-labels-idx1-ubyte") in msg and "--config.dataset.data_dir" in msg
    with pytest.raises(DatasetError, match="not a directory"):
        load_dataset("mnist", data_dir=str(tmp_path / "nope"))


def test_mnist_corrupt_idx(tmp_path):
    arrays = _fake_mnist(np.random.default_rng(2))
    _write_mnist_idx(tmp_path, arrays)
    bad = tmp_path / "train-images-idx3-ubyte"
    raw = bytearray(bad.read_bytes())
    raw[3] = 0x02  # wrong number of dimensions -> wrong magic number
    bad.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte.*magic number 2050 != 2051"):
        load_dataset("mnist", data_dir=str(tmp_path))
    # A truncated file (right magic, too few bytes) names the file too.
    _write_mnist_idx(tmp_path, arrays)
    labels = tmp_path / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-1])
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte.*truncated"):
        load_dataset("mnist", data_dir=str(tmp_path))


def test_mnist_bad_labels_and_npz(tmp_path):
    x_tr, y_tr, x_te, y_te = _fake_mnist(np.random.default_rng(3))
    y_tr[0] = 10
    np.savez(tmp_path / "mnist.npz", x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te)
    with pytest.raises(DatasetError, match=r"labels span \[\d+, 10\].*\[0, 10\)"):
        load_dataset("mnist", data_dir=str(tmp_path))
    np.savez(tmp_path / "mnist.npz", x_train=x_tr, y_train=y_tr)
    with pytest.raises(DatasetError, match=r"lacks key\(s\) \['x_test', 'y_test'\]"):
        load_dataset("mnist", data_dir=str(tmp_path))
    np.savez(tmp_path / "mnist.npz", x_train=np.array([object()]), y_train=y_tr, x_test=x_te, y_test=y_te)
    with pytest.raises(DatasetError, match="without pickle"):
        load_dataset("mnist", data_dir=str(tmp_path))


# ----------------------------------------------------------------- cifar10

def _fake_cifar(rng, n):
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n, dtype=np.uint8)


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-bin"])
def test_cifar10_from_binary(tmp_path, subdir):
    rng = np.random.default_rng(4)
    folder = tmp_path / subdir
    folder.mkdir(exist_ok=True)
    batches = [_fake_cifar(rng, n) for n in (2, 1, 3, 1, 2)]
    for i, (x, y) in enumerate(batches, start=1):
        _write_cifar_bin(folder / f"data_batch_{i}.bin", x, y)
    x_te, y_te = _fake_cifar(rng, 3)
    _write_cifar_bin(folder / "test_batch.bin", x_te, y_te)
    ds = load_dataset("cifar10", data_dir=str(tmp_path))
    assert ds.name == "cifar10" and ds.num_classes == 10
    x_tr = np.concatenate([x for x, _ in batches])
    y_tr = np.concatenate([y for _, y in batches])
    _check_images(ds.train, x_tr, y_tr, (9, 32, 32, 3))
    _check_images(ds.test, x_te, y_te, (3, 32, 32, 3))


def test_cifar10_from_npz(tmp_path):
    rng = np.random.default_rng(5)
    (x_tr, y_tr), (x_te, y_te) = _fake_cifar(rng, 4), _fake_cifar(rng, 2)
    # Keras stores CIFAR labels as (N, 1).
    np.savez(tmp_path / "cifar10.npz", x_train=x_tr, y_train=y_tr[:, None], x_test=x_te, y_test=y_te[:, None])
    ds = load_dataset("cifar10", data_dir=str(tmp_path))
    _check_images(ds.train, x_tr, y_tr, (4, 32, 32, 3))
    _check_images(ds.test, x_te, y_te, (2, 32, 32, 3))


def test_cifar10_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DatasetError, match="data_dir is empty"):
        load_dataset("cifar10")
    with pytest.raises(DatasetError) as err:
        load_dataset("cifar10", data_dir=str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path / "cifar10.npz") in msg and str(tmp_path / "cifar-10-batches-bin") in msg
    assert "data_batch_5.bin" in msg and "test_batch.bin" in msg and "--config.dataset.data_dir" in msg
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (tmp_path / name).write_bytes(bytes(3073))
    (tmp_path / "data_batch_3.bin").write_bytes(bytes(3000))
    with pytest.raises(DatasetError, match=r"data_batch_3\.bin has 3000 bytes.*3073"):
        load_dataset("cifar10", data_dir=str(tmp_path))


def test_split_is_frozen():
    split = Split(inputs=np.zeros((2, 3), np.float32), labels=np.zeros(2, np.int32))
    with pytest.raises(Exception):
        split.inputs = None
