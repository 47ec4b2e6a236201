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
    ok = subprocess.run([sys.executable, "-m", "pdd.services.launch.cli", "config", "check", str(good)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "OK" in ok.stdout
    res = subprocess.run([sys.executable, "-m", "pdd.services.launch.cli", "config", "check", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "instances.1.role" in res.stderr and "prefil" in res.stderr
