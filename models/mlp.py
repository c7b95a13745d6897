"""Multi-layer perceptron: the default model of dtx's vertical slice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
    """Flatten, ``len(features)`` ReLU layers, then a linear classifier.

    Attributes:
      features: widths of the hidden layers.
      num_classes: width of the output layer (logits).
      dtype: compute dtype (activations and matmul inputs); set by the precision policy.
      param_dtype: dtype of the stored (master) weights.
    """

    features: Sequence[int] = (256, 256)
    num_classes: int = 10
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def pipeline_layers(self) -> list[str]:
        """The Dense layers in order, for pipeline stages (:mod:`dtx.parallel.pipeline.stages`)."""
        return [f"Dense_{i}" for i in range(len(self.features) + 1)]

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train  # no dropout or normalisation: train and eval are the same function
        x = x.reshape((x.shape[0], -1)).astype(self.dtype)
        for width in self.features:
            x = nn.relu(nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype)(x))
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
