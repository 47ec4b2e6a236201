"""No project folder shadows an installed package, whatever the working directory.

All importable code lives under ``src/pdd/`` (the src layout), so the checkout's root holds no package but the
test suite: running anything from the checkout, with its root first on ``sys.path`` (``python -c``, ``-m``,
pytest's rootdir insertion, ``PYTHONPATH``), never imports one of PDD's folders under a bare name. ``kernels``
is a real PyPI package that transformers imports; PDD's kernels are ``pdd.kernels`` only. `pdd up` answering
from the checkout beside stand-ins for those names: tests/e2e/test_up_lifetime.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pdd

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(pdd.__file__).resolve().parent


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def subpackage_names() -> list[str]:
    """PDD's own subpackages (``engine``, ``kernels``, ...): the names a careless layout would expose bare."""
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def make_stand_ins(where: Path) -> dict[str, str]:
    """A stand-in package for every subpackage name without a real distribution; name -> its folder."""
    made = {}
    for name in subpackage_names():
        if installed(name):
            continue
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text("STAND_IN = True\n")
        made[name] = str(where / name)
    return made


def test_the_package_lives_under_src_and_the_root_holds_only_the_test_suite() -> None:
    assert PACKAGE == ROOT / "src" / "pdd", PACKAGE
    importable = {p.stem for p in ROOT.iterdir()
                  if (p.is_dir() and (p / "__init__.py").is_file()) or (p.is_file() and p.suffix == ".py")}
    assert importable == {"tests"}, importable
    for name in ("engine", "kernels", "router", "roles", "launch", "shared", "transports", "sim", "bench"):
        assert name in subpackage_names()


PROBE = """
import importlib, json, sys
import pdd.launch.serve  # what a service imports first
import transformers.activations  # imports the PyPI package `kernels` (transformers >= 5.25)
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = getattr(importlib.import_module(name), "__file__", None)
    except ImportError:
        out[name] = None
print(json.dumps(out))
"""


def test_from_the_checkout_every_bare_name_is_an_installed_package_or_nothing(tmp_path) -> None:
    """The checkout's root first on PYTHONPATH, then stand-ins: the worst ``sys.path`` we can give."""
    stand_ins = make_stand_ins(tmp_path / "site")
    names = subpackage_names()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(names)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        if name in stand_ins:
            assert where[name] and where[name].startswith(stand_ins[name]), (name, where[name])
        elif where[name] is not None:  # a real distribution of that name, installed
            assert "site-packages" in where[name] and PACKAGE not in Path(where[name]).resolve().parents, \
                (name, where[name])
    if installed("kernels"):  # the real one transformers needs
        assert "site-packages" in where["kernels"], where["kernels"]
