"""Simulator invariants: conservation, monotonicity in WAN bandwidth, determinism with a seed."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.loadgen.workload import AgenticConfig, agentic_arrays
from pdd.shared.cost_model import CostModel
from pdd.shared.pipelines import ROUTABLE
from pdd.sim.event_loop import BASELINE_PD, P_D, P_RLD, P_RLD_MD, PIPELINE_NAMES, SimInput, simulate
from pdd.scenarios import WanLink
from pdd.sim.scenario import Scenario, load_yaml, unit_poisson

CM = CostModel(p0=0.01, p_tok=2e-5, p_attn=1e-10, d0=0.005, d_seq=1e-4, d_ctx=1e-8, kv_capacity_tokens=400_000)


def _input(kind="pdd", n=300, rate=2.0, bw=10.0, seed=0, cap=400_000, n_relay=1, anomalous=0.05, out=200, **kw):
    wl = agentic_arrays(AgenticConfig(num_requests=n, context_tokens=8000, output_tokens=out,
                                      anomalous_fraction=anomalous, seed=seed))
    cm = CM.with_(kv_capacity_tokens=cap)
    return SimInput(
        arrivals=unit_poisson(n, seed) / rate, prompt=wl.prompt, cached=wl.cached, output=wl.output,
        prefill=cm, decode=cm, relay=cm, n_prefill=2, n_decode=2, n_relay=n_relay, kv_bytes_per_token=50_000,
        kind=kind, wan=WanLink(bandwidth_gbps=bw, per_flow_gbps=min(bw, 2.0), setup_s=0.05, jitter_sigma=0.3),
        seed=seed, **kw,
    )


@pytest.mark.parametrize("kind", ["pdd", "naive", "local"])
def test_conservation_every_request_completes_or_fails(kind):
    inp = _input(kind)
    r = simulate(inp)
    assert r.completed + r.failed == len(inp.arrivals) and r.failed == 0
    assert np.all(np.isfinite(r.ttft[r.ok])) and np.all(r.e2e[r.ok] >= r.ttft[r.ok])
    assert r.tokens_relay + r.tokens_main == pytest.approx(float(inp.output.sum()), rel=1e-6)


def test_requests_that_cannot_fit_are_counted_failed():
    inp = _input("pdd", cap=8000)  # no request (8000 + output) fits any decoder
    r = simulate(inp)
    assert r.completed + r.failed == len(inp.arrivals) and r.failed > 0


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 6.0), st.sampled_from(["pdd", "naive"]))
def test_conservation_property(seed, rate, kind):
    r = simulate(_input(kind, n=120, rate=rate, seed=seed))
    assert r.completed + r.failed == 120


@pytest.mark.parametrize("kind", ["pdd", "naive"])
def test_more_bandwidth_never_raises_ttft(kind):
    """Physics check. Routing inputs are held fixed: with a faster link the real policy rightly sends more
    requests P-MD (TTFT after a short transfer) instead of via the relay (TTFT after RDMA), a deliberate trade."""
    prev = None
    for bw in (1.0, 2.0, 5.0, 20.0, 100.0):
        inp = _input(kind, rate=1.5, route_bandwidth_bps=0.25e9)
        inp = replace(inp, wan=WanLink(bandwidth_gbps=bw, per_flow_gbps=bw / 4, setup_s=0.05, jitter_sigma=0.3))
        r = simulate(inp)
        stats = (np.nanmean(r.ttft), np.nanpercentile(r.ttft, 50), np.nanpercentile(r.ttft, 90))
        if prev is not None:
            assert all(s <= p * (1 + 1e-9) for s, p in zip(stats, prev)), (bw, stats, prev)
        prev = stats


def test_deterministic_with_seed():
    a, b = simulate(_input(seed=4)), simulate(_input(seed=4))
    assert np.array_equal(a.ttft, b.ttft, equal_nan=True) and a.wan_bytes == b.wan_bytes
    c = simulate(_input(seed=5))
    assert not np.array_equal(a.ttft, c.ttft, equal_nan=True)


def test_policy_routes_low_hits_via_relay_and_anomalous_locally():
    """With clients that send their true output length as max_tokens (the `output` rule), the anomalous rule
    sees it and finishes those requests on the relay."""
    from pdd.shared.policy import PolicyConfig

    inp = _input("pdd", n=400, out=600, policy=PolicyConfig(anomalous_min_prompt_tokens=4000))
    inp = replace(inp, route_max_tokens=inp.output)
    r = simulate(inp)
    hit = inp.cached / inp.prompt
    anomalous = inp.output < 500
    assert np.all(r.pipeline[anomalous] == P_RLD)
    relayed = r.pipeline == P_RLD_MD
    assert relayed.any() and hit[relayed].max() < hit[~relayed & ~anomalous].max()
    assert 0 < r.tokens_relay < r.tokens_main
    assert r.wan_bytes < 0.5 * r.wan_bytes_naive  # decode-side cache: only misses cross the WAN


def test_router_never_reads_the_output_length():
    """Without max_tokens from the client, the router knows only the model's room: the same short outputs that
    the anomalous rule catches when sent as max_tokens now look like any other request. (The WAN-saturated rule,
    which also finishes requests on the relay, is off: the question here is the anomalous rule's input.)"""
    from pdd.shared.policy import PolicyConfig

    inp = _input("pdd", n=400, out=600, policy=PolicyConfig(anomalous_min_prompt_tokens=4000, wan_saturated_s=1e9))
    short = inp.output < 500
    assert short.any()
    r = simulate(inp)
    assert not np.any(r.pipeline == P_RLD)
    assert np.any(simulate(replace(inp, route_max_tokens=inp.output)).pipeline[short] == P_RLD)
    # a room the request cannot fill: the router assumes max_context_tokens - prompt, never the output
    tight = simulate(replace(inp, max_context_tokens=int(inp.prompt.max()) + 100))
    assert np.all(tight.pipeline[inp.prompt >= 4000] == P_RLD)


def test_report_scenario_builds_every_system():
    scn = Scenario.from_dict(load_yaml("report"))
    wl = scn.arrays(50)
    for name in ("baseline", "naive", "pdd"):
        split = scn.splits(name)[0]
        r = simulate(scn.sim_input(name, split, 0.5, wl, unit_poisson(50, 0)))
        assert r.completed == 50
    assert scn.hardware_cost("pdd") < scn.hardware_cost("baseline")


def test_pipeline_names_come_from_the_pipeline_declaration():
    assert PIPELINE_NAMES[P_D] == BASELINE_PD
    assert [PIPELINE_NAMES[c] for c in sorted(PIPELINE_NAMES) if c != P_D] == [p.value for p in ROUTABLE]
    assert BASELINE_PD not in {p.value for p in ROUTABLE}


@pytest.mark.parametrize("output, cut", [(20, True), (2000, False)])
def test_a_transfer_the_relay_makes_moot_counts_only_the_bytes_sent(output, cut):
    """P->RLD->MD: when the relay finishes before the KV reaches MD, the live system cancels the transfer, so
    the bytes not yet sent never cross the WAN; a request the relay hands over moves all of its KV."""
    prompt = 10_000  # under the anomalous threshold: routed P->RLD->MD (500 MB at 2 Gbit/s: 2 s > the 0.25 s mask)
    r = simulate(SimInput(
        arrivals=np.zeros(1), prompt=np.array([prompt]), cached=np.zeros(1, np.int64), output=np.array([output]),
        prefill=CM, decode=CM, relay=CM, n_prefill=1, n_decode=1, n_relay=1, kv_bytes_per_token=50_000, kind="pdd",
        wan=WanLink(bandwidth_gbps=10, per_flow_gbps=2.0, setup_s=0.05, jitter_sigma=0.0), seed=0))
    assert r.pipeline[0] == P_RLD_MD and r.ok[0]
    full = prompt * 50_000
    if cut:  # 20 tokens take ~0.1 s of the transfer's ~2 s
        assert 0 < r.wan_bytes < 0.2 * full
    else:
        assert r.wan_bytes >= full


def test_main_decode_may_hold_more_than_prefill():
    """A later turn: MD decoded the previous answer, P never saw it. P prefills what it lacks, and only what MD
    lacks crosses the WAN (``SimInput.md_cached``; by default MD holds P's hits)."""
    prompt, p_hit, md_hit = 20_000, 18_000, 19_500

    def run(md_cached):
        return simulate(SimInput(
            arrivals=np.zeros(1), prompt=np.array([prompt]), cached=np.array([p_hit]), output=np.array([600]),
            prefill=CM, decode=CM, relay=CM, n_prefill=1, n_decode=1, n_relay=1, kv_bytes_per_token=50_000,
            kind="pdd", wan=WanLink(bandwidth_gbps=10, per_flow_gbps=2.0, setup_s=0.05, jitter_sigma=0.0),
            md_cached=md_cached, seed=0))

    default, more = run(None), run(np.array([md_hit]))
    assert default.wan_bytes == pytest.approx((prompt - p_hit) * 50_000, rel=0.01)
    assert more.wan_bytes == pytest.approx((prompt - md_hit) * 50_000, rel=0.01)


@pytest.mark.parametrize("kind", ["pdd", "naive", "local"])
def test_a_request_that_waits_for_another_arrives_when_that_one_ended(kind):
    """`SimInput.after`: a session's next turn goes out only once its previous answer ended; TTFT counts from
    that arrival. Every request still completes, and the run without the dependency arrives on time."""
    free = simulate(_input(kind, n=60, rate=4.0))
    inp = _input(kind, n=60, rate=4.0)
    after = np.full(60, -1, dtype=np.int64)
    after[1::2] = np.arange(0, 60, 2)  # request 2k+1 waits for request 2k
    inp.after = after
    r = simulate(inp)
    assert r.completed == 60 and np.array_equal(free.arrival, inp.arrivals)
    finish = r.arrival + r.e2e
    waited = after >= 0
    held = np.maximum(inp.arrivals[waited], finish[after[waited]])
    assert np.allclose(r.arrival[waited], held) and np.any(held > inp.arrivals[waited])
    assert np.array_equal(r.arrival[~waited], inp.arrivals[~waited])
    assert np.all(r.ttft[r.ok] > 0)


def test_a_failed_request_still_releases_the_one_waiting_for_it():
    inp = _input("pdd", n=4, rate=1.0, cap=9000, out=50)
    inp.prompt = np.array([20_000, 4000, 4000, 4000])  # request 0 can never fit a decoder
    inp.cached = np.zeros(4, dtype=np.int64)
    inp.output = np.full(4, 50)
    inp.after = np.array([-1, 0, 1, -1])
    r = simulate(inp)
    assert list(r.ok) == [False, True, True, True]
    assert r.arrival[1] >= inp.arrivals[1] and r.arrival[2] >= r.arrival[1] + r.e2e[1] - 1e-9


def test_striping_pays_up_to_the_line():
    """A transfer striped over s flows runs at min(s x per-flow, line); the line carries as many at once as fit."""
    one = WanLink(bandwidth_gbps=100, per_flow_gbps=10, streams=1)
    four = replace(one, streams=4)
    wide = replace(one, streams=16)
    assert (one.transfer_gbps, one.concurrent_transfers) == (10, 10)
    assert (four.transfer_gbps, four.concurrent_transfers) == (40, 2)
    assert (wide.transfer_gbps, wide.concurrent_transfers) == (100, 1)
    with pytest.raises(ValueError, match="streams >= 1"):
        WanLink(streams=0)
    # one naive request alone: its KV crosses 4x faster on 4 flows, 10x on 16 (the line caps it)
    ttft = {}
    for link in (one, four, wide):
        inp = replace(_input("naive", n=1, rate=1.0), wan=replace(link, setup_s=0.0, jitter_sigma=0.0))
        ttft[link.streams] = float(simulate(inp).ttft[0])
    payload = 8000 * 50_000 * 8 / 1e9  # seconds at 1 Gbit/s
    assert ttft[1] - ttft[4] == pytest.approx(payload / 10 - payload / 40, rel=1e-6)
    assert ttft[4] - ttft[16] == pytest.approx(payload / 40 - payload / 100, rel=1e-6)
