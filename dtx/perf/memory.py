"""Per-device memory of a training step, by layout: what fits, and what does not.

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054) splits data parallelism's
replicated training state in three: optimizer state (stage 1), gradients (stage
2), parameters (stage 3, FSDP). Activations are accounted per layer as in
Korthikanti et al. 2022 (arXiv 2205.05198): what the backward pass needs of the
forward pass, per example, times the examples a device holds. This module adds
both up, per device, for the layouts of :mod:`dtx.parallel`, and models when
they are live: the peak of the step, not the sum of its parts.

Per Dense/Conv layer ``l`` (``W`` weights, ``N`` devices, ``G`` the ``model``
group, ``b = B/(N·k)`` a device's share of a micro-batch, ``e_p, e_c, e_r`` bytes
of the policy's params, compute and reduce dtypes), the layer runs in a mode:

* ``data`` — weights whole: ``data``, ``zero1``, ``zero2``, unsplit layers.
* ``split`` — kernel split over the group (``model``, ``hybrid``, ``rules``): ``W/G``
  each, the group's input gathered (``b·G·in`` kept for the weight gradient).
* ``fsdp`` stores ``W/N``; XLA's SPMD partitioner then chooses per layer
  (:func:`_fsdp_mode`): **gather the weights** (whole gradient, all-reduced),
  **gather the activations** (``B·in`` kept, a ``1/N`` gradient, nothing to
  reduce) or **contract** the local slices (``B·out`` kept, ``1/N`` gradient).
  In a chain a layer's input arrives as the layer before left it; in a residual network
  (``Layer.source``, :func:`dtx.perf.layers.sources`) as its source left it, an add of
  branches split by examples if any branch is (:func:`_arriving`), and a branch added to
  one split by features gathers its activations (:func:`_partners`).
  XLA sometimes decides otherwise (docs/memory.md lists where).

Categories (``MemoryEstimate``):

* **params** ``Σ W·e_p / shards``; **optimizer** ``k`` slots (:data:`SLOTS`) like the
  params, ``1/N`` for ``zero1``/``zero2``/``fsdp`` (tensors with a dimension ``N`` divides).
* **grads** — what backprop produces: ``W·e_p`` per layer computed with whole
  weights (ZeRO-1/2 included: the step reduce-scatters after the backward pass),
  ``W/G``, ``W/N``; with ``k > 1`` micro-batches plus an accumulator (``1/N`` for
  ``zero2``/``fsdp``).
* **activations** — the batch plus, per layer, autodiff's residuals
  (:func:`activation_profile`: from the layer's output up to the next layer's
  input — ReLU outputs and masks, batch-norm's centred input and square, dropout
  masks, pool outputs — counted by JAX's own VJP, ``b·s_l``). Without a flax
  model: ``s_l = (in + out)·e_c`` (the input for ``dW``, one output-sized array).
* **buffers** — what the compiled program adds (XLA:CPU, read from its buffer
  assignment): the all-reduce's out-of-place result (``W·e_r`` per reduced
  gradient — a reduce-scatter compiles as that all-reduce plus a slice), a
  flipped copy of each convolution kernel but the first's (made before the forward
  pass for the input gradient, kept to the layer's backward; nothing asks for the
  first layer's input gradient), a max pool's ``5·in`` window-index arrays (built before the
  forward pass, freed by the pool) and ``4·out`` int32 argmax indices (kept to
  its backward; counted in activations), a re-laid-out input batch for a first
  convolution, and a compute-dtype copy of the parameters (mixed precision).
  ``backend="gpu"`` drops the XLA:CPU terms and reduce-scatters ``1/N`` (unchecked).

Peak (``total``): parameters, optimizer state and the batch live throughout; the
rest in three phases (``stash_j`` = layer ``j``'s activations)::

    forward(i)  = Σ_{j≤i} stash_j + Σ_{j≥i} pool iotas_j + Σ_j flipped_j
    backward(i) = Σ_{j≤i} (stash_j + flipped_j) + Σ_{j≥i} grad_j  (+ b·recompute: a rematerialised block,
                  dtx.perf.remat)
    update      = Σ grad + Σ reduce buffers
    total       = params + optimizer + inputs + max(forward, backward, update)

It is a model of what dtx's jit step keeps when XLA:CPU compiles it at float32,
checked against ``compiled.memory_analysis()`` (:func:`compiled_peak`):
``benchmarks/memory_model.py`` (all models × layouts), ``tests/test_memory.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dtx.optim import DECLARED
from dtx.parallel.layouts import LAYOUTS, Layout, get_layout
from dtx.perf.layers import INPUT, Join, Layer, analyze, join_members, joins
from dtx.perf.memory_profile import (  # noqa: F401
    POOL_INDEX_ARRAYS,
    Stash,
    activation_profile,
    model_terms,
)
from dtx.perf.model import Plan
from dtx.precision import Policy

SLOTS = {name: optimizer.slots for name, optimizer in DECLARED.items()}  # dtx.optim's declarations
BACKENDS = ("xla_cpu", "gpu")


class MemoryModelError(ValueError):
    """Bad input to the memory model; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of one layout; ``total`` is the step's peak (module docstring), not the sum."""

    layout: str
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    total: float
    by_layer: Mapping[str, float]  # activation bytes per Dense/Conv layer
    modes: Mapping[str, str]  # data, split, gather_weights, gather_activations, contracting
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)  # forward, backward, update: transient bytes
    outside: str = ""  # why this network lies outside the measured regime (:func:`outside_regime`), "" if it does not

    @property
    def phase(self) -> str:
        """The phase the peak falls in."""
        return max(self.phases, key=self.phases.get) if self.phases else ""

    def fits(self, capacity: float) -> bool:
        return self.total <= capacity


def _fsdp_divisible(shape: Sequence[int], n: int) -> bool:
    """Whether ``fsdp`` splits a tensor of ``shape`` over ``n`` devices (:mod:`dtx.parallel`)."""
    return n > 1 and any(d % n == 0 for d in shape)


def _split(shapes: Sequence[Sequence[int]], n: int) -> float:
    """Elements per device of tensors each split ``1/n`` when a dimension divides (``fsdp``, ZeRO state)."""
    return sum(math.prod(shape) / (n if _fsdp_divisible(shape, n) else 1) for shape in shapes)


def _tensors(layer: Layer) -> list[tuple[int, ...]]:
    """The layer's kernel and (when it has one) its bias, whose size is the output features."""
    bias = layer.weights - math.prod(layer.kernel_shape)
    return [tuple(layer.kernel_shape)] + ([(bias,)] if bias else [])


def _fsdp_mode(layer: Layer, n: int, batch: float, arriving: str, gathered: bool = False,
               pulled: bool = False) -> tuple[str, str]:
    """How XLA's SPMD partitioner runs an ``fsdp`` layer, and how it leaves the activations.

    The kernel is split along its largest dimension ``n`` divides (:mod:`dtx.parallel`).
    Split on the output features, XLA gathers the activations when the kernel is
    larger than the layer's whole-batch input (output split by features), else the
    weights. Split on the input features, it gathers the weights while the batch
    arrives split by examples, else it contracts the local slices and all-reduces
    the whole-batch output (replicated). A model of its choice, read from the
    compiled programs of the zoo (docs/memory.md). ``gathered``: a layer of a graph whose input another layer
    (its sibling, same source) already gathers; a tie (kernel = whole-batch input) then goes to the activations
    (ResNet-18 width 16's stage-4 projection beside its block's first convolution; a tie whose input no sibling
    gathers goes to the weights: ResNet-50 width 8's stage-3 last 1×1 convolutions). ``pulled``: the layer's
    output is added to a branch already split by features (ResNet-50's projection shortcut beside its block's
    last 1×1 convolution): the add asks its output split by features too, and a kernel split on its output
    features gathers the activations.
    """
    shape = layer.kernel_shape
    dim = next(d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % n == 0)
    if dim == len(shape) - 1:
        if math.prod(shape) > batch * layer.in_elements or pulled or (
                gathered and math.prod(shape) == batch * layer.in_elements):
            return "gather_activations", "features"
        return "gather_weights", "batch"
    if dim == len(shape) - 2 and arriving != "batch":
        return "contracting", "replicated"
    return "gather_weights", "batch"


def _scattered(grads: Sequence[float], kept: Sequence[float], i: int) -> float:
    """Gradient bytes live while layer ``i`` back-propagates: its own, whole, and what is kept of the later ones.

    Under ``jit`` everything is kept (``kept == grads``): XLA:CPU's SPMD partitioner turns a
    reduce-scatter into one all-reduce plus a slice after the backward pass. Under ``shard_map``
    ZeRO-1/2 call ``psum_scatter`` per tensor, which XLA:CPU compiles as a true reduce-scatter and
    schedules as soon as the gradient exists: a layer's whole gradient lives until its ``1/N`` slice is
    written (read from the buffer assignment of the held-out ``mlp-wide`` ``zero2`` row: one 512×512
    gradient live at a time beside 64×512 slices). With ``k > 1`` ZeRO-2 does so per micro-batch (into
    its ``1/N`` accumulator, ``carry``); ZeRO-1 sums whole micro-batch gradients first (``kept == grads``).
    """
    return grads[i] + (kept[i] if kept[i] != grads[i] else 0.0) + sum(kept[i + 1:])


def _partners(layers: Sequence[Layer]) -> dict[str, list]:
    """Per layer of a graph, the other branches of each :data:`dtx.perf.layers.Join` its output is one of."""
    out: dict[str, list] = {}
    for join in joins({layer.name: layer.source for layer in layers if layer.source is not None}):
        for member in join:
            if isinstance(member, str) and member != INPUT:
                out.setdefault(member, []).extend(other for other in join if other != member)
    return out


def _arriving(source: Any, left: Mapping[str, str]) -> str:
    """How the activations a graph's layer takes arrive under ``fsdp`` (:func:`_fsdp_mode`), from where its
    input comes (:func:`dtx.perf.layers.sources`) and how each layer left its output (``left``).

    The model's input arrives split by examples. A :data:`dtx.perf.layers.Join` (a residual add) is split by
    examples when any branch is, else as its first branch (by :func:`dtx.perf.layers.join_members`). Read from
    ResNet-18 width 16's compiled program (docs/memory.md): its stage-3 add of a contracted block (whole batch)
    and a projection on gathered weights (split by examples) feeds a convolution on gathered weights; its stage-4
    add of a contracted block and a projection on gathered activations (split by features) feeds contracting
    convolutions. (In a chain's order the layer before each block is its projection: the model ran stage 4's last
    block on gathered weights, 1.41 × the compiled peak.)
    """
    if isinstance(source, Join):
        branches = [_arriving(member, left) for member in join_members(source)]
        return "batch" if "batch" in branches else branches[0]
    return "batch" if source == INPUT else left.get(source, "batch")


def estimate(layers: Sequence[Layer], layout: str | Layout, *, nodes: int, global_batch: int, group_size: int = 1,
             sharded: Sequence[str] = (), optimizer: str = "adam", policy: Policy = Policy(),
             stash: Mapping[str, Stash] | None = None, input_bytes: float | None = None,
             other_params: int | Sequence[Sequence[int]] = 0,
             model_state_bytes: float = 0.0, accum_steps: int = 1, backend: str = "xla_cpu",
             explicit: bool = False, recompute: float = 0.0) -> MemoryEstimate:
    """Per-device memory of a training step of ``layers`` under ``layout``.

    Args:
      layers: from :func:`dtx.perf.layers.analyze`.
      layout: a layout of :data:`dtx.parallel.LAYOUTS` (or its name); the model reads only what it
        declares: which kernels it splits over the ``model`` axis and its ZeRO stage.
      nodes / global_batch: devices ``N`` and examples per step ``B``.
      group_size: ``G``, the ``model`` axis (``model``, ``hybrid``, ``rules``).
      sharded: for ``rules``: the layers split over ``model`` (``Plan.sharded``).
      optimizer: a name of :data:`SLOTS` (:mod:`dtx.optim`).
      policy: parameter, compute and reduce dtypes (:class:`dtx.precision.Policy`).
      stash: per layer, what :func:`activation_profile` measures; default ``(in + out)·e_c``.
      input_bytes: one example of the batch with its label (default: the first layer's input, float32).
      other_params: parameters outside Dense/Conv layers (norm scales and offsets): a count, or
        their shapes (then ``fsdp`` and ZeRO split each as :mod:`dtx.parallel` does).
      model_state_bytes: non-trainable state (batch-norm statistics), replicated.
      accum_steps: micro-batches per step.
      backend: ``"xla_cpu"`` (checked: every buffer term of the module docstring) or
        ``"gpu"`` (unchecked: no pool index arrays, kernel or input copies, and a true
        reduce-scatter for ZeRO/FSDP, ``1/N`` buffer).
      explicit: the step driver places its own collectives (``shard_map``, ``Driver.explicit`` of
        :mod:`dtx.step.drivers`): ZeRO-1/2 reduce-scatter each gradient as the backward pass produces it
        (:func:`_scattered`); ``False``: XLA's SPMD partitioner places them (``jit``).
      recompute: bytes per example a rematerialised block's recomputed forward holds in the backward pass
        (:func:`dtx.perf.remat.recompute_bytes`; 0 without remat).
    """
    if backend not in BACKENDS:
        raise MemoryModelError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    cpu = backend == "xla_cpu"
    try:
        lay = get_layout(layout)
    except ValueError:
        raise MemoryModelError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}") from None
    if lay.pairs:
        raise MemoryModelError(f"dtx.perf.memory does not model Megatron's pairs (parallel.name={lay.name!r}); "
                               "dtx.parallel.tensor.costs gives their parameter bytes and activation ratios")
    state_split_everywhere = lay.zero_stage >= 1  # the optimizer state split 1/N (ZeRO 1, 2, FSDP)
    params_split = lay.zero_stage == 3  # FSDP stores 1/N of every parameter
    if optimizer not in SLOTS:
        raise MemoryModelError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(SLOTS)}")
    n, g, k = nodes, group_size, accum_steps
    if n < 1 or g < 1 or k < 1 or n % g or global_batch % (n * k):
        raise MemoryModelError(f"global batch {global_batch} must split over {n} devices × {k} micro-batches, "
                               f"and the group size {g} must divide {n}")
    e_p, e_c = np.dtype(policy.params).itemsize, np.dtype(policy.compute).itemsize
    e_r = np.dtype(policy.reduce).itemsize
    if lay.user_rules:
        split = set(sharded)
    elif lay.splits_kernels:
        split = {layer.name for layer in layers if lay.splits(layer.kind)}
    else:
        split = set()
    split = split if g > 1 else set()
    micro = global_batch / k  # examples of one micro-batch, all devices
    once = lay.reduce == "once" and k > 1  # FSDP's "no sync" accumulation: whole accumulator, one reduction a step
    b = micro / n
    rows = []  # per layer: stash, pool iotas, flipped and re-laid-out kernels, gradient, reduce buffer
    params = optim = accumulator = 0.0
    modes, by_layer = {}, {}
    arriving = "batch"  # fsdp: how the previous layer left the activations (XLA's choice propagates)
    left: dict[str, str] = {}  # fsdp: how each layer left its output, for a graph's layers (_arriving)
    gathers: set = set()  # fsdp: the sources whose activations a graph's layer gathers (whole batch)
    partners = _partners(layers)  # fsdp: per layer of a graph, the branches its output is added to
    for i, layer in enumerate(layers):
        w, s = layer.weights, (stash or {}).get(layer.name) or Stash((layer.in_elements + layer.out_elements) * e_c)
        stored_split = params_split and _fsdp_divisible(layer.kernel_shape, n)
        act = b * (s.kept + (s.pool_kept if cpu else 0.0))  # output side: B/N examples' worth, however split
        mode, shards = "data", 1
        if layer.name in split:
            mode, shards = "split", g
            if not (cpu and layer.kind == "conv" and math.prod(layer.kernel_shape[:-2]) == 1):
                act += b * g * layer.in_elements * e_c  # the group's gathered input, kept for dW
            # A split 1×1 convolution's gathered input is gathered again in the backward pass instead
            # (measured on XLA:CPU, ResNet-50 at G = 2: twice the forward's all-gathers).
        elif stored_split:
            if layer.source is not None:  # a graph (a residual network): the input's own source, not the layer before
                arriving = _arriving(layer.source, left)
            pulled = any(_arriving(other, left) == "features" for other in partners.get(layer.name, ()))
            mode, arriving = _fsdp_mode(layer, n, micro, arriving, layer.source is not None and layer.source in gathers,
                                        pulled)
            if mode == "gather_activations" and layer.source is not None:
                gathers.add(layer.source)
            shards = 1 if mode == "gather_weights" else n
            act += micro * e_c * {"gather_weights": 0, "gather_activations": layer.in_elements,
                                  "contracting": layer.out_elements}[mode]
        if cpu and i == 0 and layer.kind == "conv":  # XLA:CPU re-lays out the batch for a first convolution
            act += b * layer.in_elements * e_c
        modes[layer.name], by_layer[layer.name] = mode, act
        left[layer.name] = arriving if layer.source is None or mode != "data" else _arriving(layer.source, left)
        stored = _split(_tensors(layer), n) if params_split else w / shards
        params += stored * e_p
        state_split = state_split_everywhere and _fsdp_divisible(layer.kernel_shape, n)
        optim += SLOTS[optimizer] * (_split(_tensors(layer), n) if state_split_everywhere else stored) * e_p
        grad = w * e_p / shards
        accumulator += grad / (n if lay.zero_stage >= 2 and state_split and shards == 1 else 1)
        reduced = n // shards > 1  # devices holding the same slice sum their gradients
        buffer = grad * e_r / e_p / (n if not cpu and state_split_everywhere else 1) if reduced else 0.0
        if once:  # each device sums its own whole gradient; after the loop one reduce-scatter (XLA:CPU: an
            # all-reduce of the whole, then a slice): W per device twice at the update, whatever the layer's mode
            accumulator += w * e_p - grad / (n if state_split and shards == 1 else 1)
            buffer = w * e_r / (1 if cpu else n)
        # Flipped for the input gradient, kept to the backward; the first layer has no input gradient. (A
        # second, re-laid-out copy for the forward pass is not counted: on held-out models a 3×3 kernel
        # costs the compiled peak its parameters and one copy, tests/test_memory.py.)
        copy = w * e_c / shards if cpu and layer.kind == "conv" and i > 0 else 0.0
        kept = grad
        scattered = lay.zero_stage == 2 or (lay.zero_stage == 1 and k == 1)  # per micro-batch / once
        if explicit and scattered and state_split:  # reduce-scattered as produced (_scattered)
            kept, buffer = grad / n, 0.0
        rows.append((act, b * s.pool_in if cpu else 0.0, copy, grad, buffer, kept))
    shapes = [(other_params,)] if isinstance(other_params, int) else [tuple(x) for x in other_params]
    other = sum(math.prod(shape) for shape in shapes) * e_p
    params += (_split(shapes, n) * e_p if params_split else other)
    optim += SLOTS[optimizer] * (_split(shapes, n) * e_p if state_split_everywhere else other)
    stash_, held, copies, grads, reduce, kept = (list(column) for column in zip(*rows))
    grads[-1] += other  # norm-parameter gradients, small: counted with the last layer's
    kept[-1] += other
    carry = accumulator + other if k > 1 else 0.0  # the accumulator beside each micro-batch's gradient
    inputs = (input_bytes if input_bytes is not None else layers[0].in_elements * 4 + 4) * global_batch / n
    compute_copy = params * e_c / e_p if e_c != e_p else 0.0
    count = range(len(layers))
    forward = max(sum(stash_[:i + 1]) + sum(held[i:]) for i in count) + sum(copies)
    backward = max(sum(stash_[:i + 1]) + sum(copies[:i + 1]) + _scattered(grads, kept, i) for i in count)
    backward += b * recompute  # one block's recomputed residuals at a time (dtx.perf.remat)
    # After the last micro-batch its own gradient is folded in: the accumulator is the step's gradient.
    update = (carry if k > 1 else sum(kept)) + sum(reduce)
    phases = dict(forward=forward + compute_copy, backward=backward + compute_copy + carry, update=update)
    peak = max(phases.values())
    total = params + optim + inputs + model_state_bytes + peak
    return MemoryEstimate(
        layout=lay.name, params=params, grads=sum(kept) + carry, optimizer=optim, activations=inputs + sum(stash_),
        buffers=sum(reduce) + sum(copies) + sum(held) + compute_copy, total=total, by_layer=by_layer, modes=modes,
        phases=phases, outside=outside_regime(layers, stash or {}, total, b, e_c) if cpu else "")


WIDE_OUTPUT = 0.2  # a convolution's output per device over the estimate: measured up to 0.18 within 15 %, 0.21+ not


def outside_regime(layers: Sequence[Layer], stash: Mapping[str, Stash], total: float, b: float, e_c: int) -> str:
    """Why an XLA:CPU estimate of this network may miss by more than 15 %, from its layers ("" where none says so).

    Measured on users' convolutional networks outside benchmarks/memory_model.py's tables (docs/memory.md,
    tests/test_memory.py): a convolution whose output on one device (``b`` examples) is more than
    :data:`WIDE_OUTPUT` of the estimated peak — a 512-1024-wide one after a pool, 1×1 or 3×3, or 128-256
    examples a device — reads 0.53-0.82 of the compiled peak: XLA:CPU holds more arrays of that size at once
    (the output before and after its bias, ReLU's zero materialised as a broadcast, the output's gradient
    and a re-laid-out copy of it) than the residuals the model counts. A max pool of stride 1 (its output as
    large as its input, padded ``SAME``) reads 0.72-0.84.
    """
    why = []
    widest = max((layer for layer in layers if layer.kind == "conv"), key=lambda layer: layer.out_elements,
                 default=None)
    if widest is not None and b * widest.out_elements * e_c > WIDE_OUTPUT * total:
        why.append(f"convolution {widest.name}'s output on one device is over {WIDE_OUTPUT:.0%} of the estimate "
                   "(such networks measured 0.53-0.82x the compiled peak)")
    for name, s in stash.items():
        if s.pool_in and s.pool_kept / POOL_INDEX_ARRAYS >= s.pool_in / (POOL_INDEX_ARRAYS + 1):
            why.append(f"a stride-1 max pool after {name} (its output as large as its input; measured 0.72-0.84x)")
            break
    return "; ".join(why)


def uncovered(layout: str | Layout, *, accum_steps: int = 1, policy: Policy = Policy(), backend: str = "xla_cpu",
              explicit: bool = False) -> str:
    """Why :func:`estimate` may miss this regime by more than 15 % ("" where it is checked to hold).

    Measured (benchmarks/memory_model.py, held-out table; docs/memory.md): FSDP, whose peak depends on
    which layers XLA's SPMD partitioner runs on gathered weights, gathered activations or contracted
    slices and on when it gathers them (held-out rows 0.62 to 1.14 of XLA's; residual networks, whose adds
    now decide how a layer's input arrives, 0.82 to 1.14, tests/test_residual_memory.py); accumulation under
    ``jit`` with kernels split over ``model`` (each model group's gradient summed apart, :mod:`dtx.step.accumulate`;
    no held-out row measures it: whole gradients per device read 0.96 and 1.01); a compute
    dtype narrower than float32 on XLA:CPU, which computes in float32 and keeps converted copies (0.68 to 0.90).
    """
    lay = get_layout(layout)
    if lay.memory_doubt:  # a parallelism that says where the model is loose for it (context, expert)
        return lay.memory_doubt
    if lay.zero_stage == 3:
        return ("FSDP: XLA's partitioner chooses per layer whether to gather weights or activations and when; "
                "held-out FSDP rows were 0.62-1.14x the compiled peak (with parallel.reduce=once: MLPs 0.93-1.00, "
                "conv nets 0.43-0.70)")
    if accum_steps > 1 and not explicit and lay.splits_kernels:
        return ("gradient accumulation under jit with kernels split over model (each model group's gradient summed "
                "apart, dtx/step/accumulate.py): no held-out row measures it")
    if backend == "xla_cpu" and np.dtype(policy.compute).itemsize < 4:
        return "a 2-byte compute dtype on XLA:CPU (computed in float32): measured 0.68-0.90x the compiled peak"
    return ""


def estimate_plan(plan: Plan, **kwargs) -> MemoryEstimate:
    """The memory of a :class:`dtx.perf.model.Plan`: its split layers in groups of ``G``, the rest data-parallel."""
    return estimate(plan.layers, "rules", nodes=plan.nodes, global_batch=plan.global_batch,
                    group_size=plan.group_size, sharded=plan.sharded, **kwargs)


def estimate_model(model: Any, input_shape: Sequence[int], layout: str, *, dtype: Any = np.float32,
                   **kwargs) -> MemoryEstimate:
    """:func:`estimate` for a flax model (:func:`model_terms`: residuals, norm parameters, batch-norm state;
    ``dtype``: of its inputs)."""
    return estimate(analyze(model, input_shape, dtype=dtype), layout,
                    **{**model_terms(model, input_shape, dtype), **kwargs})


def compiled_peak(compiled: Any) -> int:
    """XLA's per-device peak of a compiled step: ``argument + output − alias + temp`` bytes.

    Arguments (state and batch) live throughout; outputs that do not alias a
    donated argument are extra; ``temp`` is the buffer assignment's temporary
    allocation (its own peak, fragmentation included). (``peak_memory_in_bytes``
    of this jax omits ``temp`` on CPU, so it is not used.)
    """
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
