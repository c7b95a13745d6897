"""Your data: arrays in memory or memory-mapped files, trained by ``dtx.train(..., data=...)``.

dtx's batches are a pure function of ``(seed, step)`` (:mod:`dtx.data`): epoch ``e``
visits the examples in the order ``permutation(seed, e)`` and step ``s`` gathers
its rows *by index*. Nothing else is needed from a data source, so any numpy array
serves, and a memory-mapped one (``np.load(path, mmap_mode="r")``, ``np.memmap``)
trains a dataset larger than memory: each step reads only its own rows from disk,
and a resumed run reads exactly the rows an uninterrupted one would.

``data`` may be:

* ``(inputs, labels)``, ``{"inputs": ..., "labels": ...}`` or a :class:`dtx.data.datasets.Split`:
  the training split, no evaluation;
* ``{"train": <one of those>, "test": <one of those>}``, optionally with
  ``"num_classes"`` (the model's output width when the model comes from the config;
  default: ``max(label) + 1`` for integer labels, the target width for float ones) and, for token
  ids, ``"token_bytes"`` (the UTF-8 bytes each id spells: evaluation then records
  ``test_bits_per_byte``);
* a :class:`dtx.data.datasets.Dataset`.

Or by name, from the shell: ``--config.dataset.name=package.module:function`` names your function that
returns any of those (:func:`load_source`); its keyword parameters become settings of the ``dataset`` block
(``data_dir`` and ``seq_len`` are the block's own; ``seed`` is given ``config.seed``).

Arrays may also be array-like readers of other formats: anything with ``len()``, ``shape``,
``dtype`` and ``[indices]`` / ``[start:stop]`` returning those rows as numpy (:class:`Rows` is one).

Memory: the index permutation costs 8 bytes per example and a gathered batch its own
size; nothing else grows with the data. Pass ``num_classes`` with memory-mapped
integer labels to skip the scan for their maximum. Arrays of 64-bit dtypes are read
as 32-bit (JAX's default), batch by batch.
"""

from __future__ import annotations

import hashlib
import inspect
import mmap
from collections.abc import Mapping

import numpy as np

from dtx.config import ConfigError, base_config, is_import_path, parameters, register_check, register_family, resolve
from dtx.data.datasets import Dataset, Rows, Split  # noqa: F401 - Rows: read as dtx.data.userdata.Rows too
from dtx.data.tasks import Task, TaskError

_NARROW = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32),
           np.dtype(np.uint64): np.dtype(np.uint32)}


class DataError(ValueError):
    """Arrays that cannot be trained as given; the message says what to change."""



def as_dataset(data, task: Task | None, name: str = "user") -> Dataset:
    """``data`` (see the module docstring) as a :class:`Dataset`, checked against ``task`` (``None``: unchecked).

    Raises :class:`DataError` (or :class:`dtx.data.tasks.TaskError`) naming the array and the fix,
    before anything is compiled.
    """
    token_bytes = None  # text: the bytes each token id spells (bits per byte at evaluation)
    if isinstance(data, Dataset):
        train, test, num_classes, name = data.train, data.test, data.num_classes, data.name
        token_bytes = data.token_bytes
    elif isinstance(data, Mapping) and "train" in data:
        unknown = sorted(set(data) - {"train", "test", "num_classes", "token_bytes"})
        if unknown:
            raise DataError(f"data has unknown key(s) {unknown}; use 'train', 'test' and optionally 'num_classes' "
                            "and 'token_bytes'")
        train, test, num_classes = data["train"], data.get("test"), data.get("num_classes")
        token_bytes = data.get("token_bytes")
    else:
        train, test, num_classes = data, None, None
    train = _split(train, "train")
    test = None if test is None else _split(test, "test")
    if test is not None and test.inputs.shape[1:] != train.inputs.shape[1:]:
        raise DataError(f"data: test inputs have shape {test.inputs.shape[1:]} per example but train inputs "
                        f"{train.inputs.shape[1:]}; both splits must hold examples of the same shape")
    for what, split in (("train", train), ("test", test)):
        if split is not None and task is not None and task.check is not None:
            try:
                task.check(split.labels.shape, split.labels.dtype)
            except TaskError as e:
                raise TaskError(f"data['{what}'] labels: {e}") from None
    if num_classes is None:
        num_classes = _output_width(train, test)
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise DataError(f"data['num_classes']={num_classes!r} must be a positive int (the model's output width)")
    if token_bytes is not None:
        token_bytes = np.asarray(token_bytes)
        if token_bytes.shape != (num_classes,) or not np.issubdtype(token_bytes.dtype, np.integer):
            raise DataError(f"data['token_bytes'] must hold one int per token id, shape ({num_classes},) "
                            f"(num_classes), got {token_bytes.dtype} {token_bytes.shape}; give the UTF-8 bytes "
                            "each id spells (dtx.data.tokenizer.Tokenizer.token_bytes), or leave it out")
    return Dataset(name, train, test, int(num_classes), token_bytes)


def _split(part, what: str) -> Split:
    if isinstance(part, Split):
        inputs, labels = part.inputs, part.labels
    elif isinstance(part, Mapping):
        missing = [k for k in ("inputs", "labels") if k not in part]
        if missing:
            raise DataError(f"data['{what}'] lacks {missing}; give {{'inputs': array, 'labels': array}}")
        inputs, labels = part["inputs"], part["labels"]
    elif isinstance(part, (tuple, list)) and len(part) == 2:
        inputs, labels = part
    else:
        raise DataError(f"data['{what}'] is a {type(part).__name__}; give (inputs, labels), "
                        "{'inputs': ..., 'labels': ...} or a dtx.data.datasets.Split")
    inputs, labels = _array(inputs, what, "inputs"), _array(labels, what, "labels")
    if len(inputs) != len(labels):
        raise DataError(f"data['{what}']: {len(inputs)} inputs but {len(labels)} labels; they must pair up row by row")
    if not len(inputs):
        raise DataError(f"data['{what}'] is empty; give at least one example")
    return Split(inputs, labels)


def _array(x, what: str, key: str):
    if not isinstance(x, np.ndarray) and all(hasattr(x, a) for a in ("shape", "dtype", "__getitem__", "__len__")):
        # Array-like rows from elsewhere (Rows, a reader of another file format): read by index, never whole.
        dtype = np.dtype(x.dtype)
        return Rows(x, _NARROW[dtype]) if dtype in _NARROW else x
    x = x if isinstance(x, np.ndarray) else np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise DataError(f"data['{what}'] {key} have dtype {x.dtype}; give numbers (float or int arrays)")
    if x.ndim < 1:
        raise DataError(f"data['{what}'] {key} is a scalar; give an array with one row per example")
    if x.dtype == np.bool_:
        return Rows(x, np.int32)
    if x.dtype in _NARROW:  # JAX computes in 32 bits by default: convert rows as they are read
        return x.astype(_NARROW[x.dtype]) if _in_memory(x) else Rows(x, _NARROW[x.dtype])
    return x


def _in_memory(x: np.ndarray) -> bool:
    while isinstance(x, np.ndarray):
        if isinstance(x, np.memmap):
            return False
        x = x.base
    return not isinstance(x, mmap.mmap)


def _output_width(train: Split, test: Split | None) -> int:
    """``max(label) + 1`` for integer labels (read in chunks: bounded memory for memory-mapped
    labels), else the number of target values per example."""
    labels = [s.labels for s in (train, test) if s is not None]
    if not np.issubdtype(labels[0].dtype, np.integer):
        return int(np.prod(labels[0].shape[1:], dtype=np.int64)) or 1
    top, chunk = -1, 1 << 16
    for array in labels:
        for start in range(0, len(array), chunk):
            rows = np.asarray(array[start:start + chunk])
            top = max(top, int(rows.max()))
            if rows.min() < 0:
                raise DataError(f"integer labels must be >= 0 (class or token ids), found {int(rows.min())}; "
                                "for padding in next-token labels set task pad_id and use ids >= 0")
    return top + 1


def fingerprint(dataset: Dataset) -> str:
    """Shapes, dtypes and a digest of up to 16 evenly spaced rows of each array: enough to tell one
    dataset from another at resume without reading a larger-than-memory file."""
    digest = hashlib.sha256()
    for split in (dataset.train, dataset.test):
        if split is None:
            continue
        for array in (split.inputs, split.labels):
            digest.update(f"{array.shape}{np.dtype(array.dtype).str}".encode())
            for row in np.unique(np.linspace(0, len(array) - 1, 16).astype(np.int64)):
                digest.update(np.ascontiguousarray(array[int(row)]).tobytes())
    return digest.hexdigest()[:16]


def describe(dataset: Dataset) -> str:
    """One line for the records: each split's shapes and dtypes."""
    parts = []
    for what, split in (("train", dataset.train), ("test", dataset.test)):
        if split is not None:
            parts.append(f"{what} inputs {tuple(split.inputs.shape)} {np.dtype(split.inputs.dtype).name}, "
                         f"labels {tuple(split.labels.shape)} {np.dtype(split.labels.dtype).name}")
    return "; ".join(parts)


def check_resume(saved: dict, current: str | None) -> None:
    """Refuse to resume a checkpoint trained on other data (its fingerprint differs)."""
    before = saved.get("user_data")
    if before != current:
        was = f"data with fingerprint {before}" if before else "the config's dataset"
        now = f"data with fingerprint {current}" if current else "the config's dataset"
        raise DataError(f"cannot resume: the checkpoint was trained on {was} but this run has {now}; pass the "
                        "same data= (same arrays, same order) or train into a new workdir")


# ------------------------------------------------------------------ your data source by import path
_SUPPLIED = ("seed",)  # given by dtx (config.seed), never a setting of the block


def source_settings(name: str) -> dict:
    """Your data function ``package.module:function``'s settings with their defaults (keys of the dataset block)."""
    return parameters(_source(name), f"dataset.name={name!r}", supplied=_SUPPLIED)


def load_source(block, *, seed: int) -> Dataset:
    """The data of ``dataset.name=package.module:function``: the function called with the block's values of its
    settings (and ``seed``), its arrays or :class:`Dataset` read as :func:`as_dataset` reads ``data=``."""
    function = _source(block.name)
    settings = {key: block[key] for key in source_settings(block.name) if key in block}
    if "seed" in inspect.signature(function).parameters:
        settings["seed"] = seed
    try:
        data = function(**settings)
    except (ValueError, TypeError, OSError) as e:
        raise DataError(f"dataset.name={block.name!r} failed: {type(e).__name__}: {e}") from None
    return as_dataset(data, None, name=block.name)


def _source(name: str):
    function = resolve(name, "dataset.name")
    if not callable(function):
        raise ConfigError(f"dataset.name={name!r} is {type(function).__name__} {function!r}; name a function that "
                          "returns arrays ({'train': (inputs, labels), 'test': ...}) or a dtx.data.datasets.Dataset")
    return function


@register_check
def check_source(config) -> None:
    """``dataset.name=package.module:function`` resolves, and the block's own keys it does not take
    (``data_dir``, ``seq_len``) are left at their defaults."""
    block = config.dataset
    if not is_import_path(block.name):
        return
    takes, defaults = source_settings(block.name), base_config().dataset
    changed = [key for key in ("data_dir", "seq_len") if key not in takes and block[key] != defaults[key]]
    if changed:
        raise ConfigError(f"dataset.{changed[0]}={block[changed[0]]!r} does not reach dataset.name={block.name!r}, "
                          f"which takes {', '.join(takes) or 'no settings'}; leave dataset.{changed[0]} at its "
                          f"default {defaults[changed[0]]!r} or add a parameter {changed[0]} to the function")


register_family("dataset", source_settings, replaces=False)  # dataset.name=package.module:function adds its settings
