"""A small decoder-only transformer language model (the sequence model of dtx's zoo)."""

from __future__ import annotations

import functools
import inspect
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
causal_attention.grouped = True  # takes fewer key/value heads than query heads (grouped-query attention)


def masked_attention(query, key, value, mask=None):
    """``jax.nn.dot_product_attention`` under a boolean ``mask`` (decoding's: the positions cached so far), fewer
    key/value heads than query heads taken as they are (grouped)."""
    return jax.nn.dot_product_attention(query, key, value, mask=None if mask is None else mask.astype(bool))


masked_attention.grouped = True

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("gelu", "swiglu")


def rotary(x, positions, base: float = 10000.0):
    """Rotary position embedding (Su et al., *RoFormer*, arXiv 2104.09864, eq. 34): each pair of features
    ``(x[2i], x[2i+1])`` of ``x`` ``(..., time, heads, head_dim)`` rotated by the angle ``position · base^(-2i/head_dim)``,
    in float32. ``positions``: ``(time,)`` or ``(batch, time)``. A query at position ``m`` and a key at ``n`` then
    score ``q·R(n − m)·k``: the product depends on the positions only through their difference."""
    half = x.shape[-1] // 2
    frequencies = base ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angles = jnp.asarray(positions, jnp.float32)[..., None] * frequencies  # (..., time, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # a heads axis to broadcast over
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    return jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(x.shape).astype(x.dtype)


class Attention(nn.MultiHeadDotProductAttention):
    """Causal self-attention with rotary positions and grouped key/value heads; flax's
    :class:`~flax.linen.MultiHeadDotProductAttention` (the same ``query``, ``key``, ``value`` and ``out``
    parameters, decoding cache, dropout and ``attention_fn``) with:

    * ``num_kv_heads``: grouped-query attention (Ainslie et al., *GQA*, arXiv 2305.13245): the ``key`` and ``value``
      projections have ``num_kv_heads`` heads, each shared by ``num_heads / num_kv_heads`` consecutive query heads
      (query head ``h`` reads key/value head ``h // (num_heads / num_kv_heads)``); 0 means ``num_heads``. An
      ``attention_fn`` that declares ``grouped`` (:func:`causal_attention`: ``jax.nn.dot_product_attention`` takes
      them natively) gets them as they are; any other (flax's with dropout, context parallelism's kernels) gets
      them repeated to the query heads first. The decoding cache holds the ``num_kv_heads`` heads.
    * ``rope``: queries and keys rotated by their positions (:func:`rotary`) before attention, so keys enter the
      decoding cache rotated at their own positions; ``positions=`` (default ``0 .. time − 1``; decoding: the
      cache's index).
    * ``tensor_refusal``: the block's settings that Megatron's tensor split (:mod:`dtx.parallel.tensor.megatron`,
      which recomputes attention from the parameters) does not run; it refuses the module with them.
    """

    num_kv_heads: int = 0
    rope: bool = False
    rope_base: float = 10000.0
    tensor_refusal: str = ""

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None, deterministic=None, dropout_rng=None,
                 positions=None):
        x = inputs_q
        inputs_k = x if inputs_k is None else inputs_k  # flax's defaults: keys from the queries' input, values
        inputs_v = inputs_k if inputs_v is None else inputs_v  # from the keys'
        head_dim = (self.qkv_features or x.shape[-1]) // self.num_heads
        kv_heads = self.num_kv_heads or self.num_heads
        dense = functools.partial(nn.DenseGeneral, axis=-1, dtype=self.dtype, param_dtype=self.param_dtype,
                                  kernel_init=self.kernel_init, bias_init=self.bias_init, use_bias=self.use_bias,
                                  precision=self.precision)
        query = dense(features=(self.num_heads, head_dim), name="query")(x)
        key = dense(features=(kv_heads, head_dim), name="key")(inputs_k)
        value = dense(features=(kv_heads, head_dim), name="value")(inputs_v)
        if self.decode:
            initialized = self.has_variable("cache", "cached_key")
            cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if self.rope:
            if positions is None:
                positions = index.value[None] if self.decode else jnp.arange(x.shape[-2])
            query, key = rotary(query, positions, self.rope_base), rotary(key, positions, self.rope_base)
        if self.decode and initialized:  # flax's cache: this position's key and value written at the index
            length = cached_key.value.shape[-3]
            at = (0,) * (key.ndim - 3) + (index.value, 0, 0)
            key = cached_key.value = jax.lax.dynamic_update_slice(cached_key.value, key, at)
            value = cached_value.value = jax.lax.dynamic_update_slice(cached_value.value, value, at)
            mask = nn.combine_masks(mask, jnp.broadcast_to(jnp.arange(length) <= index.value,
                                                           query.shape[:-3] + (1, 1, length)))
            index.value = index.value + 1
        deterministic = True if self.dropout_rate == 0 else nn.merge_param("deterministic", self.deterministic,
                                                                            deterministic)
        if not deterministic and dropout_rng is None:
            dropout_rng = self.make_rng("dropout")
        if kv_heads != self.num_heads and not getattr(self.attention_fn, "grouped", False):
            key, value = (jnp.repeat(t, self.num_heads // kv_heads, axis=-2) for t in (key, value))
        options = dict(mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                       broadcast_dropout=self.broadcast_dropout, deterministic=deterministic, dtype=self.dtype,
                       precision=self.precision)
        accepted = inspect.signature(self.attention_fn).parameters
        y = self.attention_fn(query, key, value, **{k: v for k, v in options.items() if k in accepted})
        return nn.DenseGeneral(features=self.out_features or x.shape[-1], axis=(-2, -1),
                               kernel_init=self.out_kernel_init or self.kernel_init,
                               bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias,
                               dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                               name="out")(y)


class Block(nn.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + MLP(norm(x))``.

    Attention is :func:`causal_attention` (``jax.nn.dot_product_attention``) unless dropout on the attention
    weights is on (``dropout_rate > 0`` while training), which it does not do: then flax's own
    ``nn.dot_product_attention`` with the causal ``mask`` and weight dropout. Both have the same parameters.
    With ``moe`` the MLP is a mixture of experts of those settings (:class:`dtx.models.moe.MoE`, named ``moe``).
    ``decode``: autoregressive decoding, one position per call, flax's key/value cache (the ``cache`` collection)
    holding the earlier positions' keys and values; the same parameters.

    The defaults are GPT-2's block (LayerNorm, GELU MLP of ``mlp_hidden`` units, biases, flax's
    ``MultiHeadDotProductAttention``); the modern settings (:class:`Transformer`'s ``norm``, ``mlp``, ``use_bias``,
    ``num_kv_heads``, ``positions='rope'`` as ``rope``) swap in RMSNorm, a SwiGLU MLP (``gate``, ``up``, ``down``),
    no biases and :class:`Attention` (rotary positions, grouped key/value heads), under the same parameter names.
    """

    d_model: int
    num_heads: int
    mlp_ratio: int
    dropout_rate: float
    dtype: Any
    param_dtype: Any
    moe: MoESettings | None = None
    decode: bool = False
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: int = 0  # 0: mlp_ratio * d_model
    num_kv_heads: int = 0
    use_bias: bool = True
    rope: bool = False
    rope_base: float = 10000.0
    tensor_refusal: str = ""

    def _attention(self, **kwargs):
        """Flax's attention as GPT-2 has it, or :class:`Attention` where a modern setting needs it."""
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias,
                     name="MultiHeadDotProductAttention_0")
        if self.rope or self.num_kv_heads not in (0, self.num_heads) or self.tensor_refusal:
            return Attention(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, rope=self.rope,
                             rope_base=self.rope_base, tensor_refusal=self.tensor_refusal, **dense, **kwargs)
        return nn.MultiHeadDotProductAttention(num_heads=self.num_heads, **dense, **kwargs)

    def _norm(self):
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        return nn.RMSNorm(**dense) if self.norm == "rmsnorm" else nn.LayerNorm(use_bias=self.use_bias, **dense)

    @nn.compact
    def __call__(self, x, mask, train: bool, positions=None):
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias)
        at = {} if positions is None else {"positions": positions}  # rotary positions (Attention takes them)
        h = self._norm()(x)
        if self.decode:  # one position a call: keys and values cached, the mask the cache's (positions <= this)
            grouped = {"attention_fn": masked_attention} if self.rope or self.num_kv_heads else {}
            h = self._attention(decode=True, **grouped)(h, h, **(at if self.rope else {}))
        elif train and self.dropout_rate > 0:  # dropout on the attention weights: flax's unfused attention
            h = self._attention(dropout_rate=self.dropout_rate, deterministic=False)(
                h, h, mask=mask, **(at if self.rope else {}))
        else:
            h = self._attention(attention_fn=causal_attention)(h, h, **(at if self.rope else {}))
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = self._norm()(x)
        hidden = self.mlp_hidden or self.mlp_ratio * self.d_model
        if self.moe is not None:
            h = MoE(self.moe.experts, self.moe, self.mlp_ratio, name="moe", dtype=self.dtype,
                    param_dtype=self.param_dtype)(h, train)
        elif self.mlp == "swiglu":  # Shazeer 2020: down(silu(gate(x)) * up(x))
            h = nn.silu(nn.Dense(hidden, name="gate", **dense)(h)) * nn.Dense(hidden, name="up", **dense)(h)
            h = nn.Dense(self.d_model, name="down", **dense)(h)
        else:
            h = nn.gelu(nn.Dense(hidden, **dense)(h))
            h = nn.Dense(self.d_model, **dense)(h)
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

    Modern ("Llama-style", Touvron et al. 2023, arXiv 2302.13971) blocks, each a setting whose default keeps
    GPT-2's model, parameter for parameter:

    Attributes:
      norm: ``layernorm`` (default) or ``rmsnorm`` (Zhang & Sennrich 2019, arXiv 1910.07467: ``x / rms(x) · scale``,
        no centring, no bias), in every block and before the output layer.
      positions: ``learned`` (default: a ``positions`` table added to the embeddings) or ``rope`` (rotary
        positions, Su et al. 2021, arXiv 2104.09864, applied to every block's queries and keys: no table;
        :func:`rotary`, ``rope_base`` its θ, 10000).
      mlp: ``gelu`` (default) or ``swiglu`` (Shazeer 2020, arXiv 2002.05202: ``down(silu(gate(x)) · up(x))``).
      mlp_hidden: the MLP's hidden width; 0 (default): ``mlp_ratio · d_model`` for ``gelu``, and for ``swiglu``
        two thirds of it rounded up to a multiple of 64 (Llama's 8/3·d at ``mlp_ratio=4``, so the three matrices
        hold about the parameters of GELU's two: 2048 at width 768, 192 at 64).
      num_kv_heads: grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245): key/value heads, each shared by
        ``num_heads / num_kv_heads`` query heads (:class:`Attention`); 0 (default): ``num_heads``.
      use_bias: ``False`` drops every bias (attention, MLP, norms, output layer), as Llama.

    Those settings run under data parallelism, ZeRO/FSDP and context parallelism; Megatron's tensor split and
    pipeline stages refuse them, naming the key (:func:`layout_refusal`, :meth:`pipeline_layers`).
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
    norm: str = "layernorm"
    positions: str = "learned"
    mlp: str = "gelu"
    mlp_hidden: int = 0
    num_kv_heads: int = 0
    use_bias: bool = True
    rope_base: float = 10000.0

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
        refusal = layout_refusal(self, megatron=False, stages=True)
        if refusal:
            raise ValueError(refusal)
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
        check_modern(self)
        check_settings(self.moe)
        embed = nn.Embed(self.num_classes, self.d_model, dtype=self.dtype, param_dtype=self.param_dtype)
        x = embed(tokens)
        if self.positions == "learned":
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
        modern = dict(norm=self.norm, mlp=self.mlp, mlp_hidden=mlp_width(self), num_kv_heads=self.num_kv_heads,
                      use_bias=self.use_bias, rope=self.positions == "rope", rope_base=self.rope_base,
                      tensor_refusal=layout_refusal(self, megatron=True, stages=False))
        for i in range(self.num_layers):
            moe = self.moe if self.moe.layer(i) else None
            x = block(self.d_model, self.num_heads, self.mlp_ratio, self.dropout_rate, self.dtype,
                      self.param_dtype, moe, self.decode, **modern, name=f"Block_{i}")(x, mask, train, positions)
        if self.norm == "rmsnorm":
            x = nn.RMSNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        else:
            x = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias)(x)
        if self.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias)(x)


# The modern settings' defaults: GPT-2's block (Transformer's docstring).
DEFAULTS = dict(norm="layernorm", positions="learned", mlp="gelu", mlp_hidden=0, num_kv_heads=0, use_bias=True)
_CHOICES = dict(norm=NORMS, positions=POSITIONS, mlp=MLPS)
# What Megatron's split (dtx.parallel.tensor.megatron) would get wrong with each, had it run them.
_UNSPLIT = dict(positions="its attention is recomputed from the parameters, without the rotation of queries and keys",
                num_kv_heads="it splits the key/value projections by the query heads' count",
                mlp="it pairs two Dense layers d -> f -> d and has no gate",
                norm="its tests cover LayerNorm only", use_bias="its tests cover biased layers only")


def modern_settings(model) -> list[str]:
    """The modern settings ``model`` (a :class:`Transformer`, or a ``model`` config block) sets away from GPT-2's,
    as ``model.KEY=VALUE``."""
    get = model.get if hasattr(model, "get") else lambda key, default: getattr(model, key, default)
    changed = []
    for key, default in DEFAULTS.items():
        value = get(key, default)
        if key == "num_kv_heads" and value == get("num_heads", 0):
            continue  # as many key/value heads as query heads: GPT-2's attention
        if key == "mlp_hidden" and value == get("mlp_ratio", 4) * get("d_model", 0) and get("mlp", "gelu") == "gelu":
            continue
        if value != default:
            changed.append(f"model.{key}={value!r}")
    return changed


def check_modern(model) -> None:
    """Refuse modern settings that cannot build (``model`` a :class:`Transformer` or a ``model`` config block),
    naming the key and the values it takes."""
    get = model.get if hasattr(model, "get") else lambda key, default: getattr(model, key, default)
    for key, choices in _CHOICES.items():
        if get(key, DEFAULTS[key]) not in choices:
            raise ValueError(f"model.{key}={get(key, DEFAULTS[key])!r}: choose one of {', '.join(choices)} "
                             f"(--config.model.{key}={choices[-1]})")
    heads, kv, width = get("num_heads", 4), get("num_kv_heads", 0), get("d_model", 64)
    if width % heads:
        raise ValueError(f"num_heads={heads} must divide d_model={width}")
    if kv < 0 or (kv and heads % kv):
        divisors = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(f"model.num_kv_heads={kv} must divide model.num_heads={heads} (each key/value head serves "
                         f"num_heads/num_kv_heads query heads): choose one of {divisors}, or 0 for num_heads")
    if get("positions", "learned") == "rope" and (width // heads) % 2:
        raise ValueError(f"model.positions='rope' rotates pairs of features, and a head has d_model/num_heads = "
                         f"{width // heads} (odd); choose num_heads so that each head's width is even")
    if get("mlp", "gelu") == "swiglu" and get("moe", None) is not None and _experts(get("moe", None)):
        raise ValueError("model.mlp='swiglu' sets the dense MLPs, and model.moe.experts > 0 replaces them with "
                         "experts of GELU MLPs; set --config.model.mlp=gelu or --config.model.moe.experts=0")
    if get("mlp_hidden", 0) < 0:
        raise ValueError(f"model.mlp_hidden={get('mlp_hidden', 0)} must be >= 0 (0: the mlp's default width)")


def _experts(moe) -> int:
    return moe.experts if hasattr(moe, "experts") else moe.get("experts", 0)


def mlp_width(model) -> int:
    """The MLP's hidden width (the ``mlp_hidden`` attribute's rule)."""
    if model.mlp_hidden:
        return model.mlp_hidden
    if model.mlp == "swiglu":  # two thirds of mlp_ratio * d_model, rounded up to a multiple of 64
        return 64 * -(-(2 * model.mlp_ratio * model.d_model) // (3 * 64))
    return model.mlp_ratio * model.d_model


def layout_refusal(model, megatron: bool, stages: bool) -> str:
    """The refusal of the modern settings of ``model`` (a :class:`Transformer` or a ``model`` config block) under
    Megatron's tensor split (``megatron``) or pipeline stages (``stages``), '' where none applies."""
    modern = modern_settings(model)
    if not modern or not (megatron or stages):
        return ""
    key = modern[0].split("=")[0][len("model."):]
    where = "Megatron's tensor split (parallel.name=tensor, model_axis.split=megatron)" if megatron else \
        "pipeline stages (parallel.name=pipeline, a 'stage' mesh axis)"
    why = _UNSPLIT[key] if megatron else "they cut and plan GPT-2's block"
    return (f"{modern[0]} does not run under {where}: {why}; set --config.model.{key}={DEFAULTS[key]!r}, or train "
            "it with parallel.name=data or fsdp, or a 'context' mesh axis")
