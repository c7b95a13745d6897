"""``dtx.models`` and ``dtx.experiments`` when dtx runs straight from a source checkout.

The repository keeps ``models/`` and ``experiments/`` beside ``dtx/``; ``pip install .`` and
``pip install -e .`` map them to ``dtx.models`` and ``dtx.experiments`` (``package-dir`` in
pyproject.toml), so dtx owns no top-level name but its own and a user's ``models`` or
``experiments`` package is never shadowed. Imported from a checkout without installing (tests run
from the repository root, ``PYTHONPATH=.``), nothing has made that mapping; this finder makes it,
for exactly those two names.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "experiments")
_NAMES = frozenset(f"dtx.{name}" for name in PACKAGES)


class _BesideFinder:
    """Finds ``dtx.<name>`` in ``<checkout>/<name>/``; appended to ``sys.meta_path``, so an installer's
    own mapping (the editable finder, or the real ``dtx/models`` of a wheel) answers first."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname not in _NAMES:
            return None
        # PathFinder looks the last component up in the given folder: dtx.models -> <root>/models/__init__.py,
        # and the spec keeps the full name, so submodules become dtx.models.mlp and so on.
        return importlib.machinery.PathFinder.find_spec(fullname, [_ROOT])


def install() -> None:
    """Add the finder once, and only in a checkout: a wheel holds ``dtx/models`` itself, and the folder
    above an installed dtx (site-packages) may hold someone else's top-level ``models``."""
    here = os.path.dirname(os.path.abspath(__file__))
    in_checkout = os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and not os.path.isdir(
        os.path.join(here, PACKAGES[0]))
    if in_checkout and _BesideFinder not in sys.meta_path:
        sys.meta_path.append(_BesideFinder)
