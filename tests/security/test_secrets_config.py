"""NATS auth/TLS config: missing files are config errors naming the path; secrets never printed or logged."""

from __future__ import annotations

import argparse
import json

import pytest
import structlog
import yaml

from pdd.shared import config_cli
from pdd.shared.config import ConfigError, TelemetryConfig, load_config, redact_url
from pdd.shared.telemetry import get_logger, setup_logging


def _load(tmp_path, data: dict):
    path = tmp_path / "pdd.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, environ={})


@pytest.mark.parametrize("section, field", [
    ({"tls": {"ca_file": "{missing}"}}, "nats.tls.ca_file"),
    ({"tls": {"cert_file": "{missing}", "key_file": "{missing}"}}, "nats.tls.cert_file"),
    ({"nkey_seed_file": "{missing}"}, "nats.nkey_seed_file"),
    ({"credentials_file": "{missing}"}, "nats.credentials_file"),
])
def test_missing_file_is_a_config_error_with_the_path(tmp_path, section, field) -> None:
    missing = str(tmp_path / "nowhere" / "file.pem")
    data = json.loads(json.dumps(section).replace("{missing}", missing))
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, {"nats": data})
    text = str(info.value)
    assert field in text and missing in text and "file not found" in text, text


def test_tls_and_auth_combinations(tmp_path) -> None:
    pem = tmp_path / "c.pem"
    pem.write_text("x")
    with pytest.raises(ConfigError, match="cert_file and key_file go together"):
        _load(tmp_path, {"nats": {"tls": {"cert_file": str(pem)}}})
    with pytest.raises(ConfigError, match="one authentication method") as info:
        _load(tmp_path, {"nats": {"token": "tok-x1", "user": "u", "password": "pw-x1"}})
    assert "tok-x1" not in str(info.value) and "pw-x1" not in str(info.value)  # the section is echoed, redacted
    with pytest.raises(ConfigError, match="password is set without nats.user"):
        _load(tmp_path, {"nats": {"password": "pw-x2"}})
    ok = _load(tmp_path, {"nats": {"url": "tls://h:4222", "tls": {"ca_file": str(pem)}, "token": "t"}})
    assert ok.nats.wants_tls and ok.nats.tls.ca_file == str(pem)
    assert _load(tmp_path, {"nats": {"url": "tls://h:4222"}}).nats.wants_tls
    assert not _load(tmp_path, {}).nats.wants_tls


def test_env_override_of_secrets(tmp_path) -> None:
    path = tmp_path / "pdd.yaml"
    path.write_text("nats: {user: pdd}\n")
    cfg = load_config(path, environ={"PDD__NATS__PASSWORD": "pw-env", "PDD__NATS__TLS__VERIFY": "false"})
    assert cfg.nats.password == "pw-env" and cfg.nats.tls.verify is False and cfg.nats.wants_tls


def test_config_print_redacts_secrets(tmp_path, capsys) -> None:
    path = tmp_path / "pdd.yaml"
    path.write_text(yaml.safe_dump({
        "nats": {"url": "nats://pdd:pw-in-url@h1:4222,nats://h2:4222", "user": "pdd", "password": "pw-field"},
        "router": {"api_keys": ["sk-key-1", "sk-key-2"]},
        "transports": {"wan": {"name": "zmq", "options": {"curve": {"secret_key": "Z85-secret-key"}}}},
    }))
    assert config_cli.run(argparse.Namespace(config_command="check", file=str(path), print=True)) == 0
    out = capsys.readouterr().out
    for secret in ("pw-in-url", "pw-field", "sk-key-1", "sk-key-2", "Z85-secret-key"):
        assert secret not in out, secret
    printed = yaml.safe_load(out)
    assert printed["nats"]["user"] == "pdd" and printed["nats"]["password"] == "<redacted>"
    assert printed["nats"]["url"] == "nats://pdd:<redacted>@h1:4222,nats://h2:4222"
    assert printed["router"]["api_keys"] == ["<redacted>", "<redacted>"]
    path.write_text("nats: {token: tok-bad, url: 'http://x'}\n")  # invalid: the error output is redacted too
    assert config_cli.run(argparse.Namespace(config_command="check", file=str(path), print=False)) == 1
    err = capsys.readouterr().err
    assert "nats.url" in err and "tok-bad" not in err


def test_redact_url_forms() -> None:
    assert redact_url("nats://h:4222") == "nats://h:4222"
    assert redact_url("tls://tok@h:4222") == "tls://<redacted>@h:4222"
    assert redact_url("nats://u:p@a:1, nats://u:q@b:2") == "nats://u:<redacted>@a:1, nats://u:<redacted>@b:2"
    assert redact_url("dial nats://u:p@a:1 failed") == "dial nats://u:<redacted>@a:1 failed"


def test_log_lines_never_carry_secrets(capsys) -> None:
    saved = structlog.get_config()
    try:
        setup_logging(TelemetryConfig(log_format="json"), role="test")
        get_logger("t").warning("connecting", url="nats://pdd:pw-log@h:4222", password="pw-field",
                                token="tok-field", api_key="sk-field", error="to nats://tok-err@h failed", user="pdd")
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        structlog.configure(**saved)
        structlog.contextvars.clear_contextvars()
    event = json.loads(line)
    for secret in ("pw-log", "pw-field", "tok-field", "sk-field", "tok-err"):
        assert secret not in line, secret
    assert event["user"] == "pdd" and event["password"] == "<redacted>"
    assert event["url"] == "nats://pdd:<redacted>@h:4222"
