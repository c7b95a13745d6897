"""Orbax's side of a checkpoint (:mod:`dtx.ckpt.checkpoint`): the ``state`` item's handler and the
``manifest`` item's, whose digests are hashed and written in orbax's commit thread."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from dtx.ckpt import integrity


def state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler, writing replica 0 of every shard whole (no replica-parallel slicing), so
    the bytes it writes are the shard copies :class:`dtx.ckpt.integrity.ShardCopies` hashed."""
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (int, handlers.ScalarHandler()), (float, handlers.ScalarHandler()), (np.number, handlers.ScalarHandler()),
        (np.ndarray, handlers.NumpyHandler()), (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class ManifestHandler(ocp.AsyncCheckpointHandler):
    """Writes the ``manifest`` item from orbax's commit thread: the header (process 0) and every process's
    digests, hashed there — the step commits only once they are written."""

    async def async_save(self, directory: epath.Path, args: ManifestSave):
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(directory, args), name="dtx_manifest")]

    async def _write(self, directory: epath.Path, args: ManifestSave) -> None:
        self.save(directory, args)

    def save(self, directory: epath.Path, args: ManifestSave) -> None:
        step, arrays = args.header["step"], args.header["arrays"]
        part = integrity.part(step, args.copies.digests(), arrays)
        (directory / integrity.part_file(jax.process_index())).write_text(integrity.dumps(part, args.key))
        if jax.process_index() == 0:
            (directory / integrity.HEADER_FILE).write_text(integrity.dumps(args.header, args.key))

    def restore(self, directory: epath.Path, args=None):
        raise NotImplementedError("dtx reads manifests with dtx.ckpt.integrity.read_manifest")


@ocp.args.register_with_handler(ManifestHandler, for_save=True)
@dataclasses.dataclass
class ManifestSave(ocp.args.CheckpointArgs):
    header: dict
    copies: integrity.ShardCopies
    key: bytes | None


@ocp.args.register_with_handler(ManifestHandler, for_restore=True)
@dataclasses.dataclass
class ManifestRestore(ocp.args.CheckpointArgs):  # orbax wants one; dtx reads manifests itself
    pass
