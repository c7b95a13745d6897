"""GPT-2 small's shape (124 M parameters) trained on the Python documentation that ships with Python.

The model is ``models/transformer.py`` at GPT-2 small's size (Radford et al. 2019): 12 pre-LayerNorm blocks,
width 768, 12 heads, MLP 4 x 768, 1024 learned positions, a vocabulary of 50257 with the output layer tied to
the token embedding — 124,439,808 parameters, GPT-2's own count — computing in bfloat16 over float32 master
weights (``dtx.precision``), attention by ``jax.nn.dot_product_attention``. ``--config.remat.policy`` chooses
what each block keeps for the backward pass (none | full | dots | offload, ``dtx.models.remat``).

Data: GPT-2's BPE tokenizer cannot be had offline (``tiktoken`` downloads its merge table on first use, and
no installed package carries it), so the text is byte-level: the UTF-8 bytes of ``pydoc_data.topics`` (the
language-reference pages bundled with CPython, ~465 kB on 3.11; ``python_docs`` of ``dtx.data.datasets``)
in windows of ``dataset.seq_len`` = 1024 bytes, each label the next byte, the last 10 % held out. The
vocabulary stays 50257 wide so every shape (embedding, logits, FLOPs, memory) is GPT-2 small's; ids 256 and
up never occur, and the model learns so within a few steps (a uniform guess over 50257 ids scores ln 50257 =
10.8 nats per byte; over the 256 bytes 5.5).

Launch (one GPU; on the 8 emulated CPU devices use the width-scaled twin below — the full size is only
compiled on CPU, tests/test_gpt2.py):

    dtx train experiments/gpt2_small.py --config.emulate_cpu_devices=0 --config.num_steps=200
    dtx train experiments/gpt2_small.py --config.emulate_cpu_devices=0 --config.remat.policy=dots

The width-scaled twin (2 blocks of width 64, the same data, vocabulary and code path; seconds on CPU):

    dtx train experiments/gpt2_small.py --config.model.num_layers=2 --config.model.d_model=64 \\
        --config.model.num_heads=4 --config.model.max_len=64 --config.dataset.seq_len=64 \\
        --config.global_batch_size=16 --config.optimizer.learning_rate=3e-3 --config.optimizer.warmup_steps=2 \\
        --config.num_steps=12

Expected (the twin, tests/test_gpt2.py): training loss 11.44 at the first step (ln 50257 = 10.8, plus the
variance of tied logits at initialisation) down to 8.31 nats per byte at the 12th. At full size the step
does 865.8 M FLOPs per token (6N + 12·L·d·T = 855.1 M, N = 123.65 M).
"""

from ml_collections import ConfigDict

from dtx.config import base_config
from dtx.data import datasets

VOCAB = 50257  # GPT-2's vocabulary (50,000 BPE merges, 256 bytes, one end-of-text token)


def python_docs_bytes(seq_len: int = 1024) -> datasets.Dataset:
    """``python_docs`` (UTF-8 bytes of the Python documentation topics) with GPT-2's 50257-wide vocabulary."""
    docs = datasets.load_dataset("python_docs", seq_len=seq_len)
    return datasets.Dataset("python_docs_gpt2", docs.train, docs.test, VOCAB)


def get_config():
    config = base_config()
    config.dataset.name = "dtx.experiments.gpt2_small:python_docs_bytes"
    config.dataset.seq_len = 1024
    config.task.name = "next_token"
    config.model = ConfigDict(dict(name="transformer", num_layers=12, d_model=768, num_heads=12, mlp_ratio=4,
                                   max_len=1024, dropout_rate=0.0, tie_embeddings=True))
    config.precision = "params=float32,compute=bfloat16,output=float32,reduce=float32"
    config.driver = "jit"
    config.optimizer.name = "adamw"
    config.optimizer.learning_rate = 6e-4  # the 125M model's peak rate (Brown et al. 2020, GPT-3, Table 2.1)
    config.optimizer.weight_decay = 0.1
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_steps = 20
    config.global_batch_size = 16  # 16 x 1024 tokens per step
    config.eval_batch_size = 16
    config.num_steps = 200
    config.log_every = 10
    return config
