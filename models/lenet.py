"""LeNet-style convolutional network with batch normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class LeNet(nn.Module):
    """Conv(5x5) -> BN -> ReLU -> pool, twice, then dense layers (LeCun et al. 1998, with BN).

    Attributes:
      conv_features: output channels of the convolution blocks.
      dense_features: widths of the hidden dense layers.
      num_classes: number of logits.
      use_batch_norm: batch normalisation after each convolution; its running
        statistics live in the ``batch_stats`` collection (the train state's
        ``model_state``).
      norm_axis_name: mesh axes to average batch statistics over. The
        ``shard_map`` driver sets it to the batch axes (synchronised batch norm), so
        every device normalises with the statistics of the *global* batch — the
        same numbers the ``jit`` driver and a single device compute.
      dtype / param_dtype: compute and stored-weight dtypes (precision policy).
    """

    conv_features: Sequence[int] = (6, 16)
    dense_features: Sequence[int] = (120, 84)
    num_classes: int = 10
    use_batch_norm: bool = True
    norm_axis_name: Any = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def pipeline_layers(self) -> list:
        """The pieces in order, for pipeline stages (:mod:`dtx.parallel.pipeline.stages`): each convolution with its ReLU and
        pooling, then the Dense layers (the first flattens its input). Batch norm is refused: a stage sees one
        micro-batch at a time, whose statistics are not the batch's that one device normalises with."""
        if self.use_batch_norm:
            raise ValueError("model.use_batch_norm=True: a pipeline stage normalises one micro-batch at a time, whose "
                             "statistics differ from the whole batch's (one device's); set "
                             "--config.model.use_batch_norm=False for parallel.name=pipeline")
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        def conv(channels):
            def apply(params, x):
                x = nn.relu(nn.Conv(channels, (5, 5), padding="SAME", **dense).apply(
                    {"params": next(iter(params.values()))}, x.astype(self.dtype)))
                return nn.max_pool(x, (2, 2), strides=(2, 2)) if min(x.shape[1:3]) >= 4 else x
            return apply

        def fc(width, last):
            def apply(params, x):
                x = nn.Dense(width, **dense).apply({"params": next(iter(params.values()))},
                                                   x.reshape((x.shape[0], -1)))
                return x if last else nn.relu(x)
            return apply

        widths = list(self.dense_features) + [self.num_classes]
        return ([((f"Conv_{i}",), conv(c)) for i, c in enumerate(self.conv_features)]
                + [((f"Dense_{i}",), fc(w, i == len(widths) - 1)) for i, w in enumerate(widths)])

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype)
        for channels in self.conv_features:
            x = nn.Conv(channels, (5, 5), padding="SAME", dtype=self.dtype, param_dtype=self.param_dtype)(x)
            if self.use_batch_norm:
                x = nn.BatchNorm(
                    use_running_average=not train,
                    momentum=0.9,
                    axis_name=self.norm_axis_name if train else None,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                )(x)
            x = nn.relu(x)
            # Pool only while the image is large enough: digits are 8x8, MNIST 28x28.
            if min(x.shape[1:3]) >= 4:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        for width in self.dense_features:
            x = nn.relu(nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype)(x))
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
