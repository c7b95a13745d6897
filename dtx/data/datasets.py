"""Dataset sources for dtx: whole datasets loaded into memory as numpy arrays.

Pure numpy on purpose (no jax import): sources are host-side data, and keeping
jax out lets them be loaded and tested without touching any device. Every
source returns float32 inputs (images NHWC in [0, 1], or (N, D) feature
vectors) and int32 labels in [0, num_classes). Every bad input raises
DatasetError with a message that says what to change.

Sources (see DATASETS):
  synthetic  generated from `seed` and the `synthetic` parameter dict.
  digits     scikit-learn's bundled 8x8 digits (offline). Fixed split that
             ignores `seed`: permutation from np.random.default_rng(0), the
             last 360 examples are test -> 1437 train / 360 test.
  mnist      from `data_dir`: mnist.npz (Keras layout) or the four IDX files,
             each optionally gzipped.
  cifar10    from `data_dir`: cifar10.npz, or the CIFAR-10 binary version
             (data_batch_{1..5}.bin, test_batch.bin) in data_dir or in
             data_dir/cifar-10-batches-bin/. Pickle is never used.
  python_docs  byte-level language modelling on the Python documentation topics
             that ship with CPython (pydoc_data.topics, what help('topics')
             shows; offline). int32 token windows of `seq_len`, labels shifted
             by one; the last 10% of the text is the test split; 256 classes
             (UTF-8 bytes), or with tokenizer="bpe" a byte-level BPE of
             `vocab_size` ids trained on the training split (dtx.data.tokenizer).

Your own arrays (in memory or memory-mapped) become a Dataset through
dtx.data.userdata (dtx.train(..., data=...)).
"""
import dataclasses
import gzip
import os

import numpy as np

from dtx.data import tokenizer as tokenizer_lib

DATASETS: tuple[str, ...] = ("synthetic", "digits", "mnist", "cifar10", "python_docs")
TEXT_DATASETS: tuple[str, ...] = ("python_docs",)  # the ones dataset.tokenizer applies to

SYNTHETIC_DEFAULTS = dict(num_train=4096, num_test=1024, num_features=32,
                          num_classes=10, noise=0.8, clusters_per_class=4)

_MNIST_IDX = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_CIFAR_BINS = tuple(f"data_batch_{i}.bin" for i in range(1, 6)) + ("test_batch.bin",)


class DatasetError(ValueError):
    """A dataset could not be loaded; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a dataset: ``inputs[i]`` is example ``i``, ``labels[i]`` its target.

    Attributes:
      inputs: array of shape (N, ...): images (N, H, W, C), feature vectors (N, D) or
        token ids (N, T). Any numpy array, including a memory-mapped one
        (``np.load(path, mmap_mode="r")``, ``np.memmap``): dtx reads only the rows of
        each batch, by index, so a split may be larger than memory.
      labels: array of shape (N,) or (N, ...): int class ids (classification), float
        targets (regression) or next-token ids (N, T) (see dtx.data.tasks).

    The built-in sources return float32 inputs and int32 labels; dtx.data.userdata
    builds Splits from your arrays (``dtx.train(..., data=...)``).
    """
    inputs: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


class Rows:
    """A read-only array whose rows are converted to ``dtype`` as they are gathered (a 64-bit
    memory-mapped file read as 32-bit, or uint16 token ids as int32, without converting, or loading, the
    whole file)."""

    def __init__(self, array: np.ndarray, dtype):
        self.array, self.dtype = array, np.dtype(dtype)
        self.shape, self.ndim = tuple(array.shape), len(array.shape)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        return np.asarray(self.array[index]).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A named dataset with train and test splits and its number of classes (the model's output
    width: classes, vocabulary or target values). ``test`` may be None (nothing is evaluated).
    ``token_bytes``: for text, the UTF-8 bytes each token id spells (int, ``(num_classes,)``), from which
    evaluation counts bits per byte (:func:`dtx.data.tasks.count_bytes`); ``None`` for other data."""
    name: str
    train: Split
    test: Split
    num_classes: int
    token_bytes: np.ndarray | None = None


def load_dataset(name: str, *, data_dir: str = "", seed: int = 0,
                 synthetic: dict | None = None, seq_len: int = 64, tokenizer: str = "bytes",
                 vocab_size: int = 0) -> Dataset:
    """Loads dataset `name` (one of DATASETS) fully into memory.

    `seed` and `synthetic` (parameter overrides, keys as in SYNTHETIC_DEFAULTS)
    only affect "synthetic"; `data_dir` is required by "mnist" and "cifar10";
    `seq_len` (tokens per example), `tokenizer` and `vocab_size` (dtx.data.tokenizer)
    only affect the text datasets (TEXT_DATASETS), whose BPE tokenizer and ids are
    cached in `data_dir` when given, else in the user's cache folder.
    """
    tokenizer_lib.check_settings(tokenizer, vocab_size, name, TEXT_DATASETS)
    if name == "synthetic":
        return _synthetic(seed, synthetic)
    if name == "python_docs":
        if tokenizer == "bytes":
            return _python_docs(seq_len)
        return text_dataset(name, python_docs_text(), seq_len, vocab_size,
                            os.path.expanduser(data_dir) or tokenizer_lib.default_cache_dir())
    if name == "digits":
        return _digits()
    if name in ("mnist", "cifar10"):
        data_dir = check_data_dir(name, data_dir)
        return _mnist(data_dir) if name == "mnist" else _cifar10(data_dir)
    raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}.")


CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


def download_hint(name: str, data_dir: str) -> str:
    """Where to get a dataset's files and where to put them (empty for datasets without one place)."""
    if name != "cifar10":
        return ""
    return (f" To get CIFAR-10: download {CIFAR10_URL} (the binary version, 162 MB) and extract it into "
            f"{data_dir}: mkdir -p {data_dir} && tar xzf cifar-10-binary.tar.gz -C {data_dir} (it creates "
            f"{os.path.join(data_dir, 'cifar-10-batches-bin')}/ with data_batch_1.bin ... test_batch.bin).")


def check_data_dir(name: str, data_dir: str) -> str:
    """``data_dir`` of a file-backed dataset, user-expanded; refused when empty or not a folder."""
    if not data_dir:
        raise DatasetError(
            f"dataset {name!r} is read from local files, but data_dir is empty: "
            f"set --config.dataset.data_dir=DIR to the folder holding the files "
            f"(or use dataset 'digits' / 'synthetic', which need no files)." + download_hint(name, "DIR"))
    data_dir = os.path.expanduser(data_dir)
    if not os.path.isdir(data_dir):
        raise DatasetError(f"dataset {name!r}: data_dir {data_dir!r} is not a "
                           f"directory; set --config.dataset.data_dir to an existing folder."
                           + download_hint(name, data_dir))
    return data_dir


def _split(dataset: str, what: str, images, labels, num_classes: int,
           scale: float = 1.0) -> Split:
    """Builds a validated Split: float32 inputs / scale, int32 labels in range."""
    labels = np.asarray(labels).reshape(-1)  # Keras CIFAR labels are (N, 1)
    if not np.issubdtype(labels.dtype, np.integer):
        raise DatasetError(f"dataset {dataset!r}, {what}: labels must be integers, got {labels.dtype}.")
    if len(labels) != len(images):
        raise DatasetError(f"dataset {dataset!r}, {what}: {len(images)} inputs but "
                           f"{len(labels)} labels; the files do not belong together.")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"dataset {dataset!r}, {what}: labels span [{labels.min()}, "
                           f"{labels.max()}] but must lie in [0, {num_classes}).")
    inputs = images.astype(np.float32)  # Always a fresh copy, so dividing in place is safe
    inputs /= np.float32(scale)           # and avoids a second full-size temporary (CIFAR).
    return Split(inputs=inputs, labels=labels.astype(np.int32))


def _synthetic(seed: int, overrides) -> Dataset:
    """Gaussian mixture, several clusters per class, under a fixed tanh map.

    Multiple clusters per class make it non-linearly separable (at the defaults
    a linear classifier gets ~75% test accuracy, a one-hidden-layer MLP ~97%),
    so it exercises real learning while staying small and fast.
    """
    # ConfigDict-like objects are not Mappings but offer to_dict().
    overrides = overrides.to_dict() if hasattr(overrides, "to_dict") else dict(overrides or {})
    unknown = sorted(set(overrides) - set(SYNTHETIC_DEFAULTS))
    if unknown:
        raise DatasetError(f"unknown synthetic dataset parameter(s) {unknown}; valid keys "
                           f"are {sorted(SYNTHETIC_DEFAULTS)}.")
    p = {**SYNTHETIC_DEFAULTS, **overrides}
    for key in ("num_train", "num_test", "num_features", "num_classes", "clusters_per_class"):
        if not isinstance(p[key], (int, np.integer)) or isinstance(p[key], bool) or p[key] < 1:
            raise DatasetError(f"synthetic parameter {key} must be a positive int, got {p[key]!r}.")
    if p["num_classes"] < 2:
        raise DatasetError(f"synthetic parameter num_classes must be >= 2, got {p['num_classes']}.")
    if isinstance(p["noise"], bool) or not isinstance(p["noise"], (int, float, np.number)) \
            or not (np.isfinite(p["noise"]) and p["noise"] >= 0):
        raise DatasetError(f"synthetic parameter noise must be a finite number >= 0, got {p['noise']!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DatasetError(f"seed must be a non-negative int, got {seed!r}.")

    k, m, d = p["num_classes"], p["clusters_per_class"], p["num_features"]
    # Separate streams per role, so the test set does not change with num_train.
    task_rng, train_rng, test_rng = (np.random.default_rng([seed, i]) for i in range(3))
    centres = task_rng.normal(size=(k, m, d))
    mixing = task_rng.normal(size=(d, d)) / np.sqrt(d)

    def draw(rng, n, what):
        labels = rng.integers(0, k, size=n)
        latent = centres[labels, rng.integers(0, m, size=n)] + p["noise"] * rng.normal(size=(n, d))
        return _split("synthetic", what, np.tanh(latent @ mixing), labels, k)

    return Dataset("synthetic", draw(train_rng, p["num_train"], "train"),
                   draw(test_rng, p["num_test"], "test"), k)


def _digits() -> Dataset:
    """scikit-learn's 8x8 digits (bundled in the wheel), pixels 0..16 -> [0, 1]."""
    from sklearn.datasets import load_digits  # Lazy: only this source needs sklearn.
    digits = load_digits()
    images, labels = digits.images[..., None], digits.target  # (1797, 8, 8, 1)
    # Fixed permutation independent of `seed`, so test accuracy is comparable across runs.
    perm = np.random.default_rng(0).permutation(len(labels))
    train, test = perm[:-360], perm[-360:]
    return Dataset("digits", _split("digits", "train", images[train], labels[train], 10, 16.0),
                   _split("digits", "test", images[test], labels[test], 10, 16.0), 10)


def _load_npz(dataset: str, path: str, image_shapes: tuple) -> tuple:
    """Reads uint8 x_train, y_train, x_test, y_test from an npz, never with pickle.

    Images may have any shape in `image_shapes`; they are reshaped to the first.
    """
    keys = ("x_train", "y_train", "x_test", "y_test")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):  # A bare .npy renamed to .npz.
            raise ValueError("it is a single .npy array, not an .npz archive")
        with f:
            missing = [k for k in keys if k not in f.files]
            arrays = tuple(f[k] for k in keys) if not missing else ()
    except (OSError, ValueError) as e:
        raise DatasetError(f"dataset {dataset!r}: cannot read {path} as a numpy .npz "
                           f"without pickle ({e}); re-create it with np.savez.") from e
    if missing:
        raise DatasetError(f"dataset {dataset!r}: {path} lacks key(s) {missing}; "
                           f"expected keys {list(keys)} (found {f.files}).")
    for x in arrays[0::2]:
        if x.dtype != np.uint8 or x.shape[1:] not in image_shapes:
            raise DatasetError(f"dataset {dataset!r}: {path} images must be uint8 with shape "
                               f"(N, {', '.join(map(str, image_shapes[0]))}), got {x.dtype} {x.shape}.")
    return tuple(x.reshape(-1, *image_shapes[0]) if i % 2 == 0 else x for i, x in enumerate(arrays))


def _read_idx(path: str, expected_magic: int, item_shape: tuple) -> np.ndarray:
    """Parses an IDX file of unsigned bytes (big-endian header), validating it."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise DatasetError(f"mnist: cannot read {path} ({e}); re-download the file.") from e
    # Magic: two zero bytes, a dtype code (0x08 = uint8), the number of dimensions.
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if magic != expected_magic:
        raise DatasetError(f"mnist: {path} is not an IDX {'image' if expected_magic == 2051 else 'label'}"
                           f" file: magic number {magic} != {expected_magic} (corrupt, still "
                           f"compressed, or a different file?); re-download it.")
    header = 4 + 4 * (expected_magic & 0xFF)  # Low magic byte = number of dimensions.
    dims = tuple(int(v) for v in np.frombuffer(raw[4:header], ">u4")) if len(raw) >= header else ()
    data = np.frombuffer(raw[header:], np.uint8)
    if not dims or dims[1:] != item_shape or data.size != int(np.prod(dims)):
        raise DatasetError(f"mnist: {path} has header dims {dims} and {data.size} data bytes; "
                           f"expected (N, {', '.join(map(str, item_shape))}) items with N*"
                           f"{int(np.prod(item_shape))} bytes (truncated file?); re-download it.")
    return data.reshape(dims)


def mnist_files(data_dir: str) -> tuple:
    """``(mnist.npz, None)`` when data_dir holds it, else ``(None, the four IDX paths)``; refused naming
    the files when neither is complete."""
    npz = os.path.join(data_dir, "mnist.npz")
    if os.path.isfile(npz):
        return npz, None
    paths, missing = [], []
    for base in _MNIST_IDX:
        plain = os.path.join(data_dir, base)
        found = [p for p in (plain, plain + ".gz") if os.path.isfile(p)]
        paths.append(found[0] if found else None)
        missing += [] if found else [plain + "[.gz]"]
    if missing:
        raise DatasetError(
            f"dataset 'mnist': found neither {npz} nor {', '.join(missing)}. Set "
            f"--config.dataset.data_dir=DIR to a folder containing mnist.npz (keys x_train, "
            f"y_train, x_test, y_test) or the four IDX files {', '.join(_MNIST_IDX)} "
            f"(each optionally .gz).")
    return None, paths


def _mnist(data_dir: str) -> Dataset:
    """MNIST from data_dir/mnist.npz, else the four IDX files (optionally .gz)."""
    npz, paths = mnist_files(data_dir)
    if npz:
        arrays = _load_npz("mnist", npz, ((28, 28, 1), (28, 28)))
    else:
        arrays = tuple(_read_idx(p, 2051, (28, 28))[..., None] if "images" in p
                       else _read_idx(p, 2049, ()) for p in paths)
    x_train, y_train, x_test, y_test = arrays
    return Dataset("mnist", _split("mnist", "train", x_train, y_train, 10, 255.0),
                   _split("mnist", "test", x_test, y_test, 10, 255.0), 10)


def _read_cifar_bin(path: str) -> tuple:
    """Parses CIFAR-10 binary records: 1 label byte + 3072 bytes of CHW pixels."""
    raw = np.fromfile(path, np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise DatasetError(f"cifar10: {path} has {raw.size} bytes, not a positive multiple "
                           f"of 3073 (1 label + 3x32x32 pixels); re-download the binary version.")
    records = raw.reshape(-1, 3073)
    return records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), records[:, 0]


def cifar10_files(data_dir: str) -> tuple:
    """``(cifar10.npz, None)`` when data_dir holds it, else ``(None, the folder of the binary batches)``
    (data_dir or data_dir/cifar-10-batches-bin); refused naming the files when neither is complete."""
    npz = os.path.join(data_dir, "cifar10.npz")
    if os.path.isfile(npz):
        return npz, None
    dirs = (data_dir, os.path.join(data_dir, "cifar-10-batches-bin"))
    folder = next((d for d in dirs if all(os.path.isfile(os.path.join(d, f)) for f in _CIFAR_BINS)), None)
    if folder is None:
        raise DatasetError(
            f"dataset 'cifar10': found neither {npz} nor all of {', '.join(_CIFAR_BINS)} "
            f"in {dirs[0]} or {dirs[1]}. Set --config.dataset.data_dir=DIR to a folder "
            f"containing cifar10.npz (keys x_train, y_train, x_test, y_test; uint8 NHWC) "
            f"or the extracted CIFAR-10 binary version (cifar-10-binary.tar.gz)." + download_hint("cifar10", data_dir))
    return None, folder


def _cifar10(data_dir: str) -> Dataset:
    """CIFAR-10 from data_dir/cifar10.npz, else the binary-version batch files."""
    npz, folder = cifar10_files(data_dir)
    if npz:
        x_train, y_train, x_test, y_test = _load_npz("cifar10", npz, ((32, 32, 3),))
    else:
        parts = [_read_cifar_bin(os.path.join(folder, f)) for f in _CIFAR_BINS]
        x_train = np.concatenate([x for x, _ in parts[:5]])
        y_train = np.concatenate([y for _, y in parts[:5]])
        x_test, y_test = parts[5]
    return Dataset("cifar10", _split("cifar10", "train", x_train, y_train, 10, 255.0),
                   _split("cifar10", "test", x_test, y_test, 10, 255.0), 10)


# The readers the image sources of dtx.data.images share (one parser per format, one set of refusals).
load_npz, read_idx, CIFAR_BINS = _load_npz, _read_idx, _CIFAR_BINS


def token_windows(tokens: np.ndarray, seq_len: int) -> Split:
    """A 1-D token stream as next-token examples: ``inputs[i] = tokens[i*T : i*T+T]``,
    ``labels[i] = tokens[i*T+1 : i*T+T+1]`` (T = seq_len), non-overlapping.

    Both are strided *views* of ``tokens`` (no copy), so a memory-mapped token file
    (``np.load("tokens.npy", mmap_mode="r")``) stays on disk: only the rows of each
    batch are read. The tail that does not fill a window is left out.
    """
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DatasetError(f"token_windows needs a 1-D array of integer token ids, got {tokens.dtype} "
                           f"{tokens.shape}; flatten it or encode the text first")
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise DatasetError(f"seq_len={seq_len!r} must be a positive int (tokens per example)")
    count = (len(tokens) - 1) // seq_len
    if count < 1:
        raise DatasetError(f"{len(tokens)} tokens do not fill one window of seq_len={seq_len} plus its next "
                           "token; use a shorter seq_len or more text")
    windows = np.lib.stride_tricks.sliding_window_view
    return Split(inputs=windows(tokens[:-1], seq_len)[::seq_len][:count],
                 labels=windows(tokens[1:], seq_len)[::seq_len][:count])


def python_docs_text() -> str:
    """The Python documentation topics bundled with CPython (``pydoc_data.topics``: the language
    reference pages ``help('topics')`` shows), sorted by topic and joined: ~465 kB on Python 3.11.
    The text, and so every figure trained on it, differs a little between Python versions."""
    try:
        from pydoc_data.topics import topics  # Lazy: only this source needs it.
    except ImportError as e:  # pragma: no cover - stripped Python builds
        raise DatasetError("dataset 'python_docs' needs the standard library's pydoc_data package, which this "
                           f"Python lacks ({e}); use another dataset or a full CPython") from e
    return "\n\n".join(topics[key] for key in sorted(topics))


def _python_docs(seq_len: int) -> Dataset:
    """Byte-level language modelling: UTF-8 bytes (256 classes), last 10% of the text held out."""
    tokens = np.frombuffer(python_docs_text().encode("utf-8"), np.uint8).astype(np.int32)
    cut = len(tokens) * 9 // 10
    train, test = token_windows(tokens[:cut], seq_len), token_windows(tokens[cut:], seq_len)
    # Contiguous copies: the windows are views of one array, cheap to keep but slow to gather.
    return Dataset("python_docs", Split(np.ascontiguousarray(train.inputs), np.ascontiguousarray(train.labels)),
                   Split(np.ascontiguousarray(test.inputs), np.ascontiguousarray(test.labels)), 256,
                   tokenizer_lib.Tokenizer().token_bytes)


def split_text(text: str) -> tuple[str, str]:
    """``text`` as (train, test): the last 10% of its UTF-8 bytes held out, as the byte-level datasets cut it,
    the cut moved forward to the next character boundary (UTF-8 continuation bytes are 0b10xxxxxx)."""
    raw = text.encode("utf-8")
    cut = len(raw) * 9 // 10
    while cut < len(raw) and raw[cut] & 0xC0 == 0x80:
        cut += 1
    return raw[:cut].decode("utf-8"), raw[cut:].decode("utf-8")


def text_dataset(name: str, text: str, seq_len: int, vocab_size: int, folder: str) -> Dataset:
    """Language modelling on ``text`` with a byte-level BPE of ``vocab_size`` ids trained on its training split
    (:func:`split_text`): tokenizer and ids cached in ``folder`` and read memory-mapped
    (:mod:`dtx.data.tokenizer`), windows of ``seq_len`` ids cut as the byte-level ones (:func:`token_windows`),
    gathered as int32 like them."""
    train_text, test_text = split_text(text)
    tokenizer = tokenizer_lib.bpe(train_text, vocab_size, folder, name)
    splits = []
    for split, part in (("train", train_text), ("test", test_text)):
        windows = token_windows(tokenizer_lib.token_ids(tokenizer, part, split), seq_len)
        splits.append(Split(Rows(windows.inputs, np.int32), Rows(windows.labels, np.int32)))
    return Dataset(name, *splits, tokenizer.vocab_size, tokenizer.token_bytes)
