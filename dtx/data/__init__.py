"""What the workers learn from: data sets, the loader, your own data, and tasks (loss + metrics).

Batches are a function of ``(seed, step)`` (:mod:`dtx.data.loader`), so a resumed run sees the same
ones; built-in data sets (:mod:`dtx.data.datasets`) and the tokenizers of text
(:mod:`dtx.data.tokenizer`), your arrays and memory-mapped files (:mod:`dtx.data.userdata`), image
files read through grain with augmentation (:mod:`dtx.data.images`, :mod:`dtx.data.inputs`), and what
is scored how (:mod:`dtx.data.tasks`).
"""

from __future__ import annotations

from dtx.data import datasets, images, inputs, tasks, tokenizer, userdata  # noqa: F401
from dtx.data.loader import (  # noqa: F401
    Batch, DataError, EvalBatches, TrainLoader, epoch_permutation, eval_batches,
)
