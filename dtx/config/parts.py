"""Your own parts by import path: ``model.name``, ``task.name`` and ``dataset.name`` may name a class or a
function of your package as ``package.module:Name`` (the form of LightningCLI's ``class_path`` and of
big_vision's model names), and its settings become the block's settings.

``--config.model.name=mynets:ConvNet`` replaces the ``model`` block with the class's dataclass fields and
their defaults (``--config.model.name=lenet`` does the same with a built-in model); then
``--config.model.width=32`` applies, typed by the default, and a setting the chosen part does not take is
refused when the config loads. ``--config.task.name=mynets:focal_loss`` and
``--config.dataset.name=mynets:blobs`` add the function's keyword parameters to their block.

Each family registers how to read a name's settings (:func:`register_family`: the models, the tasks, the
data sources); :func:`choose` switches a config's block to another name, and :func:`resolve` imports.
A module is looked up on ``sys.path`` and then in the current folder, so a file beside the command works
without ``PYTHONPATH``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence

from ml_collections import ConfigDict

from dtx.config.defaults import ConfigError


def is_import_path(name) -> bool:
    """``package.module:Name`` (a colon) rather than a registry name."""
    return isinstance(name, str) and ":" in name


def resolve(path: str, key: str):
    """The object ``path`` (``package.module:Name``, ``Name`` may be dotted) names; ``key`` is the config key
    that holds it, for the error, which says what failed and how to fix it."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute or not all(
            part.isidentifier() for part in module_name.split(".") + attribute.split(".")):
        raise ConfigError(f"{key}={path!r} is not an import path; write package.module:Name (e.g. "
                          "mynets:ConvNet for class ConvNet in mynets.py)")
    module = _import(module_name, path, key)
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f" (did you mean {module_name}:{close[0]}?)" if close else ""
            raise ConfigError(f"{key}={path!r}: {module_name} ({getattr(module, '__file__', '?')}) has no "
                              f"{attribute!r}{hint}")
        target = getattr(target, part)
    return target


def _import(module_name: str, path: str, key: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.split(".")[0]
        here = os.getcwd()
        if e.name != top or here in sys.path:
            missing = e
        else:  # a module beside the command (dtx is a console script: the current folder is not on sys.path)
            sys.path.append(here)
            try:
                return importlib.import_module(module_name)
            except ModuleNotFoundError as again:
                missing = again
            except Exception as again:  # noqa: BLE001 - the user's module failed while importing
                raise _failed(path, key, module_name, again) from None
        raise ConfigError(f"{key}={path!r}: cannot import {module_name!r} ({missing}); run dtx from the folder that "
                          f"holds {top}, or put that folder on PYTHONPATH (or pip install your package)") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise _failed(path, key, module_name, e) from None


def _failed(path: str, key: str, module_name: str, error: Exception) -> ConfigError:
    return ConfigError(f"{key}={path!r}: importing {module_name!r} failed: {type(error).__name__}: {error}")


def parameters(factory: Callable, key: str, supplied: Sequence[str] = ()) -> dict[str, object]:
    """The settings of your ``factory`` with their defaults: a dataclass's init fields (a flax module's), or a
    function's keyword parameters; those dtx ``supplied`` itself are left out. One without a default is
    refused: a config block holds a value for every setting it has."""
    if dataclasses.is_dataclass(factory):
        found = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                 if f.default_factory is not dataclasses.MISSING else inspect.Parameter.empty
                 for f in dataclasses.fields(factory) if f.init}
    else:
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {factory!r} has no signature dtx can read; name a class or a function") from None
        found = {}
        for p in signature.parameters.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                raise ConfigError(f"{key}: {getattr(factory, '__qualname__', factory)} takes *{p.name}; name each "
                                  "setting it takes as a parameter, so that other settings are refused")
            found[p.name] = p.default
    found = {name: default for name, default in found.items() if name not in supplied}
    required = [name for name, default in found.items() if default is inspect.Parameter.empty]
    if required:
        raise ConfigError(f"{key}: {getattr(factory, '__qualname__', factory)} has setting(s) {required} without a "
                          "default; give each a default value in its definition (the config block starts from them "
                          "and --config.KEY=VALUE changes them)")
    return {name: _plain(default) for name, default in found.items()}


def _plain(value):
    """A default as a config value: lists as tuples (a ConfigDict holds them typed by their default)."""
    return tuple(_plain(v) for v in value) if isinstance(value, list) else value


# ------------------------------------------------------------------ families and switching their name


@dataclasses.dataclass(frozen=True)
class Family:
    """How a block's ``name`` reads its settings: ``settings(name) -> {key: default}``. ``replaces``: choosing
    a name replaces the whole block (the model); otherwise the block keeps its keys (the task's and the data's
    flattened settings) and gains those of an import path's parameters."""

    settings: Callable[[str], dict]
    replaces: bool


_FAMILIES: dict[str, Family] = {}


def register_family(block: str, settings: Callable[[str], dict], *, replaces: bool) -> None:
    """Declare that ``config[block].name`` chooses a part whose settings ``settings(name)`` gives."""
    _FAMILIES[block] = Family(settings, replaces)


def families() -> tuple[str, ...]:
    """The blocks whose ``name`` chooses a part (``model``, ``task``, ``dataset``)."""
    return tuple(_FAMILIES)


def choose(config: ConfigDict, block: str, name: str) -> ConfigDict:
    """``config`` (changed in place, and returned) with ``config[block].name = name``: the model block replaced
    by that model's settings and defaults, a task or data block given an import path's settings. The same name
    again changes nothing."""
    family = _FAMILIES.get(block)
    node = config[block]
    if family is None or name == node.get("name"):
        setattr(node, "name", name)
        return config
    if family.replaces:
        settings = {key: value for key, value in family.settings(name).items() if key != "name"}
        config[block] = ConfigDict({"name": name, **settings})
        return config
    with node.unlocked():
        node.name = name
        if is_import_path(name):
            for key, value in family.settings(name).items():
                if key not in node:
                    node[key] = value
    return config
