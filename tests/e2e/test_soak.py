"""Soak (issue #8): mixed load with random client aborts and bad requests on a whole PDD system.

The default run soaks briefly (30 requests, 3 workers; --seconds only caps a very slow machine): after the drain no engine may hold a KV block that is neither free
nor reclaimable cache, no request may hang and no process may die. RSS growth is not asserted here
(a few seconds of load say nothing about it); the slow test runs the full 10-minute soak
(bench/soak.py) and asserts its overall verdict, RSS growth included.
"""

from __future__ import annotations

import json

import pytest

from pdd.bench import soak


def test_short_soak_leaks_nothing(tmp_path, tiny_model):
    args = soak.build_parser().parse_args([
        "--requests", "30", "--seconds", "120", "--warmup", "1", "--workers", "3", "--abort-share", "0.3",
        "--bad-share", "0.1", "--sample-interval", "2", "--model", tiny_model, "--policy", json.dumps(soak.TINY_POLICY),
        "--run-dir", str(tmp_path)])
    result = soak.run(args)
    req = result["requests"]
    engines = {iid: i for iid, i in result["instances"].items() if i["role"] != "router"}
    assert set(engines) == {"p-0", "rld-0", "md-0"}
    assert {iid: i["leaked_blocks"] for iid, i in engines.items()} == {iid: 0 for iid in engines}, result
    assert all(i["after_drain_in_flight"] == 0 for i in result["instances"].values()), result["instances"]
    assert result["died"] == {}
    assert all(i["alive"] for i in result["instances"].values())
    assert result["stopped_cleanly"] == {iid: True for iid in result["instances"]}  # drained, then stopped
    assert req["hung"] == 0, result["hung_examples"]
    assert req["completed"] > 0 and req["aborted"] > 0, req
    assert req["bad_unexpected"] == {}, req  # malformed requests are all answered 4xx
    assert not [k for k in req["errored_by_status"] if k.startswith("500")], req


@pytest.mark.slow
def test_ten_minute_soak(capsys):
    code = soak.main(["--seconds", "600"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["ok"], out[-4000:]
    assert all(result["router_pipelines"].get(p, 0) > 0 for p in soak.PIPELINES), result["router_pipelines"]
