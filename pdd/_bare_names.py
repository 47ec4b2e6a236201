"""In a source checkout, the project's top-level folders never import under their bare names.

Why: pyproject maps ``kernels/`` to ``pdd.kernels``, ``engine/`` to ``pdd.engine`` and so on, so in a
checkout each folder is *also* a top-level package whenever the checkout's root is on ``sys.path``
(``python -m ...`` or ``python -c`` run from it, pytest's rootdir insertion). Some of those names are
real PyPI packages: transformers imports ``kernels`` when it is installed, and got ours instead
("cannot import name 'CUDAProperties' from 'kernels'"). So once ``pdd`` is imported, a finder placed
first on ``sys.meta_path`` resolves those bare names from every ``sys.path`` entry except the
checkout's root (and its own top-level folders, which ``python bench/NAME.py`` puts first): an
installed package of that name is found; otherwise the import fails, naming the ``pdd.`` name.
Installed from a wheel there is no checkout and nothing is installed.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

# Packages of the checkout that are imported under their bare names on purpose: the package itself,
# and the test suite (`from tests.helpers import ...`, run from the checkout).
IMPORTED_BARE = frozenset({"pdd", "tests"})


def checkout_root() -> Path | None:
    """The source checkout this package runs from (an editable install), or None (a wheel install)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "pdd" / "__init__.py").is_file() else None


def project_folders(root: Path) -> frozenset[str]:
    """Top-level packages of the checkout (folders with ``__init__.py``), those imported bare on purpose aside."""
    return frozenset(p.name for p in root.iterdir()
                     if (p / "__init__.py").is_file() and p.name.isidentifier() and p.name not in IMPORTED_BARE)


class BareNameGuard(MetaPathFinder):
    """Finds ``kernels``, ``engine``, ... anywhere on ``sys.path`` but in the checkout."""

    def __init__(self, root: Path, names: frozenset[str]):
        self.root = root
        self.names = names
        self.hidden = {root, *(root / name for name in names)}

    def _outside_checkout(self, entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() not in self.hidden
        except (OSError, RuntimeError):
            return True

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if path is not None or fullname not in self.names:
            return None  # a submodule, or a name that is not ours: the usual finders decide
        spec = PathFinder.find_spec(fullname, [e for e in sys.path if isinstance(e, str) and self._outside_checkout(e)])
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: PDD's {fullname}/ folder is the package 'pdd.{fullname}' and is not "
                f"importable as {fullname!r} (it would shadow a PyPI package of that name)", name=fullname)
        return spec


def install() -> None:
    """Put the guard first on ``sys.meta_path`` (once), when running from a checkout."""
    root = checkout_root()
    if root is None or any(isinstance(f, BareNameGuard) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, BareNameGuard(root, project_folders(root)))
