"""Checkpoints on orbax: asynchronous saves, retention, strict and verified restore onto any mesh, fallback.

What a checkpoint holds is the whole :class:`~dtx.step.state.TrainState` — parameters,
optimizer state, model state, loss scale, rng and step — and since batches are a
function of ``(seed, step)`` (:mod:`dtx.data`), the step is also the data
iterator's position: restoring it resumes the exact run.

Each step directory has two orbax items: ``state`` (the arrays, written
asynchronously, every shard by the process that holds its replica 0) and
``manifest`` (:mod:`dtx.ckpt.integrity`: per-shard SHA-256 digests hashed in the save's
commit thread, caller metadata, an optional HMAC). Orbax alone restores
bit-flipped array data without complaint; the manifest makes dtx refuse it.
Restores are strict: a structure, shape or dtype that differs from what the run
expects is an error naming the parameter path, never a silent cast, pad or
truncation. Symbolic links and paths leaving the checkpoint directory are
refused; nothing on the load path unpickles.

A state with NaN or inf is never saved: one jitted reduction on the devices
decides (so every process agrees), and the refusal first lets the pending save
commit, so the last good checkpoint is never disturbed. :meth:`Checkpointer.resume`
restores the newest step that verifies (or exactly the one asked for) and moves
newer steps to ``DIR/superseded/`` — kept, never deleted — so the resumed run's
saves cannot collide with them. With several processes, each verifies what it
restored and they agree (one ``pmax``) before any of them accepts a step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dtx.ckpt import barrier, handlers, integrity
from dtx.ckpt.integrity import CheckpointDamaged, CheckpointError, flatten

MANIFEST_VERSION = integrity.MANIFEST_VERSION
SUPERSEDED = "superseded"  # where a resume moves the steps newer than the one it restored
SAVE_TIMEOUT_S = 1200  # a save's bound (orbax's default); waits end 30 s after it
STOPPING_TIMEOUT_S = 120  # what a run stopping on an error gives its pending save
# resume's and restore's relayout: (saved config, saved arrays) -> (the saved layout's target, convert) or None
Relayout = Callable[[dict, dict], "tuple[Any, Callable[[Any], Any]] | None"]
_STUCK: list[threading.Thread] = []  # waits that gave up on a save: its orbax thread is stuck too


def stalled() -> bool:
    """Whether a save this process gave up waiting for is still stuck: the interpreter would wait for
    orbax's thread at exit, so a command ends with ``os._exit`` instead."""
    return any(waiter.is_alive() for waiter in _STUCK)


@dataclasses.dataclass
class Resumed:
    """What :meth:`Checkpointer.resume` restored, and the newer steps it skipped with the reason."""

    state: Any
    metadata: dict
    step: int
    skipped: list[tuple[int, str]]


class Checkpointer:
    """Saves and restores train states under ``directory/<step>/``.

    Args:
      directory: where step directories live (created if missing).
      keep: how many of the newest checkpoints to keep (older ones are deleted
        only after a newer one has committed).
      async_save: write in a background thread while training continues.
      hmac_key: sign every manifest file with HMAC-SHA256 under this key, and refuse
        to restore manifests that are unsigned or signed otherwise.
      read_only: restore only (``dtx eval``, ``dtx export``): create nothing, remove no
        temporaries — a run may still be writing into ``directory``.
      timeout_s: how long a save may take before it fails, and how long :meth:`wait` waits for one
        (storage that stalls ends the run with an error, never an endless wait).
      barrier_s: how long the processes' agreements at a restore wait for a rank that does not arrive
        (:mod:`dtx.ckpt.barrier`: the error names it); orbax's own barriers keep its 300 s.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 hmac_key: bytes | None = None, read_only: bool = False, timeout_s: int = SAVE_TIMEOUT_S,
                 barrier_s: float = barrier.DEFAULT_TIMEOUT_S):
        if keep < 1:
            raise CheckpointError(f"checkpoint.keep={keep} must be >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.islink(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} is a symbolic link; refusing to use it")
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"no checkpoint directory at {self.directory}")
        if not read_only:
            os.makedirs(self.directory, exist_ok=True)
        if jax.process_index() == 0 and not read_only:
            self._remove_stale_temporaries()
        self._key = hmac_key or None
        self._closed = False
        # read_only: orbax's own read_only flag only logs warnings on every start; nothing here saves or deletes.
        self._timeout_s, self._barrier_s = timeout_s, barrier_s
        # Several processes: orbax's barriers through the coordination service, bounded (dtx.ckpt.barrier); the
        # directory exists already (made above), which orbax needs of a job that names its processes.
        processes = barrier.orbax_options()
        options = ocp.CheckpointManagerOptions(max_to_keep=None if read_only else keep,
                                               enable_async_checkpointing=async_save,
                                               create=not read_only and processes is None,
                                               async_options=ocp.AsyncOptions(timeout_secs=timeout_s),
                                               **({"multiprocessing_options": processes} if processes else {}))
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": handlers.state_handler(), "manifest": handlers.ManifestHandler()})

    # ------------------------------------------------------------------ saving
    def arrive(self, step: int) -> None:
        """Wait, at most ``barrier_s``, until every process has come to the save of ``step``: a rank that does not
        come is named (:class:`dtx.ckpt.barrier.BarrierTimeout`) before anything of the step is written, where the
        save's collectives would wait for it without a bound of their own."""
        barrier.wait(f"the save of checkpoint step {step}", self._barrier_s)

    def save(self, step: int, state: Any, metadata: dict | None = None) -> None:
        """Start saving ``state`` as checkpoint ``step`` (returns before the write ends when async).

        Only the device-to-host copy of this process's shards happens here; their digests
        are computed in the commit thread. A failure of an earlier save is raised here.
        """
        self._raise_if_failed()
        bad = integrity.non_finite(state)
        if bad:
            self.wait()  # the pending save commits before this error can end the process
            raise CheckpointError(
                f"not saving step {step}: {', '.join(map(repr, bad[:3]))}{' ...' if len(bad) > 3 else ''} "
                f"has non-finite values (the run diverged); the last good checkpoint in {self.directory} "
                f"(step {self.latest_step()}) is kept")
        copies = integrity.ShardCopies(state)
        manifest = handlers.ManifestSave(integrity.header(step, metadata or {}, state), copies, self._key)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), manifest=manifest)
        try:
            self._manager.save(int(step), args=args, force=True)
        except Exception as e:  # surface storage failures with the step and directory named
            raise CheckpointError(f"saving checkpoint {step} to {self.directory} failed: {e}") from e

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until pending saves have committed, at most ``timeout_s`` (default the save timeout);
        raise if one failed or is still pending then (:func:`stalled` says so afterwards)."""
        failure = []
        waiter = threading.Thread(target=self._finish, args=(failure,), daemon=True, name="dtx-checkpoint-wait")
        waiter.start()
        bound = self._timeout_s + 30 if timeout_s is None else timeout_s
        waiter.join(bound)  # orbax's own wait has no bound
        if waiter.is_alive():
            _STUCK.append(waiter)
            committed = max((int(n) for n in os.listdir(self.directory) if n.isdigit()), default=None)
            raise CheckpointError(
                f"a checkpoint save to {self.directory} did not finish within {bound} s (storage stalled, or "
                f"another process writes there); the newest committed step is {committed}")
        if failure:
            raise CheckpointError(f"saving a checkpoint to {self.directory} failed: {failure[0]}") from failure[0]

    def _finish(self, failure: list) -> None:
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            failure.append(e)

    def close(self, timeout_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout_s)
        finally:
            if not stalled():  # closing would wait for the stuck save again, without a bound
                self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Leaving on an error still lets the pending save commit (a process that exits first loses it)."""
        if error is None:
            self.close()
            return
        try:
            self.close(STOPPING_TIMEOUT_S)
        except CheckpointError as e:  # never hide the error that stopped the run
            print(f"dtx: while stopping on {kind.__name__}, a pending checkpoint save failed too: {e}",
                  file=sys.stderr, flush=True)

    def _raise_if_failed(self) -> None:
        try:
            self._manager.check_for_errors()
        except Exception as e:
            raise CheckpointError(f"saving a checkpoint to {self.directory} failed: {e}") from e

    # --------------------------------------------------------------- restoring
    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def metadata(self, step: int) -> dict:
        """The metadata saved with checkpoint ``step`` (config, data digest, ...), read without
        restoring any array: what a resume checks before it commits to a layout."""
        step_dir = self._step_dir(step)
        self._check_tree(step_dir)
        return integrity.read_manifest(step_dir, self._key).metadata

    def restore(self, step: int, target: Any, relayout: Relayout | None = None) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` into the layout of ``target``.

        Args:
          step: which checkpoint.
          target: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set (e.g.
            from :func:`abstract_target`): the shapes and dtypes the run expects and
            where each array should live — any mesh or device count.
          relayout: as :meth:`resume`'s (a step saved in another layout than ``target``'s).

        Returns:
          ``(state, metadata)``.

        Raises:
          CheckpointError: a structure/shape/dtype mismatch (naming the path, the saved
            and the expected value); :class:`CheckpointDamaged` (a subclass) for symlinks
            or escaping paths, a missing, garbled or (with a key) unsigned manifest, and
            data whose digests differ from the manifest — on any process.
        """
        try:
            restored, manifest, error = *self._attempt(step, target, relayout=relayout), None
        except CheckpointDamaged as e:
            error = e
        if not barrier.agree(error is None, f"the restore of checkpoint step {step}", self._barrier_s):
            raise error or CheckpointDamaged(f"checkpoint {self._step_dir(step)} failed verification on another "
                                             "process (see that process's log)")
        return restored, manifest.metadata

    def resume(self, target: Any, *, step: int | None = None, check: Callable[[dict], None] | None = None,
               relayout: Relayout | None = None) -> Resumed:
        """Restore the newest step that verifies, or exactly ``step``; ``check(metadata)`` may refuse one.

        ``relayout(saved config, saved arrays)`` may name another layout of the same state for a step whose arrays
        differ from ``target``'s (a pipeline's stage rows against the model's tree): ``(its target, convert)``, the
        step restored and verified as saved, then converted into ``target``'s layout; or None.

        A damaged step (:class:`CheckpointDamaged`) is skipped, saying so on stderr, unless
        ``step`` was asked for; any other error (``check``'s, a mismatch) ends the resume.
        Steps newer than the one restored are moved to ``DIR/superseded/``.
        """
        steps = self.steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"checkpoint.resume_step={step}: {self.directory} holds no step {step} (it holds "
                                  f"{steps}); choose one of them, or 0 for the newest step that verifies")
        skipped = []
        for candidate in [step] if step is not None else steps[::-1]:
            try:
                restored, manifest, error = *self._attempt(candidate, target, check, relayout), None
            except CheckpointDamaged as e:
                error = e
            if barrier.agree(error is None, f"the restore of checkpoint step {candidate}", self._barrier_s):
                self._set_aside_newer(candidate)
                return Resumed(restored, manifest.metadata, candidate, skipped)
            why = str(error) if error else "its shards failed verification on another process (see its log)"
            if step is not None:
                raise CheckpointDamaged(f"checkpoint.resume_step={step}: {why}")
            skipped.append((candidate, why))
            print(f"dtx: WARNING: not resuming from checkpoint step {candidate}: {why}", file=sys.stderr, flush=True)
        reasons = "; ".join(f"step {s}: {why}" for s, why in skipped) or "it holds none"
        raise CheckpointDamaged(f"no checkpoint in {self.directory} verifies ({reasons}); move them away or train "
                                "into a new --workdir")

    # ------------------------------------------------------------------ helpers
    def _attempt(self, step: int, target: Any, check: Callable[[dict], None] | None = None,
                 relayout: Relayout | None = None):
        """This process's restore of ``step``, verified against the manifest: ``(state, manifest)``."""
        step_dir = self._step_dir(step)
        self._check_tree(step_dir)
        manifest = integrity.read_manifest(step_dir, self._key)
        if check is not None:
            check(manifest.metadata)
        convert = None
        if relayout is not None and not _matches(manifest, target):
            other = relayout(manifest.metadata.get("config") or {}, manifest.arrays)
            if other is not None:
                target, convert = other
        _check_matches(manifest, target, step_dir)
        handler = handlers.state_handler()
        try:
            restored = handler.restore(epath.Path(step_dir) / "state", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
        except Exception as e:  # truncated or garbled files fail inside tensorstore
            raise CheckpointDamaged(f"checkpoint {step_dir} is unreadable ({type(e).__name__}: {e}); "
                                    f"{integrity.FIX}") from e
        finally:
            handler.close()
        names = dict(flatten(ocp.tree.get_param_names(target, include_empty_nodes=False)))  # orbax's array names
        integrity.verify_restored(manifest, restored, step_dir,
                                  lambda path, region: integrity.read_stored_region(step_dir, names[path], region))
        return (restored if convert is None else convert(restored)), manifest

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def _check_tree(self, step_dir: str) -> None:
        real_root = os.path.realpath(self.directory)
        if not os.path.isdir(step_dir):
            raise CheckpointError(f"no checkpoint at {step_dir}")
        for root, dirs, files in os.walk(step_dir, followlinks=False):
            for name in dirs + files:
                path = os.path.join(root, name)
                if os.path.islink(path):
                    raise CheckpointDamaged(f"checkpoint {step_dir} contains a symbolic link ({path}); refusing it")
                if not os.path.realpath(path).startswith(real_root + os.sep):
                    raise CheckpointDamaged(f"checkpoint path {path} leaves {self.directory}; refusing it")

    def _set_aside_newer(self, step: int) -> None:
        newer = [s for s in self.steps() if s > step]
        if not newer:
            return
        if jax.process_index() == 0:
            aside = os.path.join(self.directory, SUPERSEDED)
            os.makedirs(aside, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in newer:
                name, n = f"{s}.{stamp}", 1
                while os.path.exists(os.path.join(aside, name)):
                    name, n = f"{s}.{stamp}.{n}", n + 1
                os.rename(self._step_dir(s), os.path.join(aside, name))
            print(f"dtx: moved checkpoint steps {newer} (newer than the resumed step {step}) to {aside}; dtx never "
                  "deletes them", file=sys.stderr, flush=True)
        barrier.wait(f"the move of steps {newer} aside", self._barrier_s)  # nobody saves before they are gone
        self._manager.reload()

    def _remove_stale_temporaries(self) -> None:
        # Orbax writes a step into a temporary directory and renames it on commit; a
        # process killed mid-save leaves the temporary behind. Committed steps are untouched.
        for name in os.listdir(self.directory):
            if ".orbax-checkpoint-tmp" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s carrying the shardings a restored state should have."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def state_digest(state: Any) -> str:
    """One SHA-256 over every array of ``state`` (paths, dtypes, shapes and bytes): equal iff bit-identical.

    A comparison tool (tests, notebooks), not part of saving or restoring: it needs each
    whole array on this host, so it gathers arrays that span several processes.
    """
    h = hashlib.sha256()
    for path, leaf in flatten(state):
        h.update(path.encode())
        h.update(integrity.sha256_hex(_whole_array(leaf)).encode())
    return h.hexdigest()


def _whole_array(leaf) -> np.ndarray:
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.sharding.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def _matches(manifest: integrity.Manifest, target: Any) -> bool:
    """Whether ``target``'s arrays are the saved ones: the same paths, shapes and dtypes."""
    expected = dict(flatten(target))
    saved = {path: (list(shape), dtype) for path, (shape, dtype, _) in manifest.arrays.items()}
    return saved == {path: (list(leaf.shape), np.dtype(leaf.dtype).name) for path, leaf in expected.items()}


def _check_matches(manifest: integrity.Manifest, target: Any, step_dir: str) -> None:
    saved = manifest.arrays
    expected = dict(flatten(target))
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {step_dir} has a different structure than this run: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''} (a different model or optimizer?)"
        )
    for path, leaf in expected.items():
        shape, dtype = list(leaf.shape), np.dtype(leaf.dtype).name
        saved_shape, saved_dtype, _ = saved[path]
        if saved_shape != shape or saved_dtype != dtype:
            raise CheckpointError(
                f"checkpoint {step_dir}: {path!r} was saved as {saved_dtype}{saved_shape} "
                f"but this run expects {dtype}{shape}; dtx never casts, pads or truncates on restore"
            )
