"""Bounded dispatch for hand-written training loops.

JAX dispatches a jitted step and returns at once; a loop that never reads a
result queues step after step. On an emulated CPU mesh (``jax_num_cpu_devices``)
XLA's collectives deadlock once about 35 steps are in flight — the process
aborts after XLA's stuck-collective timeout, and in a notebook the kernel dies.
On accelerators an unbounded queue only holds memory, but the bound costs
nothing there either.

:func:`paced` wraps a step so that each call, once the new step is dispatched,
waits for the step ``in_flight`` calls back — the lag-1 wait ``dtx.train``'s
loop uses (``in_flight=1``): the device always has the next step queued, and
never more than that. Example (8 emulated devices, 60 steps)::

    step = dtx.paced(dtx.make_train_step(model, tx, mesh))
    for s in range(60):
        state, metrics = step(state, loader.batch(s))
    step.wait()  # the last step's outputs are ready
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax


class Paced:
    """A step function that keeps at most ``in_flight`` earlier calls unfinished; see :func:`paced`."""

    def __init__(self, step: Callable[..., Any], in_flight: int = 1):
        if not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 0:
            raise ValueError(f"in_flight={in_flight!r} must be an integer >= 0 (1 is the lag-1 wait dtx.train "
                             "uses; 0 waits for every step before returning)")
        self.step, self.in_flight = step, in_flight
        self._pending: collections.deque = collections.deque()
        functools.update_wrapper(self, step, updated=())

    def __call__(self, *args, **kwargs):
        outputs = self.step(*args, **kwargs)
        self._pending.append(outputs)
        while len(self._pending) > self.in_flight:
            _wait_for(self._pending.popleft(), newer=outputs)
        return outputs

    def wait(self) -> None:
        """Block until every dispatched step has finished (e.g. before timing, or at the loop's end)."""
        while self._pending:
            _wait_for(self._pending.popleft(), newer=self._pending[-1] if self._pending else None)

    def __getattr__(self, name):  # .lower(), .trace(), ... of a jitted step still work
        return getattr(self.step, name)


def paced(step: Callable[..., Any], in_flight: int = 1) -> Paced:
    """``step`` wrapped so a loop over it never has more than ``in_flight`` + 1 steps in flight.

    Args:
      step: any function that dispatches device work and returns arrays (a train
        step from :func:`dtx.make_train_step`, an eval step, your own ``jax.jit``).
      in_flight: finished-or-not calls allowed besides the newest; 1 (default) waits
        for the previous step right after dispatching the next, 0 for each step itself.

    Returns:
      A callable with ``step``'s signature and outputs, and ``wait()`` to drain.
    """
    return Paced(step, in_flight)


def _wait_for(outputs: Any, newer: Any) -> None:
    """Block on ``outputs``' arrays. Those donated to a later step are gone (their step has
    finished once that later one starts); if nothing of ``outputs`` is left, wait on ``newer``."""
    live = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array) and not x.is_deleted()]
    if live:
        jax.block_until_ready(live)
    elif newer is not None:
        jax.block_until_ready([x for x in jax.tree.leaves(newer) if isinstance(x, jax.Array) and not x.is_deleted()])
