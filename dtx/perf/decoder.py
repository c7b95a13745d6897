"""One decoder block's costs: the single source of a transformer's per-layer FLOPs, bytes and memory.

A pre-LayerNorm GPT-2 block (``models/transformer.py``; Radford et al. 2019) of width ``d``, ``a`` heads, MLP width
``f`` on ``S`` positions, per token:

* **weights** — ``4d² + 4d`` (query, key, value and output projections with biases), ``2fd + f + d`` (the MLP
  pair), ``4d`` (two LayerNorms): ``12d² + 13d`` at ``f = 4d``;
* **matrix-product multiply-adds** — ``4d² + 2fd`` (the projections and the MLP) plus ``2·S·d`` (``QKᵀ`` and
  ``AV`` over the full ``S × S``, whatever the causal mask: what XLA runs and PaLM App. B counts, Chowdhery et al.
  2022, arXiv 2204.02311), so a training step's ``6·MACs`` is Kaplan et al.'s ``6N`` plus ``12·d·S``
  (arXiv 2001.08361 §2.1);
* **boundary** — ``d`` elements (the residual stream a pipeline stage sends on);
* **activations kept for the backward pass** — Korthikanti et al. (arXiv 2205.05198, Table 2, 16-bit):
  ``d·(34 + 5aS/d)`` bytes without tensor parallelism, ``d·(10 + 24/T + 5aS/(dT))`` under ``T``-way tensor
  parallelism, ``/T`` of the whole under sequence parallelism; selective recomputation (``dots``) drops the
  ``5aS/d`` scores, ``full`` keeps the block's input ``2d`` only.

:mod:`dtx.perf.lm_plan` (the transformer planner) and :func:`dtx.parallel.pipeline.plan.transformer_layers` (the data ×
pipeline planner's view of a transformer) read these; ``tests/test_decoder.py`` holds them to each other and to
:func:`dtx.perf.layers.model_flops` of the model itself.
"""

from __future__ import annotations

import dataclasses

# Bytes per parameter of a transformer's bf16 compute copy, per backend whose memory a plan models: XLA:CPU rounds
# each weight through bf16 and keeps the result in float32 (read from the LM planner's --verify twins' buffer
# assignments, dtx.perf.lm_plan); and the factor on Korthikanti et al.'s 16-bit activations (XLA:CPU keeps them in
# float32). Shared by the one-stage planner (dtx.perf.lm_plan) and the pipeline's (dtx.parallel.pipeline.lm_costs).
COMPUTE = 2
COMPUTE_COPY = dict(gpu=COMPUTE, xla_cpu=4)
ACTIVATION_WIDENING = dict(gpu=1, xla_cpu=2)


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of width ``width``, ``heads`` heads and MLP ``mlp_ratio·width``, on sequences of ``seq`` tokens."""

    width: int
    heads: int
    seq: int
    mlp_ratio: int = 4

    @property
    def params(self) -> int:
        """Weights and biases of the block (module docstring)."""
        d, f = self.width, self.mlp_ratio * self.width
        return 4 * d * d + 4 * d + 2 * f * d + f + d + 4 * d

    @property
    def dense_macs(self) -> int:
        """Multiply-adds per token of the block's weight products: the four projections and the MLP pair."""
        d, f = self.width, self.mlp_ratio * self.width
        return 4 * d * d + 2 * f * d

    @property
    def attention_macs(self) -> int:
        """Multiply-adds per token of ``QKᵀ`` and ``AV`` (the full ``S × S``)."""
        return 2 * self.seq * self.width

    @property
    def macs(self) -> int:
        """Every matrix product's multiply-adds per token."""
        return self.dense_macs + self.attention_macs

    @property
    def boundary(self) -> int:
        """Elements per token crossing the block's output (the residual stream)."""
        return self.width

    def activation_bytes(self, tensor: int = 1, sp: bool = False, policy: str = "none") -> float:
        """Bytes the block keeps per token for its backward pass on one device (module docstring)."""
        d, t, ratio = self.width, tensor, 5 * self.heads * self.seq / self.width
        if policy == "full":
            return 2 * d / (t if sp else 1)
        scores = 0.0 if policy == "dots" else ratio
        if sp:
            return d * (34 + scores) / t
        return d * (10 + 24 / t + scores / t)


def head_macs(width: int, vocab: int) -> int:
    """Multiply-adds per token of the output layer (tied or not)."""
    return width * vocab
