"""The folder ``dtx export`` writes, whole or not at all.

Its files are written into a temporary sibling folder (``.<name>.partial-<pid>``) that is renamed into
place once every file is on disk, so a process killed mid-export leaves no half-written export; and
``dtx export`` ignores SIGTERM from that rename on (:func:`dtx._sigterm.publishing`), so a signal on its
way out cannot turn a finished export into exit 143. A
folder that holds an incomplete one (written by an older dtx, or by hand) is said so and replaced; a
complete export is never overwritten. ``model.json`` names the SHA-256 of ``variables.msgpack``:
that is what "complete" means.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys

from dtx import _sigterm

VARIABLES_FILE, MODEL_FILE, SOURCE_FILE = "variables.msgpack", "model.json", "model.py"
EXPORT_FILES = (VARIABLES_FILE, MODEL_FILE, SOURCE_FILE)


def check_free(out: str) -> str | None:
    """Refuse an ``out`` that is a file, holds a complete export or holds other files; return why an
    incomplete export there will be replaced (``None``: nothing there)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out!r} is a file; name a directory (it is created if missing)")
    if not os.path.isdir(out):
        return None
    names = sorted(os.listdir(out))
    others = [name for name in names if name not in EXPORT_FILES]
    if others:
        raise FileExistsError(f"--out {out!r} holds other files ({', '.join(others[:3])}"
                              f"{' ...' if len(others) > 3 else ''}); name an empty or new directory")
    why = incomplete(out) if names else None
    if names and why is None:
        raise FileExistsError(f"--out {out!r} already holds a complete export ({MODEL_FILE}, {VARIABLES_FILE}); "
                              "choose an empty or new directory (dtx never overwrites an export)")
    return why


def incomplete(out: str) -> str | None:
    """What is missing from the export in ``out`` (``None``: it is complete)."""
    try:
        with open(os.path.join(out, MODEL_FILE), encoding="utf-8") as f:
            described = json.load(f)
        expected = described["variables_sha256"]
    except FileNotFoundError:
        return f"no {MODEL_FILE}"
    except (ValueError, KeyError, TypeError):
        return f"{MODEL_FILE} is truncated or garbled"
    try:
        with open(os.path.join(out, VARIABLES_FILE), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return f"no {VARIABLES_FILE}"
    if digest != expected:
        return f"{VARIABLES_FILE} is not the one {MODEL_FILE} names (truncated?)"
    if described.get("source") and not os.path.exists(os.path.join(out, described["source"])):
        return f"no {described['source']}"
    return None


def write(out: str, files: dict[str, bytes], replacing: str | None = None) -> None:
    """Write ``files`` (name -> bytes) as the folder ``out``: all of them, or none.

    ``replacing``: :func:`check_free`'s answer; the incomplete export there is removed only once the
    new one is whole on disk.
    """
    out = os.path.abspath(out)
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".{glob.escape(name)}.partial-*")):
        if not _alive(stale.rsplit("-", 1)[-1]):  # a killed export's temporary: nothing of it was published
            shutil.rmtree(stale, ignore_errors=True)
    temporary = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    os.makedirs(temporary)
    try:
        for filename, content in files.items():
            with open(os.path.join(temporary, filename), "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        if replacing is not None:
            print(f"dtx: --out {out} holds an incomplete export ({replacing}); replacing it", file=sys.stderr)
            shutil.rmtree(out)
        # Onto nothing, or onto an empty folder: atomic either way. In dtx export, a SIGTERM from here on can no
        # longer stop anything: once the folder is in place the command has succeeded, and exits 0.
        with _sigterm.publishing():
            os.rename(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
