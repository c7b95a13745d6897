"""A Llama-shaped language model of 88 M parameters on the Python documentation that ships with Python.

The model is ``models/transformer.py`` with its modern settings (Touvron et al. 2023, *LLaMA*, arXiv 2302.13971):
12 pre-RMSNorm blocks of width 768, 12 query heads of 64 sharing 4 key/value heads (grouped-query attention,
``model.num_kv_heads=4``), rotary positions (``model.positions=rope``), a SwiGLU MLP of 2048 hidden units (two
thirds of 4 x 768, Llama's 8/3·d), no biases, an output layer of its own (untied); 1024 positions; a byte-level BPE
of 8192 ids trained on the training split (``dataset.tokenizer=bpe``, docs/tasks_and_data.md; this 419 kB text has
pairs for 8822 ids at most, so Llama's 32000 cannot be had) — 88,099,584 parameters (12 blocks of 6,292,992, the
embedding and the output layer 6,291,456 each, the final RMSNorm 768). It computes in bfloat16 over float32 master weights under the ``jit`` driver.

Launch (one GPU; not meant to train on this CPU):

    dtx train experiments/llama_small.py --config.emulate_cpu_devices=0

On the 8 emulated CPU devices use the width-scaled twin, ``experiments/llama_tiny.py`` (the same settings at 2
blocks of width 64 on bytes; its measured figures are in its docstring):

    dtx train experiments/llama_tiny.py

On this 2-core CPU host (8 emulated devices, 22.9 GiB available) the config loads, validates and builds, and
``dtx train experiments/llama_small.py --config.num_steps=1 --config.optimizer.warmup_steps=0`` is refused before
compiling by the host-memory check: about 5.17 GiB per device (dtx.perf.memory's estimate) x 8 = 41.6 GiB. (The
BPE splits the text into 91 training windows of 1024 ids.) ``dtx simulate``'s LM planner takes tied GPT-2 models
only so far.

Layouts: data parallelism, ZeRO/FSDP (``--config.parallel.name=fsdp``) and context parallelism (a ``context``
mesh axis) run these blocks; Megatron's tensor split and pipeline stages refuse them, naming the key.
"""

from ml_collections import ConfigDict

from dtx.experiments import gpt2_small


def get_config():
    """gpt2_small.py's run (bfloat16 compute, jit, AdamW 6e-4, 16 x 1024 tokens a step) with Llama's model and BPE."""
    config = gpt2_small.get_config()
    config.dataset.name = "python_docs"
    config.dataset.tokenizer = "bpe"
    config.dataset.vocab_size = 8192
    config.model = ConfigDict(dict(name="transformer", num_layers=12, d_model=768, num_heads=12, num_kv_heads=4,
                                   mlp_ratio=4, max_len=1024, dropout_rate=0.0, norm="rmsnorm", positions="rope",
                                   mlp="swiglu", use_bias=False, tie_embeddings=False))
    return config
