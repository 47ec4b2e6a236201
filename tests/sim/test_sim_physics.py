"""Cost-model physics the report scenario relies on: attention precision, decode roofline, WAN tail,
and the same-site TTFT anchor of the report's TTFT comparison."""

from dataclasses import replace

import numpy as np
import pytest

from pdd.shared.cost_model import Chip, ModelSpec, from_hardware
from pdd.sim.event_loop import SimInput, simulate
from pdd.scenarios import WanLink
from pdd.sim.report import Reproduction
from pdd.sim.scenario import Scenario, load_yaml, set_path

MODEL = ModelSpec(name="m", layers=10, kv_bytes_per_token=50_000, active_params=1e10, weight_bytes=1e11,
                  attn_flops_per_pair=1e6, decode_attn_flops_per_pair=4e6)
FAST = Chip(name="fast", peak_tflops=2000, attn_peak_tflops=1000, mem_gb=80, mem_bw_tbs=3.0, interconnect_gbs=900)


def test_attention_runs_at_its_own_precision():
    cm = from_hardware(FAST, 8, MODEL, mfu=0.5, mbu=0.7, mem_util=0.9)
    assert cm.p_attn == pytest.approx(1e6 / (8 * 1000e12 * 0.5))  # BF16 peak, not the FP8 one
    assert cm.p_tok == pytest.approx(2e10 / (8 * 2000e12 * 0.5))
    no_split = from_hardware(replace(FAST, attn_peak_tflops=0.0), 8, MODEL, mfu=0.5, mbu=0.7, mem_util=0.9)
    assert no_split.p_attn == pytest.approx(cm.p_attn / 2)  # 0 means "same as peak_tflops"


def test_decode_attention_is_the_slower_of_reading_kv_and_its_flops():
    weak = replace(FAST, name="weak", peak_tflops=300, attn_peak_tflops=150, mem_bw_tbs=4.0)
    mem_s = MODEL.kv_bytes_per_token / (8 * 4.0e12 * 0.7)
    flop_s = MODEL.decode_attn_flops_per_pair / (8 * 150e12 * 0.5)
    assert flop_s > mem_s
    assert from_hardware(weak, 8, MODEL, 0.5, 0.7, 0.9).d_ctx == pytest.approx(flop_s)
    gqa = replace(MODEL, decode_attn_flops_per_pair=0.0)  # memory-bound decode attention
    assert from_hardware(weak, 8, gqa, 0.5, 0.7, 0.9).d_ctx == pytest.approx(mem_s)


def _naive(throughput_sigma, n=400):
    cm = from_hardware(FAST, 8, MODEL, 0.5, 0.7, 0.9)
    prompt = np.full(n, 20_000)
    return simulate(SimInput(
        arrivals=np.arange(n) * 10.0, prompt=prompt, cached=np.zeros(n, np.int64), output=np.full(n, 4),
        prefill=cm, decode=cm, n_prefill=1, n_decode=1, kv_bytes_per_token=50_000, kind="naive",
        wan=WanLink(bandwidth_gbps=100, per_flow_gbps=10, setup_s=0.0, jitter_sigma=0.0,
                    throughput_sigma=throughput_sigma), seed=3, record_itl=False))


def test_throughput_spread_keeps_the_median_transfer_and_widens_the_tail():
    flat, spread = _naive(0.0), _naive(1.0)
    f50, f90 = np.percentile(flat.ttft, [50, 90])
    s50, s90 = np.percentile(spread.ttft, [50, 90])
    assert f90 == pytest.approx(f50, rel=1e-6)  # idle link, no spread: every transfer alike
    assert s50 == pytest.approx(f50, rel=0.15)  # per-flow rate is the median
    assert s90 > 2.5 * f50  # lognormal sigma 1: P90 / P50 = e^1.28 = 3.6 on the payload


def test_same_site_anchor_adds_the_missing_ttft_to_every_system():
    data = load_yaml("report")
    splits = {"baseline": {"prefill": 3, "decode": 8}, "naive": {"prefill": 5, "decode": 4},
              "pdd": {"prefill": 4, "relay": 1, "decode": 4}}
    anchored = Reproduction(data, n=200, splits=splits).figures()
    plain = Reproduction(set_path(data, "comparison.same_site_ttft_p50_s", None), n=200, splits=splits).figures()
    d = anchored["details"]
    assert d["ttft_offset_s"] > 0 and plain["details"]["ttft_offset_s"] == 0
    assert d["ttft_p50_p90_p99_s"]["baseline"][0] == pytest.approx(data["comparison"]["same_site_ttft_p50_s"])
    # a common delay dilutes the relative gain, never reverses it
    assert 0 < anchored["ttft_reduction"] < plain["ttft_reduction"]
    assert d["ttft_reduction_without_offset"] == pytest.approx(plain["ttft_reduction"])


def test_per_role_instance_sizes():
    data = set_path(load_yaml("report"), "systems.baseline.chips_per_instance", {"prefill": 8, "decode": 16})
    scn = Scenario.from_dict(data)
    splits = scn.splits("baseline")
    assert splits and all(sp["prefill"] * 8 + sp["decode"] * 16 <= 88 for sp in splits)
    assert all(sp["prefill"] >= 1 and sp["decode"] >= 1 for sp in splits)
    wl = scn.arrays(50)
    inp = scn.sim_input("baseline", splits[0], 1.0, wl, np.arange(50.0))
    eight = scn.cost_model("A", 8)
    # weights are paid once per instance: a 16-chip instance keeps far more than twice the KV of an 8-chip one
    assert inp.decode.kv_capacity_tokens > 2 * eight.kv_capacity_tokens
    assert inp.prefill.kv_capacity_tokens == eight.kv_capacity_tokens
    typo = set_path(load_yaml("report"), "systems.baseline.chips_per_instance", {"decoder": 16})
    with pytest.raises(ValueError, match="decoder"):
        Scenario.from_dict(typo).splits("baseline")


def test_goodput_search_ends_when_every_rate_meets_the_slo():
    """A loose SLO that every offered rate meets must not make the doubling search run forever."""
    from types import SimpleNamespace

    from pdd.sim.metrics import Slo, goodput

    rates: list[float] = []

    def always_good(rate: float):
        rates.append(rate)
        return SimpleNamespace(ok=np.ones(4, bool), ttft=np.zeros(4), tpot=np.zeros(4))

    found = goodput(always_good, Slo(), hi=1.0, max_doublings=5)
    assert found == 2.0 ** 4 and max(rates) == 2.0 ** 4 and len(rates) == 6


@pytest.mark.parametrize("per_flow_gbps", [10, 100])
def test_streamed_export_overlaps_the_transfer_with_the_prefill(per_flow_gbps):
    """P streams each prefill chunk's KV as the chunk ends: the transfer begins at the first chunk's end and
    lands at the later of (that + the whole transfer) and (the prefill's end + the last chunk's transfer), plus
    the setup; without streaming it begins at the prefill's end. The TTFT gap is exactly that difference."""
    cm = from_hardware(FAST, 8, MODEL, 0.5, 0.7, 0.9)
    prompt, chunk, kvb = 65_536, 16_384, 50_000
    link = WanLink(bandwidth_gbps=100, per_flow_gbps=per_flow_gbps, setup_s=0.2, jitter_sigma=0.0,
                   throughput_sigma=0.0)

    def ttft(chunk_tokens):
        return simulate(SimInput(
            arrivals=np.zeros(1), prompt=np.full(1, prompt), cached=np.zeros(1, np.int64), output=np.full(1, 4),
            prefill=cm, decode=cm, n_prefill=1, n_decode=1, kv_bytes_per_token=kvb, kind="naive", wan=link,
            record_itl=False, prefill_chunk_tokens=chunk_tokens)).ttft[0]

    def prefill_s(k):
        return cm.p0 + cm.p_tok * k + cm.p_attn * k * k / 2
    bps = per_flow_gbps * 1e9 / 8
    whole = prefill_s(prompt) + prompt * kvb / bps
    streamed = max(prefill_s(chunk) + prompt * kvb / bps, prefill_s(prompt) + chunk * kvb / bps)
    assert streamed < whole
    assert ttft(None) - ttft(chunk) == pytest.approx(whole - streamed, rel=1e-6)


def test_a_codec_on_the_wan_moves_fewer_bytes_and_kv_at_its_own_pace():
    """A codec of wire ratio r sends r of the KV's bytes, so KV crosses at rate / r, unless the coding is slower
    (codec_mb_s): then the coding is the pace. WAN bytes count the wire; naive's full KV stays the reference."""
    cm = from_hardware(FAST, 8, MODEL, 0.5, 0.7, 0.9)
    kvb, prompt = 50_000, 8_000  # one chunk: no streaming in the way

    def run(**codec):
        link = WanLink(bandwidth_gbps=100, per_flow_gbps=10, setup_s=0.0, jitter_sigma=0.0, throughput_sigma=0.0,
                       **codec)
        return simulate(SimInput(
            arrivals=np.zeros(1), prompt=np.full(1, prompt), cached=np.zeros(1, np.int64), output=np.full(1, 4),
            prefill=cm, decode=cm, n_prefill=1, n_decode=1, kv_bytes_per_token=kvb, kind="naive", wan=link,
            record_itl=False))
    plain, coded, slow = run(), run(codec_wire_ratio=0.4), run(codec_wire_ratio=0.4, codec_mb_s=500)
    kv, wire_s = prompt * kvb, prompt * kvb / (10e9 / 8)
    assert plain.wan_bytes == pytest.approx(kv) and coded.wan_bytes == pytest.approx(0.4 * kv)
    assert coded.wan_bytes_naive == plain.wan_bytes_naive == pytest.approx(kv)
    assert plain.ttft[0] - coded.ttft[0] == pytest.approx(0.6 * wire_s, rel=1e-6)
    assert slow.ttft[0] - coded.ttft[0] == pytest.approx(kv / 500e6 - 0.4 * wire_s, rel=1e-6)
    with pytest.raises(ValueError):
        WanLink(codec_wire_ratio=1.5)
