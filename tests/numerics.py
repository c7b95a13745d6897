"""Value tolerances derived from the computation, not from one CPU.

Two float32 programs that compute the same sums in another order (a reduction split over devices, XLA:CPU's code for
another vector width or without fused multiply-adds: Intel and AMD machines differ) differ by their rounding errors.
A sum of ``n`` float32 terms computed in any order is within ``γ_n · Σ|x_i|`` of the exact sum, ``γ_n ≈ n·u`` with
``u = 2**-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2); that worst case assumes
every rounding error has the same sign. Rounding errors behave like independent variables of either sign, so the
error grows like ``√n · u · Σ|x_i|`` (Higham §2.8, the rule of thumb the float64 references of this suite use too).

``Σ|x_i|`` is not known from the result: an output near zero can be the difference of large terms (an element of
``-0.0076`` among values of order 1 was 1.3e-6 apart on two CPUs, failing ``atol=1e-6``). The scale is the
magnitude of the values of the whole array — its largest entry, which a layer's terms are of the size of —, so the
tolerance is absolute, per array: ``SPREAD · depth · √n · u · max|want|``. ``depth`` counts the reductions chained
before the value (a layer's output carries the rounding of the layers below it; a gradient, of the forward and the
backward), ``SPREAD`` = 4 covers both programs' errors (2) and the typical ratio between ``Σ|x_i|`` and the largest
result (2). A real fault (a swapped half, a row in the wrong place, a gradient not averaged) moves values by a
fraction of their magnitude: thousands of times these tolerances.
"""

from __future__ import annotations

import math

import numpy as np

U32 = float(np.finfo(np.float32).eps) / 2  # float32's unit roundoff, 2**-24
SPREAD = 4


def magnitude(values) -> float:
    """The largest absolute entry of ``values`` (an array or a tree of arrays); 0 where empty."""
    import jax

    leaves = [np.abs(np.asarray(leaf, np.float64)) for leaf in jax.tree.leaves(values)]
    return max((float(leaf.max()) for leaf in leaves if leaf.size), default=0.0)


def sum_atol(want, terms: int, depth: int = 1, scale: float | None = None) -> float:
    """The absolute tolerance of float32 values ``want`` whose computation chains ``depth`` reductions of at most
    ``terms`` terms each, summed in another order (module docstring). ``scale``: the terms' magnitude where the
    values do not show it, e.g. a bias's gradient that sums to about zero (the whole gradient's magnitude then);
    default: ``want``'s own."""
    scale = magnitude(want) if scale is None else scale
    return SPREAD * depth * math.sqrt(max(terms, 1)) * U32 * scale


def assert_sums_close(got, want, terms: int, depth: int = 1, err_msg: str = "", scale: float | None = None) -> None:
    """``got`` equals ``want`` within :func:`sum_atol` (and bit for bit where the scale is 0)."""
    atol = sum_atol(want, terms, depth, scale)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol,
                               err_msg=f"{err_msg} (atol {atol:.3g}: {terms} terms, depth {depth})")
