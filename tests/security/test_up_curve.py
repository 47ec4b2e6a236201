"""`pdd up` turns CURVE on for the WAN transport by default, and the config it writes works: KV moves
encrypted between a P and an MD built from it, and a sender with any other key is refused. A user's
own `curve` entry (keys, or false) and `--no-curve` are respected. Also: MD admits P's key read from
`pdd keys` public files (`authorized_clients_files`, what compose uses)."""

from __future__ import annotations

import argparse
import stat

import pytest
import yaml
import zmq.auth

from pdd.launch.up import add_arguments, build_config
from pdd.shared.config import load_config
from pdd.transports import PeerLostError, create_transport
from pdd.transports.keys_cli import write_keypair
from tests.transports.conftest import Pair, layout_for

LAYOUT = layout_for("float16", layers=2)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _wan(config: dict) -> dict:
    return config["transports"]["wan"]


def test_pdd_up_config_has_curve_for_the_wan(tmp_path) -> None:
    config = build_config(_args(), "nats://127.0.0.1:4222", tmp_path)
    curve = _wan(config)["options"]["curve"]
    secret = tmp_path / "keys" / "wan.key_secret"
    assert _wan(config)["name"] == "zmq" and curve["secret_key_file"] == str(secret)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    public, _ = zmq.auth.load_certificate(str(tmp_path / "keys" / "wan.key"))
    assert curve["authorized_clients"] == [public.decode()]
    path = tmp_path / "pdd.yaml"  # what `pdd up` writes and every service loads
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    assert load_config(path, environ={}).transports.wan.options["curve"] == curve
    # the shaper option still goes in next to it
    shaped = build_config(_args("--wan", "rate=1gbit,delay=20ms"), "nats://127.0.0.1:4222", tmp_path / "b")
    assert _wan(shaped)["options"]["shape"] == {"rate": "1gbit", "delay": "20ms"}
    assert _wan(shaped)["options"]["curve"]["secret_key_file"]


@pytest.mark.parametrize("base_curve, expect", [
    (False, False),
    (None, None),
    ({"secret_key_file": "/etc/pdd/keys/mine.key_secret"}, {"secret_key_file": "/etc/pdd/keys/mine.key_secret"}),
])
def test_pdd_up_respects_the_users_curve_choice(tmp_path, base_curve, expect) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"transports": {"wan": {"name": "zmq", "options": {"curve": base_curve}}}}))
    config = build_config(_args("--config", str(base)), "nats://127.0.0.1:4222", tmp_path / "run")
    assert _wan(config)["options"]["curve"] == expect
    assert not (tmp_path / "run" / "keys").exists()


def test_pdd_up_no_curve_flag_and_non_zmq_wan(tmp_path) -> None:
    config = build_config(_args("--no-curve"), "nats://127.0.0.1:4222", tmp_path / "a")
    assert _wan(config)["options"]["curve"] is False
    base = tmp_path / "inproc.yaml"
    base.write_text(yaml.safe_dump({"transports": {"wan": {"name": "inproc"}}}))
    config = build_config(_args("--config", str(base)), "nats://127.0.0.1:4222", tmp_path / "b")
    assert "curve" not in _wan(config)["options"]


async def test_generated_curve_options_encrypt_and_refuse_other_keys(tmp_path) -> None:
    options = _wan(build_config(_args(), "nats://127.0.0.1:4222", tmp_path))["options"]
    curve = options["curve"]
    async with Pair("zmq", LAYOUT, sender_opts={"curve": curve}, receiver_opts={"curve": curve}) as pair:
        assert pair.receiver.descriptor()["curve_public_key"]
        handle = pair.receiver.expect("r1", [1, 2])
        await pair.sender.send(pair.peer, "r1", [3, 4], [1, 2])
        await handle
        _, other_secret = write_keypair(tmp_path / "other", "intruder")
        intruder = create_transport("zmq", {"curve": {"secret_key_file": str(other_secret)},
                                            "connect_timeout_s": 1.0, "streams": 1})
        await intruder.start()
        try:
            intruder.register(LAYOUT, *pair.src_pool)
            with pytest.raises(PeerLostError, match="no handshake"):
                await intruder.connect(pair.receiver.descriptor())
        finally:
            await intruder.close()


async def test_authorized_clients_files(tmp_path) -> None:
    _, server_secret = write_keypair(tmp_path, "decode")
    client_public, client_secret = write_keypair(tmp_path, "prefill")
    receiver = {"curve": {"secret_key_file": str(server_secret), "authorized_clients_files": [str(client_public)]}}
    async with Pair("zmq", LAYOUT, sender_opts={"curve": {"secret_key_file": str(client_secret)}},
                    receiver_opts=receiver) as pair:
        handle = pair.receiver.expect("r2", [1])
        await pair.sender.send(pair.peer, "r2", [3], [1])
        await handle
    with pytest.raises(ValueError, match="authorized_clients_files.*nowhere.key"):
        create_transport("zmq", {"curve": {"secret_key_file": str(server_secret),
                                           "authorized_clients_files": [str(tmp_path / "nowhere.key")]}})
