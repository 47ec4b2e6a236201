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
         "--goodput-steps", "1", "--run-dir", str(tmp_path / "run")],
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
    hit = report["workload_md_hit"]
    assert 0 < hit < 1 and report["wan_bytes_ratio_if_only_missing_kv"] == pytest.approx(1 / (1 - hit), rel=1e-3)
    assert {"pdd:P-MD", "pdd:P-RLD-MD"} & {f"pdd:{k}" for k in report["setups"]["pdd"]["repeats"][0]["pipeline_mix"]}
