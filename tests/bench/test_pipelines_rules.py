"""bench/pipelines.py on the tiny model: each setup's first-token rule as the client sees it, and the
WAN calibration's stopping rule against real naive clusters (real processes, real NATS, real sockets)."""

from __future__ import annotations

import asyncio

import pytest

from pdd.bench import pipelines as bench
from pdd.shared.pipelines import Pipeline

TINY_ARGS = ["--sessions", "1", "--turns", "3", "--system-tokens", "60", "--task-tokens", "40",
             "--long-tool-tokens", "30", "--new-tokens", "8", "--output-tokens", "12",
             "--anomalous-prompt-tokens", "200", "--anomalous-min-prompt-tokens", "150",
             "--think-s", "0.1", "--delay", "250ms", "--jitter", "0ms"]


@pytest.fixture(scope="module")
def args(tiny_model):
    return bench.parse_args(["--model", tiny_model, *TINY_ARGS])


def test_each_setup_declares_its_first_token_rule(args, tmp_path) -> None:
    configs = {name: bench.setup_config(s, args, "100mbit", tmp_path / "spans.jsonl")
               for name, s in bench.SETUPS.items()}
    assert [n for n, c in configs.items() if c["router"]["first_token_after_kv"]] == ["colocated", "naive"]
    assert {n: c["router"].get("forced_pipeline") for n, c in configs.items()} == {
        "colocated": Pipeline.P_MD, "naive": Pipeline.P_MD, "naive-stream0": Pipeline.P_MD, "pdd": None}
    assert "shape" not in configs["colocated"]["transports"]["wan"]["options"]
    assert all("shape" in configs[n]["transports"]["wan"]["options"] for n in ("naive", "naive-stream0", "pdd"))
    sites = {n: {i["id"]: i["site"] for i in c["instances"]}["md-0"] for n, c in configs.items()}
    assert sites == {"colocated": "site-a", "naive": "site-b", "naive-stream0": "site-b", "pdd": "site-b"}


@pytest.mark.parametrize("name", ["naive", "naive-stream0"])
def test_position_zero_is_held_or_streamed_as_the_setup_says(args, tmp_path, name) -> None:
    """Behind a 250 ms WAN: a held position 0 arrives with position 1 (TTFT = TT2); streamed, it
    arrives a WAN delay earlier."""
    system = bench.System(bench.SETUPS[name], tmp_path, args, "1gbit")
    system.start()
    try:
        vocab = bench.word_ids(args.model)
        requests = bench.build_requests(3, 1, args, vocab)

        async def run():
            async with bench.client_session() as client:
                return [await bench.send(client, system.base_url, r) for r in requests]

        results = asyncio.run(run())
    finally:
        system.stop()
    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:
        p = r.positions
        if name == "naive":
            assert p.tt2 == p.ttft
        else:
            assert p.tt2 - p.ttft > 0.2  # position 1 waits for MD's KV behind the 250 ms delay


def test_calibration_bisects_the_rate_on_baselines_only(args, tmp_path) -> None:
    args.calibration_steps = 2
    args.rate_range = "1mbit:4gbit"
    b = bench.Bench(args, tmp_path)
    colocated = b.open(bench.SETUPS["colocated"], "calibrate", None)
    try:
        colocated_p50 = b.calibration_run(colocated)
    finally:
        b.close(colocated)
    found = b.calibrate(colocated_p50)
    started = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert started[0] == "colocated-calibrate" and all(n.startswith("naive-calibrate-") for n in started[1:])
    assert len(found.probes) == len(started) - 1 and not b.systems  # every probe's cluster was stopped
    first = found.probes[0]
    assert first["x"] == pytest.approx((1e6 * 4e9) ** 0.5)
    if abs(first["y"] - bench.TARGET_RATIO) <= bench.RATIO_TOLERANCE:
        assert found.converged and len(found.probes) == 1  # stops at the first probe within tolerance
    else:  # the second probe moves toward the target: a faster link when naive was too slow
        assert (found.probes[1]["x"] > first["x"]) == (first["y"] > bench.TARGET_RATIO)


def test_goodput_probe_counts_which_slo_bound_each_request_missed() -> None:
    from pdd.loadgen.positions import PositionTimes

    planned = bench.Planned(0, 0, "turn", [1, 2, 3], 3, 0)

    def result(times: list[float] | None) -> bench.Result:
        if times is None:
            return bench.Result(planned, ok=False, error="HTTP 503")
        return bench.Result(planned, ok=True, positions=PositionTimes(0.0, times), output_tokens=len(times))

    results = [result([0.5, 1.0, 1.2, 1.4, 1.6, 1.8]),  # within both
               result([0.5, 2.5, 2.6, 2.7, 2.8, 2.9]),  # TT2 2.5 > 2.0 (mean ITL 0.48)
               result([0.5, 1.0, 3.0, 5.0, 6.0, 7.0]),  # mean ITL 1.3 > 1.0
               result([0.5, 4.0, 9.0, 9.5, 9.6, 9.7]),  # both
               result(None)]
    assert bench.slo_misses(results, 2.0, 1.0) == {"failed": 1, "tt2": 2, "mean_itl": 2}
    assert bench.slo_share(results, 2.0, 1.0) == pytest.approx(0.2)
