"""Long sequences by context parallelism: the tiny byte-level LM on 2048-byte windows, each split over 8 devices.

The model and corpus are experiments/tiny_lm.py's (2 pre-LayerNorm blocks, width 64, 4 heads; the Python
documentation as UTF-8 bytes), at 32 times the sequence: every window is 2048 bytes. Attention's scores grow with
the square of the sequence, so one device's step no longer fits the ``memory_limit`` set here (a budget that
stands for a small accelerator's memory), and the run splits every sequence over a ``context`` axis of 8 devices
(docs/context_parallel.md): each device holds 256 positions of every window, attention by the balanced ring.

Launch (8 emulated CPU devices):

    dtx train experiments/long_context.py
    dtx train experiments/long_context.py --config.context.attention=allgather

One device is refused before anything is compiled (the memory check's estimate against ``memory_limit``):

    dtx train experiments/long_context.py --config.emulate_cpu_devices=1 --config.mesh='(("data", 1),)'

Ulysses is refused on this axis: its 4 heads do not split over 8 devices (``context.attention=ulysses`` needs
``model.num_heads`` divisible by the axis).

Measured on a 2-core x86_64 host (jax 0.10.2), tests/test_long_context.py holding the memory figures:

* one device: the memory check's estimate 3.42 GiB, XLA's compiled peak 3.66 GiB — over the 0.5 GiB limit;
* context 8, the ring: estimate 0.42 GiB, compiled peak 0.38 GiB (the all-gather's: 0.42 GiB) — under it;
* 100 steps of 8 windows (1.6 M tokens, 5 minutes): test loss 2.3752, perplexity 10.75 per byte, next-byte
  accuracy 0.397 on the 22 test windows (tiny_lm.py, 300 steps of 64-byte windows: 8.07).
"""

from dtx.experiments import tiny_lm

SEQ_LEN = 2048


def get_config():
    config = tiny_lm.get_config()  # its model, corpus and optimizer; the sequence 32 times longer
    config.dataset.seq_len = SEQ_LEN
    config.model.max_len = SEQ_LEN
    config.optimizer.warmup_steps = 10
    config.global_batch_size = 8
    config.eval_batch_size = 16
    config.num_steps = 100
    config.log_every = 10
    config.mesh = (("context", 8),)
    config.driver = "jit"
    config.memory_limit = 512 * 2**20  # bytes per device: one device's step is refused, context 8 fits
    return config
