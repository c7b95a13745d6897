"""BENCHMARKS.md's measured sections are written by scripts only, never by hand.

Each ``<!-- bench:NAME -->`` section is what a script in benchmarks/ wrote with ``--update-docs``
(through ``benchmarks/report.py``). The test finds that script (it passes ``"NAME"`` to
``report.write`` or ``report.save_section``) and checks that the section's wording is the script's:
every run of two or more plain words in the section (the words between numbers, names and
punctuation) is text of the script's string literals (or report.py's), or is the text on both sides of
one value the script fills in (an f-string's hole, or a string the script picks). A sentence typed into a
section by hand ("the machine was busy") is text no script writes, and fails; to change a section, change
its script and rerun it with ``--update-docs``. Code spans are values, not wording: a script puts what a
program printed there. Text outside the markers is free.

The numbers are held too: ``report.py`` keeps every section it writes as the script's last rendering,
``benchmarks/logs/NAME.json`` (the markdown exactly as written, the page, the command, and the raw results
where the script passes them), and each section must be that markdown, character for character, so a
figure edited by hand fails. Where the record holds raw results, every number of the section's tables must
also be one of them, rounded to the digits shown. Sections written before renderings were kept, whose
numbers no results file holds, are listed in ``UNHELD`` with the reason; rerunning the script with
``--update-docs`` holds the section, and the test then asks for its name to leave the list.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
RENDERINGS = os.path.join(BENCHMARKS, "logs")  # NAME.json: section NAME as its script last rendered it
HOLE = "\x00"  # where a script's text is cut: an f-string's value, or the start/end of a string literal
_EDGE = "([{\"'`*|"  # punctuation that starts a new run of words
_END = ")]}\"'`*|,.;:!?"


def sections(text: str) -> dict[str, str]:
    """``{name: markdown}`` of every ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->`` section."""
    found = re.findall(r"<!-- bench:(\S+) -->\n(.*?)\n<!-- /bench:\1 -->", text, re.S)
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a section appears twice: {names}"
    opened = re.findall(r"^<!-- bench:", text, re.M)
    assert len(found) == len(opened), "a <!-- bench:NAME --> marker without its closing marker"
    return dict(found)


def writer_of(name: str) -> list[str]:
    """The benchmark scripts that write section ``name``."""
    call = re.compile(r"report\.(?:write|save_section|save_doc_table)\(\s*" + re.escape(f'"{name}"'))
    return sorted(p for p in glob.glob(os.path.join(BENCHMARKS, "*.py"))
                  if call.search(open(p, encoding="utf-8").read()))


def imported_sources(script: str) -> list[str]:
    """The dtx modules ``script`` imports by name (a table header it prints may be the library's)."""
    found = []
    for node in ast.walk(ast.parse(open(script, encoding="utf-8").read())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] == "dtx":
                path = os.path.join(REPO, *name.split(".")) + ".py"
                if os.path.isfile(path) and path not in found:
                    found.append(path)
    return found


def script_text(*paths: str, rendered: tuple[str, ...] = ()) -> str:
    """The literal text of the files' strings (and of ``rendered`` text), whitespace collapsed, each piece
    between ``HOLE``s."""
    pieces = list(rendered)
    for path in paths:
        tree = ast.parse(open(path, encoding="utf-8").read())
        in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):  # literal parts, a hole for every {value}
                pieces.append(HOLE.join(v.value if isinstance(v, ast.Constant) else "" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
                pieces.append(node.value)
    return HOLE + HOLE.join(re.sub(r"\s+", " ", p) for p in pieces) + HOLE


def word_runs(markdown: str) -> list[list[str]]:
    """Runs of two or more plain words (letters, apostrophes, hyphens) separated only by spaces, outside code
    spans (`...`: commands, paths and what a program printed, verbatim)."""
    runs, current = [], []
    for token in re.sub(r"`[^`\n]*`", " \x01 ", markdown).split():
        core = token.lstrip(_EDGE)
        lead = token[: len(token) - len(core)]
        stripped = core.rstrip(_END)
        trail = core[len(stripped):]
        if not re.fullmatch(r"[A-Za-z][A-Za-z'’-]*", stripped):
            runs.append(current)
            current = []
            continue
        if lead:
            runs.append(current)
            current = []
        current.append(stripped)
        if trail:
            runs.append(current)
            current = []
    runs.append(current)
    return [run for run in runs if len(run) >= 2]


def _spaced(words: list[str]) -> str:
    return " ".join(words)


def written_by(run: list[str], text: str) -> bool:
    """``run`` is in ``text``, or is literal pieces around single words the script filled in: each piece
    before a filled-in word ends at a hole of ``text``, each piece after one starts at a hole."""
    if _spaced(run) in text:
        return True

    def fits(i: int, after_hole: bool) -> bool:  # words i.. are covered, the word before i was filled in
        if i == len(run):
            return True
        for j in range(len(run), i, -1):  # a literal piece run[i:j], longest first
            piece = _spaced(run[i:j])
            starts = [f"{HOLE}{piece}", f"{HOLE} {piece}"] if after_hole else [piece]
            if j == len(run):
                if any(s in text for s in starts):
                    return True
                continue
            if any(f"{s}{HOLE}" in text or f"{s} {HOLE}" in text for s in starts) and (
                    fits(j, after_hole=True) or fits_filled(j)):  # a value of words, or of one word
                return True
        return False

    def fits_filled(i: int) -> bool:  # run[i] is a value the script filled in, then literal text again
        return i < len(run) and fits(i + 1, after_hole=True)

    return fits(0, after_hole=False) or fits_filled(0)


_ERRORS = {"e", "err", "error", "exc", "exception"}  # names a script gives a caught exception or its message


def error_templates(*paths: str) -> list[re.Pattern]:
    """The scripts' f-strings that print a caught exception (``f"| {name} | refused: {e} |"``), as patterns whose
    groups are those messages: what a program said, not the script's wording, so the check skips them."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if not isinstance(node, ast.JoinedStr):
                continue
            holes = [isinstance(v, ast.FormattedValue) and any(isinstance(n, ast.Name) and n.id in _ERRORS
                                                                for n in ast.walk(v.value)) for v in node.values]
            literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if any(holes) and re.search(r"[A-Za-z]{3}", literal):
                found.append(re.compile("".join(
                    re.escape(v.value) if isinstance(v, ast.Constant) else "(.*?)" if error else "(?:.*?)"
                    for v, error in zip(node.values, holes))))
    return found


def handwritten(markdown: str, text: str, errors: list[re.Pattern] = ()) -> list[str]:
    """The runs of words of ``markdown`` that ``text`` (a script's strings) does not write, leaving alone the
    exception messages the ``errors`` templates print."""
    lines = []
    for line in markdown.splitlines():
        for pattern in errors:
            match = pattern.search(line)
            if match:
                for group in sorted(range(1, len(match.groups()) + 1), key=match.start, reverse=True):
                    line = line[: match.start(group)] + " \x01 " + line[match.end(group):]
        lines.append(line)
    return [_spaced(run) for run in word_runs("\n".join(lines)) if not written_by(run, text)]


def _machine() -> str:
    """What ``report.machine()`` writes on an emulated CPU mesh (it builds its words from pieces: "emulated " +
    "CPU device" + "s"), whatever devices this process has."""
    import sys

    sys.path.insert(0, BENCHMARKS)
    try:
        import report
    finally:
        sys.path.remove(BENCHMARKS)
    return report.machine("8 emulated CPU devices")


def test_every_section_is_written_by_its_script():
    """BENCHMARKS.md's sections, and those of docs/ pages (a table a page shows, ``report.save_doc_table``)."""
    found = {}
    for page in ["BENCHMARKS.md"] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        found.update(sections(open(os.path.join(REPO, page), encoding="utf-8").read()))
    assert len(found) >= 10
    wrong = []
    for name, markdown in found.items():
        scripts = writer_of(name)
        assert scripts, f"BENCHMARKS.md section {name!r}: no script in benchmarks/ calls report.write({name!r}, ...)"
        assert os.path.join(BENCHMARKS, f"{name}.py") in scripts or len(scripts) == 1, (name, scripts)
        library = [path for script in scripts for path in imported_sources(script)]
        source = script_text(*scripts, *library, os.path.join(BENCHMARKS, "report.py"), rendered=(_machine(),))
        extra = handwritten(markdown, source, error_templates(*scripts))
        if extra:
            wrong.append(f"section {name!r} holds text {', '.join(map(os.path.basename, scripts))} does not write: "
                         f"{extra}")
    assert not wrong, ("BENCHMARKS.md and docs/:\n" + "\n".join(wrong) + "\nChange the script and rerun it with --update-docs "
                       "(text outside the markers is free). Words a program printed (an error message, a refusal) "
                       "belong in a code span, `like this`, which the check leaves alone.")


def test_a_hand_edited_section_is_caught():
    """The check above, on a section as its script wrote it and as a hand might change it."""
    script = os.path.join(BENCHMARKS, "chaos.py")
    source = script_text(script, os.path.join(BENCHMARKS, "report.py"), rendered=(_machine(),))
    written = ("`python benchmarks/chaos.py` on 2-core x86_64 host, 8 emulated CPU devices per run, Python 3.11.7, "
               "jax 0.10.2, 2026-12-02; 1940 s, load average 11.9 at the start (other jobs on the machine slow the "
               "runs and move where each fault lands); 2 trials at a time. 60-step runs of the default experiment "
               "(MLP width 64, checkpoints every 7 steps); launches are `--elastic 1` with heartbeat_seconds=10, "
               "watchdog_seconds=15, startup_seconds=40. A trial held when the run (rerun at most 3 times) ends with "
               "the uninterrupted run's batches exactly and its losses, final evaluation and every array of its final "
               "checkpoint bit for bit, or, where a restart changed the mesh, within rtol 1e-5 (one test example of "
               "accuracy). Steps lost: steps computed again after a restart (the membership records) or a rerun. Every "
               "trial: `benchmarks/logs/chaos.log`.\n\n"
               "| fault | trials | held | failed | bitwise / within tolerance (mesh changed) | reruns needed: 0 / 1 / 2+ "
               "| restarts by the launcher | steps lost: total (max) | hangs named |\n"
               "|---|---|---|---|---|---|---|---|---|\n"
               "| SIGKILL/SIGTERM to `dtx train` (1 process x 8) | 30 | 30 | 0 | 30 / 0 | 0 / 30 / 0 | 0 | 124 (13) | - |")
    assert handwritten(written, source) == []
    failed = (written + "\n\nFailed trials:\n\n| fault | seed | what happened |\n|---|---|---|\n"
              "| hang | 6000 | rank 0 sleeps before step 49: the hung rank was not named |")
    assert handwritten(failed, source) == []
    for edit, caught in [
        (written.replace("2026-12-02;", "2026-12-02 (the machine shared with other jobs);"),
         "the machine shared with other jobs"),
        (written.replace("rerun at most 3 times", "rerun at most twice"), "rerun at most twice"),
        (written.replace("| 124 (13) | - |", "| 124 (13) | - |\n\nAll trials held on a quiet machine."),
         "All trials held on a quiet machine"),
        (written.replace("(1 process x 8)", "(one process x 8)"), "one process x 8"),
    ]:
        assert handwritten(edit, source), f"not caught: {caught!r}"


def test_every_file_a_section_names_is_in_the_repository():
    """A section's figures, CSVs, logs and scripts (``docs/x.png``, ``benchmarks/logs/chaos.log``) are there."""
    for name, markdown in sections(open(os.path.join(REPO, "BENCHMARKS.md"), encoding="utf-8").read()).items():
        for path in re.findall(r"(?<![\w/.-])((?:benchmarks|docs|experiments|tests|dtx)/[\w./-]*\w\.\w+)", markdown):
            assert os.path.isfile(os.path.join(REPO, path)), f"BENCHMARKS.md section {name!r} names {path}, not here"


def test_an_exception_message_the_script_prints_is_a_value():
    """``benchmarks/step_breakdown.py`` writes a refused variant's error into its row: that text is the library's
    message, left alone; wording typed into the same row is still caught."""
    script = os.path.join(BENCHMARKS, "step_breakdown.py")
    source = script_text(script, os.path.join(BENCHMARKS, "report.py"))
    row = ("| strategy.name=onebit_adam | refused: strategy.name='onebit_adam' does the optimizer's Adam "
           "preconditioning itself, so optimizer.name='ada | | | | | |")
    assert handwritten(row, source, error_templates(script)) == []
    assert handwritten(row, source) != []  # without the template it would read as wording
    assert handwritten(row + "\n\nThe refusals above are expected.", source, error_templates(script))


# Sections written before report.py kept renderings, whose scripts keep no results file (only the section):
# no saved value can vouch for their numbers, so they are not held until their scripts are rerun with
# --update-docs (which writes benchmarks/logs/NAME.json, and the test then asks for the name to leave here).
_NO_RESULTS = "written before renderings were kept, and the script saves no results file (CSV, log) to check it by"
UNHELD = {
    "step_overhead": _NO_RESULTS,
    "default_run": _NO_RESULTS,
    "time_to_accuracy": _NO_RESULTS,
    "input_pipeline": _NO_RESULTS,
    "step_breakdown": _NO_RESULTS,
    "precision": _NO_RESULTS,
    "perfmodel_verify": _NO_RESULTS,
    "checkpoint_memory": _NO_RESULTS,
}

_NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?")


def all_sections() -> dict[str, tuple[str, str]]:
    """``{name: (page, markdown)}`` of every section of BENCHMARKS.md and of docs/*.md."""
    found = {}
    for page in ["BENCHMARKS.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))):
        for name, markdown in sections(open(os.path.join(REPO, page), encoding="utf-8").read()).items():
            assert name not in found, f"section {name!r} is on {found[name][0]} and on {page}"
            found[name] = (page, markdown)
    return found


def raw_numbers(value) -> list[float]:
    """Every number in a record's raw ``results`` (nested dicts and lists)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in raw_numbers(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in raw_numbers(v)]
    return []


def unheld_numbers(markdown: str, results) -> list[str]:
    """The numbers of ``markdown``'s table rows that no value of ``results`` gives, rounded to the digits shown."""
    values = raw_numbers(results)
    missing = []
    for line in markdown.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        for token in _NUMBER.findall(line):
            text = token.replace(",", "").replace("−", "-")
            digits = len(text.split(".")[1]) if "." in text else 0
            if not any(abs(round(v, digits) - float(text)) < 10 ** -(digits + 3) for v in values):
                missing.append(token)
    return missing


def rendering_problems(name: str, page: str, markdown: str, record: dict) -> list[str]:
    """What differs between section ``name`` as ``page`` shows it and ``record``, its script's last rendering."""
    problems = []
    if record.get("section") != name or record.get("page") != page:
        problems.append(f"benchmarks/logs/{name}.json is the rendering of {record.get('section')!r} on "
                        f"{record.get('page')}, not of {name!r} on {page}")
    if record.get("markdown") != markdown:
        shown, kept = markdown.splitlines(), str(record.get("markdown")).splitlines()
        line = next((i for i, (a, b) in enumerate(zip(shown, kept)) if a != b), min(len(shown), len(kept)))
        problems.append(f"section {name!r} on {page} is not what its script last wrote (benchmarks/logs/{name}.json); "
                        f"line {line + 1} reads {shown[line] if line < len(shown) else '(nothing)'!r}, the script "
                        f"wrote {kept[line] if line < len(kept) else '(nothing)'!r}")
    if record.get("results") is not None:
        missing = unheld_numbers(markdown, record["results"])
        if missing:
            problems.append(f"section {name!r}: numbers no raw result of benchmarks/logs/{name}.json gives: {missing}")
    if record.get("results_file") and not os.path.isfile(os.path.join(REPO, record["results_file"])):
        problems.append(f"benchmarks/logs/{name}.json names {record['results_file']}, not here")
    return problems


def test_every_section_is_its_scripts_last_rendering():
    """Each section, numbers included, is exactly what its script last wrote with ``--update-docs``."""
    found = all_sections()
    wrong = []
    for name, (page, markdown) in found.items():
        path = os.path.join(RENDERINGS, f"{name}.json")
        if not os.path.isfile(path):
            if name not in UNHELD:
                wrong.append(f"section {name!r} on {page}: no benchmarks/logs/{name}.json (its script's last rendering); "
                             "rerun the script with --update-docs")
            continue
        if name in UNHELD:
            wrong.append(f"section {name!r} is held now (benchmarks/logs/{name}.json): take it out of UNHELD")
        wrong += rendering_problems(name, page, markdown, json.load(open(path, encoding="utf-8")))
    for path in glob.glob(os.path.join(RENDERINGS, "*.json")):
        name = os.path.basename(path)[: -len(".json")]
        if name not in found:
            wrong.append(f"benchmarks/logs/{name}.json keeps section {name!r}, which no page shows")
    assert not set(UNHELD) - set(found), f"UNHELD names sections no page shows: {set(UNHELD) - set(found)}"
    assert not wrong, ("\n".join(wrong) + "\nA section's figures are its script's: rerun the script with --update-docs "
                       "(which rewrites the section and benchmarks/logs/NAME.json together) rather than edit them.")


def test_a_hand_edited_number_is_caught():
    """The check above, on calibration's section as its script wrote it and with one figure changed by hand."""
    record = {"section": "calibration", "page": "BENCHMARKS.md",
              "markdown": "| predicted step (sum) | measured step | predicted ÷ measured |\n|---|---|---|\n"
                          "| 95.33 ms | 87.47 ms | 1.090 |",
              "results": {"batch": 32, "predicted_step_ms": 95.32668, "measured_step_ms": 87.47073, "ratio": 1.08981}}
    assert rendering_problems("calibration", "BENCHMARKS.md", record["markdown"], record) == []
    edited = record["markdown"].replace("87.47 ms", "95.20 ms")
    assert rendering_problems("calibration", "BENCHMARKS.md", edited, record)  # differs from the rendering
    both = dict(record, markdown=edited)  # the rendering edited to match: the raw results still tell
    assert unheld_numbers(edited, both["results"]) == ["95.20"]
    assert rendering_problems("calibration", "BENCHMARKS.md", edited, both)
    assert rendering_problems("calibration", "docs/parallelism.md", record["markdown"], record)  # another page's
