"""Write a benchmark's results into BENCHMARKS.md, between its own markers.

Each benchmark owns one section, delimited by ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; running it again replaces that section and leaves the
rest of the file alone, so ``benchmarks/run_all.py`` can refresh every figure.
"""

from __future__ import annotations

import os
import re

BENCHMARKS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md")


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
