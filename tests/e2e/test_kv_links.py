"""KV goes over the link its sites call for (shared/links.py): a main decoder in prefill's own site takes the
KV over the fast in-site transport and nothing crosses the WAN; across sites it goes over the WAN transport.

Emulated backend (the small profile: seconds to start), real processes, NATS and transports.
"""

from __future__ import annotations

import random

import httpx
import pytest

from tests.e2e.conftest import start_system
from tests.e2e.test_pipelines import body_for, metric_value


@pytest.fixture(scope="module")
def one_site_system(tmp_path_factory, tiny_model):
    from pdd.launch.natsserver import start_nats_server

    nats = start_nats_server()
    try:
        system = start_system(tmp_path_factory.mktemp("pdd-one-site"), nats.url, tiny_model, backend="emulated",
                              main_decode_site="site-a")
        yield system
        system.stop()
    finally:
        nats.stop()


def kv_bytes(system) -> tuple[float, float]:
    """P's (in-site, WAN) KV bytes so far."""
    url = system.procs["p-0"].wait_log("service_ready")["metrics"]
    return metric_value(url, "pdd:fast_path_bytes_total"), metric_value(url, "pdd:wan_bytes_total")


@pytest.mark.parametrize("where", ["one site", "two sites"])
def test_main_decode_takes_kv_over_the_link_its_site_calls_for(where, one_site_system, emulated_system):
    system = one_site_system if where == "one site" else emulated_system
    rng = random.Random(7)
    prompt = [rng.randrange(5, 380) for _ in range(120)]
    fast0, wan0 = kv_bytes(system)
    r = httpx.post(system.base_url + "/v1/completions", json=body_for(prompt, "P-MD"), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["pdd"]["pipeline"] == "P-MD"
    fast, wan = kv_bytes(system)
    if where == "one site":
        assert fast > fast0 and wan == wan0
    else:
        assert wan > wan0 and fast == fast0
