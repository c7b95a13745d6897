"""A small decoder-only transformer language model (the sequence model of dtx's zoo)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .moe import MoE, MoESettings, check_settings
from .remat import check_policy, checkpoint_policy


def causal_attention(query, key, value):
    """``jax.nn.dot_product_attention`` with a causal mask, as flax's ``attention_fn``: ``(batch, time, heads,
    head_dim)`` in and out, scores ``q·k/sqrt(head_dim)``, softmax in float32 (XLA's implementation, or a fused
    kernel where the backend has one). No dropout on the attention weights (see :class:`Block`)."""
    return jax.nn.dot_product_attention(query, key, value, is_causal=True)


causal_attention.causal = True  # what context parallelism asks before it runs its own causal kernels


class Block(nn.Module):
    """Pre-LayerNorm block: ``x + attention(LN(x))``, then ``x + MLP(LN(x))``.

    Attention is :func:`causal_attention` (``jax.nn.dot_product_attention``) unless dropout on the attention
    weights is on (``dropout_rate > 0`` while training), which it does not do: then flax's own
    ``nn.dot_product_attention`` with the causal ``mask`` and weight dropout. Both have the same parameters.
    With ``moe`` the MLP is a mixture of experts of those settings (:class:`dtx.models.moe.MoE`, named ``moe``).
    ``decode``: autoregressive decoding, one position per call, flax's key/value cache (the ``cache`` collection)
    holding the earlier positions' keys and values; the same parameters.
    """

    d_model: int
    num_heads: int
    mlp_ratio: int
    dropout_rate: float
    dtype: Any
    param_dtype: Any
    moe: MoESettings | None = None
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask, train: bool):
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.LayerNorm(**dense)(x)
        if self.decode:  # one position a call: keys and values cached, the mask the cache's (positions <= this)
            h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, decode=True,
                                                name="MultiHeadDotProductAttention_0", **dense)(h, h)
        elif train and self.dropout_rate > 0:  # dropout on the attention weights: flax's unfused attention
            h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dropout_rate=self.dropout_rate,
                                                deterministic=False, name="MultiHeadDotProductAttention_0",
                                                **dense)(h, h, mask=mask)
        else:
            h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, attention_fn=causal_attention,
                                                name="MultiHeadDotProductAttention_0", **dense)(h, h)
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm(**dense)(x)
        if self.moe is None:
            h = nn.gelu(nn.Dense(self.mlp_ratio * self.d_model, **dense)(h))
            h = nn.Dense(self.d_model, **dense)(h)
        else:
            h = MoE(self.moe.experts, self.moe, self.mlp_ratio, name="moe", **dense)(h, train)
        return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class Transformer(nn.Module):
    """Causal transformer LM: token ids ``(batch, time)`` -> next-token logits ``(batch, time, vocab)``.

    The decoder of Vaswani et al., *Attention Is All You Need* (NeurIPS 2017), without
    cross-attention, with the pre-LayerNorm arrangement and learned positions of GPT-2
    (Radford et al. 2019). Train it with the ``next_token`` task (:mod:`dtx.data.tasks`).

    Attributes:
      num_layers: transformer blocks.
      d_model: width of the residual stream.
      num_heads: attention heads (must divide ``d_model``).
      mlp_ratio: the MLP's hidden width as a multiple of ``d_model``.
      max_len: longest sequence (learned positions).
      dropout_rate: dropout on attention weights and residual branches (training only).
      num_classes: vocabulary size (logits per position); set from the dataset.
      dtype / param_dtype: compute and stored dtypes (the precision policy's).
      tie_embeddings: the output layer is the token embedding transposed (GPT-2's; no ``Dense_0`` head, no output
        bias), else a Dense layer of its own.
      remat: the rematerialisation policy of each block (:mod:`dtx.models.remat`: ``none``, ``full``, ``dots``,
        ``offload``); a run setting, ``remat.policy``, that dtx passes in (not a key of the ``model`` block).
      decode: autoregressive decoding (:mod:`dtx.run.generate`): each call takes one position per sequence, at
        ``positions=``, every block attending to the keys and values cached in the ``cache`` collection (made by
        ``init`` on a ``(batch, max_len)`` input); the same parameters as training's. Not a key of the ``model``
        block.
      moe: mixture-of-experts MLPs (:class:`dtx.models.moe.MoESettings`, the ``model.moe`` block: ``experts``,
        ``every``, ``top_k``, ``capacity_factor``, ``aux_weight``, ``z_weight``, ``balance``, ``bias_rate``,
        ``renormalize``; docs/moe.md); ``experts=0`` (the default) keeps every MLP dense. A mapping of those keys
        is taken too.
    """

    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    mlp_ratio: int = 4
    max_len: int = 256
    dropout_rate: float = 0.0
    num_classes: int = 256
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    tie_embeddings: bool = False
    remat: str = "none"
    moe: MoESettings = MoESettings()
    decode: bool = False

    def __post_init__(self):
        if not isinstance(self.moe, MoESettings):  # a mapping: a config block, or an exported model's JSON
            object.__setattr__(self, "moe", MoESettings(**{key: self.moe[key] for key in self.moe.keys()}))
        super().__post_init__()

    @property
    def reuses_parameters(self) -> bool:
        """Whether one parameter is used twice in a forward pass (the tied embedding: the lookup and the output
        layer); the jit driver then sums a device's uses before the gradient crosses the devices (dtx.step.jit)."""
        return self.tie_embeddings

    def pipeline_layers(self) -> list:
        """The pieces in order, for pipeline stages (:mod:`dtx.parallel.pipeline.stages`): the token embedding with the
        learned positions (on the first stage), each block (causal attention inside it), and the final LayerNorm with
        the output layer (on the last stage); every boundary carries the ``(time, d_model)`` residual stream.
        Refused: ``tie_embeddings`` (the first and last stages would share the embedding, and its two gradients
        would need summing across the ring) and dropout (the micro-batches' masks are not one device's). Under a
        pipeline each stage's backward re-runs its forward from the kept input, so ``remat.policy`` adds nothing."""
        if self.tie_embeddings:
            raise ValueError("model.tie_embeddings=True: under a pipeline the embedding lives on the first stage and "
                             "the output layer on the last, so they cannot be one matrix; set "
                             "--config.model.tie_embeddings=False for parallel.name=pipeline")
        if self.moe.experts:
            raise ValueError(f"model.moe.experts={self.moe.experts}: pipeline stages collect no balancing losses and "
                             "no bias updates from a mixture of experts; set --config.model.moe.experts=0 for "
                             "parallel.name=pipeline")
        if self.dropout_rate:
            raise ValueError(f"model.dropout_rate={self.dropout_rate}: pipeline stages draw no dropout masks (one "
                             "device's would differ from the micro-batches'); set --config.model.dropout_rate=0 for "
                             "parallel.name=pipeline")
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)

        def embed(params, tokens):
            x = nn.Embed(self.num_classes, self.d_model, **dense).apply({"params": params["Embed_0"]}, tokens)
            return x + params["positions"][: tokens.shape[1]].astype(self.dtype)

        def block(i):
            module = Block(self.d_model, self.num_heads, self.mlp_ratio, 0.0, self.dtype, self.param_dtype, parent=None)
            return lambda params, x: module.apply({"params": params[f"Block_{i}"]}, x, None, False)

        def head(params, x):
            x = nn.LayerNorm(**dense).apply({"params": params["LayerNorm_0"]}, x)
            return nn.Dense(self.num_classes, **dense).apply({"params": params["Dense_0"]}, x)

        return ([(("Embed_0", "positions"), embed)] + [((f"Block_{i}",), block(i)) for i in range(self.num_layers)]
                + [(("LayerNorm_0", "Dense_0"), head)])

    @nn.compact
    def __call__(self, tokens, train: bool = False, positions=None):
        """``positions``: the global position of each of the ``time`` inputs (default ``0 .. time − 1``): context
        parallelism's load-balanced layout hands the sequence over permuted (:mod:`dtx.parallel.context`), and the
        causal mask of the attention it runs follows the same positions."""
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Transformer takes integer token ids shaped (batch, time), got {tokens.dtype} "
                             f"{tokens.shape}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequences of {tokens.shape[1]} tokens exceed max_len={self.max_len}; raise "
                             "model.max_len or shorten the sequences (dataset.seq_len)")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide d_model={self.d_model}")
        check_settings(self.moe)
        embed = nn.Embed(self.num_classes, self.d_model, dtype=self.dtype, param_dtype=self.param_dtype)
        x = embed(tokens)
        table = self.param("positions", nn.initializers.normal(0.02), (self.max_len, self.d_model),
                           self.param_dtype)
        x = x + (table[: tokens.shape[1]] if positions is None else table[positions]).astype(self.dtype)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        # position t attends to positions <= t only (decoding: the cache's mask, positions up to the current)
        mask = None if self.decode else nn.make_causal_mask(tokens)
        policy = checkpoint_policy(check_policy(self.remat))
        # The block's name is fixed, so that remat does not rename the parameters (nn.remat's class is
        # CheckpointBlock); train (argument 3, self counted) is static: it chooses the attention function.
        block = Block if policy is None else nn.remat(Block, policy=policy, static_argnums=(3,))
        for i in range(self.num_layers):
            moe = self.moe if self.moe.layer(i) else None
            x = block(self.d_model, self.num_heads, self.mlp_ratio, self.dropout_rate, self.dtype,
                      self.param_dtype, moe, self.decode, name=f"Block_{i}")(x, mask, train)
        x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        if self.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
