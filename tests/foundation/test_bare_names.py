"""No project folder shadows an installed package, whatever ``sys.path`` holds (pdd/_bare_names.py).

The checkout's top-level folders (``kernels/``, ``engine/``, ...) are the packages ``pdd.kernels``,
``pdd.engine``, ...; transformers imports the PyPI package ``kernels``. Here a process started the way
launchers start services (``python -P``, ``child_env``) runs from the checkout with the checkout's
root *first on PYTHONPATH* (which ``-P`` does not remove), beside a stand-in distribution for every
folder name that has no real one installed: each bare name must resolve to the installed package,
never to the checkout, and ``import transformers.activations`` (which imports ``kernels``) must work.
`pdd up` answering in that setting: tests/e2e/test_up_lifetime.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdd._bare_names import checkout_root, project_folders
from pdd.services.launch.children import child_env, serve_argv

ROOT = checkout_root()
pytestmark = pytest.mark.skipif(ROOT is None, reason="installed from a wheel: no checkout to shadow anything")


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def make_stand_ins(where: Path) -> dict[str, str]:
    """A stand-in package for every project folder name without a real distribution; name -> its folder."""
    made = {}
    for name in sorted(project_folders(ROOT)):
        if installed(name):
            continue
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text("STAND_IN = True\n")
        made[name] = str(where / name)
    return made


def shadow_env(stand_ins: Path) -> dict[str, str]:
    """The checkout's root first on PYTHONPATH, then the stand-ins: the worst ``sys.path`` we can give."""
    return child_env({"PYTHONPATH": f"{ROOT}:{stand_ins}"})


PROBE = """
import importlib, json, sys
import pdd.services.launch.serve  # what a service imports first
import transformers.activations  # imports the PyPI package `kernels` (transformers >= 5.25)
names = json.loads(sys.argv[1])
print(json.dumps({name: getattr(importlib.import_module(name), "__file__", None) for name in names}))
"""


def test_the_guard_knows_every_top_level_package_of_the_checkout() -> None:
    names = project_folders(ROOT)
    for expected in ("kernels", "engine", "shared", "services", "transports", "bench", "sim", "loadgen"):
        assert expected in names
    assert "pdd" not in names and "tests" not in names


def test_a_service_process_imports_installed_packages_not_the_checkouts_folders(tmp_path) -> None:
    stand_ins = make_stand_ins(tmp_path / "site")
    names = sorted(project_folders(ROOT))
    python = serve_argv("router", "unused.yaml", "unused")[:2]  # the interpreter and flags a service runs with
    proc = subprocess.run([*python, "-c", PROBE, json.dumps(names)], cwd=ROOT, env=shadow_env(tmp_path / "site"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        found = Path(where[name]).resolve()
        assert ROOT / name not in found.parents, (name, found)
        if name in stand_ins:
            assert str(found).startswith(stand_ins[name]), (name, found)
    if installed("kernels"):  # the real one transformers needs; not the checkout's kernels/
        assert "site-packages" in where["kernels"], where["kernels"]


def test_a_bare_name_with_nothing_installed_fails_naming_the_pdd_package() -> None:
    """From the checkout, with its root first on sys.path: `import engine` never yields PDD's engine/."""
    code = "import pdd\ntry:\n    import engine\nexcept ModuleNotFoundError as exc:\n    print(exc)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env({"PYTHONPATH": str(ROOT)}), check=False)
    assert proc.returncode == 0, proc.stderr
    if installed("engine"):
        pytest.skip("a distribution named 'engine' is installed here")
    assert "'pdd.engine'" in proc.stdout, proc.stdout


def test_a_benchmark_run_as_a_file_imports_no_sibling_under_a_bare_name(tmp_path) -> None:
    """`python bench/NAME.py` puts bench/ first on sys.path: `engine` must still not be bench/engine.py."""
    code = (f"import sys\nsys.path.insert(0, {str(ROOT / 'bench')!r})\nimport pdd\ntry:\n    import engine\n"
            f"    print(engine.__file__)\nexcept ImportError as exc:\n    print('refused', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "refused" in proc.stdout or installed("engine"), proc.stdout
