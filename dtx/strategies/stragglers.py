"""Per-worker step-time noise: which worker is slow at which step, the same on the host and in the step.

Stragglers — workers slower than the rest at some step (a busy neighbour, a garbage
collection, a throttled node) — make synchronous SGD wait for the slowest worker.
Dean et al. (NIPS 2012) answer with asynchrony, Chen et al., *Revisiting Distributed
Synchronous SGD* (arXiv 1604.00981, 2016), with backup workers: run ``N + b`` workers
and apply the first ``N`` gradients to arrive. Both answers are only visible on a clock
that models the noise, :mod:`dtx.perf.simclock`; the noise lives here because two parties
read it: the clock (on the host, in NumPy) and the backup-worker strategy (inside the
jitted step, in ``jax.numpy``), and they must agree on who arrived first.

Models (``cluster.straggler``): ``none`` (every worker equally fast); ``lognormal``
(each worker's compute time at each step is multiplied by ``exp(σz − σ²/2)``, ``z``
standard normal, mean 1: the spread grows with ``σ = cluster.sigma``, the mean work
does not); ``slow`` (each worker at each step is, with probability
``cluster.slow_fraction``, ``cluster.slow_factor`` times slower — transient stragglers).
Draws are independent across workers and steps.

Agreement by construction: every draw is a 32-bit integer hash of ``(seed, step,
worker, salt)`` (MurmurHash3's 32-bit finaliser, Appleby 2008, applied three times),
computed with exact unsigned arithmetic in either array library. The arrival order is
the sort of an integer key that increases with the worker's time, so the step and the
host sort the same integers; the float multiplier is computed on the host only.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import numpy as np

MODELS = ("none", "lognormal", "slow")
# The cluster block's settings each model takes (the others are refused when set: dtx.perf.simclock).
SETTINGS = {"none": (), "lognormal": ("sigma",), "slow": ("slow_fraction", "slow_factor")}
_SALT_TIME, _SALT_SLOW = 0x73747261, 0x736C6F77  # separate streams: tie order / lognormal vs slow-or-not


class StragglerError(ValueError):
    """A bad straggler model or parameter; the message names the config key and the fix."""


class Stragglers(NamedTuple):
    """A straggler model bound to the run's seed (``config.seed``).

    Attributes:
      model: ``none``, ``lognormal`` or ``slow``.
      seed: the run's seed; the draws of step ``t`` depend on it and on ``t`` only.
      sigma: lognormal σ (``cluster.sigma``), >= 0.
      slow_fraction: probability a worker is slow at a step (``cluster.slow_fraction``), in [0, 1].
      slow_factor: how many times slower a slow worker is (``cluster.slow_factor``), >= 1.
    """

    model: str = "none"
    seed: int = 0
    sigma: float = 0.0
    slow_fraction: float = 0.0
    slow_factor: float = 1.0

    def check(self) -> Stragglers:
        """``self`` if every field is in range; else :class:`StragglerError` naming the key."""
        if self.model not in MODELS:
            raise StragglerError(f"cluster.straggler={self.model!r} is unknown; choose one of {list(MODELS)}")
        if not 0 <= self.sigma < 10:
            raise StragglerError(f"cluster.sigma={self.sigma!r} must be in [0, 10) (lognormal sigma, e.g. 0.3)")
        if not 0 <= self.slow_fraction <= 1:
            raise StragglerError(f"cluster.slow_fraction={self.slow_fraction!r} must be in [0, 1] "
                                 "(probability a worker is slow at a step, e.g. 0.1)")
        if not self.slow_factor >= 1:
            raise StragglerError(f"cluster.slow_factor={self.slow_factor!r} must be >= 1 "
                                 "(how many times slower a slow worker is, e.g. 4)")
        return self

    def bits(self, step, workers: int, salt: int, xp=np):
        """32-bit hashes of ``(seed, step, worker, salt)`` for each of ``workers`` workers (``xp``: np or jnp)."""
        u32 = xp.uint32
        seed = xp.asarray(int(self.seed) % 2**32, dtype=u32)
        step = xp.asarray(step).astype(u32)
        with np.errstate(over="ignore"):
            h = _mix(_mix(seed ^ u32(salt), xp) + step, xp)
        return _mix(h + xp.arange(workers, dtype=u32) * u32(0x9E3779B9), xp)

    def arrival_keys(self, step, workers: int, xp=np):
        """uint32 keys, one per worker, increasing with its time at ``step``: sort them for the arrival order.

        Ties in time (no noise; the fast workers of ``slow``) are broken by an independent draw.
        """
        order = self.bits(step, workers, _SALT_TIME, xp)
        if self.model != "slow":  # lognormal: the time increases with this very draw; none: any order
            return order
        slow = self.is_slow(step, workers, xp)
        return xp.where(slow, xp.uint32(2**31), xp.uint32(0)) | (order >> xp.uint32(1))

    def is_slow(self, step, workers: int, xp=np):
        """``slow``: whether each worker is slow at ``step`` (a uniform below ``slow_fraction``)."""
        return _uniform(self.bits(step, workers, _SALT_SLOW, xp), xp) < self.slow_fraction

    def multipliers(self, step: int, workers: int) -> np.ndarray:
        """Each worker's compute-time multiplier at ``step`` (host, float64); 1 everywhere for ``none``."""
        if self.model == "lognormal":
            normal = statistics.NormalDist()
            z = np.array([normal.inv_cdf(u) for u in _uniform(self.bits(step, workers, _SALT_TIME), np)])
            return np.exp(self.sigma * z - self.sigma**2 / 2)
        if self.model == "slow":
            return np.where(self.is_slow(step, workers), float(self.slow_factor), 1.0)
        return np.ones(workers)

    def arrival_order(self, step: int, workers: int) -> np.ndarray:
        """Worker indices, first to arrive first (host)."""
        return np.argsort(self.arrival_keys(step, workers), kind="stable")


def _mix(x, xp):
    """MurmurHash3's 32-bit finaliser (Appleby 2008): every input bit flips each output bit with p ≈ 1/2."""
    u32 = xp.uint32
    with np.errstate(over="ignore"):  # NumPy warns when a 0-d uint32 product wraps; wrapping is the point
        x = x ^ (x >> u32(16))
        x = x * u32(0x85EBCA6B)
        x = x ^ (x >> u32(13))
        x = x * u32(0xC2B2AE35)
        return x ^ (x >> u32(16))


def _uniform(bits, xp):
    """Uniform in (0, 1) from the top 24 bits: exact in float32, the same in both array libraries."""
    return ((bits >> xp.uint32(8)).astype(xp.float32) + xp.float32(0.5)) / xp.float32(2**24)
