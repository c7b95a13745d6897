"""FLOPs of a compiled step, peak FLOP/s per device kind, and utilisation (MFU and HFU).

Two utilisations, as Chowdhery et al. (*PaLM*, arXiv 2204.02311, App. B) define them:

* **MFU, model FLOPs utilisation**: the *useful* work — forward + backward of the
  model on the global batch, counted analytically over every matrix product
  (:func:`dtx.perf.layers.model_flops`: Dense/Conv layers, attention's projections and
  score and value products, a tied output layer; 6 × multiply-accumulates per example) — over the
  whole mesh's peak: ``model_flops / (step_seconds · peak · num_devices)``. Redundant
  work (a layer computed twice, recomputation) does not raise it.
* **HFU, hardware FLOPs utilisation**: what the devices actually execute, from
  XLA's own cost analysis of the compiled step
  (``jitted.lower(*args).compile().cost_analysis()``) — forward, backward, optimizer,
  element-wise layers, and any redundant work — over one device's peak:
  ``compiled_flops_per_device / (step_seconds · peak)``.

HFU above MFU means work the model does not need — or work the analytic count does
not see: element-wise layers, and matrix products outside flax's Dense/Conv/DenseGeneral,
``Embed.attend`` and ``MultiHeadDotProductAttention`` (an ``einsum`` in a model's own code).
HFU can also sit a little below MFU: by convention
the model counts the first layer's input gradient, which no program computes.

What XLA reports, checked on jax 0.10 (``tests/test_flops.py``):

* **Per device.** For a ``shard_map`` step and for a ``jit`` step with
  ``NamedSharding`` alike, the analysis is of the SPMD-partitioned program one
  device runs: a matmul over a batch split 8 ways counts 1/8 of its global FLOPs.
  MFU therefore divides by *one* device's peak; the whole mesh did
  ``flops * mesh.size`` (replicated work, such as the ``jit`` driver's optimizer
  update on replicated parameters, is counted on every device).
* **Loops count once.** The body of a ``while`` loop (``lax.scan``, ``fori_loop``) is
  counted a single time, whatever its trip count, so a step with gradient
  accumulation (a scan over micro-batches) is under-counted; :func:`step_flops`
  cannot see the trip count and callers skip MFU for such steps.
* jax 0.10 returns a dict from ``cost_analysis()``; older releases returned a list
  with one dict per program, and some backends return ``None`` — all handled here.

The peak table holds dense (no sparsity) tensor-unit rates per device as JAX
enumerates devices (one GPU; one TPU chip — v2/v3 expose each core as a device).
``float32`` is the rate XLA reaches for float32 dots at JAX's default precision:
TF32 tensor cores on Ampere and later GPUs, single-pass bfloat16 on TPUs. CPUs have
no entry: MFU is then omitted unless ``peak_flops`` (the config key) is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# Dense peak FLOP/s per device, by dtype; from the vendors' data sheets.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA (SXM parts unless named): bf16/fp16 tensor cores; float32 = TF32 tensor cores.
    "b200": {"bfloat16": 2.25e15, "float16": 2.25e15, "float32": 1.1e15},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "h100 pcie": {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12},
    "h100 nvl": {"bfloat16": 835e12, "float16": 835e12, "float32": 418e12},
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "l40s": {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12},
    "l4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "a10g": {"bfloat16": 70e12, "float16": 70e12, "float32": 35e12},
    "v100": {"float16": 125e12, "float32": 15.7e12},  # no bfloat16 unit: XLA computes it in float32
    "t4": {"float16": 65e12, "float32": 8.1e12},
    # Google TPUs, per device (chip); float32 dots run as bfloat16 passes at default precision.
    "tpu v6 lite": {"bfloat16": 918e12, "float32": 918e12},  # v6e (Trillium)
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12},  # v5e
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12},
    "tpu v5": {"bfloat16": 459e12, "float32": 459e12},  # v5p reports "TPU v5"
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12},
    "tpu v3": {"bfloat16": 61.5e12, "float32": 61.5e12},  # per core (a chip has two)
    "tpu v2": {"bfloat16": 23e12, "float32": 23e12},  # per core
}


def cost_analysis(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled executable as one flat dict (``{}`` when unavailable).

    Accepts the forms JAX has returned across releases: a dict, a list with one
    dict per program (summed), or ``None``.
    """
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 — some backends raise "not implemented"; that means "unknown"
        return {}
    if analysis is None:
        return {}
    if isinstance(analysis, Mapping):
        return dict(analysis)
    total: dict[str, float] = {}
    for part in analysis:  # one per program: sum what they report
        for key, value in (part or {}).items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


# A program compiled only to be read (its HLO text, cost and memory analyses, its collectives), never run, needs no
# optimised machine code. XLA's HLO passes, buffer assignment and analyses all come before LLVM and do not depend on
# its level: at -O0 and at the default -O2 the same HLO text, the same cost and the same memory analysis
# (tests/test_flops.py), while LLVM's code generation is ~90 % of an XLA:CPU compile; -O0 makes it in about half
# the time (a VGG-A twin's steps under six layouts: 27.9 -> 14.5 CPU-s). Checked on XLA:CPU only, so only there.
READ_ONLY_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_to_read(lowered: Any) -> Any:
    """``lowered.compile()`` for a program that is read and never run (:data:`READ_ONLY_COMPILER_OPTIONS` on
    XLA:CPU; the default elsewhere): the plan checks', the memory model's and the simulators' compiled steps."""
    import jax

    return lowered.compile(READ_ONLY_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None)


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device of one call of ``compiled`` (see the module docstring), or ``None``."""
    flops = cost_analysis(compiled).get("flops")
    return float(flops) if flops is not None and flops > 0 else None


def step_flops(jitted: Any, *args: Any) -> float | None:
    """FLOPs per device of ``jitted(*args)``, from XLA's analysis of the compiled program.

    ``args`` may be the real arguments or ``jax.ShapeDtypeStruct`` s with the same
    shardings. Lowering and compiling here fills the same caches the first real call
    uses, so that call compiles nothing again: start-up time does not grow.

    Example::

        flops = step_flops(train_step, state, batch)   # before the loop
        mfu(flops, seconds_per_step, device_peak_flops(jnp.bfloat16))
    """
    return compiled_flops(jitted.lower(*args).compile())


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name if dtype is not None else "float32"


def lookup_peak(device_kind: str, dtype: Any = "float32") -> float | None:
    """Peak FLOP/s of one device of kind ``device_kind`` (``jax.Device.device_kind``) in ``dtype``.

    Kinds match case-insensitively by the longest table key contained in the
    kind (``"NVIDIA H100 80GB HBM3"`` → ``h100``). A dtype the device has no unit for
    falls back to its float32 rate. ``None`` when the kind is unknown (CPUs).
    """
    kind = device_kind.lower()
    matches = [key for key in PEAK_FLOPS if key in kind]
    if not matches:
        return None
    rates = PEAK_FLOPS[max(matches, key=len)]
    return rates.get(_dtype_name(dtype), rates.get("float32"))


def device_peak_flops(dtype: Any = "float32", override: float = 0.0, device: Any = None) -> float | None:
    """Peak FLOP/s of ``device`` (default: the first of ``jax.devices()``) for ``dtype`` compute.

    ``override > 0`` wins (the ``peak_flops`` config key): for devices missing from
    :data:`PEAK_FLOPS`, or to measure against another yardstick.
    """
    if override and override > 0:
        return float(override)
    if device is None:
        import jax

        device = jax.devices()[0]
    return lookup_peak(device.device_kind, dtype)


def mfu(flops_per_step: float | None, step_seconds: float, peak: float | None) -> float | None:
    """Utilisation: ``flops_per_step / step_seconds / peak`` (``None`` when any input is unknown or not positive).

    With the model's FLOPs on the whole mesh and the mesh's peak it is MFU; with the
    compiled FLOPs of one device and one device's peak, HFU (module docstring).
    """
    if not flops_per_step or not peak or step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / peak


def header(model_flops: float | None, compiled_per_device: float | None, peak: float | None) -> dict[str, float]:
    """A run's first-record fields, as far as known: ``model_flops_per_step`` (analytic, global
    batch), ``compiled_flops_per_step_per_device`` (XLA) and ``peak_flops_per_device``."""
    fields = {}
    if model_flops:
        fields["model_flops_per_step"] = model_flops
    if compiled_per_device:
        fields["compiled_flops_per_step_per_device"] = compiled_per_device
    if peak:
        fields["peak_flops_per_device"] = peak
    return fields


def utilisation(model_flops: float | None, compiled_per_device: float | None, num_devices: int,
                step_seconds: float, peak: float | None) -> dict[str, float]:
    """A step record's ``{"mfu": ..., "hfu": ...}``, each where its FLOPs and the peak are known."""
    values = {"mfu": mfu(model_flops, step_seconds, peak and peak * num_devices),
              "hfu": mfu(compiled_per_device, step_seconds, peak)}
    return {k: v for k, v in values.items() if v is not None}
