"""The import rules of [tool.importlinter] in pyproject.toml, checked by the plain `lint-imports` command from the
repository root (the src layout: `pdd` is src/pdd, found through the install), plus "no import circle", "long
modules say why they are one module" and "functions stay short".

A forbidden import is shown to break its contract on a copy of the package with a probe file added, linted
from the copy's parent folder (import-linter puts the working directory first on sys.path, ahead of the
install); the checkout is never written to.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "pdd"
PYPROJECT = REPO / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

# Modules longer than this must say in their docstring why they are one module.
MAX_LINES_WITHOUT_REASON = 400
REASON_PHRASE = "Why one module:"
MAX_FUNCTION_LINES = 150
# Functions allowed past MAX_FUNCTION_LINES, each with why (docs/ARCHITECTURE.md says the same).
LONG_FUNCTIONS: dict[str, str] = {}


def _pyproject() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def copy_tree(dest: Path, extra_modules: Mapping[str, str] | None = None) -> Path:
    """dest/pdd: a copy of the package, plus ``extra_modules`` ({path under pdd/: source}, added or replacing a
    file) to show that the checks catch a bad import; returns dest (the folder to lint from)."""
    shutil.copytree(PACKAGE, dest / "pdd", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    for rel, source in (extra_modules or {}).items():
        target = dest / "pdd" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    return dest


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(COLUMNS="1000", NO_COLOR="1", TERM="dumb")  # one contract per line, no colour codes
    return env


def run_lint_imports(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The plain `lint-imports` command run in ``where``, with the contracts of the real pyproject.toml."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(PYPROJECT), *args],
        check=False,
        cwd=where,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
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


def test_all_import_contracts_pass():
    proc = run_lint_imports(REPO)  # as CI runs it
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
        "router/_import_rules_probe.py",
        "from pdd.shared.kv_layout import KVLayout\n",
        {"router"},
        "pdd.router._import_rules_probe",
    ),
    # A real role (a copy of relay.py with one line added) reaching for a launcher.
    "role-imports-launcher": (
        "roles/relay.py",
        lambda: (PACKAGE / "roles" / "relay.py").read_text() + "\nimport pdd.launch.serve  # noqa\n",
        {"roles", "layers"},
        "pdd.roles.relay -> pdd.launch.serve",
    ),
    # A role naming a backend: it must go through engine/interface.py's load_engine.
    "role-imports-a-backend": (
        "roles/relay.py",
        lambda: (PACKAGE / "roles" / "relay.py").read_text() + "\nimport pdd.engine.torch_backend.engine  # noqa\n",
        {"roles-engine"},
        "pdd.roles.relay -> pdd.engine.torch_backend.engine",
    ),
    # One backend reaching into another.
    "backend-imports-a-backend": (
        "engine/emulated_backend/_probe.py",
        "import pdd.engine.torch_backend.sampling\n",
        {"backends"},
        "pdd.engine.emulated_backend._probe -> pdd.engine.torch_backend.sampling",
    ),
}


@pytest.mark.parametrize("case", sorted(_FORBIDDEN_IMPORTS))
def test_forbidden_import_breaks_its_contract(tmp_path, case):
    probe_path, probe_source, broken, mentioned = _FORBIDDEN_IMPORTS[case]
    if callable(probe_source):
        probe_source = probe_source()
    tree = copy_tree(tmp_path, {probe_path: probe_source})
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


def test_no_import_circle():
    """No cycle among pdd's modules in the import graph.

    Counted: every import grimp sees, including those inside functions (a lazy import defers loading, but
    the dependency is still circular), as import-linter's own contracts do; left out: imports under
    `if TYPE_CHECKING:`, which never run.
    """
    modules, edges = import_graph(REPO)
    assert {"pdd.shared.protocol", "pdd.router", "pdd.engine.torch_backend.engine"} <= modules  # graph not empty
    cycles = find_cycles(modules, edges)
    assert not cycles, describe_cycles(cycles, edges)


def test_import_circle_is_detected(tmp_path):
    tree = copy_tree(
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


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_long_modules_say_why_they_are_one_module():
    missing = []
    for path in _sources():
        text = path.read_text()
        n_lines = len(text.splitlines())
        if n_lines <= MAX_LINES_WITHOUT_REASON:
            continue
        docstring = ast.get_docstring(ast.parse(text, filename=str(path))) or ""
        if REASON_PHRASE not in docstring:
            missing.append(f"{path.relative_to(PACKAGE)} ({n_lines} lines)")
    assert not missing, (
        f"modules over {MAX_LINES_WITHOUT_REASON} lines need a sentence starting {REASON_PHRASE!r} in their "
        "module docstring (or a split):\n    " + "\n    ".join(missing)
    )


def test_functions_stay_short():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n_lines = node.end_lineno - node.lineno + 1
                if n_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n_lines
    assert set(long) <= set(LONG_FUNCTIONS), f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    assert set(LONG_FUNCTIONS) <= set(long), "a listed long function is short now: drop it from LONG_FUNCTIONS"


if __name__ == "__main__":
    sys.exit(subprocess.call([str(LINT_IMPORTS), "--config", str(PYPROJECT), *sys.argv[1:]], cwd=REPO))
