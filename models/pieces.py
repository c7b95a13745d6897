"""What the pipeline pieces of the zoo's models share (:meth:`pipeline_layers`, :mod:`dtx.parallel.stages`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn


def dense_piece(width: int, last: bool, dtype: Any, param_dtype: Any):
    """A Dense layer as a piece ``apply(params, x)``: flattens its input, ReLU unless it is the output layer."""
    def apply(params, x):
        x = nn.Dense(width, dtype=dtype, param_dtype=param_dtype).apply({"params": next(iter(params.values()))},
                                                                        x.reshape((x.shape[0], -1)))
        return x if last else nn.relu(x)
    return apply


def refuse_dropout(rate: float) -> None:
    """Pipeline stages draw no dropout masks: a stage's micro-batches would draw other masks than one device's
    batch, so a model with dropout is refused, naming the key and the fix."""
    if rate:
        raise ValueError(f"model.dropout_rate={rate}: pipeline stages draw no dropout masks (one device's would differ "
                         "from the micro-batches'); set --config.model.dropout_rate=0 for parallel.name=pipeline")
