"""Every config key with its default and meaning: ``dtx config [PREFIX ...]``.

The meanings are the comments of :func:`dtx.config.defaults.base_config` — the one table of defaults every
experiment starts from, so the listing cannot drift from what a run reads: a key's own end-of-line comment, else
the comment block just above it, else the comment above its block (``c.pipeline = ConfigDict()``).
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Sequence

from dtx.config import defaults

_ASSIGNMENT = re.compile(r"^\s*c\.([\w.]+)\s*=\s*(.*?)\s*(?:#\s*(.*))?$")


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def meanings() -> dict[str, str]:
    """``key -> meaning``, read from :func:`~dtx.config.defaults.base_config`'s comments (module docstring)."""
    above, blocks, found = [], {}, {}
    for line in inspect.getsource(defaults.base_config).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").rstrip())
            continue
        match = _ASSIGNMENT.match(line)
        if not match:
            above = [] if not stripped else above
            continue
        key, value, comment = match.groups()
        text = comment or " ".join(above)
        if value.startswith("ConfigDict("):
            blocks[key] = text
        else:
            found[key] = text
        above = []
    for key in list(found):  # a key without its own comment: its block's
        block = key.rpartition(".")[0]
        found[key] = found[key] or blocks.get(block, "")
    return {**{f"{block}.*": text for block, text in blocks.items()}, **found}


def table(prefixes: Sequence[str] = ()) -> list[tuple[str, object, str]]:
    """``(key, default, meaning)`` of every key of the base config (or those under ``prefixes``), in its order."""
    values = _flat(defaults.base_config().to_dict())
    known = meanings()
    chosen = [k for k in values if not prefixes or any(k == p or k.startswith(p.rstrip(".") + ".") for p in prefixes)]
    def meaning(key: str) -> str:  # its own, else the nearest enclosing block's (a block set as a whole: model)
        parts = key.split(".")
        return known.get(key) or next((known.get(".".join(parts[:n]) + ".*") for n in range(len(parts) - 1, 0, -1)
                                       if known.get(".".join(parts[:n]) + ".*")), "")
    return [(key, values[key], meaning(key)) for key in chosen]


def config_main(argv: Sequence[str]) -> int:
    """``dtx config [PREFIX ...]``: print each key, its default and its meaning; exit 2 for a prefix no key has."""
    parser = argparse.ArgumentParser(prog="dtx config", description="List every config key (--config.KEY=VALUE) "
                                     "with its default and meaning, from dtx.config.defaults.")
    parser.add_argument("prefixes", nargs="*", help="only these keys or blocks, e.g. optimizer pipeline.schedule")
    args = parser.parse_args(argv)
    rows = table(args.prefixes)
    if not rows:
        from difflib import get_close_matches

        close = get_close_matches(args.prefixes[0], [k for k, _, _ in table()] + sorted(
            {k.split(".")[0] for k, _, _ in table()}), n=1)
        parser.error(f"no config key under {' '.join(args.prefixes)}" + (f" (did you mean {close[0]!r}?)" if close
                                                                          else ""))
    for key, value, meaning in rows:
        print(f"{key} = {value!r}" + (f"\n    {meaning}" if meaning else ""))
    return 0
