"""Write a benchmark's results into BENCHMARKS.md, between its own markers.

Each benchmark owns one section, delimited by ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; running it again replaces that section and leaves the
rest of the file alone, so ``benchmarks/run_all.py`` can refresh every figure.
Text outside the markers (analysis, runs on other machines) is written by hand.
"""

from __future__ import annotations

import os
import platform
import re
import textwrap
import time

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


def write(name: str, preamble: str, body: str, width: int = 110) -> None:
    """Section ``name``: ``preamble`` (what was run, where, how) wrapped at ``width``, then ``body`` (tables)."""
    update_section(name, textwrap.fill(preamble, width, break_long_words=False, break_on_hyphens=False)
                   + "\n\n" + body.strip())


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
