"""Two sites with one NATS each: site A and site B, their nats-servers joined by a leaf-node link.

Placement (one decision, used by `pdd up --sites netns` and the chaos scenarios):
- **site A**: nats-server A (the leaf-node hub), router, prefill, relay. The router sits beside prefill
  because a client's request must still be answered when the WAN is gone: prefill and the relay then
  finish it without anything crossing the WAN.
- **site B**: nats-server B (the leaf node, dialling A across the WAN), main decode.

Two modes:
- ``netns`` (root): each site is a network namespace; the emulated WAN between them is
  ``transports/wan_emulation.py`` (tbf rate + user-space delay relay, as `pdd wan`). Every process of a
  site runs inside its namespace (``ip netns exec``) and binds the site's WAN address, so the leaf
  link, KV (zmq) and every cross-site message go over the emulated link, and ``cut()`` drops them all.
  The host reaches each site over its own "access" veth pair (router API, /health, nats monitoring):
  a site routes only that /30 back to the host, so no cross-site packet can bypass the WAN.
- ``local`` (no root): two nats-servers on this box, leaf-linked over loopback; the WAN is the
  in-process shaper as in one-box mode. Crashing one site's NATS is still real; a network-level
  cut is not available (``can_cut`` is False).

Both servers take a token for their clients (the services' ``nats.token``) and a generated
user/password on the leaf link (nats-server's leafnode authorization has no bare token).
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Self

from pdd.launch.local_cluster import LocalCluster
from pdd.launch.natsserver import LeafLink, NatsServer, free_port, start_nats_server
from pdd.transports.wan_emulation import WanConfig, WanEmulation, WanError, require_root

SITE_A, SITE_B = "site-a", "site-b"  # the site names in the config (`sites`, each instance's `site`)
NETNS, LOCAL = "netns", "local"
CLIENT_PORT, LEAF_PORT, MONITOR_PORT = 4222, 7422, 8222  # in netns mode: on each site's own address
PING_INTERVAL_S = 2  # a silent leaf link is dropped after 2 missed pings (~4-6 s), then redialled every 1 s


class SitesError(RuntimeError):
    """The two-site layout cannot be built here (not root, namespaces taken, a command failed)."""


def _sh(*argv: str, check: bool = True) -> None:
    proc = subprocess.run(argv, check=False, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SitesError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


class TwoSites:
    """Builds, crashes, cuts and tears down the two sites and their nats-servers.

    ``wan``: the kernel WAN (netns mode; its ``ns_a``/``ns_b``/``subnet`` name the namespaces and the
    WAN /24). The access links use the next two /24s (subnet ``10.87.0`` -> ``10.87.1.0/30`` to site
    A, ``10.87.2.0/30`` to site B).
    """

    def __init__(self, run_dir: Path, mode: str = NETNS, wan: WanConfig | None = None) -> None:
        if mode not in (NETNS, LOCAL):
            raise SitesError(f"sites mode {mode!r}: expected {NETNS!r} or {LOCAL!r}")
        if mode == NETNS:
            try:
                require_root()
            except WanError:
                raise SitesError("--sites netns needs root (network namespaces, TUN devices, tc, nft); run as "
                                 "root, or leave --sites out for the one-box layout") from None
        self.mode = mode
        self.run_dir = Path(run_dir)
        self.wan = WanEmulation(wan or WanConfig(rate="1gbit", delay="5ms", ns_a="pdd-site-a", ns_b="pdd-site-b",
                                                 subnet="10.87.0")) if mode == NETNS else None
        self.token = secrets.token_hex(16)
        self.leaf_user, self.leaf_password = "pdd-leaf", secrets.token_hex(16)
        if self.wan is None:
            self.ports = {site: {"client": free_port(), "leaf": free_port(), "monitor": free_port()}
                          for site in (SITE_A, SITE_B)}
        else:
            self.ports = {site: {"client": CLIENT_PORT, "leaf": LEAF_PORT, "monitor": MONITOR_PORT}
                          for site in (SITE_A, SITE_B)}
        self.servers: dict[str, NatsServer | None] = {SITE_A: None, SITE_B: None}
        self._built = False

    # -- where things are -------------------------------------------------------------------------
    @property
    def can_cut(self) -> bool:
        """Whether ``cut()`` drops cross-site traffic at the network level (netns mode only)."""
        return self.wan is not None

    def host(self, site: str) -> str:
        """The address a site's processes bind: its WAN address (netns), loopback (local)."""
        if self.wan is None:
            return "127.0.0.1"
        return self.wan.config.addr_a if site == SITE_A else self.wan.config.addr_b

    def prefix(self, site: str) -> list[str]:
        """argv prefix that runs a command inside the site (empty in local mode)."""
        return self.wan.exec_prefix("a" if site == SITE_A else "b") if self.wan else []

    def nats_url(self, site: str) -> str:
        return f"nats://{self.host(site)}:{self.ports[site]['client']}"

    def env(self, site: str) -> dict[str, str]:
        """Environment for a service of the site: its own site's nats-server (config override)."""
        return {"PDD__NATS__URL": self.nats_url(site)}

    def describe(self) -> str:
        """One banner line: where the sites are and what joins them."""
        if self.wan is None:
            return "two nats-servers on this box, leaf-linked over loopback; no network-level WAN"
        c = self.wan.config
        return (f"kernel WAN {c.rate}, {c.delay} one-way (+/- {c.jitter}) between network namespaces {c.ns_a} "
                f"({c.addr_a}) and {c.ns_b} ({c.addr_b}): tbf + delay relay; leaf link, KV and replies cross it")

    def place(self, config: dict) -> dict:
        """Point a PDD config at these sites (in place): each instance binds its site's address, the
        router's API listens on site A's, the services authenticate with the token. ``nats.url`` is site
        A's; site B's services get their own through ``env``. Returns the config."""
        for inst in config["instances"]:
            if inst["site"] not in (SITE_A, SITE_B):
                raise SitesError(f"instance {inst['id']}: site {inst['site']!r} is neither {SITE_A} nor {SITE_B}")
            inst["host"] = self.host(inst["site"])
        config.setdefault("router", {})["host"] = self.host(SITE_A)
        nats = config.setdefault("nats", {})
        nats["url"] = self.nats_url(SITE_A)
        nats["token"] = self.token
        for key in ("user", "password", "nkey_seed_file", "credentials_file"):
            nats.pop(key, None)
        return config

    # -- lifecycle --------------------------------------------------------------------------------
    def up(self) -> None:
        """``build()``, then start both servers (those not running)."""
        self.build()
        for site in (SITE_A, SITE_B):
            if self.servers[site] is None or self.servers[site].process.poll() is not None:
                self.start_nats(site)

    def build(self) -> None:
        """The namespaces, the WAN and the access links (netns; nothing in local mode). A launcher that
        supervises its children starts the servers itself, with ``start_nats``."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.wan is not None and not self._built:
            try:
                self.wan.up()
            except WanError as exc:
                c = self.wan.config
                raise SitesError(f"{exc} (left by a killed run? `pdd wan down --ns-a {c.ns_a} --ns-b {c.ns_b}`)") from None
            self._built = True
            try:
                for site, side in ((SITE_A, "a"), (SITE_B, "b")):
                    self._access_link(site, side)
            except Exception:
                self.down()
                raise

    def _access_link(self, site: str, side: str) -> None:
        c = self.wan.config
        ns = c.ns_a if side == "a" else c.ns_b
        octets = c.subnet.split(".")
        net = f"{octets[0]}.{octets[1]}.{int(octets[2]) + (1 if side == 'a' else 2)}"
        outer = f"pa-{ns[-12:]}"
        _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", "pdd-access", "netns", ns)
        _sh("ip", "addr", "add", f"{net}.1/30", "dev", outer)
        _sh("ip", "link", "set", outer, "up")
        _sh("ip", "-n", ns, "addr", "add", f"{net}.2/30", "dev", "pdd-access")
        _sh("ip", "-n", ns, "link", "set", "pdd-access", "up")
        _sh("ip", "route", "replace", f"{self.host(site)}/32", "via", f"{net}.2", "dev", outer)

    def start_nats(self, site: str) -> NatsServer:
        """(Re)start a site's nats-server on its fixed ports (clients and the leaf link reconnect)."""
        ports = self.ports[site]
        if site == SITE_A:
            leaf = LeafLink(self.leaf_user, self.leaf_password, listen=f"{self.host(SITE_A)}:{ports['leaf']}")
        else:
            leaf = LeafLink(self.leaf_user, self.leaf_password,
                            remote=f"{self.host(SITE_A)}:{self.ports[SITE_A]['leaf']}")
        server = start_nats_server(port=ports["client"], host=self.host(site),
                                   log_file=str(self.run_dir / f"nats-{site}.log"), token=self.token, leaf=leaf,
                                   monitor_port=ports["monitor"], ping_interval_s=PING_INTERVAL_S,
                                   prefix=self.prefix(site), config_dir=self.run_dir / site)
        self.servers[site] = server
        return server

    def kill_nats(self, site: str, sig: int = signal.SIGKILL) -> None:
        """``kill -9`` of a site's nats-server (no goodbye to clients or to the leaf link)."""
        server = self.servers[site]
        if server is not None and server.process.poll() is None:
            server.process.send_signal(sig)
            server.process.wait()

    def stop_nats(self, site: str) -> None:
        server = self.servers[site]
        if server is not None:
            server.stop()
        self.servers[site] = None

    def cut(self) -> None:
        """Drop all cross-site traffic (leaf link, KV, replies) until ``mend()``; netns mode only."""
        if self.wan is None:
            raise SitesError("a network-level WAN cut needs --sites netns (root)")
        self.wan.cut()

    def mend(self) -> None:
        if self.wan is not None:
            self.wan.mend()

    def down(self) -> None:
        """Stop both servers and remove the namespaces (their veths and the host's routes go with them)."""
        for site in (SITE_A, SITE_B):
            self.stop_nats(site)
        if self.wan is not None and self._built:
            self.wan.down()
            for ns in (self.wan.config.ns_a, self.wan.config.ns_b):
                _sh("ip", "link", "del", f"pa-{ns[-12:]}", check=False)  # gone with the namespace normally
            self._built = False

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- the leaf link ----------------------------------------------------------------------------
    def leaf_links(self, site: str = SITE_B) -> int | None:
        """Leaf connections the site's server holds now (nats monitoring ``/leafz``); None: no answer."""
        url = f"http://{self.host(site)}:{self.ports[site]['monitor']}/leafz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return int(json.loads(resp.read()).get("leafnodes", 0))
        except (OSError, ValueError):
            return None

    def wait_leaf(self, t0: float, timeout: float = 60.0) -> float | None:
        """Seconds from ``t0`` until both ends hold the leaf link again (None: not within ``timeout``)."""
        while time.monotonic() - t0 < timeout:
            if self.leaf_links(SITE_A) and self.leaf_links(SITE_B):
                return round(time.monotonic() - t0, 2)
            time.sleep(0.1)
        return None


def netns_sites(run_dir: Path, shape: dict) -> TwoSites:
    """`pdd up --sites netns`: the two sites with the kernel WAN at ``shape`` (``--wan``'s figures:
    rate, delay, jitter; empty = no limit, no delay). Raises SitesError (not root) before touching anything."""
    wan = WanConfig(rate=shape.get("rate") or "100gbit", delay=shape.get("delay") or "0ms",
                    jitter=shape.get("jitter") or "0ms", ns_a="pdd-site-a", ns_b="pdd-site-b", subnet="10.87.0")
    return TwoSites(run_dir, NETNS, wan)


class SitesCluster(LocalCluster):
    """``LocalCluster`` on two sites: each instance runs in its config ``site`` (namespace in netns
    mode) against that site's nats-server. ``stop_nats``/``start_nats`` act on both servers;
    ``sites`` crashes one (``kill_nats``) or cuts the WAN."""

    def __init__(self, run_dir: Path, config: dict, mode: str = NETNS, wan: WanConfig | None = None,
                 **kwargs: Any) -> None:
        self.sites = TwoSites(Path(run_dir) / "nats", mode, wan)
        config = self.sites.place(json.loads(json.dumps(config)))
        site_of = {inst["id"]: inst["site"] for inst in config["instances"]}
        super().__init__(run_dir, config,
                         instance_env={iid: self.sites.env(site) for iid, site in site_of.items()},
                         launch_prefix={iid: self.sites.prefix(site) for iid, site in site_of.items()}, **kwargs)

    @property
    def base_url(self) -> str:
        return f"http://{self.config['router']['host']}:{self.port}"

    def start_nats(self) -> None:
        self.sites.up()
        self.nats = self.sites.servers[SITE_A]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """As LocalCluster's, after restarting a site's nats-server that a fault left down."""
        self.start_nats()
        super().wait_ready(timeout)

    def stop_nats(self) -> None:
        for site in (SITE_A, SITE_B):
            self.sites.stop_nats(site)
        self.nats = None

    def stop(self, timeout: float = 20.0, until_exit: bool = True) -> dict[str, bool]:
        try:
            return super().stop(timeout, until_exit)
        finally:
            self.sites.down()
