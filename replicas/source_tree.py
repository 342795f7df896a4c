"""Installed distributions ahead of megaserve's own folders of the same names.

In a checkout installed with `pip install -e .`, megaserve's packages are the top-level folders
`deploy/`, `router/`, `replicas/`, `kernels/` and `monitoring/`, mapped into the `megaserve`
namespace. Wherever the checkout's root is on sys.path, those folders are top-level packages as
well, and hide installed distributions of the same names: Python (`python -m`) and pytest put the
working directory there, and Ray puts the driver's working directory first on every worker's
sys.path, so a `megaserve up` started in the checkout gives every replica that root. transformers
(5.25 on) depends on Hugging Face's `kernels` distribution and imports it; SGLang imports
transformers, and would get megaserve's kernels/ folder instead.

`import_installed_namesakes()` imports each such distribution from where it is installed, before
anything else imports the name, so that sys.modules holds it for every later import, and moves the
root behind every other sys.path entry, so that processes this one spawns (SGLang starts its
scheduler with multiprocessing's spawn, which copies sys.path, not sys.modules) find the
distributions first too. megaserve's own imports go through its install's finder, not that entry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

# The checkout's root in an editable install (site-packages/megaserve in a regular one, which is
# never on sys.path), and megaserve's folders in it.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_FOLDERS = ("deploy", "router", "replicas", "kernels", "monitoring")

log = logging.getLogger(__name__)


def _is_root(entry: str, root: Path) -> bool:
    return Path(entry or os.curdir).resolve() == root


def import_installed_namesakes(root: Path = SOURCE_ROOT) -> list[str]:
    """Import the installed distribution's module of each of megaserve's folder names that `root`,
    where it is on sys.path, would hide, and leave `root` last on sys.path; returns their names
    (none where `root` is not on sys.path, which is then left as it is).
    A distribution that fails to import is left out with a warning: its importers fail as they would
    anyway, and an SGLang replica does not fail for a package it never uses."""
    if not any(_is_root(entry, root) for entry in sys.path):
        return []
    installed = importlib.metadata.packages_distributions()
    shadowed = [name for name in PACKAGE_FOLDERS if name in installed and (root / name / "__init__.py").is_file()]
    imported, at_root = shadowed[:], [entry for entry in sys.path if _is_root(entry, root)]
    sys.path[:] = [entry for entry in sys.path if not _is_root(entry, root)]
    try:
        for name in shadowed:
            module = sys.modules.get(name)
            if module is not None and Path(module.__file__ or "").resolve().parent == root / name:
                del sys.modules[name]  # imported from the folder already: import the distribution instead
            try:
                importlib.import_module(name)
            except Exception as error:  # noqa: BLE001 - a third party's import, reported and skipped
                log.warning("the installed %r (%s) does not import: %s", name, ", ".join(installed[name]), error)
                imported.remove(name)
    finally:
        sys.path.extend(at_root)
    return imported
