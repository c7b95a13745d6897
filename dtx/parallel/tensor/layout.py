"""Megatron tensor parallelism and sequence parallelism: column-split layers paired with row-split ones.

Shoeybi et al., *Megatron-LM* (arXiv 1909.08053, §3): a transformer block's two weight pairs are split
over the ``T`` devices of the ``model`` axis so that one reduction closes each pair. Attention's query,
key and value projections are split by heads (columns), each device attends with its ``h/T`` heads, and
the output projection is split by its input rows, so each device holds a partial sum of the block's
output; the MLP's up-projection is split by columns, GELU runs on the split hidden units, the
down-projection by rows. Forward: one all-reduce of ``B·S·H`` elements per pair (Megatron's ``g``);
backward: one per pair of the input gradient (its ``f``) — two and two per block, ``B`` the examples
of one data shard.

Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models* (arXiv 2205.05198,
§4.2.2), sequence parallelism (``tensor.sequence_parallel=True``): between the pairs the activations are
split over ``T`` along the sequence, so LayerNorm, dropout and the residual adds run on ``1/T`` of the
tokens and keep ``1/T`` of their activations; each all-reduce becomes a reduce-scatter onto the sequence
split (after the row layer) and an all-gather from it (before the column layer) — the same bytes. The
gathered input of a column layer is not kept for its weight gradient: it is gathered again in the
backward pass (the paper's choice; one more all-gather per pair), so every activation of a block is
``1/T``.

Which layers pair is read from the parameters, never from edits to the model (:func:`dtx.parallel.tensor.megatron.megatron_rules`):
a module with ``query``/``key``/``value``/``out`` kernels of rank 3 (flax's
``MultiHeadDotProductAttention``: ``(in, heads, head_dim)`` and ``(heads, head_dim, out)``) is split by
heads; two consecutive ``Dense`` layers of one module whose widths chain ``d → f → d`` are a column/row
pair. Every other parameter (embeddings, positions, LayerNorms, the output head) is replicated. The
activation layout (:class:`TensorLayout`) intercepts those modules (``nn.intercept_methods``) and runs
each split one as a ``shard_map`` region with the collectives written out; the rest of the model sees
the residual stream where the layout puts it:

* the token ids: split by examples over the data axes (and by positions over ``model`` under SP);
* embeddings, LayerNorms, residual adds: replicated over ``model`` (TP) or split by positions (SP);
* the output head: split by examples over every axis under TP (``1/T`` of its work per device, its input
  gradient all-gathered over ``model`` once per step), by positions under SP (no collective).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, register_check
from dtx.models.remat import PROJECTION
from dtx.parallel import nested
from dtx.parallel.rules import PartitionError
from dtx.parallel.tensor import megatron
from dtx.parallel.tensor.megatron import _ATTENTION
from dtx.paths import named_leaves

MODEL = mesh_lib.MODEL_AXIS
BLOCK, SETTINGS = "tensor", ("sequence_parallel", "zero_stage")  # the config block of its settings, and its keys


@dataclasses.dataclass(frozen=True, eq=False)
class TensorLayout:
    """Where a Megatron-split transformer's activations live, and the regions that split its layers.

    Call it for the interception context, as :class:`dtx.parallel.activations.ActivationLayout`.

    Attributes:
      mesh: the device mesh (a ``model`` axis of size ``T``; the other axes carry the batch).
      kernels: the split layers: layer path -> its kernel's spec (attention modules by their ``query`` kernel).
      attention: paths of the attention modules split by heads.
      columns / rows: paths of the MLP's column-split and row-split Dense layers.
      sequence_parallel: keep activations between the pairs split by positions (Korthikanti et al.).
      context: a context-parallel split of every sequence composed with this one (a ``context`` mesh axis:
        :class:`dtx.parallel.context.layout.ContextSplit`), else ``None``. Positions then split over ``context``
        everywhere (and further over ``model`` under SP: ``S/(C·T)`` per device between the pairs), and each
        region's attention runs the context kernel over its ``h/T`` heads.
    """

    mesh: Mesh
    kernels: Mapping[str, P]
    attention: frozenset[str]
    columns: frozenset[str]
    rows: frozenset[str]
    sequence_parallel: bool = False
    mapped: tuple[str, ...] = ()
    context: Any = None
    # Gradient accumulation under jit maps the loss over the data groups (dtx.step.accumulate) so that each
    # group's gradient is reduced once per step. A vmap of these shard_map regions (spmd_axis_name) fails JAX's
    # replication typing (pvary of a value the map already varies), so the map is a shard_map manual over the
    # data axes (manual), inside which the regions are shard_maps over model (inside_map).
    mappable: ClassVar[bool] = False

    @property
    def manual(self) -> bool:
        """Whether the regions can nest in a map over the data axes (above); composed with a context split, whose
        regions map over ``context`` too, the step accumulates in the global view instead."""
        return self.context is None

    @property
    def _positions(self):
        """The mesh axes a sequence's positions split over between the pairs: ``context`` (composed), then
        ``model`` under SP — context-major, so gathering over ``model`` yields a device's context chunk."""
        axes = ((self.context.axis,) if self.context is not None else ()) + ((MODEL,) if self.sequence_parallel
                                                                              else ())
        return self._entry(axes)

    @property
    def _chunk(self):
        """Where a region's gathered positions live: a device's context chunk, or the whole sequence."""
        return self.context.axis if self.context is not None else None

    def prepare(self, batch):
        """The batch as the devices hold it: the context split's load-balanced order where one is composed
        (:meth:`dtx.parallel.context.layout.ContextSplit.prepare`)."""
        return batch if self.context is None else self.context.prepare(batch)

    @property
    def size(self) -> int:
        return self.mesh.shape[MODEL]

    def _data(self):
        return self._entry(mesh_lib.group_batch_axes(self.mesh))

    def _entry(self, axes):
        axes = tuple(a for a in axes if a not in self.mapped)  # a map's manual axes are in no spec inside it
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def _mesh(self):
        return jax.sharding.get_abstract_mesh() if self.mapped else self.mesh

    def between(self, ndim: int) -> P:
        """Where the residual stream lives: examples over the data axes, positions over ``model`` under SP (and over
        ``context`` first where a context split is composed)."""
        return P(self._data(), self._positions if ndim > 2 else None, *[None] * (ndim - 2))

    def inside_map(self, axes: tuple[str, ...]) -> TensorLayout:
        """This layout inside a ``shard_map`` manual over the data ``axes`` (:func:`dtx.step.accumulate.
        manual_gradients`): those axes leave every spec, and each region maps over ``model`` only."""
        if MODEL in axes or self.context is not None:
            raise ValueError(f"a tensor-parallel layout's model groups cannot be split by a map over {axes}")
        return dataclasses.replace(self, mapped=tuple(axes))

    def __call__(self, arriving: P | None = None):
        inside: list[str] = []

        def intercept(next_fun, args, kwargs, context):
            module = context.module
            if inside or not args:
                return next_fun(*args, **kwargs)
            if context.method_name == "attend" and isinstance(module, nn.Embed) and getattr(args[0], "ndim", 0) == 3:
                return head(next_fun, args, kwargs)  # a tied output layer: the head's layout
            if context.method_name != "__call__":  # remat's lifted calls among them: not the model's own call
                return next_fun(*args, **kwargs)
            if self.context is not None:  # the model: the balanced sequence's global positions (positions=)
                kwargs = self.context.root_kwargs(module, args, kwargs)
            path = "/".join(module.path)
            region = (self._attention if path in self.attention else self._column if path in self.columns
                      else self._row if path in self.rows else None)
            if region is not None:
                inside.append(path)
                try:
                    return region(module, path, args, kwargs)
                finally:
                    inside.pop()
            if isinstance(module, nn.Embed):  # the ids to the stream's split: an int32 exchange, not B·S·H
                tokens = args[0]
                if self.sequence_parallel and tokens.ndim >= 2:
                    self._check_positions(tokens.shape[1], path)
                tokens = self._constrain(tokens, P(*self.between(tokens.ndim + 1)[:tokens.ndim]))
                return self._constrain(next_fun(tokens, *args[1:], **kwargs), self.between(tokens.ndim + 1))
            x = args[0]
            if not (hasattr(x, "ndim") and x.ndim == 3 and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)):
                return next_fun(*args, **kwargs)
            if isinstance(module, (nn.Dense, nn.DenseGeneral)):
                return head(next_fun, args, kwargs)
            # The rest (LayerNorm, dropout, the blocks) keeps the stream where it lives.
            spec = self.between(3)
            out = next_fun(self._constrain(x, spec), *args[1:], **kwargs)
            return self._constrain(out, spec) if getattr(out, "ndim", 0) == 3 else out

        def head(next_fun, args, kwargs):
            """A replicated Dense (the output head, or a tied embedding's ``attend``) runs data parallel over every
            device, as in dtx.parallel.activations: 1/T of its work each, its logits where the labels are."""
            spec = P(self._entry(mesh_lib.batch_axes(self.mesh)), self._chunk, None)
            return self._constrain(next_fun(self._constrain(args[0], spec), *args[1:], **kwargs), spec)

        return nn.intercept_methods(intercept)

    def _constrain(self, x, spec: P):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self._mesh(), spec))

    def _check_positions(self, length: int, layer: str) -> None:
        size = self.size * (self.context.size if self.context is not None else 1)
        if length % size:
            fits = [n for n in range(size, 4 * size + 1, size)]
            over = (f"the {MODEL!r} and 'context' axes ({size} devices)" if self.context is not None
                    else f"the {MODEL!r} axis of size {size}")
            raise PartitionError(
                f"tensor.sequence_parallel=True splits layer {layer!r}'s {length} positions over {over}, which "
                f"does not divide them; use a sequence length that {size} divides "
                f"(dataset.seq_len, e.g. {fits}), or tensor.sequence_parallel=False")

    def _projections(self, x, layers, dtype, precision):
        """``[x·W + b for (W, b) in layers]`` with ``x`` the region's input as it arrives, each device's columns:
        one all-gather of ``x`` over the positions under SP (none under TP), and in the backward pass one
        reduction of the summed input gradient (Megatron's ``f``: a reduce-scatter under SP, an all-reduce under
        TP). Under SP the backward pass gathers ``x`` again for the weight gradients instead of keeping the
        gathered copy (Korthikanti et al. §4.2.2), so what the layer keeps is ``1/T``. A custom VJP rather than
        ``jax.checkpoint``: XLA:CPU drops remat's optimisation barriers and merges the second gather into the
        first, keeping the whole input alive; the second gather here is a different instruction."""
        sp = self.sequence_parallel

        def apply(whole, kernels, biases):
            return megatron.products(whole, list(zip(kernels, biases)), dtype, precision)

        def gather(x, again=False):
            if not sp:
                return jax.lax.pcast(x, MODEL, to="varying")
            if not again:
                return jax.lax.all_gather(x, MODEL, axis=1, tiled=True)
            swapped = jax.lax.all_gather(jax.numpy.swapaxes(x, 0, 1), MODEL, axis=0, tiled=True)
            return jax.numpy.swapaxes(swapped, 0, 1)

        @jax.custom_vjp
        def project(x, kernels, biases):
            return apply(gather(x), kernels, biases)

        def forward(x, kernels, biases):
            return project(x, kernels, biases), (x, kernels, biases)

        def backward(saved, cotangents):
            x, kernels, biases = saved
            _, vjp = jax.vjp(apply, gather(x, again=True), kernels, biases)  # its forward products: dead code
            d_whole, d_kernels, d_biases = vjp(cotangents)
            return self._reduce(d_whole), d_kernels, d_biases

        project.defvjp(forward, backward)
        kernels = [kernel for kernel, _ in layers]
        biases = [bias for _, bias in layers]
        # Matmul outputs that remat's dots keeps: its policy does not see the dot_general inside a custom VJP.
        return tuple(checkpoint_name(y, PROJECTION) for y in project(x, kernels, biases))

    @property
    def _pair(self) -> megatron.Pair:
        """Megatron's ``f`` and ``g`` inside this layout's regions (:mod:`dtx.parallel.tensor.megatron`'s kernels run
        with them): the input gathered (SP; again in the backward pass) or taken as it is (TP), its gradient
        reduced; the partial sums all-reduced or reduce-scattered."""
        return megatron.Pair(self._projections, self._reduce)

    def _reduce(self, y):
        """A row region's partial sums: all-reduced (TP) or reduce-scattered onto the positions (SP)."""
        if self.sequence_parallel:
            return jax.lax.psum_scatter(y, MODEL, scatter_dimension=1, tiled=True)
        return jax.lax.psum(y, MODEL)

    def _region(self, per_device, in_specs, out_specs):
        if self.mapped:  # nested in the map over the data axes: manual over model only
            return nested.region(per_device, in_specs, out_specs, MODEL)
        return jax.shard_map(per_device, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def _stream(self, x, layer: str) -> Any:
        if x.ndim != 3:
            raise PartitionError(f"parallel.name='tensor': layer {layer!r} takes (batch, positions, features) "
                                 f"activations, got shape {x.shape}")
        if self.sequence_parallel:
            self._check_positions(x.shape[1], layer)
        return self.between(3)

    def _column(self, module, path, args, kwargs):
        """An MLP up-projection: the whole input times this device's ``1/T`` of the columns (and bias)."""
        x, params = args[0], module.variables["params"]
        between = self._stream(x, path)
        specs = {"kernel": P(None, MODEL), "bias": P(MODEL)}

        def per_device(x, params):
            return megatron.column(module, params, x, self._pair)

        return self._region(per_device, (between, {k: specs[k] for k in params}),
                            P(self._data(), self._chunk, MODEL))(x, dict(params))

    def _row(self, module, path, args, kwargs):
        """An MLP down-projection: this device's ``1/T`` of the hidden units times its rows, reduced; the bias after."""
        x, params = args[0], module.variables["params"]
        between = self._stream(x, path)

        def per_device(x, kernel):
            return megatron.row(module, kernel, x, self._pair)

        y = self._region(per_device, (P(self._data(), self._chunk, MODEL), P(MODEL, None)), between)(
            x, params["kernel"])
        return y + params["bias"].astype(y.dtype) if "bias" in params else y

    def _attention(self, module, path, args, kwargs):
        """Self-attention with ``h/T`` heads per device (:func:`dtx.parallel.tensor.megatron.attention` in a region): Q, K,
        V of its heads, attention, its rows of the output projection; the partial outputs reduced once, the
        output bias added after."""
        x = args[0]
        megatron.check_self_attention(module, args, kwargs, path, "parallel.name='tensor'")
        attention_fn = None if self.context is None else self.context.local_attention(module)
        between = self._stream(x, path)
        params = dict(module.variables["params"])
        out_bias = params["out"].get("bias")
        mask = kwargs.get("mask")
        deterministic, rng = megatron.dropout_of(module, kwargs)
        split = {"kernel": P(None, MODEL, None), "bias": P(MODEL, None)}
        specs = {name: {k: split[k] for k in params[name]} for name in _ATTENTION[:3]}
        specs["out"] = {"kernel": P(MODEL, None, None)}
        extras, extra_specs = {}, {}  # present ones only: shard_map takes no None inputs
        if mask is not None:
            extras["mask"] = mask
            extra_specs["mask"] = P() if mask.shape[0] != x.shape[0] else P(self._data(), *[None] * (mask.ndim - 1))
        if rng is not None:
            extras["rng"], extra_specs["rng"] = rng, P()

        def per_device(x, params, extras):
            rng = extras.get("rng")
            if rng is not None:  # each device's examples and heads drop their own weights
                for axis in self.mesh.axis_names:
                    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis))
            return megatron.attention(module, params, x, self._pair, extras.get("mask"), rng, deterministic,
                                      attention_fn)

        params["out"] = {"kernel": params["out"]["kernel"]}
        y = self._region(per_device, (between, specs, extra_specs), between)(x, params, extras)
        return y + out_bias.astype(y.dtype) if out_bias is not None else y


def tensor_layout(specs: Any, mesh: Mesh, sequence_parallel: bool = False, context: Any = None) -> TensorLayout:
    """The activation layout implied by Megatron's parameter specs (:func:`dtx.parallel.tensor.megatron.megatron_rules`),
    composed with ``context`` (a context split of every sequence) where one is given."""
    kernels, attention, columns, rows = {}, set(), set(), set()
    for path, spec in named_leaves(specs, is_leaf=lambda x: isinstance(x, P)):
        if not path.endswith("/kernel") or MODEL not in tuple(spec):
            continue
        layer, _, name = path[: -len("/kernel")].rpartition("/")
        if name == "query" and len(spec) == 3:
            attention.add(layer)
            kernels[layer] = spec
        elif len(spec) == 2:
            (columns if spec[1] == MODEL else rows).add(path[: -len("/kernel")])
            kernels[path[: -len("/kernel")]] = spec
    return TensorLayout(mesh, kernels, frozenset(attention), frozenset(columns), frozenset(rows),
                        bool(sequence_parallel), context=context)


@register_check
def check_config(config) -> None:
    """``tensor.*`` holds only its settings (which layout takes the block: :func:`dtx.parallel.layouts.check_config`).
    """
    block = config.get(BLOCK)
    unknown = sorted(set(block.keys()) - set(SETTINGS)) if block is not None else []
    if unknown:
        raise ConfigError(f"{BLOCK}.{unknown[0]} is not a setting; {BLOCK}.* takes {', '.join(SETTINGS)}")
    if block is not None and block.get("zero_stage", 0) not in (0, 1, 2, 3):
        raise ConfigError(f"tensor.zero_stage={block.zero_stage!r}: choose 0 (none), 1 (optimizer state), 2 (and "
                          "gradients) or 3 (and parameters) split over the data axes")
