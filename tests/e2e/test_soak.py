"""Soak (issue #8): mixed load with random client aborts and bad requests on a whole PDD system.

The default run soaks briefly (30 requests, 3 workers; --seconds only caps a very slow machine): after the drain no engine may hold a KV block that is neither free
nor reclaimable cache, no request may hang and no process may die. RSS growth is not asserted here
(a few seconds of load say nothing about it); the slow test runs the full 10-minute soak
(bench/soak.py) and asserts its overall verdict, RSS growth included.

An engine that does not answer the health read the leak count comes from (frozen with SIGSTOP, or
dead) fails the soak's and the chaos benchmark's verdict instead of reading "0 leaked".
"""

from __future__ import annotations

import json
import signal

import pytest

from pdd.bench import chaos, soak
from pdd.launch.local_cluster import LocalCluster
from pdd.shared.roles import Role


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


def test_unanswered_health_read_counts_as_failure(tmp_path, tiny_model):
    args = soak.build_parser().parse_args(["--model", tiny_model, "--run-dir", str(tmp_path)])
    with LocalCluster(tmp_path / "run", soak.cluster_config(args, tiny_model)) as cluster:
        cluster.start(300)
        roles = {iid: m.role for iid, m in cluster.members.items()}
        engines = {iid: role for iid, role in roles.items() if role != Role.ROUTER}
        answered = cluster.wait_idle(30)
        assert soak.leak_accounting(roles, answered) == {
            "leaked": {"p-0": 0, "rld-0": 0, "md-0": 0}, "unanswered": [], "ok": True}
        assert chaos.scenario_ok({**chaos.summarize([], [], answered, engines), "fault_mid_stream": True})

        cluster.kill("md-0", signal.SIGSTOP)  # alive, holding its blocks, answering nothing
        try:
            frozen = cluster.wait_idle(1)
        finally:
            cluster.kill("md-0", signal.SIGCONT)
        assert frozen["md-0"] < 0, frozen
        accounting = soak.leak_accounting(roles, frozen)
        assert accounting["unanswered"] == ["md-0"] and accounting["leaked"]["md-0"] is None
        assert not accounting["ok"]
        summary = chaos.summarize([], [], frozen, engines)
        assert summary["health_unanswered"] == ["md-0"] and summary["leaked_blocks"] == 0
        assert not chaos.scenario_ok({**summary, "fault_mid_stream": True})

        cluster.kill("rld-0")  # dead: no reading at all is no answer either
        accounting = soak.leak_accounting(roles, cluster.wait_idle(30))
        assert accounting["unanswered"] == ["rld-0"] and not accounting["ok"]


def test_chaos_fault_that_hit_nothing_fails():
    done = {"total": 4, "completed": 4, "identical": 4, "lost": 0, "hung": 0, "leaked_blocks": 0,
            "health_unanswered": []}
    assert chaos.scenario_ok({**done, "fault_mid_stream": True})
    assert chaos.scenario_ok({**done, "fault_mid_stream": None})  # stop_p: before the requests, by design
    assert not chaos.scenario_ok({**done, "fault_mid_stream": False})
