"""What a run will really do, said before it starts and written into its records.

A config can describe a run that is not the one that executes: a global batch
that does not divide the training split drops examples every epoch; a warmup
as long as the run reaches its peak rate only at the end (a longer one is
refused); a module, optimizer, task or data passed to ``dtx.train`` replaces the
config's block, whose keys then do nothing. :func:`warn` says so (``RunWarning``,
a ``UserWarning``) before anything compiles; :func:`what_ran` gives ``config.json``
and the first metrics record the module class, optimizer, task and data that
actually trained.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from typing import Any, NamedTuple

import flax.linen as nn
import optax
from ml_collections import ConfigDict

from dtx import config as config_lib

# A batch that drops at most this fraction of the training split each epoch is not worth a
# warning: a different subset is dropped every epoch, so every example is still seen.
DROPPED_FRACTION_TO_WARN = 0.05

# Marks a config block that dtx.train replaced with an argument; dtx eval/export read it.
GIVEN = "given"


class RunWarning(UserWarning):
    """The run differs from what its config suggests (dropped examples, warmup, ignored keys)."""


class WhatRan(NamedTuple):
    config: dict  # config.json: the config, with replaced blocks describing what replaced them
    record: dict  # first metrics record: model class, optimizer, examples per epoch


def warn(config: ConfigDict, *, train_size: int, data_parallel: int, num_steps: int,
         model: nn.Module | None = None, optimizer: optax.GradientTransformation | None = None,
         data_given: bool = False, task_given: bool = False) -> None:
    """Warn (``RunWarning``) about dropped examples, a warmup as long as the run, and ignored config keys."""
    message = dropped_examples_message(train_size, config.global_batch_size, data_parallel)
    if message:
        warnings.warn(message, RunWarning, stacklevel=4)
    if optimizer is None:
        message = warmup_message(config, train_size // config.global_batch_size, num_steps)
        if message:
            warnings.warn(message, RunWarning, stacklevel=4)
    blocks = {"model": model is not None, "optimizer": optimizer is not None, "dataset": data_given,
              "task": task_given}
    ignored = ignored_keys(config, **blocks)
    if ignored:
        given = " and ".join(f"{'data' if block == 'dataset' else block}=" for block, on in blocks.items() if on)
        warnings.warn(
            f"dtx.train({given}...) replaces the config's blocks, so these keys you set do nothing: "
            f"{', '.join(f'{k}={v!r}' for k, v in ignored)}. Configure what you pass instead "
            f"(e.g. optax.adamw(learning_rate=...)), or drop the {given} argument to use them",
            RunWarning, stacklevel=4)


def show_on_terminal() -> None:
    """Print :class:`RunWarning` as ``dtx: WARNING: ...`` on stderr (the command line's style) rather than
    as a pointer into the source line that raised it; other warnings are shown as before."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, RunWarning):
            print(f"dtx: WARNING: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def dropped_examples_message(train_size: int, global_batch: int, data_parallel: int) -> str | None:
    """Why and how many examples each epoch leaves out, with the batch sizes that leave out fewest;
    ``None`` when at most :data:`DROPPED_FRACTION_TO_WARN` of the split is dropped."""
    dropped = train_size % global_batch
    if dropped <= DROPPED_FRACTION_TO_WARN * train_size:
        return None
    steps = train_size // global_batch
    better = better_batches(train_size, global_batch, data_parallel)
    hint = ", ".join(f"{b} drops {train_size % b}" for b in better)
    return (f"global_batch_size={global_batch} does not divide the {train_size} training examples: each epoch "
            f"trains {steps} step{'s' * (steps != 1)} and drops {dropped} examples ({dropped / train_size:.0%}; a "
            f"different subset each epoch). Nearby multiples of the {data_parallel} data-parallel workers "
            f"that drop fewer: {hint or 'none'} (--config.global_batch_size)")


def better_batches(train_size: int, global_batch: int, data_parallel: int, count: int = 2) -> list[int]:
    """Batch sizes within a factor of two of ``global_batch`` that split over the workers and drop the fewest
    examples per epoch (nearest first among equals)."""
    low, high = max(data_parallel, global_batch // 2), min(train_size, 2 * global_batch)
    candidates = [b for b in range(low - low % data_parallel, high + 1, data_parallel)
                  if b >= data_parallel and train_size % b < train_size % global_batch]
    return sorted(candidates, key=lambda b: (train_size % b, abs(b - global_batch)))[:count]


def warmup_message(config: ConfigDict, steps_per_epoch: int, num_steps: int) -> str | None:
    """A warmup as long as the run: the rate reaches the peak the config names only at the last step.

    A warmup longer than the run cannot be scheduled at all: that raises ``ConfigError`` (with the fix)
    here, before the data or the model is built.
    """
    opt = config.optimizer
    warmup = opt.warmup_steps or round(opt.warmup_epochs * steps_per_epoch)  # as dtx.train counts it
    if not warmup or warmup < num_steps:
        return None
    key = (f"optimizer.warmup_steps={opt.warmup_steps}" if opt.warmup_steps else
           f"optimizer.warmup_epochs={opt.warmup_epochs} ({warmup} steps at {steps_per_epoch} per epoch)")
    fix = (f"Shorten the warmup, e.g. --config.optimizer.warmup_steps={max(num_steps // 10, 1)} (a tenth of the run)"
           + (" --config.optimizer.warmup_epochs=0" if opt.warmup_epochs and not opt.warmup_steps else "")
           + ", or train longer (num_steps / num_epochs)")
    if warmup > num_steps:
        raise config_lib.ConfigError(f"{key} is longer than the run's {num_steps} steps: the learning rate would "
                                     f"never reach its peak. {fix}")
    return (f"{key} is as long as the run ({num_steps} steps): the learning rate reaches its peak only at the "
            f"last step. {fix}")


def ignored_keys(config: ConfigDict, **given: bool) -> list[tuple[str, Any]]:
    """Keys of the blocks named true in ``given`` (``model``, ``optimizer``, ``dataset``, ``task``) that are set
    away from their defaults: a module / optimizer / data / task passed to ``dtx.train`` makes them moot."""
    base = config_lib.base_config()
    out = []
    for block, replaced in given.items():
        if not replaced or block not in config:
            continue
        default = _flat(base[block].to_dict(), block)
        for key, value in _flat(config[block].to_dict(), block).items():
            if key not in default or default[key] != value:
                out.append((key, value))
    return out


def what_ran(config: ConfigDict, model: nn.Module, *, model_given: bool, optimizer_given: bool,
             optimizer: optax.GradientTransformation | None = None, optimizer_description: str | None = None,
             train_size: int | None = None, task_name: str | None = None, task_given: bool = False,
             data_fingerprint: str | None = None, data_description: str | None = None) -> WhatRan:
    """``config.json`` and first-record fields naming the module, optimizer, task and data that trained.

    A block replaced by a ``dtx.train`` argument becomes ``{"given": "dtx.train(model=...)", "class": ...,
    "fields": ...}`` (the optimizer's ``description``, the task's ``name``, the data's ``fingerprint``),
    so the record never names a model, optimizer or dataset that did not run; ``dtx eval`` reads the
    marks and asks for the same arguments.
    """
    recorded = json.loads(config.to_json())
    model_class = qualified_name(model)
    if model_given:
        recorded["model"] = {GIVEN: "dtx.train(model=...)", "class": model_class, "fields": module_fields(model)}
    if optimizer_given:
        description = optimizer_description or describe_optimizer(optimizer)
        recorded["optimizer"] = {GIVEN: "dtx.train(optimizer=...)", "description": description}
    else:
        opt = config.optimizer
        description = f"{opt.name}, {opt.schedule} schedule, learning_rate {opt.learning_rate:g}"
    record = {"model": model_class, "optimizer": description}
    if task_given and "task" in recorded:
        recorded["task"] = {GIVEN: "dtx.train(task=...)", "name": task_name}
    if task_name is not None:
        record["task"] = task_name
    if data_fingerprint is not None and "dataset" in recorded:
        recorded["dataset"] = {GIVEN: "dtx.train(data=...)", "fingerprint": data_fingerprint,
                               "description": data_description}
        record["data"] = data_description or data_fingerprint
    if train_size is not None:
        record.update(train_examples=train_size, examples_dropped_per_epoch=train_size % config.global_batch_size)
    return WhatRan(recorded, record)


def qualified_name(model: nn.Module) -> str:
    """``module.Class`` of a flax module, e.g. ``dtx.models.mlp.MLP`` or ``__main__.ConvNet``."""
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def module_fields(model: nn.Module) -> dict[str, str]:
    """The module's constructor fields as text (``repr``), without flax's ``parent``/``name``."""
    return {f.name: repr(getattr(model, f.name)) for f in dataclasses.fields(model)
            if f.init and f.name not in ("parent", "name")}


def describe_optimizer(tx: optax.GradientTransformation | None) -> str:
    """A best-effort description of an optax transformation, from the factory names and scalar settings
    its functions close over (optax builds transformations as closures; its ``repr`` shows only addresses).
    Pass ``optimizer_description=`` to ``dtx.train`` for an exact one."""
    if tx is None:
        return "unknown"
    try:
        return _describe(tx.update, depth=0)
    except Exception:  # noqa: BLE001 — a description must never stop a run
        return f"optax {type(tx).__name__} (pass optimizer_description= to dtx.train to record it)"


def _describe(fn, depth: int) -> str:
    name = getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>")[0]
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    parts = []
    for var, cell in zip(code.co_freevars if code else (), cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an unset cell
            continue
        if var.startswith("init"):  # the update's twin: says nothing the update does not
            continue
        if isinstance(value, (bool, int, float, str)):
            parts.append(f"{var}={value!r}")
        elif depth < 6 and isinstance(value, optax.GradientTransformation):  # a wrapped transformation
            parts.append(_describe(value.update, depth + 1))
        elif depth < 6 and isinstance(value, (tuple, list)) and value and all(map(callable, value)):
            parts.extend(_describe(v, depth + 1) for v in value)
        elif depth < 6 and callable(value) and hasattr(value, "__code__"):
            inner = _describe(value, depth + 1)
            parts.append(inner if name == "with_extra_args_support" else f"{var}={inner}")
    if name == "with_extra_args_support" and len(parts) == 1:  # optax's plumbing, not a transformation
        return parts[0]
    return f"{name}({', '.join(parts)})"


def _flat(tree: dict, prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out
