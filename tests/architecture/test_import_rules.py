"""The import rules of [tool.importlinter] in pyproject.toml, checked by import-linter, plus "no import circle"
and "long modules say why they are one module".

Why a symlink tree: import-linter (through grimp) finds the modules of `pdd` by walking the folder that
`importlib.util.find_spec("pdd")` names. On disk that folder, pdd/, holds only __init__.py; the subpackages
are sibling folders (services/, shared/, engine/, ...) mapped in by [tool.setuptools.package-dir], which
grimp never looks at. So each check builds, in a temporary folder, `pdd/` whose __init__.py and
subpackages are symlinks to the real files and folders, and runs import-linter in a subprocess with that
folder as its working directory (import-linter puts the working directory first on sys.path, ahead of the
editable install). The linted source is the real checkout, never a copy; grimp follows the symlinks.
A subprocess is needed anyway: in this process `pdd` is already imported from the editable install, and
find_spec would answer with that.

Run the linter by hand, with its usual output and options, through this file:
    .venv/bin/python tests/architecture/test_import_rules.py [--verbose] [--contract ID]
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
ROOT = "pdd"

# Modules longer than this must say in their docstring why they are one module.
MAX_LINES_WITHOUT_REASON = 400
REASON_PHRASE = "Why one module:"
SOURCE_FOLDERS = ("services", "shared", "engine", "transports", "kernels", "sim", "loadgen", "bench")


def _pyproject() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def _package_dirs() -> dict[str, Path]:
    """{subpackage name under pdd: its real folder} from [tool.setuptools.package-dir]."""
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    out: dict[str, Path] = {}
    for name, folder in mapping.items():
        parts = name.split(".")
        if parts[0] != ROOT or len(parts) == 1:
            continue
        assert len(parts) == 2, f"package-dir maps a nested package {name!r}; teach build_tree about it"
        real = REPO / folder
        if (real / "__init__.py").is_file():  # e.g. pdd.compose maps a folder of config files, no Python
            out[parts[1]] = real
    return out


def _mirror(link: Path) -> None:
    """Turn a symlinked folder into a real one whose entries are symlinks, so a file can be added to it."""
    if not link.is_symlink():
        return
    real = link.resolve()
    link.unlink()
    link.mkdir()
    for entry in real.iterdir():
        if entry.name != "__pycache__":
            (link / entry.name).symlink_to(entry)


def build_tree(dest: Path, extra_modules: Mapping[str, str] | None = None) -> Path:
    """Build dest/pdd/ out of symlinks to the real source; return dest (the folder to put first on sys.path).

    extra_modules: {path under pdd/, e.g. "shared/_probe.py": source}: files added to the tree only, or
    replacing a file's link there (the folders on their path become real folders of symlinks), to show
    that the checks catch a bad import. The real checkout is never written to.
    """
    pkg = dest / ROOT
    pkg.mkdir(parents=True)
    for entry in (REPO / ROOT).iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for sub, real in _package_dirs().items():
        (pkg / sub).symlink_to(real, target_is_directory=True)
    for rel, source in (extra_modules or {}).items():
        parts = Path(rel).parts
        folder = pkg
        for part in parts[:-1]:
            folder = folder / part
            _mirror(folder)
        target = folder / parts[-1]
        if target.is_symlink():
            target.unlink()
        target.write_text(source)
    return dest


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(COLUMNS="1000", NO_COLOR="1", TERM="dumb")  # one contract per line, no colour codes
    return env


def run_lint_imports(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the tree, with the contracts of the real pyproject.toml."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", *args, str(PYPROJECT)],
        check=False,
        cwd=tree,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


_GRAPH_SCRIPT = """
import json, sys
import grimp
graph = grimp.build_graph("pdd", cache_dir=None, exclude_type_checking_imports=True)
edges = []
for importer in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(importer)):
        details = graph.get_import_details(importer=importer, imported=imported) or [
            {"line_number": 0, "line_contents": "?"}]
        edges += [[importer, imported, d["line_number"], d["line_contents"]] for d in details]
json.dump({"modules": sorted(graph.modules), "edges": edges}, sys.stdout)
"""


def import_graph(tree: Path) -> tuple[set[str], list[tuple[str, str, int, str]]]:
    """(modules, direct imports as (importer, imported, line, line text)) of pdd in the tree, from grimp."""
    proc = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT],
        check=False,
        cwd=tree,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    return set(data["modules"]), [tuple(e) for e in data["edges"]]


def find_cycles(modules: set[str], edges: list[tuple[str, str, int, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself); Tarjan."""
    adj: dict[str, set[str]] = {m: set() for m in modules}
    for importer, imported, _, _ in edges:
        adj.setdefault(importer, set()).add(imported)
        adj.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, iter(sorted(adj[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adj[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in adj[node]:
                    cycles.append(sorted(component))
    return cycles


def describe_cycles(cycles: list[list[str]], edges: list[tuple[str, str, int, str]]) -> str:
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("import circle among: " + ", ".join(component))
        for importer, imported, line, text in edges:
            if importer in members and imported in members:
                lines.append(f"    {importer}:{line} -> {imported}    {text}")
    return "\n".join(lines)


def _contract_names() -> dict[str, str]:
    return {c["id"]: c["name"] for c in _pyproject()["tool"]["importlinter"]["contracts"]}


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory) -> Path:
    return build_tree(tmp_path_factory.mktemp("pdd_tree"))


def test_tree_holds_every_package(real_tree):
    packages = {p.split(".")[1] for p in _pyproject()["tool"]["setuptools"]["packages"] if p.count(".") >= 1}
    assert packages <= {p.name for p in (real_tree / ROOT).iterdir()}


def test_all_import_contracts_pass(real_tree):
    proc = run_lint_imports(real_tree)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"lint-imports found broken import rules:\n{out}"
    flat = _flat(out)
    for cid, name in _contract_names().items():
        assert f"{_flat(name)} KEPT" in flat, f"contract {cid!r} was not checked:\n{out}"


_FORBIDDEN_IMPORTS = {
    # A direct import: shared code reaching into the engine.
    "shared-imports-engine": (
        "shared/_import_rules_probe.py",
        "import pdd.engine\n",
        {"shared", "layers", "acyclic"},  # engine imports shared, so this also closes a circle
        "pdd.shared._import_rules_probe",
    ),
    # An indirect one: kv_layout imports torch, so the router may not import it.
    "router-imports-torch-through-shared": (
        "services/router/_import_rules_probe.py",
        "from pdd.shared.kv_layout import KVLayout\n",
        {"router"},
        "pdd.services.router._import_rules_probe",
    ),
    # A real role (a copy of relay.py with one line added) reaching for a launcher.
    "role-imports-launcher": (
        "services/relay.py",
        lambda: (REPO / "services" / "relay.py").read_text() + "\nimport pdd.services.launch.serve  # noqa\n",
        {"roles", "layers"},
        "pdd.services.relay -> pdd.services.launch.serve",
    ),
}


@pytest.mark.parametrize("case", sorted(_FORBIDDEN_IMPORTS))
def test_forbidden_import_breaks_its_contract(tmp_path, case):
    probe_path, probe_source, broken, mentioned = _FORBIDDEN_IMPORTS[case]
    if callable(probe_source):
        probe_source = probe_source()
    tree = build_tree(tmp_path, {probe_path: probe_source})
    proc = run_lint_imports(tree)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"lint-imports passed despite {probe_path}:\n{out}"
    flat = _flat(out)
    names = _contract_names()
    for cid in broken:
        assert f"{_flat(names[cid])} BROKEN" in flat, f"contract {cid!r} not reported broken:\n{out}"
    for cid in names.keys() - broken:
        assert f"{_flat(names[cid])} KEPT" in flat, f"contract {cid!r} should still be kept:\n{out}"
    assert mentioned in out, f"the report does not name the offending import:\n{out}"


def test_no_import_circle(real_tree):
    """No cycle among pdd's modules in the import graph.

    Counted: every import grimp sees, including those inside functions (a lazy import defers loading, but
    the dependency is still circular), as import-linter's own contracts do; left out: imports under
    `if TYPE_CHECKING:`, which never run.
    """
    modules, edges = import_graph(real_tree)
    assert {"pdd.shared.protocol", "pdd.services.router", "pdd.engine.engine"} <= modules  # graph not empty
    cycles = find_cycles(modules, edges)
    assert not cycles, describe_cycles(cycles, edges)


def test_import_circle_is_detected(tmp_path):
    tree = build_tree(
        tmp_path,
        {
            "shared/_cycle_probe_a.py": "from pdd.shared import _cycle_probe_b\n",
            "shared/_cycle_probe_b.py": "def f():\n    import pdd.shared._cycle_probe_a\n",
        },
    )
    modules, edges = import_graph(tree)
    cycles = find_cycles(modules, edges)
    assert cycles == [["pdd.shared._cycle_probe_a", "pdd.shared._cycle_probe_b"]]
    assert "pdd.shared._cycle_probe_b:2 -> pdd.shared._cycle_probe_a" in describe_cycles(cycles, edges)


def test_long_modules_say_why_they_are_one_module():
    missing = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text()
            n_lines = len(text.splitlines())
            if n_lines <= MAX_LINES_WITHOUT_REASON:
                continue
            docstring = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
            if REASON_PHRASE not in docstring:
                missing.append(f"{path.relative_to(REPO)} ({n_lines} lines)")
    assert not missing, (
        f"modules over {MAX_LINES_WITHOUT_REASON} lines need a sentence starting {REASON_PHRASE!r} in their "
        "module docstring (or a split):\n    " + "\n    ".join(missing)
    )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        tree = build_tree(Path(tmp))
        code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
        sys.exit(subprocess.call([sys.executable, "-c", code, *sys.argv[1:], str(PYPROJECT)], cwd=tree))
