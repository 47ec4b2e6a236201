"""Every benchmark starts the one documented way, from the repo root and from elsewhere:
`python -m pdd.bench.NAME --help` exits 0 with a usage text (and runs nothing: --help parses the arguments
before any heavy import or work)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(p.stem for p in (ROOT / "src" / "pdd" / "bench").glob("*.py") if p.stem != "__init__")


def _help(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv, "--help"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def test_every_bench_is_listed():
    assert {"pipelines", "chaos", "soak", "calibration_holdout"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_help_from_anywhere(name, tmp_path):
    runs = {where: (["-m", f"pdd.bench.{name}"], cwd) for where, cwd in (("root", ROOT), ("elsewhere", tmp_path))}
    with ThreadPoolExecutor(len(runs)) as pool:
        done = dict(zip(runs, pool.map(lambda a: _help(*a), runs.values())))
    for key, proc in done.items():
        assert proc.returncode == 0, (key, proc.stdout[-2000:], proc.stderr[-2000:])
        assert proc.stdout.lstrip().startswith("usage:"), (key, proc.stdout[:500])
