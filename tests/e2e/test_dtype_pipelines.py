"""bfloat16 serving end to end (real processes, real nats-server, zmq WAN, tiny model).

Every routable pipeline serving in bf16 gives the same greedy tokens as one bf16 engine (and as
`pdd generate --dtype bfloat16`); bf16 KV crosses the WAN at half the fp32 bytes; `/v1/models` says
which dtypes serve; and an instance whose KV dtype differs from the running fleet's refuses to start.
This machine may lack native bf16 (then `dtype: auto` serves fp32): the cluster sets bfloat16 explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.shared.pipelines import ROUTABLE, HandoffMode, spec
from pdd.shared.protocol import Announce, Subjects
from pdd.shared.roles import Role
from pdd.transports import ucx_available

PIPELINES = [(p, mode) for p in ROUTABLE for mode in (list(HandoffMode) if spec(p).hands_over else [None])]
MAX_TOKENS = 800  # MD's KV lands mid-stream (at 400 over a 300 ms WAN the relay, ~0.55 ms/token, finished first)
SPARE = "rld-fp32"  # in the config, started only by the mismatch test (with float32)


@pytest.fixture(scope="module")
def bf16_cluster(tmp_path_factory, tiny_model):
    layout = two_site_layout()
    layout["instances"].append({"id": SPARE, "role": Role.RELAY.value, "site": "site-a"})
    config = {
        "model": {"path": tiny_model, "dtype": "bfloat16", "kv_dtype": "auto", "kv_memory_mb": 8, "block_size": 16,
                  "max_num_seqs": 32, "threads": 1},
        **layout,
        "transports": {
            "fast": {"name": "ucx" if ucx_available() else "zmq", "options": {}},
            "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "100ms"}}},  # MD's KV lands mid-stream
        },
        "router": {"request_timeout_s": 60},
        "policy": {"handoff_final_gap": 2},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }
    cluster = LocalCluster(tmp_path_factory.mktemp("bf16"), config)
    try:  # LocalCluster.start, less the spare instance
        cluster.run_dir.mkdir(parents=True, exist_ok=True)
        cluster.start_nats()
        cluster.config["nats"] = {"url": cluster.nats.url}
        cluster.config_path.write_text(yaml.safe_dump(cluster.config, sort_keys=False))
        for inst in cluster.config["instances"]:
            if inst["id"] != SPARE:
                cluster.spawn(inst["id"])
        cluster.wait_ready(240)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def bf16_reference(tiny_model):
    from pdd.engine.torch_backend.engine import TorchEngine

    return TorchEngine.from_model(tiny_model, dtype="bfloat16", kv_memory_bytes=8 << 20, num_threads=1)


def _body(prompt, pipeline, handoff=None, **extra) -> dict:
    pdd = {"return_token_ids": True, "pipeline": pipeline}
    if handoff:
        pdd["handoff"] = handoff
    return {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "pdd": pdd, **extra}


def test_every_engine_serves_bf16(bf16_cluster):
    for m in bf16_cluster.engine_members():
        loaded = m.log_event("model_loaded")
        assert loaded["dtype"] == "bfloat16" and loaded["kv_dtype"] == "bfloat16", loaded
        assert "dtype bfloat16 set in config" in loaded["dtype_reason"]
    card = httpx.get(bf16_cluster.base_url + "/v1/models", timeout=10).json()["data"][0]
    assert card["pdd"] == {"dtype": "bfloat16", "kv_dtype": "bfloat16"}


# MD extends the relay's tokens in one pass where `pdd generate` decoded them one by one: equal only
# because decode-phase attention accumulates in float64 (model.batch_invariant, the default; see
# kernels/attention.py). With fp32 accumulation this random tiny model drifted at output ~109 of 128.
@pytest.mark.parametrize("pipeline, handoff", PIPELINES)
def test_bf16_pipeline_matches_bf16_engine(bf16_cluster, bf16_reference, pipeline, handoff):
    """Each pipeline, fresh prompts, ignore_eos, one request at a time: every token equal to one bf16 engine's."""
    from pdd.engine import SamplingParams

    rng = random.Random(PIPELINES.index((pipeline, handoff)))
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(20, 60))] for _ in range(4)]
    handed_over = 0
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            want = bf16_reference.generate([prompt], SamplingParams(ignore_eos=True), max_new_tokens=MAX_TOKENS)[0]
            r = client.post(bf16_cluster.base_url + "/v1/completions",
                            json=_body(prompt, pipeline, handoff, ignore_eos=True))
            assert r.status_code == 200, r.text
            info = r.json()["pdd"]
            assert info["pipeline"] == pipeline
            assert info["token_ids"] == want, (pipeline, handoff, len(prompt), info.get("rld_tokens"))
            handed_over += bool(handoff and info.get("handoff_mode") == handoff)
    if handoff:
        assert handed_over > 0, "no request was handed over to MD"


def test_bf16_pipelines_match_pdd_generate(bf16_cluster, tiny_model):
    """`pdd generate --dtype bfloat16` and every pipeline: the same greedy tokens."""
    prompt = "the quick brown fox jumps"
    cli = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "generate", "--model", tiny_model,
                          "--prompt", prompt, "--max-tokens", "48", "--dtype", "bfloat16", "--threads", "1", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert cli.returncode == 0, cli.stderr
    assert "dtype bfloat16 set in config" in cli.stderr
    generated = json.loads(cli.stdout.strip().splitlines()[-1])
    want = generated["output_token_ids"]
    assert want
    # shorter than a KV block: no instance can hold a cached prefix of it when the next pipeline runs it
    assert len(generated["prompt_token_ids"]) < 16
    for pipeline, handoff in PIPELINES:
        body = _body(prompt, pipeline, handoff)
        body["max_tokens"] = 48
        r = httpx.post(bf16_cluster.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        info = r.json()["pdd"]
        assert info["token_ids"] == want, (pipeline, handoff, info.get("rld_tokens"))


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_bf16_kv_crosses_the_wan_at_half_the_fp32_bytes(bf16_cluster, bf16_reference):
    layout = bf16_reference.layout
    assert layout.dtype == "bfloat16"
    bytes_per_block = 2 * layout.num_layers * layout.bytes_per_block_per_tensor
    fp32_bytes_per_block = 2 * layout.num_layers * layout.block_size * layout.kv_heads * layout.head_dim * 4
    assert bytes_per_block * 2 == fp32_bytes_per_block
    p_metrics = bf16_cluster.members["p-0"].metrics_url
    prompt = [random.Random(77).randrange(5, 380) for _ in range(150)]  # fresh: every block crosses
    before = _metric(p_metrics, "pdd:wan_bytes_total")
    r = httpx.post(bf16_cluster.base_url + "/v1/completions", json=_body(prompt, "P-MD"), timeout=120)
    assert r.status_code == 200, r.text
    sent = _metric(p_metrics, "pdd:wan_bytes_total") - before
    assert sent == -(-len(prompt) // layout.block_size) * bytes_per_block


def test_fp32_instance_refuses_to_join_a_bf16_fleet(bf16_cluster):
    """A relay configured for float32 (env override) sees the bf16 fleet's heartbeats and exits."""
    member = bf16_cluster.spawn(SPARE, env={"PDD__MODEL__DTYPE": "float32"})
    try:
        member.proc.wait(timeout=180)
    finally:
        member.kill()
        member.stop()
    assert member.proc.returncode != 0
    failed = member.log_event("service_failed")
    assert failed is not None, member.log_path.read_text()[-3000:]
    error = failed["error"]
    assert "KV dtype/layout mismatch" in error and "float32" in error and "bfloat16" in error
    assert member.log_event("service_ready") is None
    # the fleet is unharmed
    assert httpx.get(bf16_cluster.base_url + "/health", timeout=10).status_code == 200


def test_router_refuses_an_instance_with_another_kv_dtype(bf16_cluster):
    """Two instances that start at once cannot see each other: the router's registry refuses the odd one."""
    import asyncio

    from pdd.shared.bus import Bus
    from pdd.shared.config import NatsConfig

    fleet_layout = next(m for m in bf16_cluster.engine_members() if m.role == Role.RELAY).log_event(
        "model_loaded")["layout"]
    odd = Announce(instance_id="rld-odd", role=Role.RELAY, site="site-a", state="ready", load=0.0,
                   running_requests=0, free_kv_blocks=10, total_kv_blocks=10, heartbeat_ms=500, dtype="float32",
                   kv_layout={**fleet_layout, "dtype": "float32"})

    async def announce() -> None:
        bus = Bus(NatsConfig(url=bf16_cluster.nats.url), name="test:odd")
        await bus.connect()
        try:
            await bus.publish(Subjects.ANNOUNCE, odd)
            await asyncio.sleep(0.5)
            await bus.publish(Subjects.ANNOUNCE, dataclasses.replace(odd, state="stopped"))
        finally:
            await bus.close()

    asyncio.run(announce())
    router = bf16_cluster.members["router-0"]
    deadline = time.monotonic() + 10
    while router.log_event("instance_refused") is None and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = router.log_event("instance_refused")
    assert refused is not None and refused["instance"] == "rld-odd"
    assert "float32" in refused["reason"] and "bfloat16" in refused["reason"]
    instances = httpx.get(bf16_cluster.base_url + "/health", timeout=10).json()["instances"]
    assert "rld-odd" not in {i["instance"] for i in instances}
