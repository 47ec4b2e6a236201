"""Kernel WAN emulation: two network namespaces joined by a TUN pair and a userspace relay.

This kernel has no netem, so the pieces are:
  * ``tc tbf`` on each TUN device's egress for the link rate (both directions);
  * a relay process in the root namespace that owns both TUN file descriptors and forwards every IP
    packet to the other side after ``delay ± jitter`` (FIFO, so jitter never reorders TCP) and drops
    a ``loss`` fraction.
TUN MTU ~64 KB keeps the packet rate (and so the relay's CPU) low. Addresses: site A = x.x.x.1,
site B = x.x.x.2 on a /24. Needs root; ``down`` (or a failed ``up``) removes everything.

    with WanEmulation(WanConfig(rate="1gbit", delay="20ms")) as wan:
        subprocess.run([*wan.exec_prefix("b"), "python", "server.py"])
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .units import fraction, rate_bits, seconds

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


class WanError(RuntimeError):
    """Emulation could not be set up (not root, already up, a command failed)."""


@dataclass
class WanConfig:
    rate: str = "1gbit"
    delay: str = "20ms"  # one way; RTT = 2 x delay
    jitter: str = "0ms"
    loss: str = "0%"
    ns_a: str = "site-a"
    ns_b: str = "site-b"
    subnet: str = "10.77.0"
    mtu: int = 65000

    @property
    def addr_a(self) -> str:
        return f"{self.subnet}.1"

    @property
    def addr_b(self) -> str:
        return f"{self.subnet}.2"

    @property
    def tun_a(self) -> str:
        return f"pw-{self.ns_a[-12:]}"

    @property
    def tun_b(self) -> str:
        return f"pw-{self.ns_b[-12:]}"


def require_root() -> None:
    if os.geteuid() != 0:
        raise WanError("WAN emulation needs root (network namespaces, TUN devices, tc). "
                       "Run as root, or use the in-process shaper (transport option 'shape').")


def _sh(*argv: str, check: bool = True) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise WanError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


class WanEmulation:
    STATE_DIR = Path("/run/pdd-wan")

    def __init__(self, config: WanConfig | None = None) -> None:
        self.config = config or WanConfig()
        self.state_file = self.STATE_DIR / f"{self.config.ns_a}--{self.config.ns_b}.json"

    def exec_prefix(self, site: str) -> list[str]:
        """argv prefix that runs a command inside site 'a' or 'b'."""
        return ["ip", "netns", "exec", self.config.ns_a if site == "a" else self.config.ns_b]

    def is_up(self) -> bool:
        return self.state_file.exists()

    def up(self) -> dict:
        require_root()
        c = self.config
        if c.tun_a == c.tun_b:
            raise WanError("namespace names must differ in their last 12 characters")
        for value, parse in ((c.rate, rate_bits), (c.delay, seconds), (c.jitter, seconds), (c.loss, fraction)):
            parse(value)  # fail on a typo before touching the system
        if self.is_up() or c.ns_a in _sh("ip", "netns", "list"):
            raise WanError(f"namespaces {c.ns_a}/{c.ns_b} already exist; run `pdd wan down` first")
        try:
            for ns in (c.ns_a, c.ns_b):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            relay = subprocess.Popen(
                [sys.executable, "-m", "pdd.transports.wan_emulation", "relay", c.tun_a, c.tun_b,
                 str(seconds(c.delay)), str(seconds(c.jitter)), str(fraction(c.loss))],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
            if relay.stdout.readline().strip() != b"READY":
                raise WanError("relay failed to create TUN devices")
            rate = rate_bits(c.rate)
            burst = max(2 * c.mtu + 1600, int(rate / 8 / 250))
            for ns, tun, addr in ((c.ns_a, c.tun_a, c.addr_a), (c.ns_b, c.tun_b, c.addr_b)):
                _sh("ip", "link", "set", tun, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", tun)
                _sh("ip", "-n", ns, "link", "set", tun, "mtu", str(c.mtu), "txqueuelen", "1000", "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", tun, "root", "tbf",
                    "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(max(burst * 2, int(rate / 8 * 0.1))))
                for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                    _sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}=4096 131072 67108864")
            self.STATE_DIR.mkdir(parents=True, exist_ok=True)
            state = {"relay_pid": relay.pid, **asdict(c), "addr_a": c.addr_a, "addr_b": c.addr_b}
            self.state_file.write_text(json.dumps(state))
            return state
        except Exception:
            self.down()
            raise

    def down(self) -> bool:
        """Remove namespaces and stop the relay; True if anything was there."""
        require_root()
        found = False
        if self.state_file.exists():
            try:
                os.killpg(json.loads(self.state_file.read_text())["relay_pid"], signal.SIGTERM)
            except (ProcessLookupError, KeyError, ValueError, PermissionError):
                pass
            self.state_file.unlink(missing_ok=True)
            found = True
        listed = _sh("ip", "netns", "list")
        for ns in (self.config.ns_a, self.config.ns_b):
            if any(line.split()[0] == ns for line in listed.splitlines() if line.strip()):
                _sh("ip", "netns", "del", ns, check=False)
                found = True
        return found

    CUT_TABLE = "pdd_wan_cut"

    def cut(self) -> None:
        """Drop every packet crossing the link, both ways, until ``mend()``: a pulled cable, silent to
        both sides (no reset, no unreachable). An nftables table in site A's namespace drops what
        leaves into and arrives from its TUN device (this kernel has no netem)."""
        require_root()
        c = self.config
        rules = (f"table inet {self.CUT_TABLE} {{\n"
                 f"  chain cut_in {{ type filter hook input priority 0; iifname \"{c.tun_a}\" drop; }}\n"
                 f"  chain cut_out {{ type filter hook output priority 0; oifname \"{c.tun_a}\" drop; }}\n}}\n")
        proc = subprocess.run(["ip", "netns", "exec", c.ns_a, "nft", "-f", "-"], input=rules, check=False,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise WanError(f"cutting the link with nft in {c.ns_a} failed: {proc.stderr.strip() or 'nft missing?'}")

    def mend(self) -> None:
        """Undo ``cut()`` (nothing to do when the link is not cut)."""
        require_root()
        _sh("ip", "netns", "exec", self.config.ns_a, "nft", "delete", "table", "inet", self.CUT_TABLE, check=False)

    def status(self) -> dict:
        if not self.is_up():
            return {"up": False, "ns_a": self.config.ns_a, "ns_b": self.config.ns_b}
        state = json.loads(self.state_file.read_text())
        try:
            os.kill(state["relay_pid"], 0)
            state["relay_alive"] = True
        except ProcessLookupError:
            state["relay_alive"] = False
        state["up"] = True
        state["qdisc_a"] = _sh("ip", "netns", "exec", state["ns_a"], "tc", "-s", "qdisc", "show",
                               "dev", WanConfig(**_cfg(state)).tun_a, check=False).strip()
        return state

    def __enter__(self) -> "WanEmulation":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _cfg(state: dict) -> dict:
    return {k: state[k] for k in WanConfig.__dataclass_fields__}


# ---- the relay (runs as its own process) --------------------------------------------------------
def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class _Direction:
    """Packets read from one TUN, released to the other after delay ± jitter, FIFO, with loss."""

    MAX_QUEUE = 20000

    def __init__(self, src: int, dst: int, delay: float, jitter: float, loss: float, seed: int) -> None:
        self.src, self.dst = src, dst
        self.delay, self.jitter, self.loss = delay, jitter, loss
        self.rng = random.Random(seed)
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.last_release = 0.0

    def read_loop(self) -> None:
        while True:
            pkt = os.read(self.src, 65536 + 64)
            if self.loss and self.rng.random() < self.loss:
                continue
            release = time.monotonic() + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
            release = max(release, self.last_release)
            self.last_release = release
            with self.cond:
                if len(self.queue) < self.MAX_QUEUE:
                    self.queue.append((release, pkt))
                    self.cond.notify()

    def write_loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.cond.wait()
                release, pkt = self.queue[0]
                wait = release - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                self.queue.popleft()
            try:
                os.write(self.dst, pkt)
            except OSError:
                pass  # device down or not yet up: a lost packet, as on a real link


def relay_main(tun_a: str, tun_b: str, delay: float, jitter: float, loss: float) -> None:
    fa, fb = _open_tun(tun_a), _open_tun(tun_b)
    print("READY", flush=True)
    for i, (src, dst) in enumerate(((fa, fb), (fb, fa))):
        d = _Direction(src, dst, delay, jitter, loss, seed=i)
        threading.Thread(target=d.read_loop, daemon=True).start()
        threading.Thread(target=d.write_loop, daemon=True).start()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PDD WAN relay (started by `pdd wan up`)")
    parser.add_argument("mode", choices=["relay"])
    parser.add_argument("tun_a")
    parser.add_argument("tun_b")
    parser.add_argument("delay", type=float)
    parser.add_argument("jitter", type=float)
    parser.add_argument("loss", type=float)
    a = parser.parse_args()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    relay_main(a.tun_a, a.tun_b, a.delay, a.jitter, a.loss)
