"""A tiny byte-level transformer language model on the Python documentation that ships with Python.

The corpus is ``pydoc_data.topics`` — the language-reference pages ``help('topics')`` prints,
bundled with CPython, so it works offline: ~465 kB of English and code on Python 3.11 (the text,
and so the figures, differ a little between Python versions). Tokens are UTF-8 bytes (256 ids);
examples are non-overlapping windows of ``dataset.seq_len`` bytes, each label the next byte; the
last 10% of the text is the test split (``dtx/data/datasets.py``: ``python_docs``). The model is
``models/transformer.py``: 2 pre-LayerNorm blocks, width 64, 4 heads, 0.14 M parameters; the task
``next_token`` (token-level cross-entropy); the final record holds ``perplexity`` (exp of the mean
test loss per byte; a uniform guess over 256 bytes scores 256).

Launch (8 emulated CPU devices; any driver, strategy or compressor that applies):

    dtx train experiments/tiny_lm.py
    dtx train experiments/tiny_lm.py --config.driver=jit
    dtx train experiments/tiny_lm.py --config.strategy.name=local_sgd --config.strategy.period=4
    dtx train experiments/tiny_lm.py --config.compression.name=topk --config.compression.fraction=0.1
    dtx train experiments/tiny_lm.py --config.dataset.tokenizer=bpe --config.dataset.vocab_size=512

Expected (300 steps of 64 windows, about a minute on 2 cores): test perplexity 8.07 per byte on the
shard_map and jit drivers (the same numbers; a uniform guess scores 256, byte frequencies 25.7);
9.29 with local SGD (H = 4), 8.80 with top-k 10%, 8.94 with PowerSGD rank 4 (BENCHMARKS.md). The final
record's ``test_bits_per_byte`` compares tokenizers: 3.0122 with bytes (test loss 2.0879 / ln 2), 2.2966 with
a byte-level BPE of 512 ids trained on the training split (``dataset.tokenizer=bpe``: test loss 3.5967,
perplexity 36.48 per token, 2.26 bytes per token; docs/tasks_and_data.md).
"""

from ml_collections import ConfigDict

from dtx.config import base_config


def get_config():
    config = base_config()
    config.dataset.name = "python_docs"
    config.dataset.seq_len = 64
    config.task.name = "next_token"
    config.model = ConfigDict(dict(name="transformer", num_layers=2, d_model=64, num_heads=4, mlp_ratio=4,
                                   max_len=64, dropout_rate=0.0))
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 3e-3
    config.optimizer.weight_decay = 0.01
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_steps = 20
    config.global_batch_size = 64
    config.eval_batch_size = 256
    config.num_steps = 300
    config.log_every = 25
    return config
