"""experiments/llama_small.py's width-scaled twin for CPU: tiny_lm.py's run with Llama's blocks.

The model is ``models/transformer.py`` with the modern settings of ``llama_small.py`` (RMSNorm, rotary positions,
SwiGLU, grouped-query attention, no biases, an untied output layer) at tiny_lm.py's size: 2 blocks of width 64, 4
query heads sharing 2 key/value heads, a SwiGLU MLP of 192 hidden units (two thirds of 4 x 64 rounded up to a
multiple of 64); 131,392 parameters (tiny_lm's 137,216: no position table, no biases). The data, task, optimizer and schedule are tiny_lm.py's:
UTF-8 bytes of ``python_docs``, 300 steps of 64 windows of 64 bytes, AdamW 3e-3, cosine, 20 warmup steps.

Launch (8 emulated CPU devices, about 2 minutes on 2 cores):

    dtx train experiments/llama_tiny.py
    dtx train experiments/llama_tiny.py --config.driver=jit --config.parallel.name=fsdp

Expected (measured: the command above, 8 emulated CPU devices, Python 3.11, jax 0.10.2; tiny_lm.py beside it):

    run                                     test_loss   perplexity/byte   bits/byte
    dtx train experiments/tiny_lm.py          2.0879         8.07           3.0122
    dtx train experiments/llama_tiny.py       1.7658         5.85           2.5475

(81 s wall on this 2-core host; test accuracy 0.5458 per byte.) The same parameter count, steps and bytes score 0.46
fewer bits per byte than GPT-2's block; which setting earns how much is not separated here.
"""

from ml_collections import ConfigDict

from dtx.experiments import tiny_lm


def get_config():
    config = tiny_lm.get_config()
    config.model = ConfigDict(dict(name="transformer", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2,
                                   mlp_ratio=4, max_len=64, dropout_rate=0.0, norm="rmsnorm", positions="rope",
                                   mlp="swiglu", use_bias=False, tie_embeddings=False))
    return config
