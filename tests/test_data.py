"""Input pipeline: deterministic order, exact epoch coverage, sharded global arrays, no implicit transfers."""

import jax
import numpy as np
import pytest

from dtx import mesh as mesh_lib
from dtx.data import DataError, TrainLoader, epoch_permutation, eval_batches


def test_order_depends_only_on_seed_and_epoch():
    a = epoch_permutation(seed=3, epoch=1, size=100)
    assert np.array_equal(a, epoch_permutation(seed=3, epoch=1, size=100))
    assert not np.array_equal(a, epoch_permutation(seed=3, epoch=2, size=100))
    assert not np.array_equal(a, epoch_permutation(seed=4, epoch=1, size=100))
    assert sorted(a) == list(range(100))


def test_each_epoch_visits_distinct_examples(digits, mesh):
    loader = TrainLoader(digits.train, 128, mesh, seed=0)
    assert loader.steps_per_epoch == len(digits.train) // 128
    for epoch in range(2):
        steps = range(epoch * loader.steps_per_epoch, (epoch + 1) * loader.steps_per_epoch)
        seen = np.concatenate([loader.indices(s) for s in steps])
        assert len(np.unique(seen)) == len(seen) == loader.steps_per_epoch * 128  # nothing repeated
    first, second = loader.indices(0), loader.indices(loader.steps_per_epoch)
    assert not np.array_equal(first, second)  # reshuffled


def test_batch_is_a_sharded_global_array_with_the_right_rows(digits, mesh):
    loader = TrainLoader(digits.train, 64, mesh, seed=7)
    batch = loader.batch(5)
    index = loader.indices(5)
    assert batch["inputs"].shape == (64, 8, 8, 1)
    assert batch["inputs"].sharding.is_equivalent_to(mesh_lib.batch_sharding(mesh), 4)
    np.testing.assert_array_equal(np.asarray(batch["inputs"]), digits.train.inputs[index])
    np.testing.assert_array_equal(np.asarray(batch["labels"]), digits.train.labels[index])
    # Device k holds rows [8k, 8k + 8) of the global batch.
    for shard in batch["labels"].addressable_shards:
        rows = shard.index[0]
        np.testing.assert_array_equal(np.asarray(shard.data), digits.train.labels[index[rows]])
        assert rows.stop - rows.start == 8


def test_same_step_same_batch_across_loaders(digits, mesh):
    """A fresh loader (as after a restart) gives step s exactly the batch it had."""
    a = TrainLoader(digits.train, 64, mesh, seed=1)
    b = TrainLoader(digits.train, 64, mesh, seed=1)
    for step in (0, 3, 50):
        np.testing.assert_array_equal(np.asarray(a.batch(step)["labels"]), np.asarray(b.batch(step)["labels"]))


def test_batch_larger_than_dataset(digits, mesh):
    with pytest.raises(DataError, match="global_batch_size=2048 is larger than the training set"):
        TrainLoader(digits.train, 2048, mesh, seed=0)


def test_batch_not_divisible_by_devices(digits, mesh):
    with pytest.raises(mesh_lib.MeshError, match=r"global_batch_size=100 .* 8 .*96 or 104"):
        TrainLoader(digits.train, 100, mesh, seed=0)


def test_eval_batches_pad_and_mask(digits, mesh):
    batches = eval_batches(digits.test, 64, mesh)
    assert len(batches) == -(-len(digits.test) // 64)
    masks = np.concatenate([np.asarray(b["mask"]) for b in batches])
    assert masks.sum() == len(digits.test) and masks[: len(digits.test)].all()
    labels = np.concatenate([np.asarray(b["labels"]) for b in batches])[: len(digits.test)]
    np.testing.assert_array_equal(labels, digits.test.labels)
    with pytest.raises(mesh_lib.MeshError, match="eval_batch_size=60"):
        eval_batches(digits.test, 60, mesh)


def test_transfer_guard_catches_an_implicit_transfer(digits, mesh):
    """Negative control for the loop's guard: a host array fed to a jitted function is refused."""
    f = jax.jit(lambda x: x * 2)
    loader = TrainLoader(digits.train, 64, mesh, seed=0)
    with jax.transfer_guard("disallow"):
        f(loader.batch(0)["inputs"])  # placed explicitly by the loader: allowed
        with pytest.raises(Exception, match="[Dd]isallowed host-to-device transfer"):
            f(digits.train.inputs[:64])
