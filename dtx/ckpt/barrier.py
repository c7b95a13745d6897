"""Bounded waits between processes around a checkpoint: every rank says it arrived, and a rank that never does is
named once the bound has passed, instead of holding the others in a collective forever.

A collective (``sync_global_devices``, a ``pmax``) has no timeout: a rank alive but elsewhere -- asleep, blocked
in its input pipeline, stuck in a read -- keeps every peer waiting, and its heartbeats say it is healthy
(jax-ml/jax#38503; marin-community/marin#8534: a barrier without a timeout held 704 GPUs for 4½ hours). Under
``dtx launch`` the launcher bounds such a wait; under SLURM nothing else does. So the agreements of
:mod:`dtx.ckpt.checkpoint` and :mod:`dtx.run.rundir` go through JAX's coordination service instead: each rank
writes its answer under a key of its own, then reads every rank's with a deadline, and the ranks whose keys did
not come are the ones the error names. Orbax's own barriers go there too (:func:`orbax_options`): through
``client.wait_at_barrier`` with orbax's timeout, not through a collective.
"""

from __future__ import annotations

import itertools
import time

import jax

from dtx.ckpt.integrity import CheckpointError

DEFAULT_TIMEOUT_S = 300  # orbax's own coordination timeout: what a wait gets when the run gives none
_rounds = itertools.count()  # every process passes the same agreements in the same order: the same keys
_abandoned: list[str] = []  # agreements a rank never came to: this process must not wait for it again


def abandoned() -> bool:
    """Whether a rank never arrived at an agreement of this process: JAX's shutdown barrier at exit would wait
    for it too (unbounded), so a command ends with ``os._exit`` instead (:mod:`dtx.tools.cli`)."""
    return bool(_abandoned)


class BarrierTimeout(CheckpointError):
    """A rank did not arrive at a checkpoint's agreement within its bound (the message names it)."""


def _client():
    from jax._src import distributed  # the coordination service's client: no public accessor in jax 0.10-0.11

    return distributed.global_state.client


def exchange(value: str, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[int, str]:
    """Every process's ``value`` by rank, waiting at most ``timeout_s`` for the others; raises
    :class:`BarrierTimeout` naming the ranks that did not arrive at ``what``."""
    if jax.process_count() == 1:
        return {0: value}
    client, rank, count = _client(), jax.process_index(), jax.process_count()
    key = f"dtx_agree/{next(_rounds)}"
    client.key_value_set(f"{key}/{rank}", value)
    deadline, answers, missing = time.monotonic() + timeout_s, {}, []
    for other in range(count):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            answers[other] = client.blocking_key_value_get(f"{key}/{other}", left_ms)
        except Exception:  # noqa: BLE001  jax raises its runtime error (DEADLINE_EXCEEDED) for a key never set
            missing.append(other)
    if missing:
        _abandoned.append(what)
        ranks = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
        raise BarrierTimeout(
            f"{ranks} did not reach {what} within {timeout_s:g} s (rank {rank} waited; alive but elsewhere -- "
            f"asleep, blocked in its input pipeline, stuck reading -- or gone); nothing was written. See that "
            "rank's log; watchdog_seconds sets this bound")
    return answers


def agree(ok: bool, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``ok`` holds on every process (the same answer everywhere), bounded as :func:`exchange`."""
    return all(answer == "1" for answer in exchange("1" if ok else "0", what, timeout_s).values())


def wait(what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A barrier every process passes, bounded as :func:`agree`."""
    agree(True, what, timeout_s)


_managers = itertools.count()  # one barrier-key prefix per checkpoint manager: orbax's keys must not repeat


def orbax_options():
    """Orbax's multiprocessing options that route its barriers through the coordination service with its
    timeout (every process named active), instead of through a collective with none; ``None`` with one process."""
    import orbax.checkpoint as ocp

    if jax.process_count() == 1:
        return None
    return ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count())),
                                              barrier_sync_key_prefix=f"dtx{next(_managers)}")
