"""A run's directory: resume it, start it over, or refuse it — decided before any work.

dtx never overwrites a run: a workdir that holds records but nothing to resume is refused, a
checkpoint is resumed only under a config that keeps its meaning, and several processes check
that they run one experiment and see one checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax
from ml_collections import ConfigDict

from dtx.ckpt import barrier as barrier_lib
from dtx.ckpt import checkpoint as checkpoint_lib
from dtx import config as config_lib
from dtx.run import metrics as metrics_lib
from dtx.data import userdata
from dtx.step.state import TrainState


def check_paths(workdir: str, checkpoint_dir: str) -> None:
    """The workdir and checkpoint directory are directories, or do not exist yet."""
    for what, path in (("--workdir (train(..., workdir=))", workdir), ("checkpoint.dir", checkpoint_dir)):
        if os.path.exists(path) and not os.path.isdir(path):
            raise config_lib.ConfigError(f"{what} {path!r} is a file, not a directory; name a directory "
                                         "(it is created if missing)")
        above = os.path.dirname(os.path.abspath(path))  # the folders that would be created: under a file?
        while not os.path.exists(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise config_lib.ConfigError(f"{what} {path!r} cannot be created: {above!r} is a file, not a "
                                         "directory; name a directory")


def prepare(config: ConfigDict, workdir: str, checkpoint_dir: str, multi_process: bool) -> tuple[bool, bytes | None]:
    """Whether the run resumes, and the manifests' HMAC key; every process agrees before anyone writes."""
    bound = barrier_seconds(config)
    if multi_process:
        check_same_config(config, bound)
    resuming = decide_resume(config.checkpoint.resume, checkpoint_dir, workdir, config.checkpoint.resume_step)
    key = hmac_key(config.checkpoint.hmac_key_env)
    barrier_lib.wait("the check of the workdir", bound)  # before anyone writes to it
    if multi_process and (config.checkpoint.every_steps or resuming):
        check_shared_directory(checkpoint_dir, bound)
    return resuming, key


def resume(checkpointer: checkpoint_lib.Checkpointer, config: ConfigDict, abstract_state: TrainState, shardings,
           workers: int, user_data: str | None, relayout: checkpoint_lib.Relayout | None = None):
    """The newest step that verifies (or ``checkpoint.resume_step``), its config checked before any array; one saved
    in another layout (a pipeline's rows, the model's tree) converted by ``relayout``."""
    return checkpointer.resume(
        checkpoint_lib.abstract_target(abstract_state, shardings), step=config.checkpoint.resume_step or None,
        relayout=relayout,
        check=lambda saved: (check_resumable(saved.get("config", {}), config),
                             check_workers(saved, workers, abstract_state),
                             userdata.check_resume(saved, user_data)))


def check_workers(saved: dict, workers: int, abstract_state: TrainState) -> None:
    """Per-worker state (residuals, local models) has one entry per worker: the count must match."""
    if jax.tree.leaves(abstract_state.worker) and saved.get("workers", workers) != workers:
        raise config_lib.ConfigError(
            f"cannot resume: the checkpoint holds per-worker state for {saved['workers']} data-parallel workers "
            f"(compression residuals or local models) but this mesh has {workers}; resume on "
            f"{saved['workers']} workers, or train into a new --workdir")


def decide_resume(mode: str, checkpoint_dir: str, workdir: str, step: int = 0) -> bool:
    """Whether to resume; refuses anything that would overwrite or mix runs, before any work."""
    steps = sorted(int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()) if os.path.isdir(checkpoint_dir) else []
    has_checkpoint = bool(steps)
    if step and step not in steps:
        raise FileNotFoundError(f"checkpoint.resume_step={step} but {checkpoint_dir} holds no step {step} "
                                f"(it holds {steps or 'none'}); choose one of them, or 0 for the newest that verifies")
    if mode == "must" and not has_checkpoint:
        raise FileNotFoundError(f"checkpoint.resume=must but {checkpoint_dir} holds no checkpoint")
    if mode == "never" and has_checkpoint:
        raise FileExistsError(f"checkpoint.resume=never but {checkpoint_dir} already holds checkpoints; "
                              "choose another --workdir (dtx never overwrites a run)")
    resuming = has_checkpoint and mode != "never"
    if not resuming and mode != "must" and _interrupted_before_first_commit(checkpoint_dir, workdir):
        return False
    if not resuming and os.path.exists(os.path.join(workdir, metrics_lib.METRICS_FILE)):
        raise FileExistsError(
            f"workdir {workdir!r} already holds a run ({metrics_lib.METRICS_FILE}) and no checkpoint to resume; "
            "choose another --workdir or move that run away (dtx never overwrites records)"
        )
    return resuming


def _interrupted_before_first_commit(checkpoint_dir: str, workdir: str) -> bool:
    """A checkpointing run stopped before its first checkpoint committed left records but nothing to resume.

    Its checkpoint directory exists (created before training starts) but holds no committed step. Nothing of
    it can be resumed, so the run starts over; its records are moved into ``WORKDIR/interrupted-<n>/``,
    never deleted. So does a run without checkpoints whose last record says SIGTERM stopped it; any
    other workdir whose run never checkpointed is still refused (that run may have finished).
    """
    records = os.path.join(workdir, metrics_lib.METRICS_FILE)
    if not os.path.exists(records):
        return False
    if os.path.isdir(checkpoint_dir) and any(n.isdigit() for n in os.listdir(checkpoint_dir)):
        return False
    # A run without checkpoints that SIGTERM stopped said "run the same command to start again": so it does.
    preempted = not os.path.isdir(checkpoint_dir) and _ends_preempted(records)
    if not (os.path.isdir(checkpoint_dir) or preempted):
        return False
    if jax.process_index() == 0:
        n = 1 + sum(1 for name in os.listdir(workdir) if name.startswith("interrupted-"))
        aside = os.path.join(workdir, f"interrupted-{n}")
        os.makedirs(aside)
        for name in os.listdir(workdir):
            if name == metrics_lib.METRICS_FILE or name == "config.json" or name.startswith("events.out.tfevents"):
                os.replace(os.path.join(workdir, name), os.path.join(aside, name))
        why = ("preempted before anything was saved" if preempted
               else "interrupted before its first checkpoint committed")
        print(f"dtx: {workdir} holds a run {why}; starting over (its records are in {aside})", file=sys.stderr)
    return True


def _ends_preempted(records: str) -> bool:
    """Whether a run's last record is the ``preempted`` mark a SIGTERM leaves."""
    with open(records, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
        lines = f.read().splitlines()
    try:
        return bool(lines) and json.loads(lines[-1]).get("preempted") == 1
    except ValueError:  # a torn last line: the run was killed, not preempted
        return False


def hmac_key(variable: str) -> bytes | None:
    """The manifests' HMAC key, from the environment variable ``checkpoint.hmac_key_env`` names (never the config,
    which is saved in every checkpoint and config.json)."""
    if not variable:
        return None
    value = os.environ.get(variable, "")
    if not value:
        raise config_lib.ConfigError(
            f"checkpoint.hmac_key_env={variable!r} but the environment variable {variable} is unset or empty; "
            f"export it in every process (e.g. {variable}=$(openssl rand -hex 32)) or set checkpoint.hmac_key_env=''")
    return value.encode()


def barrier_seconds(config: ConfigDict) -> float:
    """How long a checkpoint's agreement between processes waits for a rank (:mod:`dtx.ckpt.barrier`): the step
    watchdog's bound, ``watchdog_seconds`` (orbax's 300 s where the watchdog is off)."""
    return float(config.watchdog_seconds) if config.watchdog_seconds > 0 else barrier_lib.DEFAULT_TIMEOUT_S


def check_same_config(config: ConfigDict, bound: float = barrier_lib.DEFAULT_TIMEOUT_S) -> None:
    """Every process must run the same experiment; a mismatch would silently train nonsense. The digests travel
    through the coordination service with a deadline (:func:`dtx.ckpt.barrier.exchange`), not a collective: a
    rank that never gets here is named after ``bound`` seconds instead of holding the others."""
    digest = hashlib.sha256(config.to_json().encode()).hexdigest()[:16]
    digests = barrier_lib.exchange(digest, "the check that every process runs the same config", bound)
    differ = sorted(rank for rank, other in digests.items() if other != digests[0])
    if differ:
        raise config_lib.ConfigError(
            f"process {jax.process_index()}: the config of rank(s) {', '.join(map(str, differ))} differs from rank "
            "0's (compare their config.json); every process must be started with the same experiment and overrides")


def check_shared_directory(directory: str, bound: float = barrier_lib.DEFAULT_TIMEOUT_S) -> None:
    """Checkpoints need one directory that every process sees (a shared file system)."""
    token = os.path.join(directory, ".dtx-shared-check")
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        with open(token, "w") as f:
            f.write(str(os.getpid()))
    barrier_lib.wait("the check that the checkpoint directory is shared", bound)
    if not os.path.exists(token):
        raise FileNotFoundError(
            f"process {jax.process_index()} cannot see {directory} written by process 0: the checkpoint "
            "directory must be on storage shared by every process (set --config.checkpoint.dir)")
    barrier_lib.wait("the check that every process saw the shared directory", bound)


# Keys a resumed run may change: run length, logging, checkpointing and how (not what) it computes.
RESUME_MAY_CHANGE = ("num_steps", "num_epochs", "checkpoint", "progress", "log_every", "eval_every",
                      "eval_batch_size", "watchdog_seconds", "heartbeat_seconds", "startup_seconds",
                      "emulate_cpu_devices", "mesh", "grad_accum_steps",
                      "driver", "distributed", "allreduce", "bucket_bytes", "parallel", "profile_steps", "peak_flops",
                      "pipeline", "log_grad_norm", "compilation_cache", "wandb", "dataset.workers",
                      "host_memory_check")


def _with_defaults(saved: dict, defaults: dict, current: dict) -> dict:
    """``saved`` with the keys it lacks taken from ``defaults``, block by block: only keys the run now has
    (a block an experiment replaced, e.g. ``model`` of another architecture, gains no default's keys)."""
    merged = dict(saved)
    for key, value in defaults.items():
        if key not in current:
            continue
        if key not in merged:
            merged[key] = value
        elif isinstance(value, dict) and isinstance(merged[key], dict) and isinstance(current[key], dict):
            merged[key] = _with_defaults(merged[key], value, current[key])
    return merged


def _without(config: dict, keys) -> dict:
    """``config`` less the dotted ``keys`` inside its blocks (``dataset.workers``: how, not what, is read)."""
    config = dict(config)
    for key in keys:
        block, _, inner = key.partition(".")
        if inner and isinstance(config.get(block), dict):
            config[block] = {k: v for k, v in config[block].items() if k != inner}
    return config


def check_resumable(saved: dict, config: ConfigDict) -> None:
    """Refuse to resume a checkpoint under settings that change what its state means (data order,
    model, optimizer, precision): the run would silently stop being the run that was saved."""
    current = json.loads(config.to_json())  # the saved copy went through JSON too (tuples -> lists)
    # A key added to dtx after the checkpoint was written takes its default there: the run that
    # saved it ran with what that default means (e.g. task.name=classification).
    saved = _with_defaults(saved, json.loads(config_lib.base_config().to_json()), current) if saved else saved
    saved, current = _without(saved, RESUME_MAY_CHANGE), _without(current, RESUME_MAY_CHANGE)
    changed = sorted(k for k in set(saved) | set(current)
                     if k not in RESUME_MAY_CHANGE and saved.get(k) != current.get(k))
    if saved and changed:
        raise config_lib.ConfigError(
            f"cannot resume: {', '.join(changed)} differ from the checkpointed run's config; set them back "
            "or train into a new --workdir (only run length, logging, checkpointing, mesh, accumulation, driver and "
            "allreduce may change on resume)")
