"""grain as the input pipeline of file-backed image data: cifar10, mnist and image folders, augmented.

The contract is :mod:`dtx.data.loader`'s: the global batch of step ``s`` is a pure function of
``(seed, s)``. Epoch ``e`` visits the training set in the order ``permutation(seed, e)``, step ``s``
takes its ``s``-th slice, each process builds only its own devices' rows. The augmentation of an
example is a hash of ``(seed, e, index)`` (:func:`dtx.data.images.draws`). So one element of the grain
pipeline is one step's host batch (:class:`HostBatches`), and::

    grain.MapDataset.range(0, ∞).map(HostBatches(...))

is the whole pipeline: element ``s`` is step ``s``'s batch, whoever computes it. With
``dataset.workers = 0`` the loop reads element ``s`` in its own process (random access, no
iterator). With ``dataset.workers = W > 0`` the slice from the step it asks for onwards runs through
``mp_prefetch`` in W worker processes. Each worker builds whole batches of its share of the steps and
keeps ``_BUFFER`` of them ready, and grain hands them back in step order. Neither the worker count
nor a restart of the iterator (a resume, a step asked for out of turn) can change a batch. Whole
batches per element, not one record per element: the draws, the conversion and the normalisation are
whole-batch numpy operations, and an element per record would add grain's per-element work (and a
transfer between processes) for every image.

In-memory arrays, memory-mapped files, ``synthetic``, ``digits`` and ``python_docs`` stay on
:class:`dtx.data.loader.TrainLoader`. They need no decoding and no augmentation, their batch is one
gather of rows (microseconds), and a worker process would only add a copy.

Config (the ``dataset`` block, checked at load time by :func:`check_dataset`): ``augment.crop_padding``
(pixels of zero padding before a random crop back to the image size; 0: no crop), ``augment.flip``
(horizontal flip with probability ½), ``augment.normalize`` (per-channel ``(x - mean) / std`` on
training and test images, with ``augment.mean`` / ``augment.std``, or, when those are empty, the
statistics of up to 2048 evenly spaced training images), ``workers`` (prefetching processes).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from ml_collections import ConfigDict

from dtx.config import ConfigError, is_import_path, register_check
from dtx.data import datasets, images, tokenizer, userdata
from dtx.data.datasets import Dataset, DatasetError, Split
from dtx.data.loader import Batch, TrainLoader, _place, epoch_permutation

IMAGE_DATASETS = ("cifar10", "mnist", "image_folder")  # the datasets read through grain
_HORIZON = 1 << 62  # the pipeline's length: steps are unbounded, grain's range is lazy
_BUFFER = 2  # batches each worker keeps ready: enough to hide a slow one, little memory


@dataclasses.dataclass(frozen=True)
class Augment:
    """``dataset.augment``: a random crop after zero padding, a horizontal flip, per-channel normalisation."""

    crop_padding: int = 0
    flip: bool = False
    normalize: bool = False
    mean: tuple = ()
    std: tuple = ()

    @property
    def active(self) -> bool:
        return bool(self.crop_padding or self.flip or self.normalize)

    @classmethod
    def from_settings(cls, settings) -> Augment:
        """The ``dataset.augment`` block (a ConfigDict or dict), checked; errors name the key and the fix."""
        settings = settings.to_dict() if isinstance(settings, ConfigDict) else dict(settings or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"dataset.augment has unknown key(s) {unknown}; its keys are {known}")
        out = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
        p = out.crop_padding
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0:
            raise ConfigError(f"dataset.augment.crop_padding={p!r} must be an int >= 0 (pixels of zero padding "
                              "before the random crop; 0: no crop, 4 for CIFAR)")
        for key in ("flip", "normalize"):
            if not isinstance(getattr(out, key), bool):
                raise ConfigError(f"dataset.augment.{key}={getattr(out, key)!r} must be True or False")
        if (out.mean or out.std) and not out.normalize:
            raise ConfigError("dataset.augment.mean / std are set but dataset.augment.normalize=False; set "
                              "--config.dataset.augment.normalize=True or leave mean and std empty")
        if len(out.mean) != len(out.std) or not all(isinstance(v, (int, float)) for v in out.mean + out.std) \
                or not all(v > 0 for v in out.std):
            raise ConfigError(f"dataset.augment.mean={out.mean!r}, std={out.std!r}: give one mean and one std > 0 "
                              "per channel, e.g. mean='(0.49, 0.48, 0.45)' std='(0.25, 0.24, 0.26)', or leave both "
                              "empty to use the training images' statistics")
        return out

    def statistics(self, source) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``(mean, std)`` per channel for normalisation (``None`` without it): the settings', else the
        training images' (:func:`dtx.data.images.statistics`)."""
        if not self.normalize:
            return None, None
        channels = source.shape[-1]
        if self.mean:
            if len(self.mean) != channels:
                raise ConfigError(f"dataset.augment.mean has {len(self.mean)} values but the images have "
                                  f"{channels} channel(s); give one mean and one std per channel")
            return np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
        return images.statistics(source)


@register_check
def check_dataset(config: ConfigDict) -> None:
    """The ``dataset`` block's grain settings, at load time: the augment keys and values, ``workers``, and
    that both are asked of a dataset read through grain; ``tokenizer`` and ``vocab_size`` of a text dataset
    (:func:`dtx.data.tokenizer.check_settings`)."""
    block = config.dataset
    try:
        tokenizer.check_settings(block.get("tokenizer", "bytes"), block.get("vocab_size", 0), block.name,
                                 datasets.TEXT_DATASETS)
    except tokenizer.TokenizerError as error:
        raise ConfigError(str(error)) from None
    augment = Augment.from_settings(block.get("augment"))
    workers = block.get("workers", 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"dataset.workers={workers!r} must be an int >= 0 (processes that prefetch batches; "
                          "0: in the training process)")
    if block.name not in IMAGE_DATASETS and (augment.active or workers):
        what = "dataset.augment" if augment.active else "dataset.workers"
        raise ConfigError(f"{what} applies to the image datasets read through grain ({', '.join(IMAGE_DATASETS)}), "
                          f"not dataset.name={block.name!r}; choose one of those or leave {what} at its default")


def load_dataset(block: ConfigDict, *, seed: int) -> Dataset:
    """The config's dataset (``config.dataset``): image datasets as :class:`dtx.data.images.ImageRows` over
    their files (nothing decoded until read), the others from :func:`dtx.data.datasets.load_dataset`."""
    if is_import_path(block.name):  # your function returning arrays or a Dataset (dtx.data.userdata)
        return userdata.load_source(block, seed=seed)
    if block.name not in IMAGE_DATASETS:
        if block.name not in datasets.DATASETS:
            raise DatasetError(f"unknown dataset {block.name!r}; choose one of "
                               f"{', '.join(datasets.DATASETS + IMAGE_DATASETS[2:])}, or your function returning "
                               "arrays as package.module:function.")
        return datasets.load_dataset(block.name, data_dir=block.data_dir, seed=seed,
                                     synthetic=block.synthetic.to_dict(), seq_len=block.seq_len,
                                     tokenizer=block.get("tokenizer", "bytes"), vocab_size=block.get("vocab_size", 0))
    augment = Augment.from_settings(block.get("augment"))
    train, test, num_classes = images.open_sources(block.name, block.data_dir)
    for what, source in (("train", train), ("test", test)):
        labels = source.labels
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise DatasetError(f"dataset {block.name!r}, {what}: labels span [{labels.min()}, {labels.max()}] but "
                               f"must lie in [0, {num_classes}); re-download the files.")
    mean, std = augment.statistics(train)
    return Dataset(block.name, Split(images.ImageRows(train, mean, std), train.labels),
                   Split(images.ImageRows(test, mean, std), test.labels), num_classes)


def make_loader(dataset: Dataset, global_batch_size: int, mesh, *, seed: int,
                settings: ConfigDict | None = None) -> TrainLoader:
    """The training loader of ``dataset``: a :class:`GrainLoader` for an image source, else the plain
    :class:`TrainLoader`. ``settings`` is the config's ``dataset`` block, or ``None`` for data passed
    to ``dtx.train(data=...)`` (whose batches the config's block does not describe)."""
    if settings is not None and isinstance(dataset.train.inputs, images.ImageRows):
        return GrainLoader(dataset.train, global_batch_size, mesh, seed=seed,
                           augment=Augment.from_settings(settings.get("augment")),
                           workers=int(settings.get("workers", 0)))
    return TrainLoader(dataset.train, global_batch_size, mesh, seed=seed)


class HostBatches:
    """Step -> this process's rows of that step's batch, as numpy: one element of the grain pipeline.

    Holds only what a worker process needs (the source, the labels, the seed, the batch geometry and
    the augmentation), so it pickles small; no jax object enters it.
    """

    def __init__(self, split: Split, global_batch_size: int, rows: slice, seed: int, augment: Augment):
        self.source, self.labels = split.inputs.source, np.asarray(split.labels)
        self.mean, self.std = split.inputs.mean, split.inputs.std
        self.size, self.global_batch_size, self.rows = len(self.labels), global_batch_size, rows
        self.steps_per_epoch = self.size // global_batch_size
        self.seed, self.augment = seed, augment
        self._orders: dict[int, np.ndarray] = {}

    def __getstate__(self):
        return {**self.__dict__, "_orders": {}}  # a worker computes its own epoch orders

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_permutation(self.seed, epoch, self.size)}  # the epoch in use only
        return self._orders[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Dataset indices of the global batch of ``step`` (as :meth:`TrainLoader.indices`)."""
        epoch, position = divmod(int(step), self.steps_per_epoch)
        return self.order(epoch)[position * self.global_batch_size: (position + 1) * self.global_batch_size]

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        epoch = int(step) // self.steps_per_epoch
        local = self.indices(step)[self.rows]
        pixels = self.source.read(local)
        padding = self.augment.crop_padding
        if padding or self.augment.flip:
            dy, dx, flip = images.draws(self.seed, epoch, local, padding)
            pixels = images.augment(pixels, dy, dx, flip & self.augment.flip, padding)
        return {"inputs": images.to_float(pixels, self.mean, self.std), "labels": self.labels[local]}


class GrainLoader(TrainLoader):
    """:class:`TrainLoader` for an image source: batches built by a grain pipeline, augmented, prefetched by
    ``workers`` processes (0: built on demand in this process). The same batches for any ``workers``."""

    def __init__(self, split: Split, global_batch_size: int, mesh, *, seed: int, augment: Augment = Augment(),
                 workers: int = 0):
        super().__init__(split, global_batch_size, mesh, seed)
        import grain  # Lazy: only image datasets need grain.

        self.augment, self.workers = augment, workers
        self.host = HostBatches(split, global_batch_size, self._rows, seed, augment)
        self.dataset = grain.MapDataset.range(0, _HORIZON).map(self.host)
        # The run's length, when known (dtx.run.setup sets it): the workers build no batch past it, and
        # stop once the last one is read, so none is left in their buffers (see close).
        self.num_steps: int | None = None
        self._iterator, self._next, self._last = None, None, (None, None)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of ``step``'s batch, on the host: from the prefetching workers when they
        are on the way there, else built here (both are element ``step`` of :attr:`dataset`)."""
        step = int(step)
        if self._last[0] == step:  # the loop compiles on the first batch, then trains on it
            return self._last[1]
        if not self.workers:
            arrays = self.dataset[step]
        else:
            if self._iterator is None or self._next != step:
                self._start(step)
            # Copied out of grain's shared memory, which is then freed at once.
            arrays = {key: np.array(value) for key, value in next(self._iterator).items()}
            self._next = step + 1
            if self.num_steps is not None and self._next >= self.num_steps:
                self.close()  # the run's last batch: the workers have nothing left to build
        self._last = (step, arrays)
        return arrays

    def batch(self, step: int) -> Batch:
        """The global batch of ``step``, placed on the devices (only local rows are built)."""
        return _place(self.host_batch(step), self.sharding, self.global_batch_size)

    def _start(self, step: int) -> None:
        import grain

        self.close()
        _absl_flags_for_grain()
        options = grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=_BUFFER)
        # No reading threads inside a worker: its batches are numpy work that holds the GIL.
        read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        stop = self.num_steps if self.num_steps is not None and step < self.num_steps else _HORIZON
        self._iterator = iter(self.dataset[step:stop].to_iter_dataset(read).mp_prefetch(options))
        self._next = step

    def close(self) -> None:
        """Stops the worker processes (a later batch starts them again).

        Batches come back in shared memory (pickling them through grain's queues instead can leave a
        worker blocked on a full pipe at exit, which grain then waits 25 s for). Batches still buffered
        when an iterator closes before its end are dropped without freeing theirs, and Python warns of
        them at exit: a run's loader stops at its last step (:attr:`num_steps`) and closes itself there.
        """
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the workers are daemons and die with it
            pass


def _absl_flags_for_grain() -> None:
    """grain reads its settings as absl flags, which a program that never parsed flags (a script, a
    notebook, pytest) has not: mark grain's own flags as given, at their defaults, as grain does itself
    for its worker processes. Parsed flags, or one set on the command line, are left alone."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        for name in list(flags.FLAGS):
            if name.startswith("grain_"):
                flags.FLAGS[name].present = True
