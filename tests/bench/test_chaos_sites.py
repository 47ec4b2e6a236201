"""The chaos scenarios on two sites (bench/chaos.py: nats_kill_a, nats_kill_b, wan_cut_net) on the tiny model.

Each runs a real system of processes with one nats-server per site (site B's a leaf node of site A's):
in network namespaces with the kernel WAN when root, and in the no-root fallback (two servers on this
box) everywhere. Every request must complete with the undisturbed run's exact tokens, none lost, hung
or leaking KV; the leaf link must come back; the fallback must say it is one.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from pdd.bench import chaos
from pdd.launch.sites import LOCAL, NETNS, SITE_A, SITE_B, TwoSites

ROOT_SKIP = None if os.geteuid() == 0 else "needs root (network namespaces, TUN devices, tc, nft)"


def test_site_scenarios_are_in_the_default_run_and_take_a_layout() -> None:
    args = chaos.parse_args([])
    assert {"nats_kill_a", "nats_kill_b", "wan_cut_net"} <= set(args.scenarios)
    assert args.sites == "auto"
    assert chaos.parse_args(["--sites", LOCAL, "--scenarios", "nats_kill_b"]).scenarios == ["nats_kill_b"]
    with pytest.raises(SystemExit):
        chaos.parse_args(["--sites", "cloud"])


def test_place_points_each_site_at_its_own_server(tmp_path) -> None:
    sites = TwoSites(tmp_path, LOCAL)
    config = {"instances": [{"id": "router-0", "role": "router", "site": SITE_A},
                            {"id": "md-0", "role": "main-decode", "site": SITE_B}], "nats": {"user": "u"}}
    sites.place(config)
    assert config["nats"] == {"url": sites.nats_url(SITE_A), "token": sites.token}
    assert sites.env(SITE_B)["PDD__NATS__URL"] == sites.nats_url(SITE_B) != sites.nats_url(SITE_A)
    assert sites.prefix(SITE_A) == sites.prefix(SITE_B) == []
    assert not sites.can_cut


def _run(tmp_path, layout: str) -> dict:
    args = chaos.parse_args(["--requests", "8", "--max-tokens", "24", "--scenarios", ",".join(chaos.SITE_SCENARIOS),
                             "--sites", layout, "--nats-down-s", "3", "--wan-cut-s", "10", "--run-dir", str(tmp_path)])
    return asyncio.run(chaos.run(args))


def _check(report: dict) -> None:
    assert set(report) == set(chaos.SITE_SCENARIOS)
    for name, r in report.items():
        assert r["total"] == r["completed"] == r["identical"] == 8, (name, r)
        assert (r["lost"], r["hung"], r["leaked_blocks"]) == (0, 0, 0), (name, r)
        assert r["leaf_reconnect_s"] is not None, (name, r)  # both ends hold the leaf link again
        assert "finished_locally" in r, (name, r)
    for name in ("nats_kill_a", "nats_kill_b"):
        assert report[name]["killed"].endswith("(kill -9)") and report[name]["serving_again_s"] is not None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_site_scenarios_fallback_two_servers_on_one_box(tmp_path) -> None:
    report = _run(tmp_path, LOCAL)
    _check(report)
    assert report["wan_cut_net"]["cut"].startswith("FALLBACK")


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(1200)
@pytest.mark.skipif(ROOT_SKIP is not None, reason=ROOT_SKIP or "")
def test_site_scenarios_in_network_namespaces(tmp_path) -> None:
    report = _run(tmp_path, NETNS)
    _check(report)
    cut = report["wan_cut_net"]
    assert cut["cut"].startswith("network") and cut["leaf_dropped"] is True, cut
