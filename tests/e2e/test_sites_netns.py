"""Two sites, one nats-server each (services/launch/sites.py), in network namespaces joined by the
kernel WAN emulation (tbf + delay relay). Needs root: skipped with the reason otherwise.

- The layout: each server runs inside its site's namespace; site B's server is a leaf node of site
  A's across the WAN; clients need the token; messages cross in both directions.
- A network-level cut drops the leaf link (a message published in B never reaches A), and mending
  brings it back; ``kill -9`` of either site's server and a restart bring the link back too.
- `pdd up --sites netns` on the tiny model answers a P-MD request with main decode inside site B's
  namespace and everything else in site A's, and removes the namespaces when it stops.
- Without root, `--sites netns` is refused with a clear message (runs everywhere).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import pytest

from pdd.launch.natsserver import free_port
from pdd.launch.sites import NETNS, SITE_A, SITE_B, SitesError, TwoSites
from pdd.shared.bus import flush_barrier
from pdd.transports.wan_emulation import WanConfig

ROOT_SKIP = None if os.geteuid() == 0 else "needs root (network namespaces, TUN devices, tc, nft)"
root = pytest.mark.skipif(ROOT_SKIP is not None, reason=ROOT_SKIP or "")


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def _pid_netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


async def _crosses(sites: TwoSites, src: str, dst: str, wait_s: float) -> bool:
    """Whether a message published at site ``src`` reaches a subscriber at site ``dst`` within ``wait_s``
    (published again every 0.5 s: interest crosses the leaf link a moment after it comes up)."""
    sub_nc = await nats.connect(sites.nats_url(dst), token=sites.token, allow_reconnect=False)
    pub_nc = await nats.connect(sites.nats_url(src), token=sites.token, allow_reconnect=False)
    try:
        got = asyncio.Event()

        async def on_msg(_msg) -> None:
            got.set()

        subject = f"pdd.test.cross.{src}.{dst}.{time.monotonic_ns()}"
        await sub_nc.subscribe(subject, cb=on_msg)
        await flush_barrier(sub_nc)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not got.is_set():
            await pub_nc.publish(subject, b"x")
            await flush_barrier(pub_nc)
            try:
                await asyncio.wait_for(got.wait(), 0.5)
            except TimeoutError:
                pass
        return got.is_set()
    finally:
        await pub_nc.close()
        await sub_nc.close()


def _wait_leaf_gone(sites: TwoSites, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sites.leaf_links(SITE_B) == 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.root
@root
def test_leaf_link_crosses_the_wan_survives_a_cut_and_server_crashes(tmp_path) -> None:
    if shutil.which("nft") is None:
        pytest.skip("nft (Debian package nftables) is missing: the network-level WAN cut needs it")
    wan = WanConfig(rate="100mbit", delay="5ms", ns_a="pddt-sa", ns_b="pddt-sb", subnet="10.93.0")
    with TwoSites(tmp_path, NETNS, wan) as sites:
        for site, ns in ((SITE_A, wan.ns_a), (SITE_B, wan.ns_b)):
            assert _pid_netns_inode(sites.servers[site].pid) == _netns_inode(ns), f"{site}'s server not in {ns}"
        assert sites.wait_leaf(time.monotonic()) is not None, "site B never joined site A as a leaf node"
        with pytest.raises(Exception, match="(?i)authorization"):
            asyncio.run(nats.connect(sites.nats_url(SITE_A), allow_reconnect=False, max_reconnect_attempts=0))
        assert asyncio.run(_crosses(sites, SITE_B, SITE_A, 30))
        assert asyncio.run(_crosses(sites, SITE_A, SITE_B, 30))

        sites.cut()
        try:
            assert not asyncio.run(_crosses(sites, SITE_B, SITE_A, 3)), "a message crossed the cut WAN"
            assert _wait_leaf_gone(sites), "the leaf link outlived a cut WAN"
        finally:
            sites.mend()
        assert sites.wait_leaf(time.monotonic()) is not None, "the leaf link did not come back after the cut"
        assert asyncio.run(_crosses(sites, SITE_B, SITE_A, 30))

        for site in (SITE_A, SITE_B):
            server = sites.servers[site]
            sites.kill_nats(site)
            assert server.process.returncode == -signal.SIGKILL
            assert _wait_leaf_gone(sites) if site == SITE_A else sites.leaf_links(SITE_B) is None
            sites.start_nats(site)
            assert sites.wait_leaf(time.monotonic()) is not None, f"no leaf link after {site}'s server restarted"
            assert asyncio.run(_crosses(sites, SITE_B, SITE_A, 30))
    assert wan.ns_a not in _namespaces() and wan.ns_b not in _namespaces()


@pytest.mark.root
@pytest.mark.timeout(900)  # four engines starting on a shared 2-core box
@root
def test_pdd_up_sites_netns_serves_across_the_two_namespaces(tiny_model, tmp_path) -> None:
    if "pdd-site-a" in _namespaces():
        pytest.skip("another `pdd up --sites netns` holds the namespaces pdd-site-a/pdd-site-b")
    port = free_port()
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "pdd.launch.cli", "up", "--sites", "netns", "--model",
                             str(tiny_model), "--port", str(port), "--run-dir", str(run_dir), "--wan",
                             "rate=200mbit,delay=5ms", "--startup-timeout", "700"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "ready: OpenAI API" in line or "not healthy" in line:
                break
        assert any("ready: OpenAI API" in line for line in lines), "".join(lines)
        url = next(line for line in lines if "ready: OpenAI API" in line).split("OpenAI API ")[1].split()[0]
        url = url.removesuffix("/v1")
        assert url.startswith("http://10.87.0.1:"), url  # site A's address, reached over its access link
        pids = {line.split()[4]: int(line.split("pid=")[1]) for line in lines if "] started " in line}
        for iid, pid in pids.items():
            ns = "pdd-site-b" if iid.startswith("main-decode") else "pdd-site-a"
            assert _pid_netns_inode(pid) == _netns_inode(ns), f"{iid} runs outside {ns}"
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": "alpha beta gamma delta", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "pdd": {"pipeline": "P-MD"}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["pdd"]["pipeline"] == "P-MD"
        assert reply.json()["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert "stopped" in out, "".join(lines) + out
    assert "pdd-site-a" not in _namespaces() and "pdd-site-b" not in _namespaces()


def test_sites_netns_without_root_is_refused_clearly(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SitesError, match="needs root"):
        TwoSites(tmp_path, NETNS)
    from pdd.launch.cli import main

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert main(["up", "--sites", "netns", "--port", str(free_port()), "--run-dir", str(tmp_path / "run")]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert "--sites netns needs root" in err, err
    assert not Path(tmp_path / "run" / "pdd.yaml").exists()  # refused before anything started
