"""What makes a checkpoint trustworthy: per-shard SHA-256 digests, the manifest that records them, its HMAC.

**Digests per shard, where the shard lives.** A save hashes each process's own
share of the state and nothing else: for every array, the addressable shards
with ``replica_id == 0`` — exactly one copy of every distinct shard in the whole
job, so a replicated array is hashed once (by the process holding replica 0) and
an array split over processes is hashed piecewise by its holders. Each digest is
keyed by the shard's global index (``"0:4,0:32"``). No process ever sees another
process's data: there is no gather on the save or the restore path, and host
memory follows the local shards, not the model.

**Off the training thread.** :class:`ShardCopies` takes the host views of those
shards when the save starts (the state's buffers are donated to the next step, so
its bytes must leave the device before ``save`` returns) and hashes them later,
in orbax's commit thread (:mod:`dtx.ckpt.checkpoint` writes the manifest from there).
The views are the very arrays orbax writes from: ``np.asarray`` on a shard
caches its host copy on the shard, and orbax's own device-to-host step,
configured to write replica 0 of every shard whole (``use_replica_parallel=False``),
finds that cache. So a save holds one host copy of the local shards — on the CPU
backend not even that (host views of device buffers are zero-copy) — and the
bytes hashed are the bytes written.

**The manifest** (item ``manifest`` of each step): ``manifest.json``, written by
process 0 — version, step, caller metadata, process count and, per array, shape,
dtype and the global list of shard regions — and ``digests.<i>.json`` from every
process ``i``: its regions' SHA-256. Restore requires the parts to cover every
region exactly once and the regions to tile each array.

**Verification on any layout** (:func:`verify_restored`): each process checks the
data it actually restored, whatever the new layout. A saved region that lies
inside one restored local shard is re-hashed from that shard. A region cut across
restored shards (say, saved replicated, restored split) is read back from
storage (:func:`read_stored_region`), hashed, and every restored piece of it this
process holds is compared byte for byte with those verified bytes. Memory stays at
one shard or region.

**No NaN is saved** (:func:`non_finite`): one jitted reduction over the state on
the devices, so every process of a job takes the same decision and nothing is
copied to the host for it.

**What the digest protects against.** SHA-256 alone detects corruption — bit
flips, truncation, array files from another checkpoint — not tampering: whoever
can rewrite the arrays can recompute their digests. With a key
(``checkpoint.hmac_key_env``) every manifest file carries an HMAC-SHA256 over its
content; a manifest rewritten without the key, or written without one when a key
is required, is refused. The HMAC authenticates each file; it cannot stop the
replay of a whole, validly signed checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtx import paths

MANIFEST_VERSION = 2
HEADER_FILE = "manifest.json"
LEGACY_FILE = "metadata"  # version 1: one whole-array SHA-256 per array, written by orbax's JSON handler
FIX = "resume another step (checkpoint.resume_step=N, or resume=auto falls back by itself) or delete this one"
UNSIGNED_FIX = "resume it with checkpoint.hmac_key_env='' if you trust these files"  # (dtx eval says its own)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or must not be restored; the message says why."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are missing, garbled, unsigned or do not match their digests.

    Unlike a mismatch with the run (another model, shape or dtype), this is a fault of
    the files themselves, so a resume may fall back to an older step.
    """


def part_file(process: int) -> str:
    return f"digests.{process}.json"


def flatten(tree) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs, paths like ``params/Dense_0/kernel``."""
    return paths.named_leaves(tree)


def sha256_hex(array: np.ndarray) -> str:
    """SHA-256 of an array's bytes in C order (no copy when it is contiguous)."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


# --------------------------------------------------------------------------- regions
def region_key(index: tuple, shape: tuple) -> str:
    """A shard's global index as text: ``"0:4,0:32"`` (``""`` for a scalar)."""
    return ",".join(f"{s.start or 0}:{dim if s.stop is None else s.stop}" for s, dim in zip(index, shape))


def parse_region(key: str, shape: tuple) -> tuple[slice, ...]:
    bounds = [part.split(":") for part in key.split(",")] if key else []
    if len(bounds) != len(shape) or any(len(b) != 2 or not all(x.isdigit() for x in b) for b in bounds):
        raise ValueError(f"region {key!r} does not describe a slice of an array of shape {list(shape)}")
    region = tuple(slice(int(a), int(b)) for a, b in bounds)
    if any(not 0 <= s.start <= s.stop <= dim for s, dim in zip(region, shape)):
        raise ValueError(f"region {key!r} lies outside shape {list(shape)}")
    return region


def _contains(outer, inner) -> bool:
    return all(o.start <= i.start and i.stop <= o.stop for o, i in zip(outer, inner))


def _intersection(a, b):
    out = tuple(slice(max(x.start, y.start), min(x.stop, y.stop)) for x, y in zip(a, b))
    return out if all(s.start < s.stop for s in out) else None


def _relative(inner, outer) -> tuple[slice, ...]:
    return tuple(slice(i.start - o.start, i.stop - o.start) for i, o in zip(inner, outer))


def _tiles(regions: list[tuple[slice, ...]], shape: tuple) -> bool:
    """Whether distinct ``regions`` are the cells of a grid covering ``shape`` exactly (what a sharding makes)."""
    if not shape:
        return len(regions) == 1
    if math.prod(shape) == 0:
        return True
    axes = [sorted({(r[d].start, r[d].stop) for r in regions}) for d in range(len(shape))]
    for cuts, dim in zip(axes, shape):
        if cuts[0][0] != 0 or cuts[-1][1] != dim or any(a[1] != b[0] for a, b in zip(cuts, cuts[1:])):
            return False
    distinct = {tuple((s.start, s.stop) for s in r) for r in regions}  # slices are unhashable before 3.12
    return len(distinct) == len(regions) == math.prod(len(cuts) for cuts in axes)


def global_regions(leaf) -> list[str]:
    """Every distinct shard region of ``leaf`` in the whole job, from its sharding alone."""
    shape = tuple(np.shape(leaf))
    if isinstance(leaf, jax.Array):
        return sorted({region_key(index, shape) for index in leaf.sharding.devices_indices_map(shape).values()})
    return [region_key((slice(None),) * len(shape), shape)]


# --------------------------------------------------------------------------- saving
class ShardCopies:
    """This process's share of a save: host views of the replica-0 shards it writes, hashed later."""

    def __init__(self, state: Any):
        entries = []
        for path, leaf in flatten(state):
            if isinstance(leaf, jax.Array):
                entries += [(path, region_key(shard.index, leaf.shape), shard.data)
                            for shard in leaf.addressable_shards if shard.replica_id == 0]
            elif jax.process_index() == 0:  # a host value: one region, written by process 0
                entries.append((path, region_key((slice(None),) * np.ndim(leaf), np.shape(leaf)), np.asarray(leaf)))
        for *_, data in entries:  # start every transfer before waiting for any
            if isinstance(data, jax.Array):
                data.copy_to_host_async()
        # np.asarray caches the copy on the shard, where orbax's device-to-host step finds it.
        self._copies = [(path, key, np.asarray(data)) for path, key, data in entries]
        self.nbytes = sum(copy.nbytes for *_, copy in self._copies)

    def digests(self) -> dict[str, dict[str, str]]:
        """``{path: {region: sha256}}``; each host view is released once hashed."""
        out: dict[str, dict[str, str]] = {}
        copies, self._copies = self._copies[::-1], []
        while copies:
            path, key, data = copies.pop()
            out.setdefault(path, {})[key] = sha256_hex(data)
            del data
        return out


def non_finite(state: Any) -> list[str]:
    """Paths of floating-point leaves holding NaN or inf, decided on the devices by one jitted reduction,
    so every process of a job gets the same answer and no array is copied to the host."""
    floats = [(p, x) for p, x in flatten(state)
              if jnp.issubdtype(x.dtype if hasattr(x, "dtype") else np.result_type(x), jnp.inexact)]
    bad = [p for p, x in floats if not isinstance(x, jax.Array) and not np.all(np.isfinite(x))]
    arrays = [(p, x) for p, x in floats if isinstance(x, jax.Array)]
    if arrays:
        mesh = next((x.sharding.mesh for _, x in arrays if isinstance(x.sharding, jax.sharding.NamedSharding)), None)
        out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        flags = _finite_flags(out)(tuple(x for _, x in arrays))
        bad += [p for (p, _), ok in zip(arrays, np.asarray(flags.addressable_data(0))) if not ok]
    return bad


@functools.lru_cache(maxsize=8)
def _finite_flags(out_sharding):
    return jax.jit(lambda arrays: jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays]), out_shardings=out_sharding)


def header(step: int, metadata: dict, state: Any) -> dict:
    """Process 0's manifest file: what every array is and which regions it was saved in."""
    arrays = {path: {"shape": list(np.shape(leaf)), "dtype": _dtype_name(leaf), "regions": global_regions(leaf)}
              for path, leaf in flatten(state)}
    return _plain({"version": MANIFEST_VERSION, "step": int(step), "metadata": metadata,
                   "process_count": jax.process_count(), "arrays": arrays})


def _dtype_name(leaf) -> str:
    return np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)).name


def part(step: int, digests: dict, arrays: dict) -> dict:
    """One process's manifest file: the digests of the regions it wrote, tied to the header's arrays."""
    return {"version": MANIFEST_VERSION, "step": int(step), "process": jax.process_index(),
            "process_count": jax.process_count(), "arrays_sha256": _structure_digest(arrays), "digests": digests}


def dumps(obj: dict, key: bytes | None) -> str:
    """``obj`` as JSON, with an ``hmac`` field over its canonical form when there is a key."""
    return json.dumps({**obj, "hmac": _mac(obj, key)} if key else obj)


def _plain(obj):
    return json.loads(json.dumps(obj))  # what a reader will see (tuples become lists), so what is signed


def _canonical(obj: dict) -> bytes:
    return json.dumps({k: v for k, v in obj.items() if k != "hmac"}, sort_keys=True, separators=(",", ":")).encode()


def _mac(obj: dict, key: bytes) -> str:
    return hmac.new(key, _canonical(obj), hashlib.sha256).hexdigest()


def _structure_digest(arrays: dict) -> str:
    return hashlib.sha256(json.dumps(arrays, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- reading
@dataclasses.dataclass
class Manifest:
    """A step's manifest, read and checked: ``arrays[path] = (shape, dtype, {region: sha256})``."""

    version: int
    step: int
    metadata: dict
    arrays: dict[str, tuple[list[int], str, dict[str, str]]]


def read_manifest(step_dir: str, key: bytes | None) -> Manifest:
    """The manifest of ``step_dir``, refusing (:class:`CheckpointDamaged`, naming the file) one that is
    missing, not JSON, malformed, incomplete, or — with ``key`` — unsigned or signed with another key."""
    directory = os.path.join(step_dir, "manifest")
    path = os.path.join(directory, HEADER_FILE)
    if not os.path.exists(path):
        legacy = os.path.join(directory, LEGACY_FILE)
        if os.path.exists(legacy):
            return _legacy(_load(legacy, step_dir, key), legacy, step_dir)
        raise CheckpointDamaged(f"checkpoint {step_dir} has no manifest ({path} is missing), so its arrays cannot "
                                f"be verified and dtx will not restore it; {FIX}")
    head = _load(path, step_dir, key)
    try:
        if head["version"] != MANIFEST_VERSION:
            raise ValueError(f"manifest version {head['version']!r}, this dtx reads {MANIFEST_VERSION} (and 1)")
        count, arrays = int(head["process_count"]), head["arrays"]
        regions = {p: [parse_region(r, tuple(a["shape"])) for r in a["regions"]] for p, a in arrays.items()}
        digests: dict[str, dict[str, str]] = {p: {} for p in arrays}
        for process in range(count):
            name = os.path.join(directory, part_file(process))
            if not os.path.exists(name):
                raise CheckpointDamaged(f"checkpoint {step_dir}: {name} (the digests of process {process}'s "
                                        f"shards) is missing; {FIX}")
            piece = _load(name, step_dir, key)
            if (piece["step"], piece["process"], piece["arrays_sha256"]) != (head["step"], process,
                                                                             _structure_digest(arrays)):
                raise ValueError(f"{name} belongs to another save (step {piece['step']}, process {piece['process']})")
            for p, found in piece["digests"].items():
                if p not in digests or set(found) & set(digests[p]):
                    raise ValueError(f"{name} names {p!r} regions it cannot have written")
                digests[p].update(found)
        for p, a in arrays.items():
            if set(digests[p]) != set(a["regions"]) or not _tiles(regions[p], tuple(a["shape"])):
                raise ValueError(f"the digests of {p!r} do not cover its regions {a['regions'][:4]} exactly")
        return Manifest(int(head["version"]), int(head["step"]), dict(head["metadata"]),
                        {p: (list(a["shape"]), str(a["dtype"]), digests[p]) for p, a in arrays.items()})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointDamaged(f"checkpoint {step_dir}: its manifest is malformed ({type(e).__name__}: {e}); "
                                f"{FIX}") from e


def _load(path: str, step_dir: str, key: bytes | None) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamaged(f"checkpoint {step_dir}: manifest file {path} is not readable JSON "
                                f"({type(e).__name__}: {e}); {FIX}") from e
    if not isinstance(obj, dict):
        raise CheckpointDamaged(f"checkpoint {step_dir}: manifest file {path} holds no JSON object; {FIX}")
    if key is not None:
        if "hmac" not in obj:
            raise CheckpointDamaged(
                f"checkpoint {step_dir}: {path} has no HMAC: it was written without a key, and this run requires "
                "signed manifests (checkpoint.hmac_key_env is set), so it cannot tell it from a forgery; "
                f"{UNSIGNED_FIX}, or {FIX}")
        if not hmac.compare_digest(str(obj["hmac"]), _mac(obj, key)):
            raise CheckpointDamaged(
                f"checkpoint {step_dir}: the HMAC of {path} does not match: the manifest was rewritten without the "
                f"key (tampered) or signed with a different key; {FIX}")
    return obj


def _legacy(obj: dict, path: str, step_dir: str) -> Manifest:
    """Version 1 (one SHA-256 per whole array) is verified as one region per array."""
    try:
        arrays = {p: (list(a["shape"]), str(a["dtype"]), {region_key((slice(None),) * len(a["shape"]),
                                                                    tuple(a["shape"])): str(a["sha256"])})
                  for p, a in obj["arrays"].items()}
        return Manifest(int(obj["version"]), int(obj["step"]), dict(obj.get("metadata") or {}), arrays)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointDamaged(f"checkpoint {step_dir}: manifest {path} is malformed ({type(e).__name__}: {e}); "
                                f"{FIX}") from e


# --------------------------------------------------------------------------- verifying
def verify_restored(manifest: Manifest, restored: Any, step_dir: str, read_region) -> None:
    """Check the arrays this process restored against the manifest's per-shard digests.

    ``read_region(path, region)`` reads a saved region back from storage; it is used only
    for regions that no single local shard contains. Raises :class:`CheckpointDamaged`.
    """
    for path, leaf in flatten(restored):
        shape, _, digests = manifest.arrays[path]
        regions = [(parse_region(k, tuple(shape)), k, d) for k, d in digests.items()]
        pieces = _local_pieces(leaf)
        for where, data in pieces:  # regions inside one local shard: hash the restored bytes themselves
            host = None
            for region, key, digest in regions:
                if _contains(where, region):
                    host = _to_host(data) if host is None else host
                    _expect(sha256_hex(host[_relative(region, where)]) == digest, step_dir, path, key)
            del host
        for region, key, digest in regions:  # regions cut across shards: verify the stored bytes, then compare
            touching = [(where, data) for where, data in pieces if _intersection(where, region) is not None]
            if not touching or any(_contains(where, region) for where, _ in touching):
                continue
            stored = read_region(path, region)
            _expect(sha256_hex(stored) == digest, step_dir, path, key)
            for where, data in touching:
                both = _intersection(where, region)
                mine = _to_host(data)[_relative(both, where)]
                theirs = stored[_relative(both, region)]
                _expect(mine.shape == theirs.shape and np.array_equal(
                    np.ascontiguousarray(mine).reshape(-1).view(np.uint8),
                    np.ascontiguousarray(theirs).reshape(-1).view(np.uint8)), step_dir, path, key, restored=True)


def read_stored_region(step_dir: str, name: str, region: tuple[slice, ...]) -> np.ndarray:
    """One saved region of array ``name``, read from the step's OCDBT store (the bytes on disk)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts

    base = {"driver": "file", "path": os.path.join(step_dir, "state") + os.sep}
    context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
    errors = []
    for driver in ("zarr", "zarr3"):  # orbax writes zarr v2 by default; v3 if asked
        spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": base, "path": name}}
        try:
            store = ts.open(spec, open=True, read=True, context=context).result()
            return np.asarray(store[region].read().result())
        except Exception as e:  # noqa: BLE001 — reported below, with both attempts
            errors.append(f"{driver}: {e}")
    raise CheckpointDamaged(f"checkpoint {step_dir}: cannot read array {name!r} back ({'; '.join(errors)}); "
                            f"{FIX}")


def _local_pieces(leaf) -> list[tuple[tuple[slice, ...], Any]]:
    """One ``(region, data)`` per distinct region this process holds (replicas on local devices once)."""
    shape = tuple(np.shape(leaf))
    if not isinstance(leaf, jax.Array):
        return [(tuple(slice(0, d) for d in shape), np.asarray(leaf))]
    pieces = {}
    for shard in leaf.addressable_shards:
        pieces.setdefault(region_key(shard.index, shape), shard.data)
    return [(parse_region(k, shape), data) for k, data in pieces.items()]


def _to_host(data) -> np.ndarray:
    """A shard's bytes on the host without caching them on the restored array (``np.asarray`` would
    keep a host copy alive as long as the array lives)."""
    to_numpy = getattr(data, "_single_device_array_to_np_array_did_copy", None)
    return to_numpy()[0] if to_numpy is not None else np.asarray(data)


def _expect(ok: bool, step_dir: str, path: str, key: str, restored: bool = False) -> None:
    if not ok:
        what = ("the restored data differs from the verified stored bytes" if restored
                else "does not match its recorded SHA-256 (corrupted or tampered data)")
        raise CheckpointDamaged(f"checkpoint {step_dir}: array {path!r}, shard [{key}] {what}; {FIX}")
