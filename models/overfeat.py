"""OverFeat "fast" model: Sermanet et al., *OverFeat* (ICLR 2014, arXiv 1312.6229, Table 1).

Five convolutions and three fully connected layers on 231×231×3 inputs:

=====  ======  ========  ======  =====  =========  ================
layer  kernel  stride    pad     out C  pool       output (231 in)
=====  ======  ========  ======  =====  =========  ================
conv1  11×11   4         0       96     2×2 / 2    56 → 28
conv2  5×5     1         0       256    2×2 / 2    24 → 12
conv3  3×3     1         1       512    —          12
conv4  3×3     1         1       1024   —          12
conv5  3×3     1         1       1024   2×2 / 2    12 → 6
fc6    —       —         —       3072   —          1
fc7    —       —         —       4096   —          1
fc8    —       —         —       1000   —          1
=====  ======  ========  ======  =====  =========  ================

146 M parameters, 2.8 G multiply-adds per image. (Table 1 of the paper lists the
layer-2 *input* as 24×24, which is conv2's output; the arithmetic above, 231 → 56
→ 28 → 24 → 12, is what the layer table's filters and strides give.) The paper's
ReLU follows every layer but the last; dropout 0.5 precedes fc7 and fc8. Das et al.
(arXiv 1602.06709 §5) scale it alongside VGG-A.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

# (name, channels, kernel, stride, padding, pool after)
OVERFEAT_FAST_CONVS = (
    ("conv1", 96, 11, 4, 0, True),
    ("conv2", 256, 5, 1, 0, True),
    ("conv3", 512, 3, 1, 1, False),
    ("conv4", 1024, 3, 1, 1, False),
    ("conv5", 1024, 3, 1, 1, True),
)


class OverFeatFast(nn.Module):
    """OverFeat-FAST, full size by default.

    Attributes:
      width: multiplier on every convolution's channel count (1.0 = the paper's).
      fc_features: widths of the hidden fully connected layers fc6, fc7 ((3072, 4096)).
      dropout_rate: dropout before fc7 and fc8 in training (0.5).
      num_classes: number of logits (1000).
      dtype / param_dtype: compute and stored-weight dtypes (precision policy).

    The input's shape sets the resolution (231×231×3 in the paper; at least
    ~51×51 so conv2's unpadded 5×5 window fits).
    """

    width: float = 1.0
    fc_features: tuple[int, int] = (3072, 4096)
    dropout_rate: float = 0.5
    num_classes: int = 1000
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    default_input_shape = (231, 231, 3)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.astype(self.dtype)
        for name, channels, kernel, stride, pad, pool in OVERFEAT_FAST_CONVS:
            x = nn.Conv(max(1, round(channels * self.width)), (kernel, kernel), strides=(stride, stride),
                        padding=((pad, pad), (pad, pad)), name=name, dtype=self.dtype,
                        param_dtype=self.param_dtype)(x)
            x = nn.relu(x)
            if pool and min(x.shape[1:3]) >= 2:
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        for name, features in zip(("fc6", "fc7"), self.fc_features):
            x = nn.relu(nn.Dense(features, name=name, dtype=self.dtype, param_dtype=self.param_dtype)(x))
            x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes, name="fc8", dtype=self.dtype, param_dtype=self.param_dtype)(x)
