"""Checkpoint integrity: damaged and forged manifests, per-shard digests hashed where the shard lives,
verification of the bytes actually restored on any layout, and no gather on the save or restore path.

Every test first checks that its fault really happened, then that dtx refused it, naming the step.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import tracemalloc

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from dtx import models
from dtx import config as config_lib
from dtx.ckpt import integrity
from dtx import mesh as mesh_lib
from dtx import optim
from dtx.ckpt.checkpoint import Checkpointer, CheckpointDamaged, CheckpointError, abstract_target, state_digest
from dtx.tools.launch import free_port
from dtx.step.state import abstract_train_state, init_train_state, replicated_shardings
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
RUN = ["--config.model.features=(32,)", "--config.log_every=1", "--config.progress=False"]
EXAMPLE = jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32)
P = jax.sharding.PartitionSpec


def _state(seed=0):
    model, tx = models.build_model("mlp", features=(32,)), optax.adam(1e-3)
    state = init_train_state(model, tx, EXAMPLE, seed, mesh_lib.make_mesh([("data", 8)]))
    return state.replace(step=state.step + 7), model, tx


def _target(model, tx, split=False):
    """The state's layout on 8 devices: replicated, or every array whose rows divide by 8 split by rows."""
    mesh = mesh_lib.make_mesh([("data", 8)])
    abstract = abstract_train_state(model, tx, EXAMPLE)
    shardings = replicated_shardings(abstract, mesh)
    if split:
        shardings = jax.tree.map(lambda a: jax.sharding.NamedSharding(
            mesh, P("data") if a.ndim and a.shape[0] % 8 == 0 else P()), abstract)
    return abstract_target(abstract, shardings)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 7 of a replicated 8-device state, committed."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    state, model, tx = _state()
    checkpointer = Checkpointer(directory)
    checkpointer.save(7, state, {"note": "fixture"})
    checkpointer.close()
    return directory, jax.device_get(state), model, tx


def _copy(saved_dir, tmp_path):
    shutil.copytree(saved_dir, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("damage", ["garbled", "missing"])
def test_damaged_manifest_is_a_checkpoint_error_naming_the_step(saved, tmp_path, damage):
    """F8: a manifest that is not JSON, or is gone, is a CheckpointError naming the step directory —
    not a JSON or KeyError traceback — for metadata() (what a resume reads first) and restore()."""
    directory = _copy(saved[0], tmp_path)
    files = [directory / "7" / "manifest" / n for n in os.listdir(directory / "7" / "manifest")
             if n != "commit_success.txt"]
    for path in files:
        if damage == "garbled":
            path.write_text('{"version": 2, "step": 7\x01')
        else:
            path.unlink()
    assert files and all(not p.exists() or "\x01" in p.read_text() for p in files)  # the fault fired
    expected = "not readable JSON" if damage == "garbled" else "has no manifest"
    for attempt in (lambda c: c.metadata(7), lambda c: c.restore(7, _target(saved[2], saved[3]))):
        with pytest.raises(CheckpointError, match=f"checkpoint {directory / '7'}.*{expected}"):
            attempt(Checkpointer(directory))


def test_digests_that_miss_a_region_are_refused(saved, tmp_path):
    """A (still valid JSON) digest file that lost an array's digests would leave data unverified."""
    directory = _copy(saved[0], tmp_path)
    part = directory / "7" / "manifest" / integrity.part_file(0)
    doc = json.loads(part.read_text())
    del doc["digests"]["params/Dense_0/kernel"]
    part.write_text(json.dumps(doc))
    with pytest.raises(CheckpointDamaged, match=r"digests of 'params/Dense_0/kernel' do not cover its regions"):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3]))


def test_regions_must_tile_the_array():
    """What the manifest's region list must be (what a sharding makes): a grid covering the array once."""
    def tiles(keys, shape):
        return integrity._tiles([integrity.parse_region(k, shape) for k in keys], shape)

    assert tiles(["0:4,0:8", "4:8,0:8"], (8, 8)) and tiles([""], ())
    assert not tiles(["0:4,0:8"], (8, 8))  # half the rows unverified
    assert not tiles(["0:4,0:8", "2:8,0:8"], (8, 8))  # overlapping
    assert not tiles(["0:4,0:4", "4:8,4:8"], (8, 8))  # a grid with holes
    for bad in ("0:9", "4:2", "0:4,0:4", "a:b"):
        with pytest.raises(ValueError):
            integrity.parse_region(bad, (8,))


def test_version_1_manifests_still_restore_verified(saved, tmp_path):
    """Checkpoints written before per-shard digests (``manifest/metadata``: one SHA-256 per whole array)
    restore, verified as one region per array, also onto a split layout; a wrong digest is refused."""
    directory = _copy(saved[0], tmp_path)
    manifest = directory / "7" / "manifest"
    head = json.loads((manifest / integrity.HEADER_FILE).read_text())
    digests = json.loads((manifest / integrity.part_file(0)).read_text())["digests"]
    arrays = {p: {"shape": a["shape"], "dtype": a["dtype"], "sha256": digests[p][a["regions"][0]]}
              for p, a in head["arrays"].items()}
    (manifest / integrity.HEADER_FILE).unlink()
    (manifest / integrity.part_file(0)).unlink()
    legacy = {"version": 1, "step": 7, "metadata": head["metadata"], "arrays": arrays}
    (manifest / integrity.LEGACY_FILE).write_text(json.dumps(legacy))
    for split in (False, True):
        restored, metadata = Checkpointer(directory).restore(7, _target(saved[2], saved[3], split))
        assert state_digest(restored) == state_digest(saved[1]) and metadata == {"note": "fixture"}
    arrays["params/Dense_0/kernel"]["sha256"] = "0" * 64
    (manifest / integrity.LEGACY_FILE).write_text(json.dumps(legacy))
    with pytest.raises(CheckpointDamaged, match=r"'params/Dense_0/kernel'.*does not match its recorded SHA-256"):
        Checkpointer(directory).restore(7, _target(saved[2], saved[3]))


def test_hmac_refuses_forged_and_unsigned_manifests(tmp_path):
    """F9: arrays swapped for another state's with their SHA-256 recomputed pass the unkeyed digest
    (it detects corruption, not tampering); with a key the forgery is refused, and so is a manifest
    written without one, or under another key."""
    key = b"0123456789abcdef0123456789abcdef"
    state, model, tx = _state(seed=0)
    other, _, _ = _state(seed=1)
    for name, value, signing in (("signed", state, key), ("plain", other, None)):
        checkpointer = Checkpointer(tmp_path / name, hmac_key=signing)
        checkpointer.save(7, value)
        checkpointer.close()
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "signed", forged)
    shutil.rmtree(forged / "7" / "state")
    shutil.copytree(tmp_path / "plain" / "7" / "state", forged / "7" / "state")
    part = forged / "7" / "manifest" / integrity.part_file(0)
    doc = json.loads(part.read_text())
    doc["digests"] = json.loads((tmp_path / "plain" / "7" / "manifest" / integrity.part_file(0)).read_text())["digests"]
    part.write_text(json.dumps(doc))  # the forger recomputed every SHA-256 but cannot recompute the HMAC
    target = _target(model, tx)

    restored, _ = Checkpointer(forged).restore(7, target)  # no key: the forgery is indistinguishable
    assert state_digest(restored) == state_digest(other) != state_digest(state)
    with pytest.raises(CheckpointDamaged, match=r"HMAC of .*digests.0.json does not match.*tampered"):
        Checkpointer(forged, hmac_key=key).restore(7, target)
    del doc["hmac"]
    part.write_text(json.dumps(doc))
    with pytest.raises(CheckpointDamaged, match="has no HMAC: it was written without a key"):
        Checkpointer(forged, hmac_key=key).restore(7, target)
    with pytest.raises(CheckpointDamaged, match="has no HMAC: it was written without a key"):
        Checkpointer(tmp_path / "plain", hmac_key=key).restore(7, target)
    with pytest.raises(CheckpointDamaged, match="does not match"):
        Checkpointer(tmp_path / "signed", hmac_key=b"another key").metadata(7)
    restored, _ = Checkpointer(tmp_path / "signed", hmac_key=key).restore(7, target)
    assert state_digest(restored) == state_digest(state)


def test_hmac_key_comes_from_the_environment_variable_the_config_names(tmp_path, monkeypatch):
    """checkpoint.hmac_key_env names the variable: unset, the run is refused before any work; set, the
    run signs; resumed under another key, its only checkpoint is refused as not signed with that key."""
    config = config_lib.load(DEFAULT, RUN + ["--config.num_steps=2", "--config.checkpoint.every_steps=2",
                                             "--config.checkpoint.hmac_key_env=DTX_TEST_CHECKPOINT_KEY"])
    monkeypatch.delenv("DTX_TEST_CHECKPOINT_KEY", raising=False)
    with pytest.raises(config_lib.ConfigError, match="environment variable DTX_TEST_CHECKPOINT_KEY is unset"):
        train(config, tmp_path)
    assert not (tmp_path / "checkpoints").exists()
    monkeypatch.setenv("DTX_TEST_CHECKPOINT_KEY", "first key, 32 characters long..")
    train(config, tmp_path)
    assert "hmac" in json.loads((tmp_path / "checkpoints" / "2" / "manifest" / integrity.HEADER_FILE).read_text())
    monkeypatch.setenv("DTX_TEST_CHECKPOINT_KEY", "a different key")
    with pytest.raises(CheckpointDamaged, match=r"no checkpoint in .* verifies .*step 2: .*HMAC"):
        train(config_lib.override(config, num_steps=4), tmp_path)


def test_restore_checks_the_bytes_it_restored_on_any_layout(saved, monkeypatch):
    """A saved region inside one restored shard is re-hashed from that shard; one cut across restored
    shards (saved replicated, restored split by rows) is read back, verified and compared with every
    restored piece. Either way the bytes checked are the restored ones: a restore that hands back one
    wrong value is refused on both layouts."""
    directory, state, model, tx = saved
    for split in (False, True):
        restored, metadata = Checkpointer(directory).restore(7, _target(model, tx, split))
        assert state_digest(restored) == state_digest(state) and metadata == {"note": "fixture"}
    kernel = restored.params["Dense_0"]["kernel"]
    assert len({str(s.index) for s in kernel.addressable_shards}) == 8  # the split layout really split it

    original = ocp.PyTreeCheckpointHandler.restore

    def one_wrong_value(self, *args, **kwargs):
        tree = original(self, *args, **kwargs)
        kernel = tree.params["Dense_0"]["kernel"]
        wrong = jax.device_put(kernel.at[9, 3].add(1.0), kernel.sharding)
        return tree.replace(params={**tree.params, "Dense_0": {**tree.params["Dense_0"], "kernel": wrong}})

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "restore", one_wrong_value)
    with pytest.raises(CheckpointDamaged, match=r"'params/Dense_0/kernel', shard \[0:64,0:32\] does not match"):
        Checkpointer(directory).restore(7, _target(model, tx))
    with pytest.raises(CheckpointDamaged, match=r"'params/Dense_0/kernel'.*restored data differs from the verified"):
        Checkpointer(directory).restore(7, _target(model, tx, split=True))


def test_save_hashes_local_shards_off_the_training_thread_without_host_copies(tmp_path, monkeypatch):
    """64 MB split over 8 devices: the manifest holds one digest per shard; they are computed in
    orbax's commit thread, not the caller's; and the save allocates next to no host memory (tracemalloc
    peak, save to commit). On the CPU backend a shard's host view is its device buffer, so any host
    copy of the local shards would show as >= 1x (the previous whole-array copy measured 1.0x)."""
    mesh = mesh_lib.make_mesh([("data", 8)])
    weights = jax.device_put(np.random.default_rng(0).standard_normal((4096, 4096), np.float32),
                             jax.sharding.NamedSharding(mesh, P("data")))
    threads = []
    digests = integrity.ShardCopies.digests
    monkeypatch.setattr(integrity.ShardCopies, "digests",
                        lambda self: (threads.append(threading.current_thread()), digests(self))[1])
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, {"w": weights})  # compiles the finiteness check outside the measurement
    checkpointer.wait()
    tracemalloc.start()
    try:
        checkpointer.save(2, {"w": weights})
        checkpointer.wait()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    checkpointer.close()
    assert threads and threading.main_thread() not in threads
    assert peak <= 0.25 * weights.nbytes, f"{peak / weights.nbytes:.2f}x the local shard bytes"
    found = json.loads((tmp_path / "2" / "manifest" / integrity.part_file(0)).read_text())["digests"]["w"]
    assert sorted(found) == sorted(f"{512 * i}:{512 * (i + 1)},0:4096" for i in range(8))
    assert found["0:512,0:4096"] == integrity.sha256_hex(np.asarray(weights)[:512])


_WORKER = """
import sys, traceback
import jax, numpy as np
from jax.experimental import multihost_utils
gather = multihost_utils.process_allgather
def guarded(tree, *args, **kwargs):
    # Barriers gather a 4-byte name hash (jax's sync_global_devices, orbax's barriers, train's checks):
    # allowed. Gathering any array on the checkpoint path is what this test forbids.
    stack = "".join(traceback.format_stack())
    if any(p in stack for p in ("dtx/ckpt/checkpoint.py", "dtx/ckpt/integrity.py", "orbax/checkpoint")) and any(
            isinstance(x, jax.Array) or np.size(x) > 1 for x in jax.tree.leaves(tree)):
        raise AssertionError("process_allgather of an array on the checkpoint path:\\n" + stack)
    return gather(tree, *args, **kwargs)
multihost_utils.process_allgather = guarded
from dtx.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _two_processes(workdir, *args):
    port, env = free_port(), {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", _WORKER, "train", DEFAULT, "--workdir", str(workdir), *RUN, *args,
               "--config.emulate_cpu_devices=4", "--config.parallel.name=fsdp", "--config.driver=jit"]
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**env, mesh_lib.ENV_COORDINATOR: f"127.0.0.1:{port}",
                                     mesh_lib.ENV_NUM_PROCESSES: "2", mesh_lib.ENV_PROCESS_ID: str(rank)})
               for rank in range(2)]
    try:
        outputs = [w.communicate(timeout=400)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, output in zip(workers, outputs):
        assert w.returncode == 0, output[-4000:]
    return outputs


def _overwrite(step_dir, name, region):
    """Write zeros over ``region`` of a saved array, in place (valid data that no longer matches its digest)."""
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": {"driver": "file", "path": f"{step_dir}/state/"},
                                          "path": name}}
    store = ts.open(spec, open=True, read=True, write=True, context=ocp.type_handlers.get_ts_context(use_ocdbt=True))
    store = store.result()
    before = store[region].read().result()
    store[region].write(np.zeros_like(before)).result()
    assert np.any(before != 0) and not np.any(store[region].read().result())  # the fault fired


def test_two_process_fsdp_saves_and_restores_shards_where_they_live(tmp_path):
    """FSDP over 2 processes x 4 devices, with process_allgather made to fail on the checkpoint path:
    saves at steps 2 and 4, a resume from 4 (each process verifies the shards it restored) and a save
    at 6 all succeed; each process's digest file holds exactly the shards it owns; the job's checkpoint
    restores, verified, in this one process on one device; and when only process 1's shards of step 6
    are damaged, both processes skip step 6 together and resume from 4."""
    _two_processes(tmp_path, "--config.num_steps=4", "--config.checkpoint.every_steps=2")
    outputs = _two_processes(tmp_path, "--config.num_steps=6", "--config.checkpoint.every_steps=2")
    assert "resumed from step 4" in outputs[0]
    manifest = tmp_path / "checkpoints" / "6" / "manifest"
    regions = json.loads((manifest / integrity.HEADER_FILE).read_text())["arrays"]["params/Dense_0/kernel"]["regions"]
    parts = [set(json.loads((manifest / integrity.part_file(i)).read_text())["digests"]["params/Dense_0/kernel"])
             for i in range(2)]
    assert len(regions) == 8 and all(len(p) == 4 for p in parts) and parts[0] | parts[1] == set(regions)

    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    tx = optim.make_optimizer("adam", optim.make_schedule("constant", 2e-3, 6))  # as the trainer builds it
    abstract = abstract_train_state(models.build_model("mlp", features=(32,)), tx, EXAMPLE)
    restored, _ = Checkpointer(tmp_path / "checkpoints").restore(6, abstract_target(
        abstract, replicated_shardings(abstract, mesh)))
    assert int(restored.step) == 6

    region = sorted(parts[1])[0]  # a shard process 1 wrote, and restores again under the same layout
    _overwrite(tmp_path / "checkpoints" / "6", "params.Dense_0.kernel", integrity.parse_region(region, (64, 32)))
    outputs = _two_processes(tmp_path, "--config.num_steps=8", "--config.checkpoint.every_steps=2")
    assert "not resuming from checkpoint step 6: checkpoint" in outputs[1]  # process 1 says why ...
    assert "step 6: its shards failed verification on another process" in outputs[0]  # ... process 0 follows
    assert all("resumed from step 4" in out for out in outputs[:1])
    assert [n.split(".")[0] for n in os.listdir(tmp_path / "checkpoints" / "superseded")] == ["6"]
