"""A trace through the simulator: hits come from simulated per-instance caches that evict at capacity (MD's
inside MD's memory), and `pdd sim trace` prints the comparison as one JSON line."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from pdd.loadgen.trace import MaxTokensRule, hit_tokens, read_trace, trace_arrays
from pdd.scenarios import WanLink
from pdd.shared.cost_model import CostModel
from pdd.sim.event_loop import P_MD, P_RLD_MD, SimInput, simulate
from pdd.sim.metrics import hit_rates
from pdd.sim.prefix_cache import BlockCache

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_excerpt.jsonl"
CM = CostModel(p0=0.01, p_tok=2e-6, p_attn=1e-12, d0=0.005, d_seq=1e-4, d_ctx=1e-9, kv_capacity_tokens=2_000_000)


def test_block_cache_evicts_least_recent_leaves_first():
    cache = BlockCache(4)
    cache.insert([1, 2, 3])
    cache.insert([1, 4])  # 1 touched again: the oldest are now 3, then 2
    cache.insert([5])
    assert len(cache) == 4 and cache.evicted == 1
    assert cache.match([1, 2]) == 2 and cache.match([1, 2, 3]) == 2 and cache.match([1, 4]) == 2
    cache.shrink(2)  # memory taken by running requests
    assert len(cache) == 2 and cache.match([5]) == 1 and cache.match([1]) == 1 and cache.match([1, 4]) == 1
    BlockCache(0).insert([1])  # no memory: nothing held, nothing raised


def _trace_input(n_prefill=1, p_cache=None, decode_cap=2_000_000, rule=MaxTokensRule(), **kw):
    arrays = trace_arrays(read_trace(EXCERPT), rule, 131072)
    dec = CM.with_(kv_capacity_tokens=decode_cap)
    return arrays, SimInput(
        arrivals=arrays.arrival, prompt=arrays.prompt, cached=np.zeros_like(arrays.prompt), output=arrays.output,
        prefill=CM, decode=dec, relay=CM, n_prefill=n_prefill, n_decode=2, n_relay=1, kv_bytes_per_token=1000,
        kind="pdd", wan=WanLink(bandwidth_gbps=100, per_flow_gbps=10, setup_s=0.05, jitter_sigma=0.0),
        route_max_tokens=arrays.route_max_tokens, chains=arrays.chains, block_tokens=512,
        prefill_cache_tokens=p_cache, **kw)


def test_an_unbounded_cache_on_one_prefill_instance_finds_every_shared_block():
    arrays, inp = _trace_input(n_prefill=1, p_cache=10**9)
    r = simulate(inp)
    assert r.completed == len(arrays)
    bound = hit_tokens(arrays.chains, arrays.prompt, 512)
    assert np.array_equal(r.p_cached, bound) and bound.sum() > 0 and r.p_evictions == 0


def test_the_prefill_cache_evicts_at_capacity():
    arrays, _ = _trace_input()
    roomy = simulate(_trace_input(p_cache=10**9)[1])
    small = simulate(_trace_input(p_cache=20 * 512)[1])  # 20 blocks: a few prompts' worth
    assert small.p_evictions > 0 and roomy.p_evictions == 0
    assert hit_rates(small)["mean_hit_p"] < hit_rates(roomy)["mean_hit_p"]
    assert small.completed == roomy.completed == len(arrays)


def test_md_cache_lives_in_md_memory():
    """With less KV on MD, its running requests leave less room for cached prefixes: fewer MD hits and more
    KV over the WAN, on the same requests."""
    _, roomy_in = _trace_input(decode_cap=4_000_000)
    _, tight_in = _trace_input(decode_cap=150_000)
    roomy, tight = simulate(roomy_in), simulate(tight_in)
    assert roomy.completed == tight.completed == len(roomy_in.prompt)
    assert hit_rates(tight)["mean_hit_md"] < hit_rates(roomy)["mean_hit_md"]
    to_md = (roomy.pipeline == P_MD) | (roomy.pipeline == P_RLD_MD)
    assert to_md.all() and roomy.md_cached.sum() > 0


def test_without_a_decode_side_cache_md_holds_nothing():
    _, inp = _trace_input()
    r = simulate(replace(inp, drc=False))
    assert r.md_cached.sum() == 0 and r.wan_bytes >= simulate(inp).wan_bytes


def test_pdd_sim_trace_prints_the_comparison(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "sim", "trace", str(EXCERPT), "--num-prompts", "120",
                           "--rate-scale", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line == json.loads(out.read_text())
    for key in ("mean_hit_p", "mean_hit_md", "ttft_mean_reduction_vs_naive", "goodput_gain_vs_naive",
                "goodput_gain_vs_baseline", "goodput_rps", "wan_bytes_ratio_naive_over_pdd", "pdd_pipeline_mix",
                "rld_token_share"):
        assert key in line, key
    assert line["requests"] == 120 and line["max_tokens_rule"] == "none" and line["rate_scale"] == 2
    assert set(line["goodput_rps"]) == {"baseline", "naive", "pdd"}
    assert 0 <= line["mean_hit_p"] <= line["mean_hit_unbounded"] + 1e-9


def test_pdd_sim_trace_rejects_a_bad_trace_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(EXCERPT.read_text().splitlines()[0] + "\n" + '{"timestamp": 1, "input_length": 5}\n')
    proc = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "sim", "trace", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and ":2: field 'output_length': missing" in proc.stderr and not proc.stdout
