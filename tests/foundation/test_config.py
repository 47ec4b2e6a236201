import subprocess
import sys

import pytest

from pdd.shared.config import ConfigError, load_config

GOOD = """
model: {path: default, block_size: 16}
nats: {url: "nats://127.0.0.1:4222"}
sites: [{name: site-a}, {name: site-b}]
instances:
  - {id: router-0, role: router, site: site-a}
  - {id: p-0, role: prefill, site: site-a}
  - {id: md-0, role: main-decode, site: site-b}
policy: {handoff_catch_up_threshold: 32}
"""


def test_good_config_and_env_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    cfg = load_config(path, environ={"PDD__NATS__URL": "nats://10.0.0.1:4222", "PDD__ROUTER__PORT": "9001",
                                     "PDD__POLICY__WAN_MASKING_THRESHOLD_S": "0.5"})
    assert cfg.nats.url == "nats://10.0.0.1:4222"
    assert cfg.router.port == 9001
    assert cfg.policy.wan_masking_threshold_s == 0.5
    assert cfg.policy.handoff_catch_up_threshold == 32
    assert cfg.instance("md-0").site == "site-b"


@pytest.mark.parametrize(
    "text, needle",
    [
        (GOOD.replace("block_size: 16", "block_size: -3"), "model.block_size"),
        (GOOD.replace("site: site-b", "site: site-z"), "unknown site 'site-z'"),
        (GOOD.replace("nats://127", "http://127"), "nats.url"),
        (GOOD + "\nbogus: 1\n", "bogus: unknown field"),
        (GOOD.replace("id: p-0", "id: router-0"), "duplicate id"),
        ("model: [unclosed", "not valid YAML"),
    ],
)
def test_bad_config_names_the_field(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert needle in str(info.value)


def test_cli_config_check(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("role: prefill", "role: prefil"))
    ok = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "config", "check", str(good)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    res = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "config", "check", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "instances.1.role" in res.stderr and "prefil" in res.stderr


def test_env_overlay_merges_into_the_file_and_wins(tmp_path, monkeypatch):
    """pydantic-settings overlay: nested values merge with the file's section, env wins, '' is null, JSON lists."""
    path = tmp_path / "c.yaml"
    path.write_text(GOOD.replace('nats: {url: "nats://127.0.0.1:4222"}', "nats: {url: 'nats://h:4222', token: t}")
                    + "router: {port: 8100, request_timeout_s: 7}\n"
                    + "transports: {wan: {name: zmq, options: {streams: 2}}}\n")
    cfg = load_config(path, environ={"PDD__ROUTER__PORT": "9002", "PDD__NATS__TOKEN": "",
                                     "PDD__ROUTER__API_KEYS": '["k1", "k2"]', "pdd__service__heartbeat_ms": "250",
                                     "PDD__TRANSPORTS__WAN__OPTIONS__ADVERTISE_HOST": "10.2.3.4"})
    assert cfg.router.port == 9002 and cfg.router.request_timeout_s == 7  # the file's sibling stays
    assert cfg.nats.token is None and cfg.nats.url == "nats://h:4222"
    assert cfg.router.api_keys == ["k1", "k2"] and cfg.service.heartbeat_ms == 250
    assert cfg.transports.wan.options == {"streams": 2, "advertise_host": "10.2.3.4"}
    assert type(cfg).__name__ == "PDDConfig"
    monkeypatch.setenv("PDD__ROUTER__PORT", "9003")  # environ=None reads the process environment
    assert load_config(path).router.port == 9003
    assert load_config(path, environ={}).router.port == 8100


@pytest.mark.parametrize("environ, needles", [
    ({"PDD__ROUTER__PORT": "abc"}, ["router.port", "valid integer", "'abc'", "PDD__ROUTER__PORT"]),
    ({"PDD__ROUTR__PORT": "1"}, ["PDD__ROUTR__PORT", "no such config section"]),
    ({"PDD__NATS__BOGUS": "1"}, ["nats.bogus", "unknown field", "PDD__NATS__BOGUS"]),
    ({"PDD__ROUTER__API_KEYS": "k1"}, ["PDD__ROUTER__API_KEYS", "not valid JSON"]),
    ({"PDD__NATS__USER": "u", "PDD__NATS__PASSWORD": "pw-env-9"}, ["one authentication method", "PDD__NATS__USER"]),
])
def test_bad_env_value_names_the_variable(tmp_path, environ, needles):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD.replace('nats: {url: "nats://127.0.0.1:4222"}', "nats: {token: t}"))
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=environ)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert "pw-env-9" not in str(info.value)
