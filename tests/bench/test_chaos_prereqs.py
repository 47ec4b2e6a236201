"""bench/chaos.py's up-front checks and kill_md's timing (issue #26).

- Prerequisites are checked before anything starts: a scenario that cannot run here (no `nft` for
  wan_cut_net in network namespaces, ...) is skipped and says why and how to get it, in its output and
  its last-line JSON, never reported as passed; when none of those asked for can run, the benchmark
  refuses within seconds (exit 2) instead of dying mid-run.
- kill_md kills a main decoder only once one holds requests while decoding (its /health), read and
  killed in one step; when none ever does, nothing is killed and the attempt is reported as not landed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdd.bench import chaos
from pdd.launch.local_cluster import LocalCluster
from pdd.launch.sites import LOCAL, NETNS
from pdd.shared.roles import Role

ONE_BOX = [n for n in chaos.SCENARIOS if n not in chaos.SITE_SCENARIOS]


def _path_without_nft(tmp_path: Path) -> str:
    """A PATH holding the other tools netns mode runs (ip, tc, sysctl), but no nft."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, _ in chaos.NETNS_TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_without_nft_wan_cut_net_alone_is_refused_in_seconds(tmp_path) -> None:
    env = {**os.environ, "PATH": _path_without_nft(tmp_path)}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.chaos", "--scenarios", "wan_cut_net", "--sites", NETNS,
                           "--run-dir", str(tmp_path / "run")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    took = time.monotonic() - t0
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert took < 30, took  # the check, not a started system
    assert "`nft`" in proc.stdout and "apt-get install nftables" in proc.stdout, proc.stdout
    assert "refused" in proc.stderr and "nothing started" in proc.stderr, proc.stderr
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line: one JSON object
    assert list(verdict) == ["wan_cut_net"]
    assert verdict["wan_cut_net"]["passed"] is False
    assert "apt-get install nftables" in verdict["wan_cut_net"]["skipped"]
    assert not (tmp_path / "run").exists()  # no model built, no cluster started


def test_only_the_scenarios_that_need_a_missing_tool_are_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", _path_without_nft(tmp_path))
    netns_ready = (os.geteuid() == 0 and all(shutil.which(t) for t, _ in chaos.NETNS_TOOLS)
                   and os.path.exists("/dev/net/tun"))  # all but nft
    everything = list(chaos.SCENARIOS)
    unmet = chaos.unmet_prerequisites(everything, NETNS)
    assert not set(unmet) & set(ONE_BOX)  # one box needs no network tools
    assert any("apt-get install nftables" in need for need in unmet["wan_cut_net"])
    # nats_kill_a/b need no nft: with the rest there they still run
    assert set(unmet) == ({"wan_cut_net"} if netns_ready else set(chaos.SITE_SCENARIOS))
    assert chaos.unmet_prerequisites(everything, LOCAL) == {}  # the fallback needs none of it

    fake_nft = tmp_path / "bin" / "nft"
    fake_nft.write_text("#!/bin/sh\nexit 0\n")
    fake_nft.chmod(0o755)
    unmet = chaos.unmet_prerequisites(everything, NETNS)
    assert not any("nft" in need for needs in unmet.values() for need in needs)
    assert unmet == {} if netns_ready else set(unmet) == set(chaos.SITE_SCENARIOS)


def test_a_skipped_scenario_is_never_passed() -> None:
    skipped = {"skipped": "missing `nft` ...: apt-get install nftables"}
    assert not chaos.scenario_ok(skipped)
    line = chaos.last_line({"wan_cut_net": skipped})
    assert line == {"wan_cut_net": {**skipped, "passed": False}}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_md_waits_for_main_decode_to_hold_requests(tmp_path, tiny_model) -> None:
    """Real processes: idle, no main decoder qualifies and none is killed; under kill_md's load the victim
    is a main decoder that held requests at the kill, and every request still ends identically."""
    args = chaos.parse_args(["--model", str(tiny_model), "--requests", "16", "--scenarios", "kill_md"])
    texts = chaos.prompts(args.requests, args.seed)

    async def go() -> dict:
        with LocalCluster(tmp_path / "run", chaos.build_config(args, tmp_path / "run")) as cluster:
            cluster.start(300)
            ended = threading.Event()
            t0 = time.monotonic()
            assert chaos.kill_when_holding(cluster, Role.MAIN_DECODE, 1, 3.0) == (None, 0)  # idle: times out
            assert time.monotonic() - t0 >= 3.0
            ended.set()
            assert chaos.kill_when_holding(cluster, Role.MAIN_DECODE, 1, 60.0, ended) == (None, 0)  # load over
            assert all(m.alive for m in cluster.members.values())
            ref = await chaos.run_load(cluster, texts, args, [None] * len(texts))
            reference = [r.tokens for r in ref]
            assert all(reference)
            return await chaos.scenario("kill_md", cluster, texts, reference, args)

    r = asyncio.run(go())
    assert r["killed"].startswith("md-") and r["killed"] not in r["alive"], r
    assert r["hit_in_flight"] >= max(1, len(texts) // 8) and r["fault_mid_stream"] is True, r
    assert r["total"] == r["completed"] == r["identical"] == len(texts), r
    assert (r["lost"], r["hung"], r["leaked_blocks"]) == (0, 0, 0), r
    assert r["migrated"] > 0, r
