"""The documentation runs as written: README.md, docs/*.md and the doctest examples of dtx's docstrings.

Convention (stated for writers in docs/README.md):

- every ```python block of a page runs. A page's blocks run top to bottom in one fresh Python
  process, like a notebook's cells, so a block may use names an earlier block of the same page
  defined; the process starts in an empty temporary folder, on 8 emulated CPU devices, and each
  block has a time budget (``BLOCK_SECONDS``);
- ```python no-run marks a block that must not run (it needs a cluster, a GPU, a file the reader
  has); it is still compiled, so it cannot rot into invalid Python. Keep it rare;
- ```bash blocks are not run, but every ``dtx ...`` line in them goes through the real CLI up to the point
  where it would start its work (experiment and ``--config.`` overrides loaded and validated, the run's parts
  built on the 8 devices; ``dtx simulate`` runs; ``dtx plot``/``eval``/``export`` name runs an earlier line of
  the page writes), and every ``python benchmarks/NAME.py ...`` line through its script's parser; ``dtx``
  commands in inline code name a command and flags it has; a ``dtx simulate`` line whose comment states
  ``speedup S× at N nodes`` prints that speedup (rounded as stated);
- a block whose prose states a result asserts it (``assert abs(acc - 0.97) < 0.01``), so the page's claim
  is checked where the reader sees it;
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
import tempfile
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


# ------------------------------------------------------------------ command lines

# What each command does once its arguments are parsed and its input checked: the test stops it there.
# ``dtx train`` has loaded and validated its experiment (``dtx.config.load``, as the CLI does) when it
# calls ``train``; ``dtx bench step`` has loaded every ``--vary`` variant when it measures the first.
_WORK = {"dtx.run.trainer.train": "train", "dtx.tools.bench.measure_step": "bench step",
         "dtx.tools.bench.measure": "bench collectives", "dtx.tools.plots.plot_runs": "plot",
         "dtx.run.evaluate.evaluate_run": "eval", "dtx.run.evaluate.export_run": "export",
         "dtx.run.generate.generate_text": "generate"}
# usage lines: [--step N], EXPERIMENT.py, DIR; a script's shell variable (--config.grad_accum_steps=$accum)
_PLACEHOLDER = re.compile(r"^\[|\]$|^[A-Z][A-Z_]*(\.py)?$|\.\.\.|=\$")
_PYTHON = re.compile(r"^(python3?|\.venv/bin/python3?)$")
# Lines of pages this file's owners do not edit, known to be wrong; each must still fail (then fix the page
# and delete the entry).
KNOWN_WRONG: dict = {}  # (page, command) -> why it is wrong, while its fix waits: the test fails once it is right


class _Reached(Exception):
    """A command got past its parser and its checks to the work itself."""

    def __init__(self, kind, *args):
        super().__init__(kind)
        self.kind, self.args_ = kind, args


def command_lines(page: str) -> list[dict]:
    """Every ``dtx ...`` and ``python benchmarks/...`` command of ``page``, in page order: the lines of its
    ```bash blocks (continuations joined; after ``srun`` or ``&&``) and its inline code spans.
    Each: ``line``, ``text``, ``words`` (from ``dtx`` or the script on), ``inline`` (a code span in prose)."""
    text = open(os.path.join(REPO, page), encoding="utf-8").read()
    found, fenced = [], []
    for match in FENCE.finditer(text):
        fenced.append((match.start(), match.end()))
        if match["info"].split()[:1] != ["bash"]:
            continue
        line_no, pending = text.count("\n", 0, match.start()) + 2, ""
        for offset, line in enumerate(match["body"].splitlines()):
            if not pending:
                start = line_no + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            comment = re.search(r"(?:^|\s)#\s*(.*)$", line)  # what the page says the command gives
            for words in _segments(shlex.split(pending + line, comments=True)):
                found.append(dict(line=start, text=" ".join(words), words=words, inline=False,
                                  comment=comment[1] if comment else ""))
            pending = ""
    for match in re.finditer(r"`([^`\n]+)`", text):
        if any(a <= match.start() < b for a, b in fenced):
            continue
        try:
            words = shlex.split(match[1])
        except ValueError:
            continue
        for words in _segments(words):
            found.append(dict(line=text.count("\n", 0, match.start()) + 1, text=" ".join(words), words=words,
                              inline=True))
    return sorted(found, key=lambda c: c["line"])


def _segments(words: list[str]):
    """The commands of one shell line: each ``&&``-separated part from ``dtx`` (or ``.venv/bin/dtx``, after
    ``srun``) or from ``python benchmarks/NAME.py`` on."""
    part = []
    for word in words + ["&&"]:
        if word != "&&":
            part.append(word)
            continue
        for i, w in enumerate(part):
            if (w == "dtx" or w.endswith("/dtx")) and len(part) > i + 1 and not part[i + 1].startswith("-"):
                yield ["dtx", *part[i + 1:]]
                break
            if _PYTHON.match(w) and len(part) > i + 1 and part[i + 1].startswith("benchmarks/"):
                yield part[i + 1:]
                break
        part = []


def _dtx_words(words: list[str]) -> list[str]:
    """The command words of ``dtx ...``: ``["train"]``, ``["bench", "step"]``; [] for an unknown command."""
    from dtx.tools import cli

    for name in [*cli._COMMANDS, "train"]:
        if words[1: 1 + len(name.split())] == name.split():
            return name.split()
    return []


def _run_cli(argv: list[str]) -> tuple[int | None, _Reached | None, str]:
    """``dtx ARGV`` through the real CLI up to its work: (exit status or None, where it stopped, stderr+stdout)."""
    import contextlib
    import io
    import types

    import pytest

    importlib.import_module("dtx.run.trainer")  # every plug-in registered, with its config checks, as in dtx train
    from dtx import config as config_lib
    from dtx.tools import cli, launch

    def stop(kind):
        def reached(*args, **kwargs):
            raise _Reached(kind, *args, kwargs)
        return reached

    def popen(command, **kwargs):  # dtx launch: the command each process would run, not the process
        raise _Reached("launch", command, kwargs.get("env", {}))

    loaded, load = [], config_lib.load

    def recording_load(*args, **kwargs):  # every config the command loads (dtx bench step: one per --vary value)
        loaded.append(load(*args, **kwargs))
        return loaded[-1]

    out = io.StringIO()
    code, reached = None, None
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        patch.setattr(config_lib, "load", recording_load)
        for target, kind in _WORK.items():
            patch.setattr(target, stop(kind))
        patch.setattr("dtx.run.preflight.show_on_terminal", lambda: None)
        patch.setattr(launch, "subprocess", types.SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT))
        try:
            code = cli.main(argv)
        except _Reached as r:
            reached = r
            reached.loaded = loaded
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, reached, out.getvalue()


def _check_dtx(command: dict, devices: int, scratch: str) -> str:
    """Run one ``dtx`` command line up to its work; '' when it got there as the page says, else why not."""
    words = command["words"]
    name = _dtx_words(words)
    if not name:
        return f"`dtx {words[1]}` is not a dtx command"
    args = words[1 + len(name):]
    if command["inline"] or any(_PLACEHOLDER.search(w) for w in args):  # a fragment or usage: its flags exist
        if name == ["train"] and args and not args[0].startswith("-") and not any(_PLACEHOLDER.search(w) for w in args):
            pass  # a whole command after all (`dtx train digits_mlp`): checked in full below
        else:
            code, _, help_text = _run_cli([*name, "--help"])
            flags = [w.strip("[]").split("=")[0] for w in args if w.strip("[").startswith("--")]
            unknown = [f for f in flags if not f.startswith("--config.") and not re.search(re.escape(f) + r"\b",
                                                                                          help_text)]
            if code != 0 or unknown:
                return f"dtx {' '.join(name)} --help exited {code}; flags not in it: {unknown}\n{help_text}"
            return ""
    # The shell's globs (runs/*), expanded in the page's folder.
    args = [w for a in args for w in (sorted(glob.glob(a)) or [a] if re.search(r"[*?]", a) else [a])]
    if name == ["simulate"]:  # cheap: run it, without compiling the plans (--verify) or drawing (--out)
        args = [a for i, a in enumerate(args) if a != "--verify" and a != "--out" and args[i - 1 : i] != ["--out"]]
    code, reached, output = _run_cli([*name, *args])
    if reached is None:
        if name == ["simulate"] and code == 0:
            return _stated_speedups(command.get("comment", ""), output)
        return f"exited {code} before its work:\n{output[-3000:]}"
    if reached.kind == "launch":  # what each process runs: a dtx train command of its own
        from dtx import mesh as mesh_lib

        processes = int(reached.args_[1][mesh_lib.ENV_NUM_PROCESSES])
        child = reached.args_[0][reached.args_[0].index("train"):]
        code, reached, output = _run_cli(child)
        if reached is None:
            return f"a process's `dtx {' '.join(child)}` exited {code}:\n{output[-3000:]}"
        return _check_config(reached.args_[0], processes, devices, scratch) or _ran(reached)
    if reached.kind == "train":
        return _check_config(reached.args_[0], 1, devices, scratch) or _ran(reached)
    if reached.kind == "bench step":  # every variant, as each would be measured
        return "".join(_check_config(config, 1, devices, scratch) for config in reached.loaded)
    if reached.kind in ("eval", "export", "generate"):  # dtx plot checks its runs itself
        missing = [r for r in [reached.args_[0]] if not os.path.isdir(r)]
        if missing:
            return f"names {missing}, which no command before it on this page writes"
    return ""


_SPEEDUP = re.compile(r"speedup (\d+(?:\.\d+)?)× at (\d+) nodes")
_TABLE_ROW = re.compile(r"^\s*(\d+)\s+\S+\s+[\d.]+s\s+[\d.]+s\s+([\d.]+)\s", re.M)


def _stated_speedups(comment: str, output: str) -> str:
    """A ``dtx simulate`` line's comment stating ``speedup S× at N nodes`` matches what the command prints
    (its table's speedup at N nodes, rounded as the page rounds it); '' when it does or states none."""
    try:  # --json: the speedups by node count
        printed = {int(nodes): float(speedup) for nodes, speedup in json.loads(output)["speedup"].items()}
    except (ValueError, KeyError, TypeError):
        printed = {int(nodes): float(speedup) for nodes, speedup in _TABLE_ROW.findall(output)}
    wrong = []
    for stated, nodes in _SPEEDUP.findall(comment):
        digits = len(stated.split(".")[1]) if "." in stated else 0
        if int(nodes) not in printed or round(printed[int(nodes)], digits) != float(stated):
            wrong.append(f"states speedup {stated}× at {nodes} nodes; the command prints {printed.get(int(nodes))}")
    return "; ".join(wrong)


def _check_config(config, processes: int, devices: int, scratch: str) -> str:
    """``train()`` itself up to its first compilation, on this test's devices when the command asks for as many
    (or for whatever a cluster has): the mesh, the data, the model, optimizer, compressor and strategy are
    built, so an unknown name or a batch that does not split is refused as the command would refuse it."""
    from dtx import config as config_lib

    try:
        config_lib.validate(config)  # train()'s first line
    except config_lib.ConfigError as e:
        return f"refused by train(): {e}"
    if config.emulate_cpu_devices * processes != devices and config.emulate_cpu_devices != 0:
        return ""
    # This process's 8 devices are the job's global mesh; a fresh run directory (a resume's checkpoint is not here).
    config = config_lib.override(config, emulate_cpu_devices=0, **{"checkpoint.resume_step": 0,
                                                                   "checkpoint.resume": "auto"})
    key = config.to_json()
    if key not in _BUILT:  # the same run on several pages is built once
        _BUILT[key] = _build(config, scratch)
    return _BUILT[key]


_BUILT: dict[str, str] = {}


def _build(config, scratch: str) -> str:
    import pytest

    from dtx.run import trainer

    def built(*args, **kwargs):  # called right after setup.build_parts, before anything is compiled
        raise _Reached("built")

    os.makedirs(scratch, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dtx.run.preflight.what_ran", built)
        patch.setattr("dtx.run.preflight.show_on_terminal", lambda: None)
        try:
            trainer.train(config, tempfile.mkdtemp(dir=scratch))
        except _Reached:
            return ""
        except Exception as e:  # noqa: BLE001 - what dtx train would print instead of training
            return f"refused by train(): {type(e).__name__}: {e}"
    return "train() ran past building its parts"


def _ran(reached: _Reached) -> str:
    """What the command leaves behind for the page's later commands: a run directory with its records."""
    if reached.kind == "train":
        workdir = os.fspath(reached.args_[1])
        if not os.path.isabs(workdir):
            os.makedirs(workdir, exist_ok=True)
            open(os.path.join(workdir, "metrics.jsonl"), "a").close()
    return ""


def _check_benchmarks(commands: list[tuple[str, dict]], tmp_path) -> list[str]:
    """Each ``python benchmarks/NAME.py ...`` line: the script exists and its own parser accepts the line,
    in one child process (the scripts set JAX up as they import); nothing runs past the parser."""
    wrong, todo = [], []
    for where, command in commands:
        script = os.path.join(REPO, command["words"][0])
        if not os.path.isfile(script):
            wrong.append(f"{where}: `{command['text']}`: no such script")
        else:
            todo.append(dict(where=where, script=script, args=command["words"][1:]))
    if not todo:
        return wrong
    spec = tmp_path / "benchmarks.json"
    spec.write_text(json.dumps(todo))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg", "DTX_BENCH_DIR": str(tmp_path / "results")}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--parse-benchmarks", str(spec)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    report = [json.loads(line[len("PARSED "):]) for line in done.stdout.splitlines() if line.startswith("PARSED ")]
    assert done.returncode == 0 and len(report) == len(todo), done.stdout[-3000:] + done.stderr[-3000:]
    wrong += [f"{r['where']}: `{' '.join(['python', os.path.relpath(r['script'], REPO), *r['args']])}`: {r['error']}"
              for r in report if r["error"]]
    return wrong


def _parse_benchmarks(spec_path: str) -> int:
    """Child process of :func:`_check_benchmarks`: run each script as ``__main__`` until its parser returns."""
    import argparse
    import contextlib
    import io
    import runpy

    class Parsed(Exception):
        pass

    inside = []
    original_args, original_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def parse_args(self, args=None, namespace=None):
        inside.append(1)
        try:
            original_args(self, args, namespace)
        finally:
            inside.pop()
        raise Parsed

    def parse_known_args(self, args=None, namespace=None):
        result = original_known(self, args, namespace)
        if inside:
            return result
        unknown = [a for a in result[1] if not a.startswith("--config.")]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        raise Parsed

    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = parse_args, parse_known_args
    for item in json.load(open(spec_path, encoding="utf-8")):
        sys.argv = [item["script"], *item["args"]]
        out, error = io.StringIO(), ""
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                runpy.run_path(item["script"], run_name="__main__")
            error = "ran to the end without parsing its arguments"
        except Parsed:
            pass
        except SystemExit as e:
            error = f"exited {e.code}: {out.getvalue()[-2000:]}"
        except Exception as e:  # noqa: BLE001 - reported as the line's failure
            error = f"{type(e).__name__}: {e}"
        print("PARSED " + json.dumps(dict(item, error=error)), flush=True)
    return 0


def test_every_command_line_of_the_pages_parses_and_validates(tmp_path, monkeypatch):
    """Every ``dtx ...`` command of README.md, docs/*.md and BENCHMARKS.md goes through the real CLI up to the
    point where it would start its work: parsed by its own parser; an experiment with its ``--config.``
    overrides loaded and validated as ``dtx train`` does (``dtx.config.load``), then ``train()`` itself up to
    its first compilation (mesh, data, model, optimizer, compressor, strategy) on this test's 8 devices when
    the command asks for 8 (or for a cluster's);
    ``dtx launch`` each process's ``dtx train`` command; ``dtx bench step`` every ``--vary`` value;
    ``dtx simulate`` run (without ``--verify`` and ``--out``); ``dtx plot``/``eval``/``export`` name run folders
    an earlier command of the page writes. Inline code spans (`dtx simulate --memory`) must name a command and
    flags it has. ``python benchmarks/NAME.py ...``: the script exists and its parser takes the line.
    Each page runs in an empty folder of its own (``experiments`` linked in), so nothing tracked is written."""
    import jax

    devices = len(jax.devices())
    wrong, benchmarks, counts = [], [], {"dtx": 0, "inline": 0, "benchmarks": 0}
    for page in pages() + ["BENCHMARKS.md"]:  # BENCHMARKS.md: the commands of its hand-written text
        work = tmp_path / page.replace("/", "_")
        work.mkdir()
        (work / "experiments").symlink_to(os.path.join(REPO, "experiments"))
        monkeypatch.chdir(work)
        for command in command_lines(page):
            where = f"{page}:{command['line']}"
            if command["words"][0] != "dtx":
                if not _PLACEHOLDER.search(os.path.basename(command["words"][0])):  # not `benchmarks/NAME.py`
                    benchmarks.append((where, command))
                counts["benchmarks"] += 1
                continue
            problem = _check_dtx(command, devices, str(tmp_path / "scratch"))
            counts["inline" if command["inline"] else "dtx"] += 1
            known = KNOWN_WRONG.get((page, command["text"]))
            if known:
                assert problem, f"{where}: `{command['text']}` is right now: delete its KNOWN_WRONG entry"
            elif problem:
                wrong.append(f"{where}: `{command['text']}`: {problem}")
    monkeypatch.chdir(REPO)
    wrong += _check_benchmarks(benchmarks, tmp_path)
    assert not wrong, "\n\n".join(wrong)
    print(counts)
    assert counts["dtx"] >= 70 and counts["inline"] >= 30 and counts["benchmarks"] >= 8, counts


def test_a_wrong_command_line_fails_the_check(tmp_path, monkeypatch):
    """Misspelt flags, keys and values, batch sizes the mesh refuses, runs no command wrote: each is caught."""
    import jax

    (tmp_path / "experiments").symlink_to(os.path.join(REPO, "experiments"))
    monkeypatch.chdir(tmp_path)
    mlp = "dtx train experiments/digits_mlp.py"

    def problem(text, inline=False):
        return _check_dtx(dict(words=shlex.split(text), text=text, inline=inline), len(jax.devices()),
                          str(tmp_path / "scratch"))

    assert problem(f"{mlp} --config.driver=jit") == ""
    for wrong in [f"{mlp} --config.drivr=jit", f"{mlp} --config.driver=pjit", f"{mlp} --workdri runs/x",
                  f"{mlp} --config.global_batch_size=100", "dtx train experiments/digits_mpl.py",
                  "dtx launch --procesess 2 experiments/digits_mlp.py",
                  "dtx launch --processes 2 --devices-per-process 4 experiments/digits_mlp.py --config.mesh=data",
                  "dtx bench step experiments/digits_mlp.py --vary compression.name=none,topkk",
                  "dtx simulate --model vgg_aa", "dtx simulate --model vgg_a --cluster haswel_fdr",
                  "dtx bench collectives --sizez 1MiB", "dtx plot runs/nothing --x sim_time", "dtx eval runs/ck",
                  "dtx evaluate runs/ck"]:
        assert problem(wrong), wrong
    assert problem("dtx simulate --memory", inline=True) == "" and problem("dtx simulate --memroy", inline=True)
    # A speedup a page states beside a dtx simulate line is the one the command prints (4.46 here).
    _, _, output = _run_cli(shlex.split("dtx simulate --model speech_dnn --cluster haswell_fdr --nodes 1,8")[1:])
    stated = {"speedup 4.5× at 8 nodes": False, "speedup 4.46× at 8 nodes": False, "speedup 4.4× at 8 nodes": True,
              "speedup 4× at 4 nodes": True, "plans vs compiled programs": False}
    for comment, is_wrong in stated.items():
        assert bool(_stated_speedups(comment, output)) == is_wrong, (comment, output[:600])
    _, _, output = _run_cli(shlex.split("dtx simulate --model speech_dnn --cluster haswell_fdr --nodes 1,8 --json")[1:])
    assert _stated_speedups("speedup 4.46× at 8 nodes", output) == "" and _stated_speedups("speedup 4.4× at 8 nodes",
                                                                                            output)
    bench = [(f"page:{i}", dict(words=shlex.split(text), text=text)) for i, text in enumerate(
        ["benchmarks/large_batch_sweep.py --optimizers lars --batches 128,8192",
         "benchmarks/large_batch_sweep.py --optimisers lars", "benchmarks/no_such_sweep.py"])]
    assert sorted(w.split(":")[1] for w in _check_benchmarks(bench, tmp_path)) == ["1", "2"]


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
    sys.exit(_parse_benchmarks(sys.argv[2]) if sys.argv[1] == "--parse-benchmarks" else _execute(sys.argv[1]))


def test_the_extension_guides_tables_name_every_field_of_the_declarations():
    """docs/extending.md's family table lists every field of the layout, optimizer and mesh-axis declarations
    (a field added to the code and not to the guide fails here), and names no field the code lacks."""
    import dataclasses

    from dtx import mesh as mesh_lib
    from dtx import optim, parallel

    page = open(os.path.join(REPO, "docs", "extending.md")).read()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in page.splitlines() if line.startswith("| ")}
    for family, declaration in (("layout", parallel.Layout), ("optimizer", optim.Optimizer),
                                ("mesh axis", mesh_lib.Axis)):
        cell = rows[family]
        fields = {field.name for field in dataclasses.fields(declaration)} - {"name"}
        named = set(re.findall(r"`(\w+)`", cell))
        assert fields <= named, f"docs/extending.md's {family} row leaves out {sorted(fields - named)}"
        listed = cell
        while re.search(r"\([^()]*\)", listed):  # what a field's parenthesis says is not a field
            listed = re.sub(r"\([^()]*\)", "", listed)
        listed = listed.split(";")[0]  # after it: what the declaration's methods return
        stray = set(re.findall(r"`(\w+)`", listed)) - fields
        assert not stray, f"docs/extending.md's {family} row names {sorted(stray)}, which the code does not have"
