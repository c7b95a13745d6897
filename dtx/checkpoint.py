"""Checkpoints on orbax: asynchronous saves, retention, strict restore onto any mesh, integrity.

What a checkpoint holds is the whole :class:`~dtx.state.TrainState` — parameters,
optimizer state, model state, loss scale, rng and step — and since batches are a
function of ``(seed, step)`` (:mod:`dtx.data`), the step is also the data
iterator's position: restoring it resumes the exact run.

Each step directory has two orbax items: ``state`` (the arrays, written
asynchronously) and ``manifest`` (JSON: shape, dtype and SHA-256 of every array,
plus caller metadata). Orbax alone restores bit-flipped array data without
complaint; the manifest makes dtx refuse it. Restores are strict: a structure,
shape or dtype that differs from what the run expects is an error naming the
parameter path, never a silent cast, pad or truncation. Symbolic links and
paths leaving the checkpoint directory are refused; nothing on the load path
unpickles.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

MANIFEST_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be restored; the message says why."""


class Checkpointer:
    """Saves and restores train states under ``directory/<step>/``.

    Args:
      directory: where step directories live (created if missing).
      keep: how many of the newest checkpoints to keep (older ones are deleted
        only after a newer one has committed).
      async_save: write in a background thread while training continues.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        if keep < 1:
            raise CheckpointError(f"checkpoint.keep={keep} must be >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.islink(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} is a symbolic link; refusing to use it")
        os.makedirs(self.directory, exist_ok=True)
        if jax.process_index() == 0:
            self._remove_stale_temporaries()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "manifest"))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, metadata: dict | None = None) -> None:
        """Start saving ``state`` as checkpoint ``step`` (returns before the write ends when async).

        The digests are computed from a host copy taken now, so they describe exactly
        the arrays being written. A failure of an earlier asynchronous save is raised here.
        """
        self._manager.check_for_errors()
        arrays = {}
        for path, leaf in _flatten(state):
            arrays[path] = _describe(leaf)
            if not arrays[path].pop("finite"):
                raise CheckpointError(
                    f"not saving step {step}: {path!r} has non-finite values (the run diverged); the last "
                    f"good checkpoint in {self.directory} is kept"
                )
        manifest = {"version": MANIFEST_VERSION, "step": int(step), "metadata": metadata or {}, "arrays": arrays}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), manifest=ocp.args.JsonSave(manifest))
        try:
            self._manager.save(int(step), args=args, force=True)
        except Exception as e:  # surface storage failures with the step and directory named
            raise CheckpointError(f"saving checkpoint {step} to {self.directory} failed: {e}") from e

    def wait(self) -> None:
        """Block until pending saves have committed; raise if one failed."""
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:
            raise CheckpointError(f"saving a checkpoint to {self.directory} failed: {e}") from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()

    # --------------------------------------------------------------- restoring
    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def metadata(self, step: int) -> dict:
        """The metadata saved with checkpoint ``step`` (config, data digest, ...), read without
        restoring any array: what a resume checks before it commits to a layout."""
        self._check_tree(os.path.join(self.directory, str(int(step))))
        manifest = self._manager.restore(int(step), args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))[
            "manifest"]
        return manifest["metadata"]

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` into the layout of ``target``.

        Args:
          step: which checkpoint.
          target: a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set (e.g.
            from :func:`abstract_target`): the shapes and dtypes the run expects and
            where each array should live — any mesh or device count.

        Returns:
          ``(state, metadata)``.

        Raises:
          CheckpointError: symlinks or escaping paths in the checkpoint, a
            structure/shape/dtype mismatch (naming the path, the saved and the
            expected value), or data whose digest differs from the manifest.
        """
        step_dir = os.path.join(self.directory, str(int(step)))
        self._check_tree(step_dir)
        manifest = self._manager.restore(int(step), args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))[
            "manifest"]
        _check_matches(manifest, target, step_dir)
        try:
            restored = self._manager.restore(
                int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:  # truncated or garbled files fail inside tensorstore
            raise CheckpointError(f"checkpoint {step_dir} is unreadable ({type(e).__name__}: {e}); "
                                  "restore an older step or delete this one") from e
        for path, leaf in _flatten(restored):
            digest = _describe(leaf)["sha256"]
            if digest != manifest["arrays"][path]["sha256"]:
                raise CheckpointError(
                    f"checkpoint {step_dir}: array {path!r} does not match its recorded SHA-256 "
                    f"(corrupted or tampered data); restore an older step or delete this one"
                )
        return restored, manifest["metadata"]

    # ------------------------------------------------------------------ helpers
    def _check_tree(self, step_dir: str) -> None:
        real_root = os.path.realpath(self.directory)
        if not os.path.isdir(step_dir):
            raise CheckpointError(f"no checkpoint at {step_dir}")
        for root, dirs, files in os.walk(step_dir, followlinks=False):
            for name in dirs + files:
                path = os.path.join(root, name)
                if os.path.islink(path):
                    raise CheckpointError(f"checkpoint {step_dir} contains a symbolic link ({path}); refusing it")
                if not os.path.realpath(path).startswith(real_root + os.sep):
                    raise CheckpointError(f"checkpoint path {path} leaves {self.directory}; refusing it")

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
    """One SHA-256 over every array of ``state`` (paths, dtypes, shapes and bytes): equal iff bit-identical."""
    h = hashlib.sha256()
    for path, leaf in _flatten(state):
        h.update(path.encode())
        h.update(_describe(leaf)["sha256"].encode())
    return h.hexdigest()


def _check_matches(manifest: dict, target: Any, step_dir: str) -> None:
    saved = manifest["arrays"]
    expected = dict(_flatten(target))
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {step_dir} has a different structure than this run: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''} (a different model or optimizer?)"
        )
    for path, leaf in expected.items():
        shape, dtype = list(leaf.shape), np.dtype(leaf.dtype).name
        if saved[path]["shape"] != shape or saved[path]["dtype"] != dtype:
            raise CheckpointError(
                f"checkpoint {step_dir}: {path!r} was saved as {saved[path]['dtype']}{saved[path]['shape']} "
                f"but this run expects {dtype}{shape}; dtx never casts, pads or truncates on restore"
            )


def _describe(leaf) -> dict:
    array = _host_array(leaf)
    finite = bool(np.all(np.isfinite(array))) if np.issubdtype(array.dtype, np.inexact) else True
    return {"shape": list(array.shape), "dtype": array.dtype.name, "finite": finite,
            "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}


def _flatten(tree) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


class PreemptionWatcher:
    """SIGTERM -> stop at the next step boundary (after saving), instead of dying mid-step.

    With several processes JAX's own preemption sync point decides, so every process
    stops at the same step; there JAX installs the signal notifier itself (a handler
    installed after ``jax.distributed.initialize`` would silently disable it).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._flag = threading.Event()
        self._previous = None

    def requested(self, step: int) -> bool:
        if not self.enabled:
            return False
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag.is_set()

    def __enter__(self) -> PreemptionWatcher:
        if self.enabled and jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._flag.set())
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _host_array(leaf) -> np.ndarray:
    """The full value of ``leaf`` on this host, also for arrays spread over several processes."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.sharding.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))
