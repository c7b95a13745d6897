"""Tokenizers of text datasets: UTF-8 bytes, or a byte-level BPE trained on the corpus at hand.

``dataset.tokenizer`` chooses (:data:`TOKENIZERS`):

* ``bytes`` (the default): every UTF-8 byte is a token, 256 ids; nothing is trained or cached.
* ``bpe``: byte-pair encoding (Sennrich, Haddow, Birch, *Neural Machine Translation of Rare Words
  with Subword Units*, ACL 2016, arXiv 1508.07909) over bytes, as GPT-2 does it (Radford et al.,
  *Language Models are Unsupervised Multitask Learners*, 2019, §2.2): the alphabet is the 256 bytes,
  so any text encodes with no unknown token and decodes back exactly; the text is first split by
  GPT-2's pattern (words, numbers, punctuation, whitespace runs) so merges never cross those;
  ``dataset.vocab_size`` ids in all: :data:`SPECIALS` (id 0, never produced by ``encode``), the 256
  bytes, then the merges learned from the training split, most frequent pair first. Trained with
  Hugging Face ``tokenizers`` (its ``BpeTrainer``, written in Rust; deterministic for a given text
  and vocabulary size).

Both are computed once and cached (:func:`bpe`, :func:`token_ids`): the tokenizer as
``<corpus>-bpe<V>-<hash of the training text>.tokenizer.json`` and each split's ids as
``<that stem>.<split>-<hash of the split's text>.npy``, so a changed corpus or vocabulary gets a
tokenizer and ids of its own and nothing stale is read back. Each file is written to a temporary
name in the same folder and renamed into place, so processes that start together (the ranks of one
job) never see a half-written file; two that both train write the same bytes. Ids are ``uint16``
while the vocabulary fits (≤ 65536 ids), else ``uint32``, and are read back memory-mapped
(``np.load(..., mmap_mode="r")``), so a corpus larger than memory stays on disk.

:attr:`Tokenizer.token_bytes` is how many bytes of text each id spells: what bits per byte are
counted against (``test_bits_per_byte``, :func:`dtx.data.tasks.count_bytes`). A byte-level BPE token
is a byte string, written in its vocabulary one character per byte (GPT-2's byte-to-character map),
so its length there is its byte count; the special token spells none. Decoding ids concatenates
those byte strings, so the bytes of any run of ids is the sum of its entries.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable

import numpy as np

TOKENIZERS: tuple[str, ...] = ("bytes", "bpe")
SPECIALS: tuple[str, ...] = ("<|endoftext|>",)  # GPT-2's document separator; ids 0.. of a BPE vocabulary
MIN_BPE_VOCAB = len(SPECIALS) + 256  # the specials and the byte alphabet, before any merge
ENV = "DTX_DATA_CACHE"  # where tokenizers and ids of data without a data_dir are cached (default below)


class TokenizerError(ValueError):
    """A tokenizer setting that cannot work, or a cache that cannot be written; the message names the fix."""


class Tokenizer:
    """Text <-> token ids, and the bytes each id spells.

    Attributes:
      name: ``bytes`` or ``bpe``.
      vocab_size: ids ``0 .. vocab_size - 1`` (the model's ``num_classes``).
      token_bytes: int32 ``(vocab_size,)``: the UTF-8 bytes id ``i`` spells.
      path: the cached tokenizer file (``""`` for ``bytes``).
    """

    name = "bytes"
    path = ""

    def __init__(self):
        self.vocab_size = 256
        self.token_bytes = np.ones(256, np.int32)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """A trained byte-level BPE (``tokenizers.Tokenizer``), loaded from or saved to :attr:`path`."""

    name = "bpe"

    def __init__(self, hf, path: str = ""):
        self.hf, self.path = hf, path
        self.vocab_size = hf.get_vocab_size()
        self.token_bytes = np.array([0 if token in SPECIALS else len(token)
                                     for token in map(hf.id_to_token, range(self.vocab_size))], np.int32)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.hf.encode(text).ids, np.int32)

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])


def check_settings(tokenizer: str, vocab_size: int, dataset: str, text_datasets: tuple[str, ...]) -> None:
    """The ``dataset.tokenizer`` / ``dataset.vocab_size`` pair, before any work: refused by key with the fix."""
    if tokenizer not in TOKENIZERS:
        raise TokenizerError(f"dataset.tokenizer={tokenizer!r} is unknown; choose one of {', '.join(TOKENIZERS)} "
                             "(bytes: UTF-8 bytes, 256 ids; bpe: a byte-level BPE trained on the training split, "
                             "with --config.dataset.vocab_size=N)")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)):
        raise TokenizerError(f"dataset.vocab_size={vocab_size!r} must be an int (ids of the BPE vocabulary; 0 with "
                             "dataset.tokenizer=bytes)")
    if tokenizer != "bpe" and vocab_size:
        raise TokenizerError(f"dataset.vocab_size={vocab_size} is set but dataset.tokenizer={tokenizer!r} has a "
                             "fixed vocabulary (256 bytes); add --config.dataset.tokenizer=bpe to train one of "
                             "that size, or leave dataset.vocab_size at 0")
    if tokenizer == "bpe" and vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(f"dataset.vocab_size={vocab_size} is too small for dataset.tokenizer=bpe: it needs "
                             f"{MIN_BPE_VOCAB} ids before any merge ({len(SPECIALS)} special, 256 bytes); set "
                             f"--config.dataset.vocab_size to at least {MIN_BPE_VOCAB}, e.g. 512 or 4096")
    if tokenizer != "bytes" and dataset not in text_datasets:
        raise TokenizerError(f"dataset.tokenizer={tokenizer!r} applies to the text datasets "
                             f"({', '.join(text_datasets)}), not dataset.name={dataset!r}; choose one of those or "
                             "leave dataset.tokenizer at bytes (your own token ids need no tokenizer here)")


def default_cache_dir() -> str:
    """Where tokenizers and ids are cached when the data has no folder of its own (``dataset.data_dir``
    empty): ``$DTX_DATA_CACHE``, else ``$XDG_CACHE_HOME/dtx/tokens`` or ``~/.cache/dtx/tokens``."""
    if os.environ.get(ENV):
        return os.path.expanduser(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dtx", "tokens")


def text_hash(text: str) -> str:
    """16 hex digits of the text's SHA-256: what a cached file's name carries."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def train_bpe(text: str, vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of ``vocab_size`` ids trained on ``text`` (not cached; :func:`bpe` caches)."""
    from tokenizers import Tokenizer as HFTokenizer  # Lazy: only bpe needs the library.
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    # No prefix space: decode(encode(x)) == x exactly, the text's first word included.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([text], trainer=trainer)
    return BPETokenizer(hf)


def bpe(train_text: str, vocab_size: int, folder: str, corpus: str) -> BPETokenizer:
    """The byte-level BPE of ``vocab_size`` ids for ``train_text``: read from ``folder`` when it was trained
    before, else trained (:func:`train_bpe`) and saved there."""
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(folder, f"{corpus}-bpe{vocab_size}-{text_hash(train_text)}.tokenizer.json")
    if os.path.isfile(path):
        return BPETokenizer(HFTokenizer.from_file(path), path)
    tokenizer = train_bpe(train_text, vocab_size)
    if tokenizer.vocab_size != vocab_size:  # too little text to learn that many merges
        raise TokenizerError(f"dataset.vocab_size={vocab_size}: the training text ({len(train_text)} characters) "
                             f"has pairs for only {tokenizer.vocab_size} ids; lower --config.dataset.vocab_size "
                             f"to at most {tokenizer.vocab_size} or train on more text")
    _write_atomic(path, lambda file: file.write(tokenizer.hf.to_str().encode("utf-8")))
    tokenizer.path = path
    return tokenizer


def token_ids(tokenizer: Tokenizer, text: str, split: str) -> np.ndarray:
    """``tokenizer.encode(text)`` as a read-only memory-mapped array, encoded once and cached beside the
    tokenizer's file (``<its stem>.<split>-<hash of text>.npy``)."""
    if not tokenizer.path:
        raise TokenizerError(f"token_ids caches ids beside the tokenizer's file, but this {tokenizer.name} tokenizer "
                             "has none; get it from bpe(train_text, vocab_size, folder, corpus), which saves it")
    stem = tokenizer.path.removesuffix(".tokenizer.json")
    path = f"{stem}.{split}-{text_hash(text)}.npy"
    if not os.path.isfile(path):
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
        ids = tokenizer.encode(text).astype(dtype)
        _write_atomic(path, lambda file: np.save(file, ids, allow_pickle=False))
    return np.load(path, mmap_mode="r")


def _write_atomic(path: str, write: Callable) -> None:
    """``write(file)`` into a temporary file beside ``path``, then renamed over it: readers see the whole file
    or none, and two writers of the same bytes leave one."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    except OSError as e:
        raise TokenizerError(f"cannot write the tokenizer cache in {folder!r} ({e.strerror}); set "
                             f"--config.dataset.data_dir to a writable folder (or ${ENV})") from None
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide a shared cache from the other users
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
