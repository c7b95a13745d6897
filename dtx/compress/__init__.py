"""Gradient compression with error feedback (the Hitchhiker's Guide §3.4).

Compressors wrap the gradient allreduce: quantisation (:mod:`dtx.compress.quantize`: fp16/bf16
casts, 1-bit sign, TernGrad, QSGD), sparsification (:mod:`dtx.compress.sparsify`: top-k / Deep
Gradient Compression, random-k) and low rank (:mod:`dtx.compress.lowrank`: PowerSGD), each
selected by name with :func:`make_compressor` (:mod:`dtx.compress.compressors`).
"""

from __future__ import annotations

from dtx.compress import lowrank, quantize, sparsify  # noqa: F401
from dtx.compress.compressors import (  # noqa: F401
    COMPRESSORS, CompressionError, Compressor, WIRE_DTYPES, cast, compressor_settings, make_compressor, none, powersgd, qsgd, randomk, sign, terngrad, topk,
)
