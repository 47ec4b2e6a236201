"""NATS authentication and TLS against a real nats-server: who gets in, who is refused, and how fast.

A refused service fails at start with BusConnectError naming what to check (it does not retry
forever); a tls:// config never falls back to clear text; credentials never reach a log line.
"""

from __future__ import annotations

import asyncio
import os
import sys

import nats
import pytest

from pdd.launch.natsserver import ServerTLS, start_nats_server
from pdd.shared.bus import Bus, BusConnectError, BusError, connect_options
from pdd.shared.config import ConfigError, NatsConfig
from pdd.shared.protocol import Ping, Pong, Subjects

HANG_GUARD_S = 30  # only there so a broken build fails instead of hanging; not a timing claim


async def request_retrying(bus: Bus, subject: str, message, **kwargs):
    """nats-server now and then answers "no responders" to a request sent right after another
    connection's SUB was flushed (seen with plain nats-py too, ~2%): retry that, nothing else."""
    for _ in range(20):
        try:
            return await bus.request(subject, message, **kwargs)
        except BusError as exc:
            if exc.code != "no_responders":
                raise
            await asyncio.sleep(0.05)
    return await bus.request(subject, message, **kwargs)


async def _raw_connect(url: str, **kwargs) -> None:
    """A plain nats-py client, one attempt: raises if the server refuses it."""
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, **kwargs)
    await nc.close()


async def _roundtrip(config: NatsConfig) -> None:
    """Connect two buses with ``config`` and do a request/reply between them."""
    server, client = Bus(config, "t-server"), Bus(config, "t-client")
    await asyncio.wait_for(server.connect(), HANG_GUARD_S)
    await asyncio.wait_for(client.connect(), HANG_GUARD_S)
    try:
        async def on_ping(message, _env):
            return Pong(instance_id="srv", role="prefill", payload=message.payload)

        await server.subscribe(Subjects.instance("srv", "ping"), on_ping, expect=Ping)
        await server.sync()
        reply = await request_retrying(client, Subjects.instance("srv", "ping"), Ping(payload="hi"), expect=Pong)
        assert reply.payload == "hi"
    finally:
        await client.close()
        await server.close()


async def _refused(config: NatsConfig, needle: str) -> BusConnectError:
    bus = Bus(config, "t-refused")
    with pytest.raises(BusConnectError) as info:
        await asyncio.wait_for(bus.connect(), HANG_GUARD_S)
    assert needle in str(info.value), info.value
    assert bus.nc is None and not bus.connected.is_set()
    return info.value


@pytest.fixture
def token_server(tmp_path):
    server = start_nats_server(token="tok-3f9a", log_file=str(tmp_path / "nats.log"))
    yield server
    server.stop()


@pytest.fixture
def password_server(tmp_path):
    server = start_nats_server(user="pdd", password="pw-c0rrect", log_file=str(tmp_path / "nats.log"))
    yield server
    server.stop()


async def test_token_server_rejects_anonymous_and_wrong_token(token_server) -> None:
    with pytest.raises(Exception, match="(?i)authorization"):
        await _raw_connect(token_server.url)
    await _refused(NatsConfig(url=token_server.url), "credentials refused")
    err = await _refused(NatsConfig(url=token_server.url, token="tok-wrong"), "credentials refused")
    assert "tok-wrong" not in str(err)
    await _roundtrip(NatsConfig(url=token_server.url, token="tok-3f9a"))


async def test_password_server_rejects_anonymous_and_wrong_password(password_server) -> None:
    with pytest.raises(Exception, match="(?i)authorization"):
        await _raw_connect(password_server.url)
    await _refused(NatsConfig(url=password_server.url), "credentials refused")
    await _refused(NatsConfig(url=password_server.url, user="pdd", password="pw-wrong"), "credentials refused")
    await _refused(NatsConfig(url=password_server.url, user="someone", password="pw-c0rrect"), "credentials refused")
    # credentials inside the URL are refused the same way, and never echoed back
    url = password_server.url.replace("nats://", "nats://pdd:pw-wrong@")
    err = await _refused(NatsConfig(url=url), "credentials refused")
    assert "pw-wrong" not in str(err) and "pdd:<redacted>@" in str(err)
    await _roundtrip(NatsConfig(url=password_server.url, user="pdd", password="pw-c0rrect"))


async def test_tls_only_server_refuses_plain_and_untrusted_clients(pki, tmp_path) -> None:
    server = start_nats_server(tls=ServerTLS(pki.server_cert, pki.server_key), log_file=str(tmp_path / "nats.log"))
    try:
        assert server.url.startswith("tls://")
        plain_url = server.url.replace("tls://", "nats://")
        # a client that does not trust the server's CA fails the handshake (nats-py upgrades to TLS on the
        # server's demand, with the system trust store), whether it asked for TLS or not
        with pytest.raises(Exception, match="(?i)certificate verify failed"):
            await _raw_connect(plain_url)
        await _refused(NatsConfig(url=plain_url), "TLS handshake failed")
        await _refused(NatsConfig(url=server.url, tls={"ca_file": pki.other_ca_file}), "TLS handshake failed")
        # the CA that signed the server: in, over TLS, from either URL form
        await _roundtrip(NatsConfig(url=server.url, tls={"ca_file": pki.ca_file}))
        await _roundtrip(NatsConfig(url=plain_url, tls={"ca_file": pki.ca_file, "hostname": "localhost"}))
        opts = connect_options(NatsConfig(url=server.url, tls={"ca_file": pki.ca_file, "hostname": "localhost"}))
        assert opts["tls_hostname"] == "localhost" and opts["tls"].check_hostname
    finally:
        server.stop()


async def test_tls_with_client_certificates(pki, tmp_path) -> None:
    server = start_nats_server(tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca_file, verify=True),
                               log_file=str(tmp_path / "nats.log"))
    try:
        # TLS 1.3 reports a missing client certificate after the handshake: the alert, or just a reset
        await _refused(NatsConfig(url=server.url, tls={"ca_file": pki.ca_file}), "check nats.tls")
        await _roundtrip(NatsConfig(url=server.url, tls={"ca_file": pki.ca_file, "cert_file": pki.client_cert,
                                                          "key_file": pki.client_key}))
    finally:
        server.stop()


async def test_tls_config_never_falls_back_to_clear_text(pki, tmp_path) -> None:
    """nats-py only upgrades when the server demands TLS: a tls:// URL to a plain server is refused here."""
    server = start_nats_server(log_file=str(tmp_path / "nats.log"))
    try:
        await _refused(NatsConfig(url=server.url.replace("nats://", "tls://"), tls={"ca_file": pki.ca_file}),
                       "does not require TLS")
    finally:
        server.stop()


async def test_nkey_seed_auth(tmp_path) -> None:
    nkeys = pytest.importorskip("nkeys", reason="NKey auth needs the optional 'nkeys' package")

    def new_user_seed() -> tuple[bytes, str]:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)  # what `nk -gen user` writes
        return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()

    seed, public = new_user_seed()
    _, other_public = new_user_seed()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed + b"\n")
    server = start_nats_server(nkeys=[public], log_file=str(tmp_path / "nats.log"))
    try:
        await _refused(NatsConfig(url=server.url), "credentials refused")
        await _roundtrip(NatsConfig(url=server.url, nkey_seed_file=str(seed_file)))
    finally:
        server.stop()
    server = start_nats_server(nkeys=[other_public], log_file=str(tmp_path / "nats.log"))
    try:
        await _refused(NatsConfig(url=server.url, nkey_seed_file=str(seed_file)), "credentials refused")
    finally:
        server.stop()


def test_nkey_without_package_is_a_config_error(tmp_path, monkeypatch) -> None:
    seed_file = tmp_path / "user.nk"
    seed_file.write_text("SUAEXAMPLE\n")
    config = NatsConfig(nkey_seed_file=str(seed_file))
    monkeypatch.setitem(sys.modules, "nkeys", None)  # import nkeys -> ImportError
    with pytest.raises(ConfigError, match="pip install nkeys"):
        connect_options(config)


def test_server_config_file_holds_the_secret_not_the_command_line(tmp_path) -> None:
    server = start_nats_server(token="tok-in-file", log_file=str(tmp_path / "nats.log"))
    try:
        assert "tok-in-file" not in " ".join(server.args)
        assert "tok-in-file" in open(server.config_file).read()
        assert os.stat(server.config_file).st_mode & 0o777 == 0o600
        cmdline = open(f"/proc/{server.pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        assert "tok-in-file" not in cmdline
    finally:
        server.stop()
