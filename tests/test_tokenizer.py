"""Tokenizers of text datasets (dtx.data.tokenizer): the byte-level BPE round-trips any text, is trained once
per corpus and vocabulary and cached (a changed corpus or vocabulary retrains), its ids are memory-mapped and
equal a direct encode, its windows feed the model as the byte windows do; bits per byte against numpy from
per-token losses and byte counts (and exactly test_loss / ln 2 for bytes); refusals by key.

A small corpus (a few kB, non-ASCII included) and vocabularies of 300 and 320 keep it fast; no network.
Tolerances: float32 log-softmax sums against float64 numpy, rtol 1e-5.
"""

import math
import os

import numpy as np
import pytest

import dtx
from dtx import config as config_lib
from dtx import models
from dtx.data import datasets, tasks
from dtx.data import tokenizer as tokenizer_lib
from dtx.experiments import tiny_lm

CORPUS = "".join(
    f"def f{i}(x):\n    return x * {i} + {i % 7}  # café naïve — ∑ 日本語 🎉\n\n"
    f"The value of f{i} grows with x; résumé line {i}.\t(tab)  spaces   here\n" for i in range(120))
VOCAB = 300


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return tokenizer_lib.bpe(CORPUS, VOCAB, str(tmp_path_factory.mktemp("cache")), "corpus")


def test_bpe_round_trips_text_exactly_and_spells_its_bytes(bpe):
    assert bpe.vocab_size == VOCAB and bpe.path.endswith(f"corpus-bpe{VOCAB}-{tokenizer_lib.text_hash(CORPUS)}"
                                                         ".tokenizer.json")
    unseen = ["  leading spaces, ünïcödé, 中文, emoji 🙂🎉 and a\r\nCRLF\tend ", "x", "", "\n\n\n", "€" * 5]
    for text in [CORPUS] + unseen:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        # The bytes the ids spell are the text's UTF-8 bytes: what bits per byte count.
        assert int(bpe.token_bytes[ids].sum()) == len(text.encode("utf-8"))
    assert len(bpe.encode(CORPUS)) < 0.7 * len(CORPUS.encode("utf-8"))  # merges were learned and used
    assert bpe.token_bytes[0] == 0 and bpe.hf.id_to_token(0) == tokenizer_lib.SPECIALS[0]
    byte = tokenizer_lib.Tokenizer()
    assert byte.decode(byte.encode(CORPUS)) == CORPUS and byte.vocab_size == 256


def test_cache_is_reused_and_a_changed_corpus_or_vocabulary_retrains(tmp_path, monkeypatch):
    folder = str(tmp_path)
    first = tokenizer_lib.bpe(CORPUS, VOCAB, folder, "corpus")
    ids = tokenizer_lib.token_ids(first, CORPUS, "train")
    stamps = {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}
    trained = []
    real_train = tokenizer_lib.train_bpe
    monkeypatch.setattr(tokenizer_lib, "train_bpe", lambda *a: trained.append(a) or real_train(*a))

    again = tokenizer_lib.bpe(CORPUS, VOCAB, folder, "corpus")
    np.testing.assert_array_equal(tokenizer_lib.token_ids(again, CORPUS, "train"), ids)
    assert not trained and again.path == first.path and again.hf.to_str() == first.hf.to_str()
    assert {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)} == stamps

    changed = tokenizer_lib.bpe(CORPUS + "more text", VOCAB, folder, "corpus")
    bigger = tokenizer_lib.bpe(CORPUS, VOCAB + 20, folder, "corpus")
    assert len(trained) == 2 and len({first.path, changed.path, bigger.path}) == 3
    assert bigger.vocab_size == VOCAB + 20
    assert not [n for n in os.listdir(folder) if n.startswith(".tmp-")]  # written by rename, nothing left over


def test_memmapped_ids_equal_a_direct_encode(bpe):
    ids = tokenizer_lib.token_ids(bpe, CORPUS, "train")
    assert isinstance(ids, np.memmap) and ids.dtype == np.uint16 and not ids.flags.writeable
    np.testing.assert_array_equal(ids, bpe.hf.encode(CORPUS).ids)
    with pytest.raises(tokenizer_lib.TokenizerError, match=r"has none; get it from bpe\("):
        tokenizer_lib.token_ids(tokenizer_lib.Tokenizer(), CORPUS, "train")  # no file to cache beside


def test_bpe_windows_feed_as_byte_windows_do(tmp_path):
    dataset = datasets.text_dataset("corpus", CORPUS, 16, VOCAB, str(tmp_path))
    train_text, test_text = datasets.split_text(CORPUS)
    assert train_text + test_text == CORPUS and dataset.num_classes == VOCAB
    tokenizer = tokenizer_lib.bpe(train_text, VOCAB, str(tmp_path), "corpus")
    for split, text in ((dataset.train, train_text), (dataset.test, test_text)):
        stream = tokenizer.encode(text)
        count = (len(stream) - 1) // 16
        assert split.inputs.shape == split.labels.shape == (count, 16)
        rows = np.arange(count)
        inputs, labels = split.inputs[rows], split.labels[rows]
        assert inputs.dtype == labels.dtype == np.int32  # as the byte windows: the loader cannot tell
        np.testing.assert_array_equal(inputs.reshape(-1), stream[:count * 16])
        np.testing.assert_array_equal(labels.reshape(-1), stream[1:count * 16 + 1])
        assert 0 <= inputs.min() and labels.max() < VOCAB
    np.testing.assert_array_equal(dataset.token_bytes, tokenizer.token_bytes)


def test_python_docs_bpe_through_the_config_block(tmp_path):
    block = config_lib.override(config_lib.base_config(), **{
        "dataset.name": "python_docs", "dataset.tokenizer": "bpe", "dataset.vocab_size": 320,
        "dataset.data_dir": str(tmp_path), "dataset.seq_len": 32}).dataset
    dataset = dtx.data.inputs.load_dataset(block, seed=0)
    assert dataset.num_classes == 320 and dataset.train.inputs.shape[1] == 32
    text = datasets.python_docs_text()
    assert dataset.token_bytes.sum() > 256  # merges spell more than one byte
    # Windows cover the text in order: the first training windows spell the start of the text.
    tokenizer = tokenizer_lib.bpe(datasets.split_text(text)[0], 320, str(tmp_path), "python_docs")  # the cached one
    first = dataset.train.inputs[np.arange(3)].reshape(-1)
    assert text.startswith(tokenizer.decode(first)) and len(tokenizer.decode(first)) > 3 * 32
    byte_level = datasets.load_dataset("python_docs")
    assert byte_level.num_classes == 256 and (byte_level.token_bytes == 1).all()


def _numpy_nats(logits, labels):
    logits = logits.astype(np.float64)
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    return -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]


@pytest.mark.parametrize("vocab, smoothing", [(256, 0.0), (VOCAB, 0.0), (VOCAB, 0.1)])
def test_bits_per_byte_from_per_token_losses_and_byte_counts(vocab, smoothing, bpe):
    """Evaluation's sums over two batches, the last padded with masked examples: bits per byte = total nats of
    the scored tokens / ln 2 / the bytes they spell; with bytes (one each) exactly test_loss / ln 2."""
    token_bytes = tokenizer_lib.Tokenizer().token_bytes if vocab == 256 else bpe.token_bytes
    task = tasks.count_bytes(tasks.next_token(label_smoothing=smoothing), token_bytes)
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(6, 8, vocab)).astype(np.float32) * 3
    labels = rng.integers(0, vocab, (6, 8)).astype(np.int32)
    mask = np.array([True] * 4 + [False] * 2)
    record = tasks.summarize([tasks.eval_sums(task, logits[:3], labels[:3], mask[:3]),
                              tasks.eval_sums(task, logits[3:], labels[3:], mask[3:])], task)
    nats, spelled = _numpy_nats(logits, labels)[mask], token_bytes[labels[mask]]
    assert record["test_bits_per_byte"] == pytest.approx(nats.sum() / math.log(2) / spelled.sum(), rel=1e-5)
    assert record["test_bytes_per_token"] == spelled.sum() / spelled.size  # integer sums: exact
    assert record["perplexity"] == pytest.approx(math.exp(nats.mean()), rel=1e-5)  # still per token
    if vocab == 256:
        assert record["test_bits_per_byte"] == record["test_loss"] / math.log(2)
    # Other data, or a task that does not score tokens: unchanged.
    plain, text = tasks.classification(), tasks.next_token()
    assert tasks.count_bytes(plain, token_bytes) is plain and tasks.count_bytes(text, None) is text


@pytest.mark.parametrize("tokenizer, vocab_size", [("bytes", 0), ("bpe", VOCAB)])
def test_a_run_follows_the_tokenizer_and_records_bits_per_byte(tokenizer, vocab_size, tmp_path):
    """dtx.train on python_docs: the model's vocabulary is the tokenizer's (its embedding table), and the final
    record's bits per byte is the test loss over the bytes the test windows' labels spell."""
    config = config_lib.override(tiny_lm.get_config(), num_steps=2, log_every=1, progress=False,
                                 eval_batch_size=512, **{
                                     "dataset.tokenizer": tokenizer, "dataset.vocab_size": vocab_size,
                                     "dataset.data_dir": str(tmp_path / "data"), "dataset.seq_len": 32,
                                     "optimizer.warmup_steps": 1, "model.num_layers": 1, "model.d_model": 16,
                                     "model.max_len": 32})
    result = dtx.train(config, str(tmp_path / "run"))
    final = result.metrics
    vocab = vocab_size or 256
    assert result.state.params["Embed_0"]["embedding"].shape == (vocab, 16)
    dataset = dtx.data.inputs.load_dataset(config.dataset, seed=0)
    labels = dataset.test.labels[np.arange(len(dataset.test))]
    assert final["test_tokens"] == labels.size
    assert final["test_bytes_per_token"] == dataset.token_bytes[labels].sum() / labels.size
    assert final["test_bits_per_byte"] == pytest.approx(
        final["test_loss"] / math.log(2) / final["test_bytes_per_token"], rel=1e-12)
    if tokenizer == "bytes":
        assert final["test_bits_per_byte"] == final["test_loss"] / math.log(2)


@pytest.mark.parametrize("overrides, match", [
    ({"dataset.tokenizer": "wordpiece"}, r"dataset\.tokenizer='wordpiece' is unknown; choose one of bytes, bpe"),
    ({"dataset.tokenizer": "bpe"}, r"dataset\.vocab_size=0 is too small for dataset\.tokenizer=bpe.*at least 257"),
    ({"dataset.tokenizer": "bpe", "dataset.vocab_size": 256}, r"dataset\.vocab_size=256 is too small.*at least 257"),
    ({"dataset.vocab_size": 512}, r"dataset\.vocab_size=512 is set but dataset\.tokenizer='bytes'.*"
                                  r"--config\.dataset\.tokenizer=bpe"),
    ({"dataset.name": "digits", "dataset.tokenizer": "bpe", "dataset.vocab_size": 512},
     r"dataset\.tokenizer='bpe' applies to the text datasets \(python_docs\), not dataset\.name='digits'"),
])
def test_refusals_by_key_before_any_work(overrides, match, tmp_path):
    config = tiny_lm.get_config()
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.override(config, **{"dataset.data_dir": str(tmp_path), **overrides})
    assert not os.listdir(tmp_path)  # refused before anything was trained or written
    with pytest.raises(tokenizer_lib.TokenizerError, match=match):  # the Python API too
        datasets.load_dataset(overrides.get("dataset.name", "python_docs"), data_dir=str(tmp_path),
                              tokenizer=overrides.get("dataset.tokenizer", "bytes"),
                              vocab_size=overrides.get("dataset.vocab_size", 0))


def test_a_given_model_narrower_than_the_vocabulary_is_refused(tmp_path):
    config = config_lib.override(tiny_lm.get_config(), num_steps=1, progress=False, **{"optimizer.warmup_steps": 0,
        "dataset.tokenizer": "bpe", "dataset.vocab_size": VOCAB, "dataset.data_dir": str(tmp_path / "data")})
    model = models.build_model("transformer", num_classes=256, num_layers=1, d_model=16, num_heads=2,
                                   max_len=64)
    with pytest.raises(config_lib.ConfigError, match=r"model\.num_classes=256 logits but the dataset's tokenizer "
                                                      rf"has {VOCAB} ids \(dataset\.vocab_size\); build it with "
                                                      rf"num_classes={VOCAB}"):
        dtx.train(config, str(tmp_path / "run"), model=model)
