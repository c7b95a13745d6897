"""A finished (or running) run's checkpoints, evaluated or exported: ``dtx eval`` and ``dtx export``.

    dtx eval WORKDIR [--step N]
    dtx export WORKDIR --out DIR [--step N]

Both rebuild the run from ``WORKDIR/config.json`` — mesh, data, model, optimizer,
precision, strategy, exactly as ``dtx.train`` built them — and restore a checkpoint
through :class:`dtx.ckpt.checkpoint.Checkpointer` (read-only), so every integrity check of
a resume applies: per-shard SHA-256 digests, the HMAC of signed manifests, strict
shapes and dtypes. The newest checkpoint by default, or step ``N``.

``eval`` runs the run's own evaluation program on the test split: the numbers equal
the ones the run recorded for that step. ``export`` writes the evaluated parameters
and the model state (batch-norm statistics) for plain flax: ``variables.msgpack``
(:func:`flax.serialization.msgpack_serialize` of ``{"params": ..., "batch_stats": ...}``),
``model.json`` (class, constructor keywords, input shape) and, when the model's module
is a self-contained file, a copy of it as ``model.py`` (docs/checkpoints.md shows the
load). A model, task or data source that the config names by import path
(``--config.model.name=package.module:Class``, :mod:`dtx.config.parts`) is rebuilt like dtx's own,
when its module imports. A run that trained a module, optimizer, task or data passed to ``dtx.train``
as an object cannot be rebuilt from its config: pass the same ones to :func:`evaluate_run` /
:func:`export_run`; one error lists every part a run lacks.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import flax.serialization
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec
from ml_collections import ConfigDict

from dtx.ckpt import checkpoint as checkpoint_lib
from dtx.ckpt import integrity
from dtx.comm import context as comm_lib
from dtx.data import datasets, inputs, userdata
from dtx.run import preflight
from dtx.data import tasks as tasks_lib
from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import xla_cache
from dtx.data.loader import TrainLoader, eval_batches
from dtx.step import body as step_body
from dtx.step import state_specs

from dtx.run import exportdir, rundir, setup
from dtx.run import trainer as train_lib  # noqa: E402

from dtx.run.exportdir import MODEL_FILE, SOURCE_FILE, VARIABLES_FILE  # noqa: E402


class RunError(ValueError):
    """A workdir that cannot be evaluated or exported as asked; the message says what to do, in terms the
    command being run takes (its WORKDIR, ``--step``, ``--out``), or else the file or command that does."""


_OVERRIDE = re.compile(r"--config\.([\w.]+)")  # a training run's override, in a message: the key it names


class Restored(NamedTuple):
    """A run rebuilt from its workdir, with one checkpoint restored."""

    config: ConfigDict
    mesh: Any
    dataset: datasets.Dataset
    parts: setup.Parts
    state: Any
    step: int
    directory: str  # the checkpoint directory


def evaluate_run(workdir: str | os.PathLike, *, step: int | None = None, **given) -> dict:
    """Test metrics of checkpoint ``step`` (default: the newest) of the run in ``workdir``.

    Returns ``{"step", "test_loss", "test_<metric>" (e.g. test_accuracy), "test_examples", ...}``,
    computed by the run's own evaluation program (same mesh, driver, task and batches as
    ``dtx.train``'s). ``given``: ``model=``, ``optimizer=``, ``task=``, ``data=`` — the ones the run
    was given in ``dtx.train``, which its config cannot rebuild (:func:`restore` says which).
    """
    run = restore(workdir, step=step, **given)
    parts, config = run.parts, run.config
    if run.dataset.test is None:
        raise RunError(f"{workdir} trained on data without a test split: nothing to evaluate (dtx export still "
                       "writes its variables); in Python, evaluate_run(WORKDIR, data={'train': ..., 'test': ...}) "
                       "evaluates it on the test split you give")
    eval_step = setup.make_eval(config, parts, run.mesh)
    batches = eval_batches(run.dataset.test, config.eval_batch_size, run.mesh, config.get("eval_batches", 0))
    return {"step": run.step, **train_lib.evaluate(eval_step, run.state, batches, parts.task)}


def export_run(workdir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, **given) -> dict:
    """Write checkpoint ``step``'s evaluated parameters and model state to ``out`` for plain flax.

    Returns what ``model.json`` holds. The folder appears whole or not at all (:mod:`dtx.run.exportdir`):
    refuses an ``out`` that already holds a complete export (dtx never overwrites), other files, or is a
    file; replaces an incomplete export, saying so.
    """
    out = os.fspath(out)
    replacing = exportdir.check_free(out)  # before any work
    run = restore(workdir, step=step, **given)
    variables = _evaluated_variables(run)
    variables = jax.tree.map(np.asarray, jax.device_get(variables))
    payload = flax.serialization.msgpack_serialize(variables)
    net = run.parts.model
    described = {
        "class": preflight.qualified_name(net),
        "class_name": type(net).__qualname__,
        "kwargs": _constructor_kwargs(net),
        "source": None,
        "input_shape": list(run.parts.example.shape[1:]),
        "input_dtype": np.dtype(run.parts.example.dtype).name,
        "collections": sorted(variables),
        "step": run.step,
        "workdir": os.path.abspath(os.fspath(workdir)),
        "variables_sha256": hashlib.sha256(payload).hexdigest(),
        "apply": "model.apply(variables, inputs, train=False) -> logits",
    }
    source = _self_contained_source(type(net))
    files = {VARIABLES_FILE: payload}
    if source is not None:
        files[SOURCE_FILE] = source.encode("utf-8")
        described["source"] = SOURCE_FILE
    files[MODEL_FILE] = json.dumps(described, indent=2).encode("utf-8")
    exportdir.write(out, files, replacing)
    return described


def restore(workdir: str | os.PathLike, *, step: int | None = None, model: nn.Module | None = None,
            optimizer: optax.GradientTransformation | None = None, task: tasks_lib.Task | None = None,
            data=None) -> Restored:
    """Rebuild the run in ``workdir`` from its ``config.json`` and restore checkpoint ``step`` (newest if None).

    ``model``, ``optimizer``, ``task``, ``data``: what the run was given in ``dtx.train`` instead of its
    config (``config.json`` marks those blocks ``"given"``); refused when such a block's argument is missing.
    """
    workdir = os.fspath(workdir)
    saved = _saved_config(workdir)
    _check_rebuildable(workdir, saved, {"model": model, "optimizer": optimizer, "task": task, "dataset": data})
    config = config_from_json(saved)
    with _settings_of(workdir):
        if config.emulate_cpu_devices:
            mesh_lib.emulate_cpu_devices(config.emulate_cpu_devices)
        xla_cache.enable(config.compilation_cache)
        mesh = mesh_lib.make_mesh(config.mesh)
        mesh_lib.check_batch_size(config.eval_batch_size, mesh, what="eval_batch_size")
        task = task or setup.config_task(config)
        if data is None:  # as dtx.train reads the config
            data = inputs.load_dataset(config.dataset, seed=config.seed)
    dataset = userdata.as_dataset(data, task)
    recorded = saved.get("dataset", {}).get("fingerprint")
    if recorded and recorded != userdata.fingerprint(dataset):
        raise RunError(f"data: these arrays are not the ones {workdir} trained on (fingerprint "
                       f"{userdata.fingerprint(dataset)}, the run recorded {recorded}); pass the run's data")
    loader = TrainLoader(dataset.train, config.global_batch_size, mesh, seed=config.seed)
    num_steps = config.num_steps or math.ceil(config.num_epochs * loader.steps_per_epoch)
    with _settings_of(workdir):
        parts = setup.build_parts(config, mesh, dataset, loader.steps_per_epoch, num_steps, model=model,
                                  optimizer=optimizer, task=task)
    directory = config.checkpoint.dir or os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory) or not any(n.isdigit() for n in os.listdir(directory)):
        moved = (f"; if its checkpoints moved, set checkpoint.dir in {os.path.join(workdir, 'config.json')} to "
                 "where they are now" if config.checkpoint.dir else "")
        raise RunError(f"{workdir} has no checkpoint in {directory}: only a run that saved checkpoints can be "
                       "evaluated or exported; train one with dtx train EXPERIMENT.py "
                       f"--config.checkpoint.every_steps=N (it also saves the last step){moved}")
    variable = config.checkpoint.hmac_key_env
    if variable and not os.environ.get(variable):  # rundir.hmac_key's own fix is a training run's
        raise RunError(f"{workdir} signed its checkpoints with the key in the environment variable {variable} "
                       f"(its config.json's checkpoint.hmac_key_env), which is unset or empty here; export "
                       f"{variable} with that same key (another key fails every manifest's HMAC) and run the command "
                       "again")
    checkpointer = checkpoint_lib.Checkpointer(directory, hmac_key=rundir.hmac_key(variable), read_only=True)
    try:
        steps = checkpointer.steps()
        chosen = steps[-1] if step is None else int(step)
        if chosen not in steps:
            raise RunError(f"--step {chosen}: {directory} holds no checkpoint {chosen}; it holds {steps}")
        target = checkpoint_lib.abstract_target(parts.abstract_state, parts.placement.state)
        try:
            state, _ = checkpointer.restore(chosen, target, setup.relayout(parts, mesh))  # another layout's step too
        except checkpoint_lib.CheckpointDamaged as e:  # its fix names a resume's settings: here, --step
            others = [s for s in steps if s != chosen]
            fix = (f"choose another step with --step N ({directory} also holds {others}) or delete this one"
                   if others else f"{directory} holds no other step to choose with --step N")
            raise type(e)(str(e).replace(integrity.UNSIGNED_FIX, "if you trust these files, set "
                                         f"checkpoint.hmac_key_env to '' in {os.path.join(workdir, 'config.json')}")
                          .replace(integrity.FIX, fix)) from e
    finally:
        checkpointer.close()
    return Restored(config, mesh, dataset, parts, state, chosen, directory)


@contextlib.contextmanager
def _settings_of(workdir: str):
    """Rebuilding the run from its config.json: an error whose fix is a ``--config.KEY=VALUE`` override (a
    training run's; ``dtx eval`` and ``dtx export`` take none) names that key in config.json instead, which
    they rebuild the run from -- e.g. a dataset's ``data_dir`` that moved, a mesh for other devices."""
    try:
        yield
    except RunError:
        raise
    except ValueError as e:
        text = str(e)
        if "--config." not in text:
            raise
        path = os.path.join(workdir, "config.json")
        raise RunError(f"{path}: {_OVERRIDE.sub(lambda m: m.group(1), text)} (dtx eval and dtx export take no "
                       f"--config overrides: change that key in {path}, which they rebuild the run from)") from None


def _check_rebuildable(workdir: str, saved: dict, arguments: dict) -> None:
    """Refuse, in one error that lists them all, the parts ``config.json`` cannot rebuild: those passed to
    ``dtx.train`` (marked ``"given"``) and not passed here, and those named by an import path that does not
    import here."""
    missing, needed = [], []
    for block, argument in arguments.items():
        entry = saved.get(block, {})
        if not isinstance(entry, dict):
            continue
        name = "data" if block == "dataset" else block
        if preflight.GIVEN in entry and argument is None:
            what = entry.get("class") or entry.get("description") or entry.get("name") or entry.get("fingerprint")
            module, _, cls = str(entry.get("class") or "").rpartition(".")
            hint = (f"; or train it again by import path, dtx train EXPERIMENT.py --config.model.name={module}:{cls}, "
                    "and dtx eval and dtx export can rebuild that run" if block == "model" and module
                    and module != "__main__" else "")
            missing.append(f"the {name} passed to {entry[preflight.GIVEN]} ({what}){hint}")
            needed.append(name)
        elif preflight.GIVEN not in entry and config_lib.is_import_path(entry.get("name")) and argument is None:
            try:
                config_lib.resolve(entry["name"], f"{block}.name")
            except config_lib.ConfigError as e:
                missing.append(str(e))
    if missing:
        call = ", ".join(f"{name}=..." for name in needed)
        fix = (f"; in Python, pass the same ones: dtx.run.evaluate.evaluate_run({workdir!r}, {call}) (or export_run)"
               if needed else "")
        raise RunError(f"{workdir} cannot be rebuilt from its config.json; it needs {len(missing)} part(s) it cannot "
                       f"find: " + "; ".join(f"({i}) {m}" for i, m in enumerate(missing, 1)) + fix)


def config_from_json(saved: dict) -> ConfigDict:
    """The locked, validated config a run's ``config.json`` records (JSON lists back to tuples).

    Blocks that ``dtx.train`` replaced with an argument keep their defaults: the argument, not
    the config, says what ran.
    """
    config = config_lib.base_config()
    for key, value in saved.items():
        if key not in config:
            raise RunError(f"config.json has key {key!r}, which this dtx does not know (a run of another version?)")
        if isinstance(value, dict) and preflight.GIVEN in value:
            continue
        try:
            if key == "model":  # experiments replace the whole block (another model, other settings)
                config.model = ConfigDict(_tuples(value))
            elif isinstance(config[key], ConfigDict):
                if isinstance(value, dict) and config_lib.is_import_path(value.get("name")):
                    config_lib.choose(config, key, value["name"])  # your task's or data's settings join the block
                _assign(config[key], value, key)
            else:
                setattr(config, key, _tuples(value))
        except (TypeError, AttributeError, KeyError) as e:
            raise RunError(f"config.json: key {key!r} does not fit this dtx's config ({e})") from None
    config_lib.validate(config)
    return config


def eval_main(argv: Sequence[str]) -> int:
    """``dtx eval WORKDIR [--step N]``: print the test metrics of a checkpoint; exit 0, 2 (bad input) or 4."""
    parser = argparse.ArgumentParser(prog="dtx eval", description="Evaluate a training run's checkpoint on the "
                                     "test split, rebuilding the run from WORKDIR/config.json.")
    parser.add_argument("workdir", help="a dtx train --workdir that saved checkpoints")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    metrics = _reporting_errors(lambda: evaluate_run(args.workdir, step=args.step))
    if isinstance(metrics, int):
        return metrics
    figures = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("test_") and k != "test_examples")
    print(f"step {metrics['step']}: {figures}  ({metrics.get('test_examples')} test examples)")
    print(json.dumps(metrics))
    return 0


def export_main(argv: Sequence[str]) -> int:
    """``dtx export WORKDIR --out DIR [--step N]``: write a checkpoint's variables for plain flax."""
    parser = argparse.ArgumentParser(prog="dtx export", description="Write a checkpoint's parameters and batch-norm "
                                     "statistics to DIR for plain flax (variables.msgpack, model.json, model.py); "
                                     "docs/checkpoints.md shows how to load them.")
    parser.add_argument("workdir", help="a dtx train --workdir that saved checkpoints")
    parser.add_argument("--out", required=True, help="directory to write (created; never overwritten)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    described = _reporting_errors(lambda: export_run(args.workdir, args.out, step=args.step))
    if isinstance(described, int):
        return described
    print(f"step {described['step']}: {described['class']} -> {os.path.join(args.out, VARIABLES_FILE)} "
          f"({', '.join(described['collections'])}), {os.path.join(args.out, MODEL_FILE)}")
    return 0


# ---------------------------------------------------------------------- helpers
def _reporting_errors(work):
    try:
        return work()
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"dtx: error: {e}", file=sys.stderr)
        return 2
    except checkpoint_lib.CheckpointError as e:
        print(f"dtx: checkpoint error: {e}", file=sys.stderr)
        return 4


def _saved_config(workdir: str) -> dict:
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise RunError(f"{workdir} holds no config.json: name as WORKDIR the folder a dtx train run wrote into "
                       "(the one holding its config.json, metrics.jsonl and checkpoints)")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise RunError(f"{path} is not valid JSON ({e})") from None


def _tuples(value):
    """JSON arrays back to the tuples dtx configs hold."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _assign(block: ConfigDict, values: dict, prefix: str) -> None:
    for key, value in values.items():
        if key not in block:
            raise KeyError(f"{prefix}.{key}")
        if isinstance(block[key], ConfigDict):
            _assign(block[key], value, f"{prefix}.{key}")
        else:
            setattr(block, key, _tuples(value))


def _evaluated_variables(run: Restored):
    """The variables the run evaluates: the strategy's global model (the workers' mean for local SGD and
    gossip), computed by the strategy itself on the run's mesh, and the model state the eval step uses
    (the workers' mean of their own batch-norm statistics, :func:`dtx.step.body.eval_model_state`)."""
    if run.parts.placement.runner is not None:  # its state's parameters (a pipeline's rows) as the model's tree
        return {"params": run.parts.placement.runner.model_params(run.state.params), **run.state.model_state}
    if not run.parts.strategy.caps.local_models:
        return {"params": run.state.params, **run.state.model_state}
    axes = mesh_lib.batch_axes(run.mesh)
    comm = comm_lib.CommContext(axes, mesh_lib.data_parallel_size(run.mesh),
                                lambda tree: jax.lax.pmean(tree, axes))

    def body(state):  # each worker sees its own slice of the per-worker state, as in the eval step
        state = state.replace(worker=jax.tree.map(lambda x: x[0], state.worker))
        return {"params": run.parts.strategy.eval_params(state, comm),
                **step_body.eval_model_state(state, run.parts.strategy, comm)}

    program = jax.shard_map(body, mesh=run.mesh, in_specs=(state_specs(axes),), out_specs=PartitionSpec(),
                            check_vma=False)
    return jax.jit(program)(run.state)


def _constructor_kwargs(model: nn.Module) -> dict:
    """The module's constructor keywords as JSON (dtypes by name, tuples as lists); ``norm_axis_name`` is
    left out (its default, None, is right outside a dtx step)."""
    out = {}
    for f in dataclasses.fields(model):
        if not f.init or f.name in ("parent", "name", "norm_axis_name"):
            continue
        out[f.name] = _jsonable(getattr(model, f.name), f.name)
    return out


def _jsonable(value, name: str):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, name) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, name) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a settings block (the transformer's moe)
        return _jsonable(dataclasses.asdict(value), name)
    try:
        return np.dtype(value).name  # jnp.float32, np.float32, "bfloat16"
    except TypeError:
        raise RunError(f"cannot export: the model's field {name}={value!r} has no JSON form; export a model whose "
                       "constructor takes numbers, strings, dtypes and tuples of them") from None


def _self_contained_source(cls: type) -> str | None:
    """The source of ``cls``'s module when it is one file importing no dtx code (dtx's models are), else None."""
    try:
        path = inspect.getsourcefile(cls)
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (TypeError, OSError, SyntaxError):  # a notebook cell, a built-in, a compiled extension
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "dtx"):
            return None
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "dtx" for a in node.names):
            return None
    return source
