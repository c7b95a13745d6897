"""The documentation runs as written: README.md, docs/*.md and the doctest examples of dtx's docstrings.

Convention (stated for writers in docs/README.md):

- every ```python block of a page runs. A page's blocks run top to bottom in one fresh Python
  process, like a notebook's cells, so a block may use names an earlier block of the same page
  defined; the process starts in an empty temporary folder, on 8 emulated CPU devices, and each
  block has a time budget (``BLOCK_SECONDS``);
- ```python no-run marks a block that must not run (it needs a cluster, a GPU, a file the reader
  has); it is still compiled, so it cannot rot into invalid Python. Keep it rare;
- ```bash blocks are not run, but every ``dtx train`` / ``dtx launch`` / ``dtx bench step`` line in
  them has its experiment and ``--config.`` overrides loaded and validated;
- ``>>>`` examples in docstrings of dtx (and dtx.models, dtx.experiments) run as doctests.
"""

from __future__ import annotations

import doctest
import glob
import importlib
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_SECONDS = 60  # per python block; the whole suite of pages takes well under a minute
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def pages() -> list[str]:
    """README.md and every page under docs/, as paths relative to the repository."""
    return ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))


def blocks(page: str) -> list[dict]:
    """The fenced blocks of ``page``: language, flags, first line number of the code, the code."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    found = []
    for match in FENCE.finditer(text):
        language, *flags = match["info"].split() or [""]
        body = textwrap.dedent("".join(line[len(match["indent"]):] if line.startswith(match["indent"]) else line
                                       for line in match["body"].splitlines(keepends=True)))
        found.append(dict(language=language, flags=flags, line=text.count("\n", 0, match.start()) + 2, code=body))
    return found


def test_user_facing_text_cites_no_file_users_do_not_have():
    """The pages, the notebook and the package's own sources stand on their own."""
    paths = [os.path.join(REPO, p) for p in pages()] + [os.path.join(REPO, "notebooks", "quickstart.ipynb")]
    paths += [p for folder in ("dtx", "models", "experiments")
              for p in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True)]
    for path in paths:
        text = open(path, encoding="utf-8").read()
        for name in ("DESIGN.md", "../shared", "shared/DESIGN"):
            assert name not in text, f"{os.path.relpath(path, REPO)} cites {name}, which users do not have"


# ------------------------------------------------------------------ python blocks


def _run_page(page: str, tmp_path) -> list[dict]:
    runnable = [b for b in blocks(page) if b["language"] == "python" and "no-run" not in b["flags"]]
    if not runnable:
        return []
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(dict(page=page, blocks=runnable, budget=BLOCK_SECONDS)))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), str(spec)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=BLOCK_SECONDS * len(runnable) + 60)
    report = [json.loads(line[len("BLOCK "):]) for line in done.stdout.splitlines() if line.startswith("BLOCK ")]
    assert done.returncode == 0, f"{page}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert len(report) == len(runnable)
    return report


def test_every_page_lists_its_blocks_in_a_known_form():
    """A typo in a fence (```pyton, ```Python) would quietly exempt a block from running."""
    known = {"python", "bash", "text", "console", "json", "toml", "ini", "yaml", ""}
    for page in pages():
        for block in blocks(page):
            assert block["language"] in known, f"{page}:{block['line']}: unknown block language {block['language']!r}"
            assert set(block["flags"]) <= {"no-run"}, f"{page}:{block['line']}: unknown flags {block['flags']}"
            if block["language"] == "python":  # no-run blocks too: they must stay valid Python
                compile(block["code"], f"{page}:{block['line']}", "exec")


def pytest_generate_tests(metafunc):
    if "page" in metafunc.fixturenames:
        with_python = [p for p in pages() if any(b["language"] == "python" for b in blocks(p))]
        metafunc.parametrize("page", with_python)


def test_python_blocks_run(page, tmp_path):
    for block in _run_page(page, tmp_path):
        print(f"{page}:{block['line']}: {block['seconds']:.1f} s")


# ------------------------------------------------------------------ bash blocks

_CONFIG_COMMANDS = (("dtx", "train"), ("dtx", "launch"), ("dtx", "bench", "step"))


def _commands(code: str):
    """Each ``dtx train|launch|bench step`` command of a bash block (also as ``.venv/bin/dtx``, after ``srun``
    or ``&&``), continuation lines joined: ``(line, arguments after the command words)``."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word != "dtx" and not word.endswith("/dtx"):
                continue
            for command in _CONFIG_COMMANDS:
                if tuple(["dtx", *words[i + 1: i + len(command)]]) == command:
                    rest = words[i + len(command):]
                    yield line.strip(), rest[: rest.index("&&")] if "&&" in rest else rest


def _experiment_and_overrides(args: list[str]) -> tuple[str, list[str]]:
    flags_with_values = {"--workdir", "--processes", "--devices-per-process", "--vary", "--steps", "--rounds",
                         "--port", "--timeout"}
    positional, overrides, skip = [], [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--config."):
            overrides.append(arg)
        elif arg in flags_with_values:
            skip = True
        elif not arg.startswith("-"):
            positional.append(arg)
    return positional[0], overrides


def test_dtx_commands_in_bash_blocks_name_real_experiments_and_keys(monkeypatch):
    from dtx import config as config_lib

    monkeypatch.chdir(REPO)  # the pages' commands run from the repository root
    checked = 0
    for page in pages():
        for block in blocks(page):
            if block["language"] != "bash":
                continue
            for line, args in _commands(block["code"]):
                if "EXPERIMENT.py" in args or not args:
                    continue  # the usage line
                experiment, overrides = _experiment_and_overrides(args)
                try:
                    config_lib.load(experiment, overrides)
                except config_lib.ConfigError as e:
                    raise AssertionError(f"{page}:{block['line']}: `{line}`: {e}") from None
                checked += 1
    assert checked >= 20


# ------------------------------------------------------------------ benchmarks write nothing tracked unasked


def test_benchmarks_write_tracked_files_only_with_update_docs(tmp_path, monkeypatch):
    monkeypatch.setenv("DTX_BENCH_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import report

    tracked = open(report.BENCHMARKS_MD, encoding="utf-8").read()
    assert report.write("demo", "what ran", "| a |\n|---|", update_docs=False) == str(tmp_path / "BENCHMARKS.md")
    assert "<!-- bench:demo -->\nwhat ran\n\n| a |" in (tmp_path / "BENCHMARKS.md").read_text()
    assert open(report.BENCHMARKS_MD, encoding="utf-8").read() == tracked
    assert report.figures_dir(False) == str(tmp_path) and report.figures_dir(True) == report.DOCS
    # Every script that records results goes through report with the flag, never straight to the tracked files.
    for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
        source = open(path, encoding="utf-8").read()
        name = os.path.basename(path)
        if name == "report.py":
            continue
        assert "update_section(" not in source, name
        assert 'os.path.join(REPO, "docs")' not in source, f"{name} writes into docs/ without --update-docs"
        if "report.write(" in source or "save_section(" in source:
            assert "update_docs=args.update_docs" in source and ("--update-docs" in source
                                                                   or "add_output_arguments" in source), name


# ------------------------------------------------------------------ docstrings


def _dtx_modules():
    import dtx

    names = ["dtx"] + [m.name for m in pkgutil.walk_packages(dtx.__path__, "dtx.")]
    return names + [f"dtx.{p}" for p in ("models", "experiments") if f"dtx.{p}" not in names]


def test_docstring_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    examples = 0
    for name in _dtx_modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            examples += len(test.examples)
            runner.run(test)
    summary = runner.summarize(verbose=False)
    assert summary.failed == 0, f"{summary.failed} docstring example(s) failed; see the output above"
    assert examples >= 2


# ------------------------------------------------------------------ the runner (a fresh process per page)


def _execute(spec_path: str) -> int:
    import signal
    import traceback

    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # what tests/conftest.py sets; a block's own call agrees
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)

    def over_budget(signum, frame):
        raise TimeoutError(f"block ran past its {spec['budget']} s budget: give it fewer steps or less data")

    signal.signal(signal.SIGALRM, over_budget)
    namespace = {"__name__": "__main__"}
    for block in spec["blocks"]:
        where = f"{spec['page']}:{block['line']}"
        start = time.perf_counter()
        signal.alarm(spec["budget"])
        try:
            exec(compile(block["code"], where, "exec"), namespace)
        except BaseException:
            print(f"{where}: the block failed as written:\n{block['code']}\n{traceback.format_exc()}", flush=True)
            return 1
        finally:
            signal.alarm(0)
        print("BLOCK " + json.dumps(dict(line=block["line"], seconds=time.perf_counter() - start)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_execute(sys.argv[1]))
