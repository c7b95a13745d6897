"""The fully connected acoustic-model DNN that Das et al. scale (arXiv 1602.06709 §5).

Das et al. train "a 7-layer DNN" for speech recognition (a hybrid DNN-HMM acoustic
model: a window of filter-bank frames in, senone posteriors out) and report 6.5×
scaling on 16 nodes. The widths below are **our documented choice, not read from
their paper**, which we could not check layer by layer: the CD-DNN-HMM convention of
Seide, Li & Yu (Interspeech 2011) — 11 frames × 40 log-mel features = 440 inputs,
hidden layers of 2048 sigmoid/ReLU units, 9304 senone outputs — with 7 weight layers
in all (6 hidden + output). If the paper's "7 layers" means 7 *hidden* layers (Seide
et al.'s 7×2k), set ``hidden=(2048,) * 7``. Either way every layer is fully
connected, so the model exists to exercise the planner where weights dominate
everywhere (Das et al. §3: model/hybrid parallelism pays off for FC layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


class SpeechDNN(nn.Module):
    """``len(hidden)`` ReLU layers ``fc1..`` and a senone classifier ``fc{len(hidden)+1}``.

    Attributes:
      hidden: hidden-layer widths (default six of 2048: 7 weight layers in all).
      num_classes: output senones (9304, Seide et al. 2011).
      dtype / param_dtype: compute and stored-weight dtypes (precision policy).

    Inputs of any shape are flattened per example; the default is 440 features.
    """

    hidden: Sequence[int] = (2048,) * 6
    num_classes: int = 9304
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    default_input_shape = (440,)

    def pipeline_layers(self) -> list[str]:
        """The Dense layers in order, for pipeline stages (:mod:`dtx.parallel.pipeline.stages`)."""
        return [f"fc{i + 1}" for i in range(len(self.hidden) + 1)]

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train  # no dropout or normalisation
        x = x.reshape((x.shape[0], -1)).astype(self.dtype)
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"fc{i + 1}", dtype=self.dtype, param_dtype=self.param_dtype)(x))
        return nn.Dense(self.num_classes, name=f"fc{len(self.hidden) + 1}", dtype=self.dtype,
                        param_dtype=self.param_dtype)(x)
