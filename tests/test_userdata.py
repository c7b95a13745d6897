"""Your data through dtx.train (dtx.data.userdata): in-memory arrays, memory-mapped files larger than a memory
cap, bitwise resume with your data, and clear refusals of data that cannot train.

The memory test runs dtx.train in a subprocess on a 256 MiB memory-mapped float32 file under a cap of
128 MiB of anonymous resident-memory growth (RssAnon, sampled every 2 ms; measured 6 MiB on Linux 6.18:
steps and compiled programs). The file pages the batches touch are page cache, not counted: the kernel maps
them in folios of its choosing (VmRSS grew 215 MiB on 6.18 for the same run) and can evict them. A loader
that read the file into memory would add 256 MiB of anonymous memory.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import dtx
from dtx import config as config_lib
from dtx.data import tasks, userdata
from dtx.data.datasets import Split
from dtx.data.tasks import TaskError
from dtx.data.userdata import DataError

FILE_MIB, CAP_MIB = 256, 128


def _config(**overrides):
    return config_lib.override(config_lib.base_config(), **{
        "num_steps": 6, "global_batch_size": 64, "eval_batch_size": 128, "progress": False, "log_every": 2,
        "model.features": (16,), "optimizer.name": "momentum", "optimizer.learning_rate": 0.05, **overrides})


def _blobs(n, seed, d=8, k=3):
    """Three Gaussian blobs: linearly separable enough to learn in a few steps."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    centres = np.random.default_rng(99).normal(size=(k, d)) * 3
    return (centres[labels] + rng.normal(size=(n, d))).astype(np.float32), labels.astype(np.int64)


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_your_arrays_train_through_dtx_train(tmp_path):
    train, test = _blobs(512, 0), _blobs(200, 1)  # int64 labels: read as int32
    result = dtx.train(_config(num_steps=20), tmp_path / "class", data={"train": train, "test": Split(*test)})
    assert result.metrics["test_examples"] == 200 and result.metrics["test_accuracy"] > 0.9

    x, _ = _blobs(512, 2)
    y = np.stack([x[:, 0] - x[:, 1], 0.5 * x[:, 2]], axis=1).astype(np.float64)  # float64 targets: read as float32
    result = dtx.train(_config(num_steps=20, **{"task.name": "regression"}), tmp_path / "regression", data=(x, y))
    assert result.metrics == {}  # no test split: nothing evaluated
    losses = [r["loss"] for r in _records(tmp_path / "regression") if "loss" in r]
    assert "mae" in _records(tmp_path / "regression")[1] and losses[-1] < 0.5 * losses[0]


def test_data_that_cannot_train_is_refused_naming_the_array_and_the_fix(tmp_path):
    x, y = _blobs(64, 0)
    classification = tasks.classification()
    for data, error, message in [
        ((x, y[:-1]), DataError, r"64 inputs but 63 labels"),
        ({"train": (x, y), "valid": (x, y)}, DataError, r"unknown key\(s\) \['valid'\]"),
        ({"train": (x, y), "test": (x[:, :4], y)}, DataError, r"test inputs have shape \(4,\).*train inputs \(8,\)"),
        ((x, y.astype(np.float32)), TaskError, r"data\['train'\] labels: task 'classification' needs integer"),
        ((x.astype(str), y), DataError, r"dtype <U"),
        ({"train": (x, y), "num_classes": 0}, DataError, r"num_classes.*positive"),
        ((x, y - 1), DataError, r"labels must be >= 0"),
    ]:
        with pytest.raises(error, match=message):
            userdata.as_dataset(data, classification)
    with pytest.raises(TaskError, match="float targets"):  # through dtx.train, before anything compiles
        dtx.train(_config(**{"task.name": "regression"}), tmp_path / "run", data=(x, y))
    assert not (tmp_path / "run").exists()


def test_num_classes_and_sequences_from_your_data():
    x, y = _blobs(64, 0, k=5)
    assert userdata.as_dataset((x, y), tasks.classification()).num_classes == int(y.max()) + 1
    assert userdata.as_dataset((x, x[:, :3]), tasks.regression()).num_classes == 3
    tokens = np.arange(100) % 7
    windows = dtx.data.datasets.token_windows(tokens, 8)
    assert np.shares_memory(windows.inputs, tokens)  # views: a memory-mapped stream stays on disk
    np.testing.assert_array_equal(windows.labels[:, :-1], windows.inputs[:, 1:])
    assert userdata.as_dataset(windows, tasks.next_token()).num_classes == 7


class Reader:
    """An array-like reader of some other format: rows by index, counting what it was asked for."""

    def __init__(self, array):
        self.array, self.shape, self.dtype, self.rows_read = array, array.shape, array.dtype, 0

    def __len__(self):
        return len(self.array)

    def __getitem__(self, index):
        rows = self.array[index]
        self.rows_read += len(rows) if np.ndim(rows) == self.array.ndim else 1
        return rows


def test_an_array_like_reader_is_read_by_rows_never_whole():
    from dtx import mesh as mesh_lib
    from dtx.data import TrainLoader

    x, y = _blobs(4096, 0)
    reader = Reader(x.astype(np.float64))
    dataset = userdata.as_dataset({"train": (reader, y), "num_classes": 3}, tasks.classification())
    assert dataset.train.inputs.dtype == np.float32  # read as 32-bit, row by row
    batch = TrainLoader(dataset.train, 64, mesh_lib.make_mesh([("data", -1)]), seed=0).batch(5)
    assert batch["inputs"].dtype == np.float32 and batch["inputs"].shape == (64, 8)
    assert reader.rows_read <= 64 + 16  # the batch, and the fingerprint's 16 sampled rows
    userdata.fingerprint(dataset)


@pytest.fixture(scope="module")
def memory_mapped(tmp_path_factory):
    """Blobs saved as .npy files and opened with np.load(mmap_mode='r')."""
    folder = tmp_path_factory.mktemp("mmap")
    for name, (x, y) in (("train", _blobs(640, 0)), ("test", _blobs(100, 1))):
        np.save(folder / f"{name}_x.npy", x)
        np.save(folder / f"{name}_y.npy", y)
    load = lambda name: (np.load(folder / f"{name}_x.npy", mmap_mode="r"),  # noqa: E731
                         np.load(folder / f"{name}_y.npy", mmap_mode="r"))
    return {"train": load("train"), "test": load("test")}


def test_resume_with_memory_mapped_data_is_bitwise(tmp_path, memory_mapped):
    """3 steps, stop, resume to 6 == 6 steps straight: parameters bit for bit, the same batches (data digest)
    and the same evaluation; a resume on other data is refused."""
    whole = dtx.train(_config(), tmp_path / "whole", data=memory_mapped)
    every = {"checkpoint.every_steps": 3, "checkpoint.async_save": False}
    dtx.train(_config(num_steps=3, **every), tmp_path / "split", data=memory_mapped)
    resumed = dtx.train(_config(**every), tmp_path / "split", data=memory_mapped)
    for a, b in zip(jax.tree.leaves(jax.device_get(whole.state.params)),
                    jax.tree.leaves(jax.device_get(resumed.state.params))):
        np.testing.assert_array_equal(a, b)
    digest = lambda path: [r["data_digest"] for r in _records(path) if r["step"] == 6 and "data_digest" in r]  # noqa: E731
    assert digest(tmp_path / "whole") == digest(tmp_path / "split") and digest(tmp_path / "whole")
    assert resumed.metrics == whole.metrics
    other = {"train": (memory_mapped["train"][0][::-1], memory_mapped["train"][1][::-1]), "test": memory_mapped["test"]}
    with pytest.raises(DataError, match="cannot resume: the checkpoint was trained on data with fingerprint"):
        dtx.train(_config(num_steps=9, **every), tmp_path / "split", data=other)


_BOUNDED = r"""
import json, sys, tempfile, threading, time
import numpy as np
import dtx
from dtx import config as config_lib

def rss():
    # Anonymous resident memory: what the process allocated. Pages of the memory-mapped file it reads are page
    # cache, mapped by the kernel in folios of its choosing (Linux 6.x maps large ones: VmRSS then counts up to
    # MiBs per row read) and reclaimed at will; a copy of the data would be anonymous and shows here.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

x, y = np.load(sys.argv[1], mmap_mode="r"), np.load(sys.argv[2], mmap_mode="r")
config = config_lib.override(config_lib.base_config(), **{
    "num_steps": 6, "global_batch_size": 64, "eval_batch_size": 512, "progress": False, "log_every": 3,
    "model.features": (16,), "optimizer.name": "sgd", "optimizer.learning_rate": 0.01})
small = np.zeros((1024,) + x.shape[1:], np.float32), np.zeros(1024, np.int32)
dtx.train(config, tempfile.mkdtemp(), data={"train": small, "test": small, "num_classes": 10})  # JAX warmed up
before, peak, done = rss(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

sampler = threading.Thread(target=sample)
sampler.start()
result = dtx.train(config, tempfile.mkdtemp(), data={"train": (x[:-1024], y[:-1024]), "test": (x[-1024:], y[-1024:]),
                                                   "num_classes": 10})
done.set()
sampler.join()
print(json.dumps({"growth_mib": (peak[0] - before) / 2**20, "test_examples": result.metrics["test_examples"]}))
"""


def test_a_memory_mapped_file_larger_than_the_memory_cap_trains_in_bounded_memory(tmp_path):
    rows, width = FILE_MIB * 2**20 // (4 * 1024), 1024
    inputs = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(rows, width))
    for start in range(0, rows, 8192):  # written in chunks: this process never holds the file either
        inputs[start:start + 8192] = np.random.default_rng(start).standard_normal((8192, width), np.float32)
    inputs.flush()
    del inputs
    np.save(tmp_path / "y.npy", np.random.default_rng(0).integers(0, 10, rows).astype(np.int32))
    assert os.path.getsize(tmp_path / "x.npy") >= FILE_MIB * 2**20 > CAP_MIB * 2**20
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _BOUNDED, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["test_examples"] == 1024
    assert found["growth_mib"] < CAP_MIB, f"resident memory grew {found['growth_mib']:.0f} MiB (cap {CAP_MIB})"
