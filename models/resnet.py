"""ResNet-18 and ResNet-50: He, Zhang, Ren & Sun, *Deep Residual Learning* (CVPR 2016, Table 1).

A 7×7/2 stem convolution and 3×3/2 max pool, four stages of residual blocks (basic
3×3+3×3 blocks for ResNet-18, bottleneck 1×1+3×3+1×1 blocks with 4× expansion for
ResNet-50; the first block of stages 2-4 strides by 2 and projects its shortcut with
a 1×1 convolution), global average pooling and one fully connected classifier.
Batch normalisation follows every convolution; the last BN of each block starts at
zero scale (Goyal et al. 2017), so a fresh network is close to its shortcuts.

Parameter paths are stable for the planner: ``stem_conv``, ``stage2_block1/conv2``,
``stage2_block1/proj``, ``fc`` (e.g. the rule regex ``^fc/kernel$``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class _Block(nn.Module):
    channels: int
    strides: int
    bottleneck: bool
    norm: Any
    conv: Any

    @nn.compact
    def __call__(self, x):
        out_channels = self.channels * (4 if self.bottleneck else 1)
        if self.bottleneck:
            shapes = [(self.channels, (1, 1), 1), (self.channels, (3, 3), self.strides), (out_channels, (1, 1), 1)]
        else:
            shapes = [(self.channels, (3, 3), self.strides), (self.channels, (3, 3), 1)]
        y = x
        for i, (features, kernel, strides) in enumerate(shapes, start=1):
            y = self.conv(features, kernel, (strides, strides), name=f"conv{i}")(y)
            last = i == len(shapes)
            y = self.norm(name=f"bn{i}", scale_init=nn.initializers.zeros if last else nn.initializers.ones)(y)
            if not last:
                y = nn.relu(y)
        if x.shape[-1] != out_channels or self.strides != 1:
            x = self.conv(out_channels, (1, 1), (self.strides, self.strides), name="proj")(x)
            x = self.norm(name="proj_bn")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A ResNet; :class:`ResNet18` and :class:`ResNet50` set the depth.

    Attributes:
      stage_sizes: residual blocks per stage.
      bottleneck: bottleneck blocks (ResNet-50 and deeper) instead of basic ones.
      width: channels of the first stage (64); later stages double it.
      num_classes: number of logits (1000).
      norm_axis_name: mesh axes to average batch statistics over in training
        (synchronised batch norm; the ``shard_map`` driver fills it in).
      dtype / param_dtype: compute and stored-weight dtypes (precision policy).

    Input resolution is the input's shape (224×224×3 standard; 32×32 works).
    """

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    bottleneck: bool = False
    width: int = 64
    num_classes: int = 1000
    norm_axis_name: Any = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    default_input_shape = (224, 224, 3)

    @nn.compact
    def __call__(self, x, train: bool = False):
        def conv(features, kernel, strides, name):
            pad = [((k - 1) // 2, k // 2) for k in kernel]  # "SAME" for odd kernels, as in the paper
            return nn.Conv(features, kernel, strides, padding=pad, use_bias=False, name=name,
                           dtype=self.dtype, param_dtype=self.param_dtype)

        def norm(name, scale_init=nn.initializers.ones):
            return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, name=name,
                                axis_name=self.norm_axis_name if train else None, scale_init=scale_init,
                                dtype=self.dtype, param_dtype=self.param_dtype)

        x = x.astype(self.dtype)
        x = nn.relu(norm("stem_bn")(conv(self.width, (7, 7), (2, 2), "stem_conv")(x)))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for stage, blocks in enumerate(self.stage_sizes, start=1):
            for block in range(1, blocks + 1):
                strides = 2 if stage > 1 and block == 1 else 1
                x = _Block(self.width * 2 ** (stage - 1), strides, self.bottleneck, norm, conv,
                           name=f"stage{stage}_block{block}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc", dtype=self.dtype, param_dtype=self.param_dtype)(x)


class ResNet18(ResNet):
    """ResNet-18: basic blocks (2, 2, 2, 2), 11.7 M parameters, 1.8 G multiply-adds at 224²."""


class ResNet50(ResNet):
    """ResNet-50: bottleneck blocks (3, 4, 6, 3), 25.6 M parameters, 4.1 G multiply-adds at 224²."""

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    bottleneck: bool = True
