"""Reading experiments: an experiment file (or a packaged experiment's bare name) and
``--config.KEY=VALUE`` overrides into a validated, locked config (:mod:`dtx.config` holds the
defaults and the checks; it re-exports :func:`load`, :func:`override`, :func:`packaged_experiments`).

Overrides are parsed by ``ml_collections.config_flags``, typed by the default's value, so
``--config.num_steps=1.5`` is refused at load time; an unknown key names the closest known one.
"""

from __future__ import annotations

import difflib
import importlib.util
import io
import os
import re
import tokenize
from collections.abc import Sequence

from ml_collections import ConfigDict

from dtx.config import parts
from dtx.config.defaults import MOVED_KEYS, ConfigError, validate

def load(path: str | os.PathLike, overrides: Sequence[str] = ()) -> ConfigDict:
    """Load experiment file ``path`` (``file.py`` or ``file.py:arg``) and apply overrides.

    Args:
      path: the experiment file, or the bare name of one that ships with dtx (``digits_mlp``, see
        :func:`packaged_experiments`); ``:arg`` after it is passed to ``get_config(arg)``.
      overrides: strings ``--config.KEY=VALUE`` (the ``--config.`` prefix is optional).

    Returns:
      The locked, validated config.

    Raises:
      ConfigError: missing file, a file Python could not decode (its bytes are not UTF-8 or the encoding
        its ``# -*- coding: ... -*-`` line declares), unknown key, value of the wrong type, bad value.
    """
    path = _packaged_experiment(os.fspath(path))
    file_part = path.split(":", 1)[0]
    if not os.path.isfile(file_part):
        raise ConfigError(f"experiment file {file_part!r} not found (expected a Python file with get_config(), "
                          f"or the name of one that ships with dtx: {', '.join(packaged_experiments())})")
    _check_experiment_source(file_part)
    # First the file alone, so its own mistakes are reported against it ...
    config = _parse(path, [], blame=file_part)
    if not isinstance(config, ConfigDict):
        raise ConfigError(f"{file_part}: get_config() must return an ml_collections.ConfigDict")
    # ... then the overrides: first a part chosen by name (--config.model.name=lenet replaces the model block
    # with lenet's settings), then each other key, checked against the config it changes.
    flags_ = [_as_flag(arg) for arg in overrides]
    pairs = [flag[len("--config."):].partition("=")[::2] for flag in flags_]
    chosen = {key.partition(".")[0]: value for key, value in pairs if _chooses(key)}  # the last one wins
    flags_ = [flag for flag, (key, _) in zip(flags_, pairs) if not _chooses(key)]
    for block, name in chosen.items():
        config = parts.choose(config, block, name)
    for flag in flags_:
        key = flag[len("--config."):].split("=", 1)[0]
        node = config
        try:
            for part in key.split("."):
                node = _child(node, part, key)
        except ConfigError as e:
            block = key.partition(".")[0]
            if block not in chosen:
                raise
            takes = ", ".join(k for k in config[block] if k != "name") or "none"
            raise ConfigError(f"{e}: --config.{block}.name={chosen[block]} chose a {block} that does not take it "
                              f"(its settings: {takes})") from None
    if flags_:
        config = _parse(config, flags_, blame="override")
    validate(config)
    return config


def packaged_experiments() -> list[str]:
    """Names of the experiment files that ship with dtx (``dtx.experiments``), e.g. ``digits_mlp``."""
    folder = _experiments_folder()
    return sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".py") and not name.startswith("_"))


def _packaged_experiment(path: str) -> str:
    """``digits_mlp`` or ``digits_mlp:arg`` (a bare name, no folder, no ``.py``) is the file shipped in
    ``dtx.experiments``: it works after ``pip install`` without a checkout. A file that exists wins."""
    file_part, sep, arg = path.partition(":")
    if os.path.isfile(file_part) or not file_part.isidentifier() or file_part not in packaged_experiments():
        return path
    return os.path.join(_experiments_folder(), file_part + ".py") + sep + arg


def _experiments_folder() -> str:
    """Where ``dtx.experiments`` lives, found without importing it: the experiment files stand on
    this floor (they import dtx.config), not the other way round."""
    spec = importlib.util.find_spec("dtx.experiments")
    return os.path.dirname(spec.origin)


def _check_experiment_source(file_part: str) -> None:
    """A file that does not parse, or defines no ``get_config``, is named with the fix before ml_collections
    turns it into a long traceback or a misleading 'unknown key' (it reads a missing get_config as a key)."""
    import ast

    source = _read_source(file_part)
    try:
        tree = ast.parse(source, filename=file_part)
    except SyntaxError as e:
        raise ConfigError(f"{file_part}, line {e.lineno}: {e.msg} (the experiment file is not valid Python): "
                          f"{(e.text or '').strip()!r}") from None
    if not any(isinstance(node, (ast.FunctionDef, ast.Assign, ast.ImportFrom, ast.Import)) and _defines(node)
               for node in tree.body):
        raise ConfigError(f"{file_part} defines no get_config(); an experiment file must define "
                          "def get_config(): returning dtx.config.base_config() with its changes")


def _read_source(file_part: str) -> str:
    """The experiment file's text, decoded as Python decodes a source file (PEP 263): UTF-8, unless a
    ``# -*- coding: NAME -*-`` line among its first two (or a UTF-8 byte-order mark) says otherwise -- the
    encoding ml_collections' import of the file uses too. Bytes that encoding cannot decode are one
    ConfigError naming the file, the line and the fix, before the import turns them into a traceback."""
    with open(file_part, "rb") as f:
        data = f.read()
    fix = ("save it as UTF-8, or declare its encoding on its first or second line (e.g. "
           "# -*- coding: latin-1 -*-)")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:
        if not e.msg.startswith("invalid or missing encoding declaration"):  # a declaration naming no codec
            raise ConfigError(f"{file_part}: {e.msg} (its coding declaration); {fix}") from None
        encoding = "utf-8"  # no declaration, and its first lines are not UTF-8: the byte is named below
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{file_part}, line {line}: byte 0x{data[e.start]:02x} is not valid {e.encoding} "
                          f"({e.reason}), the encoding the experiment file is read in; {fix}") from None


def _defines(node) -> bool:
    import ast

    if isinstance(node, ast.FunctionDef):
        return node.name == "get_config"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "get_config" for t in node.targets)
    return any((alias.asname or alias.name) == "get_config" for alias in node.names)


def _parse(source: str | ConfigDict, flags_: list[str], blame: str) -> ConfigDict:
    """Run ml_collections' config_flags on ``--config=path`` (or on a config already read) plus ``flags_``:
    each value parsed by the type of the key's current value."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    # sys_argv: config_flags finds the override flags there (default: the process's sys.argv).
    try:
        if isinstance(source, ConfigDict):
            argv = ["dtx", *flags_]
            config_flags.DEFINE_config_dict("config", source, flag_values=flag_values, lock_config=True, sys_argv=argv)
        else:
            argv = ["dtx", f"--config={source}", *flags_]
            config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
        flag_values(argv)
        return flag_values.config
    except AttributeError as e:  # ConfigDict refusing a key the locked default does not have
        text = str(e)
        key = re.search(r'Key "([^"]+)"', text) or re.search(r"'([^']+)'", text)
        close = re.search(r'Did you mean "([^"]+)"', text)
        hint = f" (did you mean {close.group(1)!r}?)" if close else ""
        raise ConfigError(
            f"{blame}: unknown config key {key.group(1) if key else text!r}{hint}; "
            "experiments may only change keys of dtx.config.base_config()"
        ) from None
    except TypeError as e:  # the file assigned a value of the wrong type
        raise ConfigError(f"{blame}: {_one_line(e)}") from None
    except flags.Error as e:  # an override's value of the wrong type, or a file that fails to load
        text = str(e).strip()
        field = re.search(r"of field config\.([\w.]+) is not supported for overriding", text)
        if field and "NoneType" in text:  # a key whose default is None (your part's): its type is unknown
            raise ConfigError(f"config key {field.group(1)!r} has the default None, so the command line cannot tell "
                              "its type; give it a default of its type (e.g. '' or 0.0) where it is defined, or set "
                              "it from Python (dtx.override) or an experiment file") from None
        flag = re.search(r"--config\.([\w.]+)=(.*?): (.*)", text)
        if flag:
            key, value, reason = flag.groups()
            raise ConfigError(f"config key {key!r}: --config.{key}={value} has the wrong type ({reason})") from None
        # A traceback from inside get_config(): its last line says what went wrong.
        raise ConfigError(f"{blame}: {text.splitlines()[-1]}") from None


def override(config: ConfigDict, **values) -> ConfigDict:
    """Copy of ``config`` with dotted keys replaced, e.g. ``override(c, **{"model.features": (64,)})``.

    The Python-API twin of ``--config.KEY=VALUE``, with the same strictness.
    """
    new = config.copy_and_resolve_references()
    new.lock()
    # A part chosen by name first (override(c, **{"model.name": "lenet"}) replaces the model block), then the rest.
    values = dict(sorted(values.items(), key=lambda item: not _chooses(item[0])))
    for key, value in values.items():
        if _chooses(key):
            _child(new, key.partition(".")[0], key)
            parts.choose(new, key.partition(".")[0], value)
            continue
        node, _, leaf = key.rpartition(".")
        target = new
        for part in filter(None, node.split(".")):
            target = _child(target, part, key)
        _child(target, leaf, key)  # raises on unknown
        try:
            setattr(target, leaf, value)
        except TypeError as e:
            raise ConfigError(f"config key {key!r}: {_one_line(e)}") from None
    validate(new)
    return new


def _chooses(key: str) -> bool:
    """``model.name``, ``task.name``, ``dataset.name``: a key that chooses a part (:mod:`dtx.config.parts`)."""
    block, _, leaf = key.partition(".")
    return leaf == "name" and block in parts.families()


def _as_flag(arg: str) -> str:
    arg = arg if arg.startswith("--") else "--" + arg
    arg = arg if arg.startswith("--config.") else arg.replace("--", "--config.", 1)
    # --config.cluster=NAME is short for --config.cluster.name=NAME (a block cannot take a string)
    return arg.replace("--config.cluster=", "--config.cluster.name=", 1) if arg.startswith("--config.cluster=") else arg


def _child(node, part: str, key: str):
    if not isinstance(node, ConfigDict):
        raise ConfigError(f"config key {key!r}: {part!r} is below a value of type {type(node).__name__}, not a block")
    if part not in node:
        if key in MOVED_KEYS:
            raise ConfigError(f"config key {key!r} is now {MOVED_KEYS[key]!r}: set --config.{MOVED_KEYS[key]} instead")
        close = difflib.get_close_matches(part, list(node.keys()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown config key {key!r}{hint}")
    return node[part]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
