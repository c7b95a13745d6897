"""Mixed-precision policy and loss scaling.

The Hitchhiker's Guide (§4.2, "mixed precision") and Micikevicius et al. 2018
("Mixed Precision Training"): keep float32 master weights, compute in a 16-bit
type, keep the loss and softmax in float32, and — for float16, whose exponent is
narrow — scale the loss so small gradients do not flush to zero, skipping steps
whose gradients overflow.

A :class:`Policy` names four dtypes: ``params`` (stored master weights),
``compute`` (activations, matmul inputs), ``output`` (what the model returns) and
``reduce`` (what gradients travel in between devices). It is parsed from
``"params=float32,compute=bfloat16,output=float32"`` or the short
``"p=f32,c=bf16,o=f32,r=f32"``. bfloat16 is chosen explicitly: nothing here
picks float16 behind the user's back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
}
_FIELDS = {"params": "params", "p": "params", "compute": "compute", "c": "compute",
           "output": "output", "o": "output", "reduce": "reduce", "r": "reduce"}


class PrecisionError(ValueError):
    """A policy string or loss-scale setting that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of a mixed-precision run (all ``numpy.dtype``)."""

    params: Any = np.dtype("float32")
    compute: Any = np.dtype("float32")
    output: Any = np.dtype("float32")
    reduce: Any = np.dtype("float32")

    def cast_to_compute(self, tree):
        return _cast_floats(tree, self.compute)

    def cast_to_params(self, tree):
        return _cast_floats(tree, self.params)

    def cast_to_output(self, tree):
        return _cast_floats(tree, self.output)

    def cast_to_reduce(self, tree):
        return _cast_floats(tree, self.reduce)

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 anywhere on the gradient's path underflows without loss scaling (bfloat16 has
        float32's range): gradients take the params' dtype, flow back through output and compute,
        and travel in reduce."""
        return np.dtype("float16") in (self.params, self.compute, self.output, self.reduce)

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name).name}" for f in dataclasses.fields(self))


def parse_policy(spec: str) -> Policy:
    """Parse ``"params=float32,compute=bfloat16,output=float32[,reduce=...]"`` (or ``p=f32,c=bf16,...``).

    Unspecified fields default to float32, except ``compute``, which follows ``params``.

    Example:
      >>> parse_policy("p=f32,c=bf16")
      Policy(params=dtype('float32'), compute=dtype(bfloat16), output=dtype('float32'), reduce=dtype('float32'))
    """
    values: dict[str, np.dtype] = {}
    for item in filter(None, (part.strip() for part in str(spec).split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in _FIELDS:
            raise PrecisionError(
                f"precision {spec!r}: {item!r} is not NAME=DTYPE with NAME in params|compute|output|reduce "
                "(or p|c|o|r); example: 'params=float32,compute=bfloat16,output=float32'"
            )
        if value not in _DTYPES:
            raise PrecisionError(
                f"precision {spec!r}: unknown dtype {value!r} for {_FIELDS[key]}; use one of "
                "float32 (f32), bfloat16 (bf16), float16 (f16)"
            )
        if _FIELDS[key] in values:
            raise PrecisionError(f"precision {spec!r}: {_FIELDS[key]} is given twice")
        values[_FIELDS[key]] = np.dtype(_DTYPES[value])
    values.setdefault("params", np.dtype("float32"))
    values.setdefault("compute", values["params"])
    return Policy(**values)


def _cast_floats(tree, dtype):
    """Cast floating-point leaves only: labels, masks and counters keep their integer types."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


# ----------------------------------------------------------------------------- loss scaling


class LossScaleState(NamedTuple):
    """Dynamic loss scale carried in the train state (so checkpoints resume it exactly).

    Attributes:
      scale: float32 scalar the loss is multiplied by before differentiation.
      good_steps: consecutive finite steps since the scale last changed.
      skipped_steps: total steps skipped for non-finite gradients.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, §3.2): grow ×``1/backoff`` every
    ``growth_interval`` finite steps, multiply by ``backoff`` and skip the step on overflow.

    ``enabled=False`` gives a scaler that never scales and never skips (float32/bfloat16).
    """

    enabled: bool = False
    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    backoff: float = 0.5
    min_scale: float = 1.0

    def __post_init__(self):
        if self.enabled:
            if not self.initial_scale >= self.min_scale > 0:
                raise PrecisionError(
                    f"loss_scale: need initial_scale >= min_scale > 0, got {self.initial_scale}, {self.min_scale}"
                )
            if not 0 < self.backoff < 1:
                raise PrecisionError(f"loss_scale.backoff={self.backoff} must be in (0, 1)")
            if self.growth_interval < 1:
                raise PrecisionError(f"loss_scale.growth_interval={self.growth_interval} must be >= 1")

    def init(self) -> LossScaleState:
        scale = self.initial_scale if self.enabled else 1.0
        return LossScaleState(jnp.float32(scale), jnp.int32(0), jnp.int32(0))

    def scale_loss(self, state: LossScaleState, loss: jax.Array) -> jax.Array:
        return loss * state.scale.astype(loss.dtype) if self.enabled else loss

    def unscale(self, state: LossScaleState, grads):
        if not self.enabled:
            return grads
        return jax.tree.map(lambda g: g / state.scale.astype(g.dtype), grads)

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """Next state after a step whose (globally reduced) gradients were ``finite``."""
        if not self.enabled:
            return state
        grow = jnp.logical_and(finite, state.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, state.scale / self.backoff, state.scale),
            jnp.maximum(state.scale * self.backoff, self.min_scale),
        )
        good = jnp.where(jnp.logical_and(finite, ~grow), state.good_steps + 1, 0)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32),
                              state.skipped_steps + (~finite).astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    """True when every element of every floating leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def select_tree(pred: jax.Array, on_true, on_false):
    """Elementwise ``pred ? on_true : on_false`` over two trees of the same structure."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)
