"""`python bench/pipelines.py --backend emulated` end to end on the small test profile: real processes (nats-server,
router, emulated P, RLD, MD per setup), each run beside `pdd sim` of the same requests.

The `small` scenario has only a pdd system; the benchmark needs the report's three (baseline, naive, pdd), so the
test writes a variant of it with a one-site baseline and a cache-less naive system on the same chip.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd.bench import pipelines_emulated as em
from pdd.roles.kv_export import BLOCKS_FINAL_EVENT
from pdd.sim.scenario import load_yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> str:
    data = load_yaml("small")
    data["systems"]["baseline"] = {"kind": "local", "chips": {"S": 4}, "chips_per_instance": 1,
                                   "roles": {"prefill": "S", "decode": "S"}}
    data["systems"]["naive"] = {"kind": "naive", "chips": {"S": 4}, "chips_per_instance": 1, "drc": False,
                                "leased_lines": 1, "roles": {"prefill": "S", "decode": "S"}}
    path = tmp_path_factory.mktemp("scenario") / "small3.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_sim_of_a_run_follows_each_setups_rules(scenario, tiny_model, tmp_path) -> None:
    """Cheap: the same arrays and arrival times for every setup; pdd and naive-stream0 get the first token from P,
    the baselines from the decoder; the link as the live shaper emulates it; no decode-side cache for naive."""
    args = em.parse_args(["--model", tiny_model, "--scenario", scenario, "--output-tokens", "8", "--requests", "6"])
    plan = em.plan(args, tmp_path)
    run = em.build_run(plan, 6, 0, args)
    assert len(run.planned) == 6 and [len(r.prompt) for r in run.planned] == run.arrays.prompt.tolist()
    assert all(r.prompt[:len(run.warm)] == run.warm for r in run.planned if r.turn == 0)
    inputs = {n: em.sim_input(plan, s, run, plan.rate) for n, s in em.live.SETUPS.items()}
    assert {n: i.first_token_from_prefill for n, i in inputs.items()} == {
        "colocated": False, "naive": False, "naive-stream0": True, "pdd": True}
    assert {n: i.kind for n, i in inputs.items()} == {
        "colocated": "local", "naive": "naive", "naive-stream0": "naive", "pdd": "pdd"}
    assert not inputs["naive"].drc and inputs["pdd"].drc
    assert inputs["pdd"].wan.concurrent_transfers == 1 and inputs["pdd"].wan.throughput_sigma == 0
    assert all((i.arrivals == inputs["pdd"].arrivals).all() for i in inputs.values())
    assert (inputs["pdd"].n_prefill, inputs["pdd"].n_relay, inputs["pdd"].n_decode) == (1, 1, 1)
    # a turn waits for its session's previous turn, in live and sim alike
    assert all((i.after == run.after).all() for i in inputs.values())
    for i, prev in enumerate(run.after.tolist()):
        r = run.planned[i]
        if prev < 0:
            assert not any(q.session == r.session for q in run.planned[:i])
        else:
            assert (run.planned[prev].session, run.planned[prev].turn) == (r.session, r.turn - 1)
    assert (em.open_loop(run).after == -1).all()  # goodput probes offer their rate


def test_run_at_sends_a_turn_only_after_its_sessions_previous_one_ended(monkeypatch) -> None:
    """The driver's schedule alone (the system is stood in by a fixed 1 s answer): request 1 is due at 0 s but
    waits for request 0; request 2 has no predecessor and goes out at its time, long before request 1."""
    import asyncio

    async def answer(client, base_url, planned):
        await asyncio.sleep(1.0)
        return em.live.Result(planned, ok=True)

    monkeypatch.setattr(em.live, "send", answer)
    reqs = [em.live.Planned(s, t, "turn", [1, 2, 3], 1, 0) for s, t in ((0, 0), (0, 1), (1, 0))]
    results, _ = asyncio.run(em.live.run_at("http://unused", reqs, [0.0, 0.0, 0.05], [-1, 0, -1]))
    sent = [r.sent for r in results]
    assert sent[1] >= 1.0 and 0.05 <= sent[2] < sent[1]


@pytest.mark.timeout(240)
def test_emulated_benchmark_end_to_end(scenario, tiny_model, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.bench.pipelines", "--backend", "emulated", "--model", tiny_model,
         "--scenario", scenario,
         "--output-tokens", "8", "--requests", "4", "--seeds", "1", "--rate", "4", "--goodput-requests", "4",
         "--goodput-steps", "1", "--wan-codec", "fp8+lossless", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=230)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Live beside `pdd sim` of the same requests" in out
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backend"] == "emulated" and report["bench"] == "pipelines"
    assert report["scenario"] == scenario and report["kv_scale"] == 4.0  # small: 64 modeled B / 16 real B
    assert report["time_dilation"] == 1.0 and report["instance_fraction"] == pytest.approx(1 / 3, abs=1e-3)
    assert report["timing_rules"] and len(report["rules"]) == 4
    assert set(report["setups"]) == {"colocated", "naive", "naive-stream0", "pdd"}
    for name, setup in report["setups"].items():
        rep = setup["repeats"][0]
        assert rep["completed"] == rep["requests"] == 4, (name, rep["errors"])
        assert rep["sim"]["completed"] == 4
        share = setup["overrun_share"]
        assert share is not None and 0 <= share <= 1 and report["overrun_share"][name] == share
        assert setup["pacing"]["steps"] > 0
        assert rep["turn_hold_s"] >= 0 and rep["sim"]["turn_hold_s"] >= 0
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_mean_s", "goodput_rps"):
            assert math.isfinite(setup[f"sim_{key}"]) and setup[f"sim_{key}"] > 0, (name, key)
            assert math.isfinite(setup[f"rel_err_{key}"]), (name, key)
    # bytes cross the WAN only between sites; the naive baselines move the whole prompt's KV, pdd only misses
    assert report["setups"]["colocated"]["sim_wan_bytes_per_request"] == 0
    for name in ("naive", "naive-stream0", "pdd"):
        assert report["setups"][name]["repeats"][0]["wan_bytes_metric"] > 0, name
        assert math.isfinite(report["setups"][name]["rel_err_wan_bytes_per_request"]), name
    assert report["wan_bytes_ratio_naive_over_pdd"] > 1 and report["sim_wan_bytes_ratio_naive_over_pdd"] > 1
    # the codec (fp8+lossless here) is stated, and the goal's figure set beside the ratio at the same codec
    codec = report["wan_codec"]
    assert codec["codec"] == "fp8+lossless" and "real bf16 KV" in codec["source"] and "free" in codec["coding"]
    assert "WAN codec: fp8+lossless" in out
    for key in ("wan_bytes_ratio_naive_uncoded_over_pdd", "sim_wan_bytes_ratio_naive_uncoded_over_pdd"):
        assert report[key] == pytest.approx(report[key.replace("_uncoded", "")] / codec["wire_ratio"], rel=1e-2), key
    assert report["goals"]["wan_bytes_ratio_naive_uncoded_over_pdd"]["target"] == 20.0
    hit = report["workload_md_hit"]
    assert 0 < hit < 1 and report["wan_bytes_ratio_if_only_missing_kv"] == pytest.approx(1 / (1 - hit), rel=1e-3)
    assert {"pdd:P-MD", "pdd:P-RLD-MD"} & {f"pdd:{k}" for k in report["setups"]["pdd"]["repeats"][0]["pipeline_mix"]}
    lag = report["setups"]["pdd"]["kv_ready_lag_over_bound"]
    assert report["kv_ready_lag_over_bound_requests"] == lag["requests"] >= 0 and lag["min_chunks"] == 4


def test_a_wan_codec_is_charged_at_its_measured_ratio_on_every_setup_that_crosses(scenario, tiny_model,
                                                                                   tmp_path) -> None:
    """Cheap: --wan-codec takes bench/codec.py's bf16 ratio; the live links run without a codec and their shapers
    emulate it (cross-site setups only); the sim's link gets the same ratio, coding free in both; the offered rate
    and the requests are those without the codec; the router assumes the link's KV rate."""
    from pdd.bench.codec import MEASURED_BF16_RATIO

    plans, configs = {}, {}
    for codec in ("none", "fp8+lossless"):
        args = em.parse_args(["--model", tiny_model, "--scenario", scenario, "--output-tokens", "8",
                              "--wan-codec", codec])
        (tmp_path / codec).mkdir()
        plans[codec] = em.plan(args, tmp_path / codec)
        configs[codec] = {n: em.setup_config(s, plans[codec], args, tmp_path / "spans")
                          for n, s in em.live.SETUPS.items()}
    plain, coded = plans["none"], plans["fp8+lossless"]
    wire = 1 / MEASURED_BF16_RATIO["fp8+lossless"]
    assert coded.codec["wire_ratio"] == pytest.approx(wire) and "real bf16 KV" in coded.codec["source"]
    assert coded.rate == plain.rate and coded.link.rate_bits == plain.link.rate_bits
    assert (coded.scn.wan.codec_wire_ratio, coded.scn.wan.codec_mb_s) == (pytest.approx(wire), 0.0)
    assert plain.scn.wan.codec_wire_ratio == 1.0 and "wire_ratio" not in configs["none"]["pdd"]["transports"]["wan"][
        "options"]["shape"]
    for name, cfg in configs["fp8+lossless"].items():
        wan = cfg["transports"]["wan"]
        assert wan["codec"] == "none", name
        crossing = name != "colocated"
        assert wan["options"].get("shape", {}).get("wire_ratio") == (coded.link.wire_ratio if crossing else None)
        assert cfg["policy"]["default_wan_gbps"] == pytest.approx(
            configs["none"][name]["policy"]["default_wan_gbps"] / wire)
    run = em.build_run(coded, 6, 0, em.parse_args(["--model", tiny_model, "--scenario", scenario]))
    for name in ("naive", "pdd"):
        setup = em.live.SETUPS[name]
        coded_bytes = em.sim_figures(coded, setup, run, coded.rate, 1.0)[0]["wan_bytes"]
        plain_bytes = em.sim_figures(plain, setup, run, plain.rate, 1.0)[0]["wan_bytes"]
        assert plain_bytes > 0 and coded_bytes == pytest.approx(plain_bytes * wire, rel=0.1), name


@pytest.mark.timeout(240)
def test_a_wan_codec_sends_its_ratio_fewer_wan_bytes_live_and_in_sim(scenario, tiny_model, tmp_path) -> None:
    """The same four requests over naive (it sends every prompt's whole KV: no route to vary) with no codec and with
    fp8+lossless: P's WAN byte counter and the simulator's bytes both fall by the measured ratio."""
    from pdd.bench.codec import MEASURED_BF16_RATIO

    setup, wan = em.live.SETUPS["naive"], {}
    for codec in ("none", "fp8+lossless"):
        args = em.parse_args(["--model", tiny_model, "--scenario", scenario, "--output-tokens", "8", "--requests", "4",
                              "--seeds", "1", "--rate", "4", "--setups", "naive", "--wan-codec", codec])
        (tmp_path / codec).mkdir()
        bench = em.Bench(args, tmp_path / codec)
        run = bench.run_for(0, 4)
        with em.live.setups_running(bench.systems):
            system = bench.open(setup)
            try:
                results, _, live_bytes = bench.one_run(system, run, bench.plan.rate)
            finally:
                bench.close(system)
        assert all(r.ok for r in results), [r.error for r in results]
        sim = em.sim_figures(bench.plan, setup, run, bench.plan.rate, 1.0)[0]["wan_bytes"]
        wan[codec] = (live_bytes * bench.plan.scale, sim, [r.prompt for r in run.planned])
    assert wan["none"][2] == wan["fp8+lossless"][2]  # the same requests
    ratio = MEASURED_BF16_RATIO["fp8+lossless"]
    assert wan["none"][0] / wan["fp8+lossless"][0] == pytest.approx(ratio, rel=0.01)
    assert wan["none"][1] / wan["fp8+lossless"][1] == pytest.approx(ratio, rel=1e-6)
    assert wan["none"][0] == pytest.approx(wan["none"][1], rel=0.05)  # live reads the sim's modeled bytes


def test_kv_ready_lag_is_judged_against_the_streamed_exports_bound() -> None:
    """MD ready minus P's prefill end, over delay + max(last chunk's transfer, transfer - prefill), on transfers of
    at least 4 chunks' worth of bytes: a 5-chunk prompt (MD holds none) whose transfer outlasts its prefill, and one of
    which MD holds 3 chunks (not judged)."""
    from pdd.launch.emulate import EmulatedLink

    link = EmulatedLink(rate_bits=8e6, delay_s=0.2, why="test")  # 1 MB/s

    def spans(rid, prompt, md_hit, nbytes, prefill_s, ready_after_s):
        end = 10 * 10**9
        return [
            {"name": "prefill", "service": "pdd-prefill", "start_ns": end - int(prefill_s * 1e9), "end_ns": end,
             "attributes": {"request_id": rid, "prompt_tokens": prompt, "cached_tokens": 0}},
            {"name": "kv.transfer.wan", "service": "pdd-prefill", "start_ns": end - 10**9, "end_ns": end + 1,
             "attributes": {"request_id": rid, "bytes": nbytes, "blocks": 10, "cached_tokens_at_peer": md_hit}},
            {"name": "kv.receive", "service": "pdd-main-decode", "start_ns": end, "end_ns": end + int(ready_after_s * 1e9),
             "attributes": {"request_id": rid}},
        ]
    # 5 x 100-token chunks, 10 kB a token: 5 MB, 5 s at 1 MB/s; prefill 2 s -> bound 0.2 + max(1, 3) = 3.2 s
    judged = spans("a", 500, 0, 5_000_000, 2.0, 4.0)
    skipped = spans("b", 500, 300, 2_000_000, 2.0, 9.0)
    lag = em.kv_ready_lag(judged + skipped, link, chunk_tokens=100)
    assert lag["requests"] == 1 and lag["p50"] == pytest.approx(4.0 / 3.2, abs=1e-3)
    assert lag["isolated"]["requests"] == 0  # the two transfers overlap: each may have queued behind the other
    alone = em.kv_ready_lag(judged, link, chunk_tokens=100)["isolated"]
    assert alone["requests"] == 1 and alone["p50"] == lag["p50"]
    # no step marked: the prompt's KV is final only at the prefill's end, so the floor is the whole send after it
    assert lag["over_floor"]["p50"] == pytest.approx(4.0 / 5.2, abs=1e-3)
    # chunks final every 0.4 s: the first can leave only at 0.4 s, so the last byte lands 5.4 s after the start,
    # 3.4 s after the prefill's end: floor 0.2 + 3.4 (the bound misses the first chunk's compute)
    start = judged[0]["start_ns"]
    judged[0]["events"] = [{"name": BLOCKS_FINAL_EVENT, "ts_ns": start + int(0.4e9 * k), "attributes": {"tokens": 100 * k}}
                           for k in range(1, 5)]
    floor = em.kv_ready_lag(judged, link, chunk_tokens=100)["over_floor"]
    assert floor["requests"] == 1 and floor["p50"] == pytest.approx(4.0 / 3.6, abs=1e-3)
    # main decode holding the first 150 tokens: what crosses starts in the second chunk (final at 0.8 s) -> 3.5 MB
    # from 0.8 s, 2.3 s past the end: floor 2.5; bound 0.2 + max(1.0, 3.5 - 2) = 1.7
    judged[1]["attributes"]["cached_tokens_at_peer"] = 150
    judged[1]["attributes"]["bytes"] = 3_500_000
    partial = em.kv_ready_lag(judged, link, chunk_tokens=100)
    assert partial["p50"] == pytest.approx(4.0 / 1.7, abs=1e-3)
    assert partial["over_floor"]["p50"] == pytest.approx(4.0 / 2.5, abs=1e-3)


# ---- --trace: a Mooncake trace replayed live beside the simulator with block chains ----------------------------
EXCERPT = ROOT / "tests" / "data" / "mooncake" / "conversation_excerpt.jsonl"


@pytest.fixture(scope="module")
def few_lines(tmp_path_factory) -> Path:
    """Six lines of the excerpt, one per timestamp (0 to 15 s), each sharing its first block (hash id 0) with the
    others: the caches' reuse is the trace's, and no two prompts arrive together."""
    lines = EXCERPT.read_text().splitlines()
    picked, seen = [], set()
    for text in lines:
        line = json.loads(text)
        if line["timestamp"] not in seen and line["hash_ids"][0] == 0:
            seen.add(line["timestamp"])
            picked.append(text)
    path = tmp_path_factory.mktemp("trace") / "few.jsonl"
    path.write_text("\n".join(picked[:6]) + "\n")
    return path


def _trace_args(scenario: str, model: str, trace: Path, *extra: str):
    return em.parse_args(["--model", model, "--scenario", scenario, "--trace", str(trace), "--trace-block-tokens", "32",
                          *extra])


def test_a_trace_run_is_the_replays_requests_and_the_sims_chains(scenario, tiny_model, few_lines, tmp_path) -> None:
    """Cheap: prompts are replay.py's token ids (equal hash ids, equal blocks), the simulator gets the same lengths,
    chains and outputs; a later run's ids share no block with the first; the default time scale is the scenario's
    pdd prefill instances; the live engines' pools become the simulator's capacities."""
    from pdd.loadgen.trace import prompt_token_ids, read_trace

    args = _trace_args(scenario, tiny_model, few_lines, "--max-tokens", "output")
    plan = em.plan(args, tmp_path)
    reqs = read_trace(few_lines)
    assert plan.trace is not None and plan.trace.time_scale == plan.scenario_split["prefill"] == 3
    assert plan.rate == pytest.approx(plan.trace.rate / 3)
    run = em.build_trace_run(plan, 0, None)
    assert [r.prompt for r in run.planned] == [prompt_token_ids(r, 32, plan.trace.pool) for r in reqs]
    assert all(r.prompt[:32] == run.planned[0].prompt[:32] for r in run.planned)  # hash id 0 in every prompt
    assert [len(r.prompt) for r in run.planned] == run.arrays.prompt.tolist() == [r.input_tokens(32) for r in reqs]
    assert [r.max_tokens for r in run.planned] == [r.sent_max_tokens for r in run.planned] == \
        run.trace.output.tolist() == [r.output_length for r in reqs]
    assert (run.unit / plan.rate).tolist() == pytest.approx([(r.arrival_s - reqs[0].arrival_s) * 3 for r in reqs])
    other = em.build_trace_run(plan, 1, None)
    assert not {h for c in other.trace.chains for h in c} & {h for c in run.trace.chains for h in c}
    assert other.planned[0].prompt[:32] != run.planned[0].prompt[:32]
    cap = {"prefill": 1600, "relay": 800, "main-decode": 3200}
    inp = em.sim_input(plan, em.live.SETUPS["pdd"], run, plan.rate, cap)
    assert inp.chains == run.trace.chains and inp.block_tokens == 32
    assert (inp.prefill_cache_tokens, inp.relay.kv_capacity_tokens, inp.decode.kv_capacity_tokens) == (1600, 800, 3200)
    assert (inp.after == -1).all()


def test_requests_sharing_a_timestamp_spread_over_its_tick_in_file_order(scenario, tiny_model, tmp_path) -> None:
    """The excerpt's first 12 lines: 10 at 0 s, 2 at 3 s (a 3 s grid). Spread (default): in file order, evenly up to
    the next timestamp (the last tick: the median tick); burst: as recorded. Live and sim get the same times."""
    import numpy as np

    from pdd.bench.pipelines_trace import spread_ties

    out, tick = spread_ties(np.array([0, 0, 0, 3, 3, 6.0]))
    assert tick == 3 and out.tolist() == [0, 1, 2, 3, 4.5, 6]
    assert spread_ties(np.array([5.0, 5.0]))[1] == 0  # one timestamp: no tick to spread over
    times = {}
    for ties in ("spread", "burst"):
        args = em.parse_args(["--model", tiny_model, "--scenario", scenario, "--trace", str(EXCERPT),
                              "--num-prompts", "12", "--trace-block-tokens", "16", "--trace-time-scale", "1",
                              "--trace-ties", ties])
        plan = em.plan(args, tmp_path)
        run = em.build_trace_run(plan, 0, None)
        times[ties] = (run.unit / plan.rate).tolist()
        inp = em.sim_input(plan, em.live.SETUPS["pdd"], run, plan.rate)
        assert inp.arrivals.tolist() == pytest.approx(times[ties])
    assert times["burst"] == pytest.approx([0.0] * 10 + [3.0] * 2)
    assert times["spread"] == pytest.approx([0.3 * k for k in range(10)] + [3.0, 4.5])


@pytest.mark.parametrize("flags, why", [
    (["--trace-block-tokens", "24"], "multiple"),
    (["--context-tokens", "128"], "own lengths"),
    (["--max-tokens", "-3"], "max-tokens"),
])
def test_trace_flags_that_cannot_run_are_refused(scenario, tiny_model, few_lines, flags, why, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        em.parse_args(["--model", tiny_model, "--scenario", scenario, "--trace", str(few_lines), *flags])
    assert exc.value.code == 2 and why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        em.parse_args(["--model", tiny_model, "--scenario", scenario, "--num-prompts", "3"])  # only with --trace


@pytest.mark.timeout(300)
def test_emulated_benchmark_on_a_trace_end_to_end(scenario, tiny_model, few_lines, tmp_path) -> None:
    """Six excerpt lines through every setup, live and simulated: live and sim figures per setup, the same requests
    (prompt lengths per request), and P's prefix hits live where the trace shares a prefix (no timing figure is
    checked: the comparison's accuracy is the benchmark's output, not a test's)."""
    from pdd.loadgen.trace import hit_tokens, read_trace

    proc = subprocess.run(
        [sys.executable, "-m", "pdd.bench.pipelines", "--backend", "emulated", "--model", tiny_model,
         "--scenario", scenario, "--trace", str(few_lines), "--trace-block-tokens", "16", "--trace-time-scale", "0.1",
         "--goodput-steps", "1", "--run-dir", str(tmp_path / "run")],
        check=False, capture_output=True, text=True, timeout=290)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    reqs = read_trace(few_lines)
    prompts = [r.input_tokens(16) for r in reqs]
    shared = hit_tokens([r.hash_ids for r in reqs], prompts, 16)
    assert shared.sum() > 0
    t = report["trace"]
    assert (t["file"], t["requests"], t["block_tokens"], t["time_scale"], t["max_tokens"]) == \
        ("few.jsonl", 6, 16, 0.1, "none")
    assert set(t["capacity_tokens"]) >= set(em.live.SETUPS)
    assert set(report["setups"]) == set(em.live.SETUPS)
    for name, setup in report["setups"].items():
        rep = setup["repeats"][0]
        assert rep["completed"] == rep["requests"] == rep["sim"]["completed"] == 6, (name, rep["errors"])
        for key in ("ttft_p90_s", "ttft_mean_s", "goodput_rps", "wan_bytes_per_request", "p_hit_tokens"):
            v = setup["vs_sim"][key]
            assert v["live"] is not None and v["sim"] is not None, (name, key, v)
        rows = json.loads(Path(rep["per_request_file"]).read_text())
        assert [x["prompt"] for x in rows] == [x["sim_prompt"] for x in rows] == prompts, name
        assert rep["trace_hits"]["prompts_equal"]
        # P's cache served the shared first block live, as the simulator's chains say it could
        assert 0 < rep["hit_tokens"]["prefill"] <= shared.sum(), (name, rep["hit_tokens"])
        assert rep["sim"]["p_hit_tokens"] == shared.sum(), name
    assert report["setups"]["colocated"]["vs_sim"]["wan_bytes_per_request"]["sim"] == 0
    for name in ("naive", "naive-stream0", "pdd"):
        assert report["setups"][name]["vs_sim"]["wan_bytes_per_request"]["live"] > 0, name
