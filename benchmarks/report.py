"""Where a benchmark's results go: a results folder by default, BENCHMARKS.md and docs/ when asked.

Each benchmark owns one section of BENCHMARKS.md, delimited by ``<!-- bench:NAME -->``
and ``<!-- /bench:NAME -->``. With ``--update-docs`` a run replaces that section (and
writes its figures, CSV and PNG, into docs/), leaving the rest of the file alone, so
``benchmarks/run_all.py --update-docs`` can refresh every figure. Without it nothing
tracked is touched: the section and the figures go to :func:`results_dir` (printed),
so trying a benchmark never rewrites the repository. Text outside the markers
(analysis, runs on other machines) is written by hand.

Every section written is also kept as its script's *last rendering*: ``logs/NAME.json`` beside the
section (``benchmarks/logs/`` with ``--update-docs``, the results folder without), holding the page,
the command, the date, the section's markdown exactly as written, and the raw results the script passes
(``results=``). tests/test_benchmarks_docs.py holds each section of BENCHMARKS.md and docs/ to that
file, so a number edited by hand in a section (and not by rerunning its script) fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS_MD = os.path.join(REPO, "BENCHMARKS.md")
DOCS = os.path.join(REPO, "docs")
LOGS = os.path.join(REPO, "benchmarks", "logs")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--update-docs``: the one way a benchmark writes tracked files."""
    parser.add_argument("--update-docs", action="store_true",
                        help="write the results into BENCHMARKS.md (this benchmark's section) and its figures into "
                             "docs/; default: a results folder, printed ($DTX_BENCH_DIR or the temp folder)")


def results_dir() -> str:
    """Untracked home of results not written into the repository: ``$DTX_BENCH_DIR``, else the temp folder."""
    path = os.environ.get("DTX_BENCH_DIR") or os.path.join(tempfile.gettempdir(), "dtx-benchmarks")
    os.makedirs(path, exist_ok=True)
    return path


def figures_dir(update_docs: bool, out: str | None = None) -> str:
    """Folder for a benchmark's CSV and PNG files: ``out`` if given, docs/ with ``--update-docs``, else results."""
    path = out or (DOCS if update_docs else results_dir())
    os.makedirs(path, exist_ok=True)
    return path


def update_section(name: str, markdown: str, path: str = BENCHMARKS_MD) -> None:
    """Replace section ``name`` of ``path`` with ``markdown`` (appended when the markers are missing)."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write(name: str, preamble: str, body: str, width: int = 110, *, update_docs: bool,
          results: object = None) -> str:
    """Section ``name``: ``preamble`` (what was run, where, how) wrapped at ``width``, then ``body`` (tables)."""
    return save_section(name, textwrap.fill(preamble, width, break_long_words=False, break_on_hyphens=False)
                        + "\n\n" + body.strip(), update_docs=update_docs, results=results)


def rendering_path(name: str, update_docs: bool) -> str:
    """Where section ``name``'s last rendering is kept: ``benchmarks/logs/NAME.json`` (``update_docs``), else the
    results folder's ``logs/NAME.json``."""
    return os.path.join(LOGS if update_docs else os.path.join(results_dir(), "logs"), f"{name}.json")


def save_rendering(name: str, page: str, markdown: str, *, update_docs: bool, results: object = None) -> str:
    """Keep section ``name`` as its script last rendered it (``markdown``, written into ``page``, a path relative to
    the repository such as ``BENCHMARKS.md`` or ``docs/memory.md``), with the command, the date and ``results``
    (the raw values the section was rendered from, when the script passes them)."""
    path = rendering_path(name, update_docs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if sys.argv and sys.argv[0] else ""
    record = {"section": name, "page": page, "command": " ".join(["python", script, *sys.argv[1:]]),
              "written": time.strftime("%Y-%m-%d %H:%M:%S"), "markdown": markdown.strip(), "results": results}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return path


def save_section(name: str, markdown: str, *, update_docs: bool, results: object = None) -> str:
    """Section ``name`` into BENCHMARKS.md (``update_docs``) or into ``results_dir()/BENCHMARKS.md``, whose
    sections can be compared with the tracked ones, and its rendering into :func:`rendering_path`; returns the
    file written and says which it was."""
    path = BENCHMARKS_MD if update_docs else os.path.join(results_dir(), "BENCHMARKS.md")
    update_section(name, markdown, path)
    kept = save_rendering(name, "BENCHMARKS.md", markdown, update_docs=update_docs, results=results)
    note = "" if update_docs else " (the tracked BENCHMARKS.md is unchanged; --update-docs writes there)"
    print(f"section {name!r} written to {path}{note}; its rendering kept in {kept}", flush=True)
    return path


def save_doc_table(name: str, doc: str, markdown: str, *, update_docs: bool, results: object = None) -> str:
    """A table a page of docs/ shows, in that page's ``<!-- bench:NAME -->`` section (``update_docs``) or into
    ``results_dir()/doc``: the page's figures come from the script that measures them, as BENCHMARKS.md's do."""
    path = os.path.join(DOCS if update_docs else results_dir(), doc)
    if update_docs and f"<!-- bench:{name} -->" not in open(path, encoding="utf-8").read():
        raise ValueError(f"{path} has no <!-- bench:{name} --> section to write")
    update_section(name, markdown, path)
    kept = save_rendering(name, f"docs/{doc}", markdown, update_docs=update_docs, results=results)
    print(f"section {name!r} written to {path}; its rendering kept in {kept}", flush=True)
    return path


def machine(devices: str = "") -> str:
    """Where and when a figure was measured, e.g. ``2-core CPU, 8 emulated devices, jax 0.10.2, 2026-11-29``.

    ``devices`` describes the devices used; by default it is read from JAX (which
    must then be configured already).
    """
    if not devices:
        import jax

        found = jax.devices()
        kind = found[0].device_kind if found[0].platform != "cpu" else "CPU device"
        devices = f"{len(found)} {'emulated ' if found[0].platform == 'cpu' and len(found) > 1 else ''}{kind}" + (
            "s" if len(found) > 1 else "")
    import jax

    return (f"{os.cpu_count()}-core {platform.machine()} host, {devices}, Python {platform.python_version()}, "
            f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
