"""`pdd sim report` output shape, the bathtub plot, and calibration on synthetic bench JSON."""

import json

import pytest

from pdd.loadgen.workload import AgenticConfig, agentic_arrays
from pdd.shared.cost_model import CostModel
from pdd.sim.calibrate import BenchRun, compare, fit, predict, to_bench_json
from pdd.sim.event_loop import SimInput, simulate
from pdd.sim.scenario import unit_poisson

KEYS = {"ttft_reduction", "goodput_gain", "hw_cost_change", "wan_bandwidth_ratio", "rld_token_share"}


def test_report_cli_last_line_is_json(tmp_path, capsys):
    from pdd.launch.cli import main

    rc = main(["sim", "report", "--num-requests", "300", "--no-sensitivity", "--out-dir", str(tmp_path)])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figs = json.loads(last)
    assert set(figs) == KEYS and all(isinstance(v, float) for v in figs.values())
    assert (tmp_path / "bathtub.png").stat().st_size > 0 and (tmp_path / "sim_ttft_cdf.png").stat().st_size > 0


TRUE = CostModel(p0=0.03, p_tok=2e-4, p_attn=2e-8, d0=0.01, d_seq=2e-3, d_ctx=5e-7)


def _synthetic_run(seed, rate, n=400):
    wl = agentic_arrays(AgenticConfig(num_requests=n, context_tokens=600, context_jitter=0.5, output_tokens=40,
                                      output_jitter=0.5, seed=seed))
    inp = SimInput(arrivals=unit_poisson(n, seed) / rate, prompt=wl.prompt, cached=wl.cached, output=wl.output,
                   prefill=TRUE, decode=TRUE, n_prefill=1, n_decode=1, kv_bytes_per_token=1.0, kind="local",
                   rdma_setup_s=0.0, seed=seed, record_itl=False)
    return to_bench_json(inp, simulate(inp))


def test_calibration_recovers_coefficients_and_predicts_holdout(tmp_path):
    paths = []
    for seed, rate in ((1, 0.5), (2, 1.0)):
        p = tmp_path / f"fit{seed}.json"
        p.write_text(json.dumps(_synthetic_run(seed, rate)))
        paths.append(p)
    cm = fit([BenchRun.load(p) for p in paths])
    assert cm.p_tok == pytest.approx(TRUE.p_tok, rel=0.25)
    assert cm.d_seq == pytest.approx(TRUE.d_seq, rel=0.25)
    assert cm.d0 == pytest.approx(TRUE.d0, rel=0.25)
    hold = BenchRun.from_json(_synthetic_run(3, 0.8))
    cmp = compare(predict(cm, hold), hold)
    assert abs(cmp["ttft_p50_error"]) < 0.2 and abs(cmp["ttft_p90_error"]) < 0.2


def test_calibrate_cli(tmp_path, capsys):
    from pdd.launch.cli import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_synthetic_run(1, 0.5)))
    b.write_text(json.dumps(_synthetic_run(3, 0.8)))
    assert main(["sim", "calibrate", "--fit", str(a), "--predict", str(b)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"coefficients", "ttft_p50_error", "ttft_p90_error"} <= set(out)


def test_import_is_cheap():
    import subprocess
    import sys

    code = "import sys, pdd.sim, pdd.sim.event_loop, pdd.loadgen.workload; print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_report_sweep_shows_progress_on_stderr(tmp_path, capsys, monkeypatch):
    """One progress line per sensitivity point goes to stderr; stdout keeps the tables and the JSON last line."""
    from pdd.launch.cli import main
    from pdd.sim import report

    monkeypatch.setattr(report, "SENSITIVITY", (("wan.setup_s", (0.05, 0.5)), ("utilisation.mfu", (0.5,))))
    rc = main(["sim", "report", "--num-requests", "300", "--sensitivity-requests", "100", "--out-dir", str(tmp_path)])
    assert rc == 0
    captured = capsys.readouterr()
    progress = [line for line in captured.err.splitlines() if line.startswith("sensitivity ")]
    assert [line.split(" (")[0] for line in progress] == [
        "sensitivity 1/3: wan.setup_s=0.05", "sensitivity 2/3: wan.setup_s=0.5", "sensitivity 3/3: utilisation.mfu=0.5"]
    assert "sensitivity 1/3" not in captured.out
    assert set(json.loads(captured.out.strip().splitlines()[-1])) == KEYS
    saved = json.loads((tmp_path / "report.json").read_text())["sensitivity"]
    assert [(row["param"], row["value"]) for row in saved] == [("wan.setup_s", 0.05), ("wan.setup_s", 0.5),
                                                               ("utilisation.mfu", 0.5)]
