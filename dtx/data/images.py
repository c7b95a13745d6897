"""Image files as random-access sources, and the augmentation of a batch, in pure numpy.

A *source* holds the uint8 pixels of one split, ``(N, H, W, C)``, and reads them by index without
loading the split: it follows grain's random-access protocol (``len(source)``, ``source[i]``: grain's
``RandomAccessDataSource``, what ``grain.MapDataset.source`` takes) and adds ``read(indices)``, a whole
batch in one call, and ``labels`` (int32, in memory: 4 bytes per example). Sources:

* :class:`ArrayImages`: a uint8 array, in memory or memory-mapped (``mnist.npz``, ``cifar10.npz``,
  an uncompressed MNIST IDX file mapped from disk);
* :class:`CifarBinary`: the CIFAR-10 binary batches (1 label byte + 3×32×32 CHW pixels per record),
  memory-mapped, read record by record;
* :class:`ImageFolder`: ``<split>/<class>/*.png|jpg`` decoded by Pillow when read; class ids are the
  sorted folder names (the layout of torchvision's ``ImageFolder``).

:class:`ImageRows` shows a source as the float32 array a :class:`dtx.data.datasets.Split` holds
(pixels / 255, optionally normalised per channel), read row by row, so evaluation, fingerprints and
shapes work on it as on any array. Augmentation (:func:`augment`) is the standard CIFAR recipe of
He et al. 2016 (§4.2): pad by ``p`` pixels, take a random ``H×W`` crop, flip horizontally with
probability ½; its draws (:func:`draws`) are a hash of ``(seed, epoch, example index)`` alone, so a
batch is the same in any worker process, after a resume, and in one process or several.
"""

from __future__ import annotations

import os

import numpy as np

from dtx.data import datasets
from dtx.data.datasets import DatasetError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_STATISTICS_SAMPLE = 2048  # images a normalisation estimate reads: bounded work on a large folder


class ArrayImages:
    """A uint8 ``(N, H, W, C)`` array (in memory or memory-mapped) and its labels, as a source.

    ``mapped=(path, offset, shape)`` says the array maps that file: a worker process it is sent to maps
    the file again instead of receiving its contents (pickling a ``np.memmap`` copies its data).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, mapped: tuple | None = None):
        self.images, self.labels = images, np.asarray(labels).astype(np.int32).reshape(-1)
        self.shape, self.mapped = tuple(images.shape), mapped

    def __getstate__(self):
        return {**self.__dict__, "images": None} if self.mapped else self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.mapped:
            path, offset, shape = self.mapped
            self.images = np.memmap(path, np.uint8, "r", offset=offset, shape=shape).reshape(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        return np.asarray(self.images[index])

    def read(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(self.images[np.asarray(indices)])


class CifarBinary:
    """CIFAR-10's binary batch files, memory-mapped: record ``i`` is read when asked for, never the file."""

    RECORD = 1 + 3 * 32 * 32

    def __init__(self, paths):
        self.paths, self.files = list(paths), []
        for path in self.paths:
            size = os.path.getsize(path)
            if size == 0 or size % self.RECORD:
                raise DatasetError(f"cifar10: {path} has {size} bytes, not a positive multiple of {self.RECORD} "
                                   "(1 label + 3x32x32 pixels); re-download the binary version.")
            self.files.append(np.memmap(path, np.uint8, "r", shape=(size // self.RECORD, self.RECORD)))
        self.starts = np.cumsum([0] + [len(f) for f in self.files])
        # The label column is one byte per record: read once (50 kB for the training set).
        self.labels = np.concatenate([np.asarray(f[:, 0]) for f in self.files]).astype(np.int32)
        self.shape = (int(self.starts[-1]), 32, 32, 3)

    def __getstate__(self):  # a worker process maps the files again (pickling a memmap copies its data)
        return {**self.__dict__, "files": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.files = [np.memmap(p, np.uint8, "r").reshape(-1, self.RECORD) for p in self.paths]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read(np.array([index]))[0]

    def read(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, np.int64)
        out = np.empty((len(indices), self.RECORD - 1), np.uint8)
        which = np.searchsorted(self.starts, indices, side="right") - 1
        for f in np.unique(which):
            mine = which == f
            out[mine] = self.files[f][indices[mine] - self.starts[f], 1:]
        return out.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # CHW records -> HWC images


class ImageFolder:
    """``root/<class>/<image>``: class ids are the sorted folder names, images sorted by path within
    each; PNG or JPEG decoded by Pillow when read. Every image must have the first one's size and
    colour mode (``L`` grey: 1 channel; anything else is read as ``RGB``: 3)."""

    def __init__(self, root: str, classes: list[str] | None = None):
        if not os.path.isdir(root):
            raise DatasetError(f"image_folder: {root!r} is not a directory; put the images in "
                               f"{root}/<class>/*.png|jpg (set --config.dataset.data_dir to the folder above it)")
        found = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
        self.classes = list(classes) if classes is not None else found
        if not self.classes:
            raise DatasetError(f"image_folder: {root!r} holds no class folders; put each class's images in "
                               f"{root}/<class>/ (*.png, *.jpg)")
        self.paths, labels = [], []
        for label, name in enumerate(self.classes):
            folder = os.path.join(root, name)
            files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_SUFFIXES)) \
                if os.path.isdir(folder) else []
            self.paths += [os.path.join(folder, f) for f in files]
            labels += [label] * len(files)
        if not self.paths:
            raise DatasetError(f"image_folder: no images ({', '.join(IMAGE_SUFFIXES)}) in the class folders of "
                               f"{root!r}; put the images in {root}/<class>/")
        self.labels = np.asarray(labels, np.int32)
        from PIL import Image  # Lazy: only image folders need Pillow.

        with Image.open(self.paths[0]) as first:
            self.mode = "L" if first.mode in ("L", "1") else "RGB"
            width, height = first.size
        self.shape = (len(self.paths), height, width, 1 if self.mode == "L" else 3)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        from PIL import Image

        path = self.paths[int(index)]
        try:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert(self.mode), np.uint8)
        except OSError as e:
            raise DatasetError(f"image_folder: cannot decode {path} ({e}); replace or remove the file") from e
        pixels = pixels.reshape(pixels.shape[:2] + (self.shape[3],))
        if pixels.shape != self.shape[1:]:
            raise DatasetError(f"image_folder: {path} is {pixels.shape[1]}x{pixels.shape[0]} but the folder's "
                               f"images are {self.shape[2]}x{self.shape[1]}; resize the images to one size")
        return pixels

    def read(self, indices: np.ndarray) -> np.ndarray:
        return np.stack([self[i] for i in np.asarray(indices).reshape(-1)]) if len(indices) else \
            np.empty((0,) + self.shape[1:], np.uint8)


def open_sources(name: str, data_dir: str) -> tuple:
    """``(train, test, num_classes)`` sources of ``name`` (``cifar10``, ``mnist``, ``image_folder``) in
    ``data_dir``; the same files, the same refusals and the same pixels as :func:`datasets.load_dataset`."""
    data_dir = datasets.check_data_dir(name, data_dir)
    if name == "image_folder":
        train = ImageFolder(os.path.join(data_dir, "train"))
        test_root = os.path.join(data_dir, "test")
        if not os.path.isdir(test_root):
            raise DatasetError(f"image_folder: {test_root!r} is missing; put the test images in "
                               f"{test_root}/<class>/ with the class folders of train/ ({', '.join(train.classes)})")
        extra = sorted(set(d for d in os.listdir(test_root) if os.path.isdir(os.path.join(test_root, d)))
                       - set(train.classes))
        if extra:
            raise DatasetError(f"image_folder: {test_root} has class folders {extra} that train/ lacks; "
                               "every test class needs training images")
        test = ImageFolder(test_root, classes=train.classes)  # the same class ids as train/
        if test.shape[1:] != train.shape[1:]:
            raise DatasetError(f"image_folder: test images are {test.shape[1:]} (H, W, C) but train images "
                               f"{train.shape[1:]}; both splits need one image size and colour mode")
        return train, test, len(train.classes)
    if name == "cifar10":
        npz, folder = datasets.cifar10_files(data_dir)
        if npz:
            x_train, y_train, x_test, y_test = datasets.load_npz("cifar10", npz, ((32, 32, 3),))
            return ArrayImages(x_train, y_train), ArrayImages(x_test, y_test), 10
        paths = [os.path.join(folder, f) for f in datasets.CIFAR_BINS]
        return CifarBinary(paths[:5]), CifarBinary(paths[5:]), 10
    if name == "mnist":
        npz, paths = datasets.mnist_files(data_dir)
        if npz:
            x_train, y_train, x_test, y_test = datasets.load_npz("mnist", npz, ((28, 28, 1), (28, 28)))
            return ArrayImages(x_train, y_train), ArrayImages(x_test, y_test), 10
        splits = []
        for images, labels in (paths[0:2], paths[2:4]):
            pixels, mapped = _idx_images(images)
            splits.append(ArrayImages(pixels, datasets.read_idx(labels, 2049, ()), mapped))
        return splits[0], splits[1], 10
    raise DatasetError(f"dataset {name!r} has no image source; image sources are cifar10, mnist, image_folder")


def _idx_images(path: str) -> tuple:
    """An IDX image file as ``(N, 28, 28, 1)`` uint8 and how it is mapped (:class:`ArrayImages`):
    memory-mapped when uncompressed, else decompressed into memory."""
    if path.endswith(".gz"):
        return datasets.read_idx(path, 2051, (28, 28))[..., None], None
    with open(path, "rb") as f:
        header = f.read(16)
    dims = tuple(int(v) for v in np.frombuffer(header[4:], ">u4")) if len(header) == 16 else ()
    if int.from_bytes(header[:4], "big") != 2051 or dims[1:] != (28, 28) \
            or os.path.getsize(path) != 16 + int(np.prod(dims)):
        return datasets.read_idx(path, 2051, (28, 28))[..., None], None  # not well formed: its reader says why
    return np.memmap(path, np.uint8, "r", offset=16, shape=dims)[..., None], (path, 16, dims)


def to_float(pixels: np.ndarray, mean: np.ndarray | None, std: np.ndarray | None) -> np.ndarray:
    """uint8 pixels -> float32 in [0, 1] (÷ 255, as the in-memory readers), then ``(x - mean) / std`` per
    channel when ``mean`` is given."""
    x = pixels.astype(np.float32)
    x /= np.float32(255)
    if mean is not None:
        x -= mean
        x /= std
    return x


def statistics(source, sample: int = _STATISTICS_SAMPLE) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation of the [0, 1] pixels of up to ``sample`` evenly spaced
    images of ``source`` (all of them when it holds fewer), float32."""
    index = np.unique(np.linspace(0, len(source) - 1, min(sample, len(source))).astype(np.int64))
    x = to_float(source.read(index), None, None).astype(np.float64)
    axes = tuple(range(x.ndim - 1))
    return x.mean(axis=axes).astype(np.float32), x.std(axis=axes).astype(np.float32)


class ImageRows:
    """A source as a read-only float32 array: ``rows[index]`` decodes and converts (:func:`to_float`) only
    those rows. What a :class:`dtx.data.datasets.Split` holds for an image source (evaluation batches,
    fingerprints and shapes read it as any array); training batches add augmentation
    (:mod:`dtx.data.inputs`)."""

    dtype = np.dtype(np.float32)

    def __init__(self, source, mean: np.ndarray | None = None, std: np.ndarray | None = None):
        self.source, self.mean, self.std = source, mean, std
        self.shape, self.ndim = tuple(source.shape), len(source.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self[np.array([index])][0]
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        return to_float(self.source.read(np.asarray(index)), self.mean, self.std)


# --------------------------------------------------------------------------------- augmentation

def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of uint64 whose output bits all depend on
    every input bit, so consecutive example indices get independent-looking draws."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draws(seed: int, epoch: int, indices: np.ndarray, padding: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crop offsets ``(dy, dx)`` in ``[0, 2·padding]`` and flips (bool) of the examples ``indices`` in
    ``epoch``: a hash of ``(seed, epoch, index)`` and nothing else (no generator state, no worker
    identity), so any process that builds the batch draws the same."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        key = _mix(np.asarray([seed], np.uint64) + golden)
        key = _mix(key ^ (np.asarray([epoch], np.uint64) + golden))
        h = _mix(key ^ (np.asarray(indices, np.uint64) * golden))
    span = np.uint64(2 * padding + 1)
    dy = (h % span).astype(np.int64)
    dx = ((h >> np.uint64(21)) % span).astype(np.int64)
    flip = ((h >> np.uint64(42)) & np.uint64(1)).astype(bool)
    return dy, dx, flip


def augment(pixels: np.ndarray, dy: np.ndarray, dx: np.ndarray, flip: np.ndarray, padding: int) -> np.ndarray:
    """Each image of ``pixels`` (B, H, W, C) zero-padded by ``padding`` on every side, cropped back to
    H×W at ``(dy, dx)``, then mirrored left-right where ``flip``."""
    batch, height, width = pixels.shape[:3]
    padded = np.pad(pixels, ((0, 0), (padding, padding), (padding, padding), (0, 0))) if padding else pixels
    out = np.empty_like(pixels)
    # One slice copy per image: 2-3x faster than a single fancy-index gather over the batch (which
    # builds a (B, H, W) index and gathers element by element), measured on 512 CIFAR images.
    for b in range(batch):
        crop = padded[b, dy[b]:dy[b] + height, dx[b]:dx[b] + width]
        out[b] = crop[:, ::-1] if flip[b] else crop
    return out
