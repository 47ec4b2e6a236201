"""`pdd plan`: every deployment it tries fits the budget, and on a tiny trace it names a system to deploy."""

import json
from pathlib import Path

from pdd.launch.cli import main
from pdd.sim.plan import deployments
from pdd.sim.scenario import Scenario, load_yaml, set_path

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_excerpt.jsonl"


def test_every_deployment_fits_the_budget_and_uses_every_role():
    data = load_yaml("report")
    scn = Scenario.from_dict(data)
    budget = scn.hardware_cost("pdd")
    for name in ("baseline", "naive", "pdd"):
        options = deployments(scn, name, budget)
        assert options, name
        roles = set(scn.system(name)["roles"])
        for chips, split in options:
            assert set(split) == roles and min(split.values()) >= 1
            varied = Scenario.from_dict(set_path(data, f"systems.{name}.chips", chips))
            assert varied.hardware_cost(name) <= budget + 1e-9, (name, chips)
    mixes = {tuple(sorted(chips.items())) for chips, _ in deployments(scn, "pdd", budget)}
    assert len(mixes) > 3  # the A:B mix varies, not only the split


def test_plan_on_a_tiny_trace_recommends_a_system(tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc = main(["plan", "--trace", str(EXCERPT), "--num-prompts", "60", "--top", "1", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0 and png.stat().st_size > 0
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["plans"]) == {"none", "output"}
    for rule, plan in result["plans"].items():
        assert plan["deploy"] in ("baseline", "naive", "pdd") and f"max_tokens {rule}: deploy {plan['deploy']}" in out
        best = max(plan["systems"].values(), key=lambda r: r["goodput_rps"])
        assert plan["systems"][plan["deploy"]]["goodput_rps"] == best["goodput_rps"]
        for row in plan["systems"].values():
            assert row["hardware_cost"] <= result["budget"] + 1e-9 and row["goodput_rps"] >= 0


def test_plan_rejects_a_bad_trace_before_simulating(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}\n')
    assert main(["plan", "--trace", str(bad), "--plot", "none"]) == 2
    assert ":1: field 'hash_ids'" in capsys.readouterr().err
