"""The house holds: every import of dtx (lazy ones included) flows down the floors of
``dtx/_floors.py`` and none closes a circle; README.md's layout section is those floors."""

from __future__ import annotations

import ast
import os
import re

import pytest

from dtx import _floors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where each installed package's files are in a checkout (pyproject.toml's package-dir).
FOLDERS = {"dtx": "dtx", "dtx.models": "models", "dtx.experiments": "experiments"}


def modules() -> dict[str, str]:
    """Every module of the installed dtx, ``dotted name -> file``."""
    found = {}
    for package, folder in FOLDERS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            if prefix.startswith(("dtx.models.", "dtx.experiments.")) or (
                    prefix.count(".") and prefix.split(".")[1] in ("models", "experiments") and folder == "dtx"):
                continue
            for name in filenames:
                if name.endswith(".py"):
                    dotted = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    found[dotted] = os.path.join(dirpath, name)
    return found


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """The dtx modules ``name`` imports anywhere in its file (top level, functions, branches)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "dtx"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "dtx":
                continue
            for alias in node.names:  # `from pkg import submodule` imports the submodule, not pkg's face
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return found - {name}


@pytest.fixture(scope="module")
def graph():
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_floor(graph):
    homeless = sorted(name for name in graph if name.count(".") and _floors.floor_of(name) is None
                      and not name.startswith("dtx.experiments"))
    assert not homeless, f"modules on no floor of dtx/_floors.py: {homeless}"


def test_no_import_goes_up_a_floor(graph):
    def floor(module):
        index = _floors.floor_of(module)
        return len(_floors.FLOORS) if index is None else index  # the face dtx and experiments stand on top

    upward = sorted(f"{name} ({_floors.FLOORS[floor(name)][0]}) imports {target} "
                    f"({_floors.FLOORS[floor(target)][0] if floor(target) < len(_floors.FLOORS) else 'the top'})"
                    for name, targets in graph.items() if floor(name) < len(_floors.FLOORS)
                    for target in targets if floor(target) > floor(name))
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def test_no_import_cycle(graph):
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(sorted(c)) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components of more than one module (the cycles)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_guard_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a lazy import inside a function is an edge like any other."""
    graph = {"dtx.mesh": {"dtx.run.trainer"}, "dtx.run.trainer": {"dtx.mesh"}}
    assert strongly_connected(graph) == [{"dtx.mesh", "dtx.run.trainer"}]
    assert _floors.floor_of("dtx.mesh") < _floors.floor_of("dtx.run.trainer")
    source = "def f():\n    from dtx.run import trainer\n"
    path = os.path.join(ROOT, "tests", "_house_probe.py")
    try:
        with open(path, "w") as f:
            f.write(source)
        assert imports("dtx.mesh", path, {"dtx.run.trainer"}) == {"dtx.run.trainer"}
    finally:
        os.remove(path)


def test_readme_layout_is_the_floors():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Layout\n.*?```\n(.*?)```", readme, re.S)
    assert block, "README.md has no ## Layout code block"
    assert block.group(1).rstrip("\n") == _floors.render(), (
        "README.md's layout block differs from dtx/_floors.py; paste this:\n" + _floors.render())


def test_ls_dtx_is_the_floors():
    """Every package and module of dtx/ is a room of some floor, and every room exists."""
    listed = {room for _, rooms in _floors.FLOORS for room, _ in rooms}
    present = {name[:-3] if name.endswith(".py") else name for name in os.listdir(os.path.join(ROOT, "dtx"))
               if name != "__init__.py" and name != "__pycache__"}
    assert present | {"models"} == listed, (sorted(present - listed), sorted(listed - present - {"models"}))


# Variables that hold a plug-in's name: comparing one with a name literal is asking the name, not the declaration.
_HOLDERS = ("driver", "layout", "parallel", "algorithm", "allreduce")
_REGISTRIES = {"dtx.step.drivers", "dtx.parallel.layouts", "dtx.comm.algorithms"}


def name_comparisons(source: str, names: set[str]) -> list[str]:
    """Comparisons of a name-holding expression with a registered name (or a tuple of them) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literals = [o for o in operands if _literal_names(o) & names]
        holders = [o for o in operands if o not in literals and any(h in ast.unparse(o) for h in _HOLDERS)]
        if literals and holders:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _literal_names(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_no_driver_layout_or_algorithm_name_is_compared_outside_its_registry():
    """Drivers, layouts and allreduce algorithms are known by what they declare (``explicit``, ``zero_stage``,
    ``levels``, ``native``...): nothing outside the module that registers them compares their names."""
    from dtx.comm.algorithms import ALGORITHMS
    from dtx.parallel import LAYOUTS
    from dtx.step import DRIVERS

    names = set(DRIVERS) | set(LAYOUTS) | set(ALGORITHMS)
    found = {name: name_comparisons(open(path).read(), names) for name, path in modules().items()
             if name.startswith("dtx.") and name not in _REGISTRIES
             and not name.startswith(("dtx.models", "dtx.experiments"))}
    found = {name: lines for name, lines in found.items() if lines}
    assert not found, "name comparisons outside a registry:\n" + "\n".join(
        f"{name} {line}" for name, lines in found.items() for line in lines)
    # ... and the check sees one when there is one.
    assert name_comparisons('if config.driver == "jit" or layout in ("zero1", "zero2"): pass', names) == [
        "line 1: config.driver == 'jit'", "line 1: layout in ('zero1', 'zero2')"]


def test_make_train_step_takes_one_settings_object():
    import inspect

    from dtx.step import make_eval_step, make_train_step

    assert list(inspect.signature(make_train_step).parameters) == ["model", "tx", "mesh", "spec"]
    assert list(inspect.signature(make_eval_step).parameters) == ["model", "mesh", "spec"]


def test_no_function_on_the_step_floor_takes_more_than_eight_parameters():
    """The step floor's functions take at most 8 parameters (self and cls aside): what the drivers and layouts
    differ in travels as one object (dtx.step.body.Route, Worker; the pipeline's StageOptions; a StepSpec)."""
    crowded = []
    for name, path in sorted(modules().items()):
        if _floors.floor_of(name) is None or _floors.FLOORS[_floors.floor_of(name)][0] != "the step":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg)
                                                                                   if x is not None]
                count = len([n for n in names if n not in ("self", "cls")])
                if count > 8:
                    crowded.append(f"{name}.{node.name}: {count}")
    assert not crowded, "functions on the step floor over 8 parameters:\n" + "\n".join(crowded)


# Each family's registry, the names it registers and the variables that hold one of them.
_FAMILIES = {
    "dtx.strategies.registry": ("strategy",),
    "dtx.compress.compressors": ("compression", "compressor"),
    "dtx.optim": ("optimizer",),
}


def test_no_strategy_compressor_or_optimizer_name_is_compared_outside_its_registry():
    """Strategies, compressors and optimizers are known by what they declare (``caps``, ``slots``,
    ``whole_tensors``, ...): nothing outside the module that registers a family compares its names with a
    variable holding one of that family."""
    from dtx.compress import COMPRESSORS
    from dtx.optim import DECLARED
    from dtx.strategies import STRATEGIES

    global _HOLDERS
    registered = {"dtx.strategies.registry": set(STRATEGIES), "dtx.compress.compressors": set(COMPRESSORS),
                  "dtx.optim": set(DECLARED)}
    found, kept = [], _HOLDERS
    try:
        for registry, holders in _FAMILIES.items():
            _HOLDERS = holders
            for name, path in modules().items():
                if name.startswith("dtx.") and name != registry and not name.startswith(("dtx.models",
                                                                                          "dtx.experiments")):
                    found += [f"{name} {line}" for line in name_comparisons(open(path).read(), registered[registry])]
        assert name_comparisons('if optimizer in ("lars", "lamb"): pass', registered["dtx.optim"]) == [
            "line 1: optimizer in ('lars', 'lamb')"]  # the check sees one when there is one
    finally:
        _HOLDERS = kept
    assert not found, "name comparisons outside a registry:\n" + "\n".join(found)


def test_no_layout_kind_is_compared_outside_its_registry():
    """A layout's kind of split (its ``kernels`` field) is read through what it declares (``splits_kernels``,
    ``pairs``, ``user_rules``, ``by_layer_kind``, ``splits(kind)``), and no module but the registry picks a layout
    by its name: nothing outside dtx.parallel.layouts compares ``.kernels`` or subscripts ``LAYOUTS`` with a name."""
    found = []
    for name, path in modules().items():
        if not name.startswith("dtx.") or name == "dtx.parallel.layouts" or name.startswith(("dtx.models",
                                                                                             "dtx.experiments")):
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
            if any(isinstance(o, ast.Attribute) and o.attr == "kernels" for o in operands) and \
                    any(_literal_names(o) for o in operands):
                found.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("LAYOUTS") and \
                    isinstance(node.slice, ast.Constant):
                found.append(f"{name} line {node.lineno}: {ast.unparse(node)}")
    assert not found, "layout kinds or names asked outside the registry:\n" + "\n".join(found)


def test_every_package_is_installed():
    """pyproject.toml lists every package folder of dtx (setuptools installs only the listed ones: a sub-package left
    out works from a checkout and is missing from a wheel)."""
    import tomllib

    listed = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.endswith("__init__.py")}
    assert found <= listed, f"pyproject.toml's [tool.setuptools] packages leave out {sorted(found - listed)}"
