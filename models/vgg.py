"""VGG-A: configuration A of Simonyan & Zisserman (ICLR 2015, arXiv 1409.1556, Table 1).

Eight 3×3 convolutions (stride 1, padding 1) in five blocks separated by 2×2 max
pooling, then three fully connected layers: 224×224×3 → 7×7×512 → 4096 → 4096 →
1000, 133 M parameters, 7.6 G multiply-adds per image. One of the two CNNs Das et
al. scale (arXiv 1602.06709 §5): its convolutions hold 7 % of the weights and 99 % of
the arithmetic, its FC layers the reverse — the case for per-layer hybrid parallelism.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

# (layer name, output channels); "pool" closes a block. Names are stable: the
# planner's partitioning rules are regexes on parameter paths such as "fc6/kernel".
VGG_A_CONVS = (
    ("conv1", 64), "pool",
    ("conv2", 128), "pool",
    ("conv3_1", 256), ("conv3_2", 256), "pool",
    ("conv4_1", 512), ("conv4_2", 512), "pool",
    ("conv5_1", 512), ("conv5_2", 512), "pool",
)


class VGGA(nn.Module):
    """VGG configuration A (11 weight layers), full size by default.

    Attributes:
      width: multiplier on every convolution's channel count (1.0 = the paper's).
      fc_features: width of the hidden fully connected layers fc6 and fc7 (4096).
      dropout_rate: dropout before fc7 and fc8 in training, as in the paper (0.5).
      num_classes: number of logits (1000 for ImageNet).
      dtype / param_dtype: compute and stored-weight dtypes (precision policy).

    Input resolution is the input's shape (224×224×3 in the paper); smaller inputs
    skip a pooling once the feature map is 1×1, so e.g. 32×32 works for tests.
    """

    width: float = 1.0
    fc_features: int = 4096
    dropout_rate: float = 0.5
    num_classes: int = 1000
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    default_input_shape = (224, 224, 3)  # per example, HWC (class constant, not a setting)

    def pipeline_layers(self) -> list:
        """The 11 weight layers in order, for pipeline stages (:mod:`dtx.parallel.pipeline.stages`): each convolution with its
        ReLU and the pooling that closes its block, fc6-fc8 (fc6 flattens its input). Dropout is refused: a stage's
        micro-batches would draw other masks than one device's batch."""
        if self.dropout_rate:
            raise ValueError(f"model.dropout_rate={self.dropout_rate}: pipeline stages draw no dropout masks (one "
                             "device's would differ from the micro-batches'); set --config.model.dropout_rate=0 for "
                             "parallel.name=pipeline")
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        def conv(channels, pool):
            def apply(params, x):
                x = nn.relu(nn.Conv(channels, (3, 3), padding=((1, 1), (1, 1)), **dense).apply(
                    {"params": next(iter(params.values()))}, x.astype(self.dtype)))
                return nn.max_pool(x, (2, 2), strides=(2, 2)) if pool and min(x.shape[1:3]) >= 2 else x
            return apply

        def fc(width, last):
            def apply(params, x):
                x = nn.Dense(width, **dense).apply({"params": next(iter(params.values()))},
                                                   x.reshape((x.shape[0], -1)))
                return x if last else nn.relu(x)
            return apply

        pieces = []
        for i, layer in enumerate(VGG_A_CONVS):
            if layer != "pool":
                name, channels = layer
                pieces.append(((name,), conv(max(1, round(channels * self.width)), VGG_A_CONVS[i + 1] == "pool")))
        return pieces + [((name,), fc(width, name == "fc8")) for name, width in
                         (("fc6", self.fc_features), ("fc7", self.fc_features), ("fc8", self.num_classes))]

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype)
        for layer in VGG_A_CONVS:
            if layer == "pool":
                if min(x.shape[1:3]) >= 2:  # small test inputs run out of pixels before block 5
                    x = nn.max_pool(x, (2, 2), strides=(2, 2))
                continue
            name, channels = layer
            x = nn.Conv(max(1, round(channels * self.width)), (3, 3), padding=((1, 1), (1, 1)), name=name,
                        dtype=self.dtype, param_dtype=self.param_dtype)(x)
            x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        for name in ("fc6", "fc7"):
            x = nn.relu(nn.Dense(self.fc_features, name=name, dtype=self.dtype, param_dtype=self.param_dtype)(x))
            x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="fc8", dtype=self.dtype, param_dtype=self.param_dtype)(x)
