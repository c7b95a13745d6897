"""Gradient compression on the reference task: the digits MLP with each compressor of dtx.compress.

The Hitchhiker's Guide §5 (gradient compression): quantisation (bf16 casts, 1-bit/sign,
TernGrad, QSGD), sparsification (top-k with Deep Gradient Compression's fixes, random-k)
and low rank (PowerSGD), all with error feedback. Every variant trains the MLP 256-256
of experiments/digits_mlp.py on 8 data-parallel workers for the same number of steps
with SGD-momentum; only the compressor changes. ``topk_dgc`` is DGC as published:
0.1% of each gradient, momentum correction (momentum moves from the optimizer into the
compressor, so the optimizer is plain SGD), local gradient clipping, momentum factor
masking and sparsity warm-up.

Launch one variant (the name of a variant as the config argument):

    dtx train experiments/compression_sweep.py:topk_dgc
    dtx train experiments/compression_sweep.py:sign

Variants: none, cast, topk, topk_dgc, randomk, sign, terngrad, qsgd, powersgd.
The whole sweep, table and plot: ``python benchmarks/compression_sweep.py`` (BENCHMARKS.md).
Expected (measured, see BENCHMARKS.md): every variant within about a point of ``none``
(~97-98% test accuracy); ``topk_dgc`` sends ~620× fewer payload bytes than the float32
gradient (~160× fewer wire bytes than a float32 ring allreduce on 8 workers), ``sign`` ~31×.
"""

from dtx.config import base_config

# Compression settings per variant (everything else is shared).
VARIANTS = {
    "none": dict(name="none"),
    "cast": dict(name="cast", dtype="bfloat16"),
    "topk": dict(name="topk", fraction=0.01),
    "topk_dgc": dict(name="topk", fraction=0.001, momentum=0.9, clip_norm=1.0, warmup_steps=40),
    "randomk": dict(name="randomk", fraction=0.01),
    "sign": dict(name="sign"),
    "terngrad": dict(name="terngrad"),
    "qsgd": dict(name="qsgd", levels=16),
    "powersgd": dict(name="powersgd", rank=4),
}
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def get_config(variant: str = "topk_dgc"):
    if variant not in VARIANTS:
        raise ValueError(f"compression_sweep: variant {variant!r} must be one of {sorted(VARIANTS)}")
    config = base_config()
    config.dataset.name = "digits"
    config.model.features = (256, 256)
    config.global_batch_size = 128
    config.num_epochs = 20.0
    config.optimizer.learning_rate = LEARNING_RATE
    settings = VARIANTS[variant]
    # DGC's momentum correction is the momentum of SGD-momentum, applied before sparsification.
    config.optimizer.name = "sgd" if settings.get("momentum") else "momentum"
    config.optimizer.momentum = MOMENTUM
    for key, value in settings.items():
        config.compression[key] = value
    config.log_every = 25
    return config
