"""Workload generators: the hit distribution is what was configured, prompts share real prefixes."""

import json
import os

import numpy as np
import pytest

from pdd.loadgen.workload import (
    AgenticConfig,
    HitDistribution,
    agentic_arrays,
    agentic_sessions,
    random_specs,
    sharegpt_specs,
)


def test_default_hit_distribution_is_report_like():
    h = HitDistribution()
    assert abs(h.mean() - 0.9) < 0.02  # report: mean ~90%
    p_above_95 = sum(p for p, (lo, _) in zip(h.probabilities, h.bins) if lo >= 0.95)
    assert 0.70 <= p_above_95 <= 0.80  # report: 70-80% of requests hit > 95%


@pytest.mark.parametrize("weights", [None, (0.5, 0.1, 0.1, 0.1, 0.1, 0.1)])
def test_arrays_hit_bins_match_config(weights):
    dist = HitDistribution(weights=weights) if weights else HitDistribution()
    wl = agentic_arrays(AgenticConfig(num_requests=20000, context_tokens=64000, hits=dist, seed=3))
    counts = np.bincount(dist.bin_index(wl.hit), minlength=len(dist.bins)) / len(wl)
    assert np.allclose(counts, dist.probabilities, atol=0.015)


def test_sessions_prompts_extend_previous_turns_and_match_hits():
    cfg = AgenticConfig(num_requests=600, context_tokens=1500, output_tokens=20, seed=5)
    specs = agentic_sessions(cfg)
    dist = cfg.hits
    hits = np.array([s.hit_rate for s in specs])
    counts = np.bincount(dist.bin_index(hits), minlength=6) / len(specs)
    assert np.allclose(counts, dist.probabilities, atol=0.05)
    # the cached prefix is literally shared with the previous turn of the same session
    for prev, cur in zip(specs, specs[1:]):
        if cur.session != prev.session or cur.turn == 0:
            continue
        a = " ".join(m["content"] for m in prev.messages).split()
        b = " ".join(m["content"] for m in cur.messages).split()
        assert len(os.path.commonprefix([a, b])) >= min(cur.cached_tokens, len(a)) - 1
        assert cur.messages[-1]["role"] == "user"


def test_random_and_sharegpt(tmp_path):
    specs = random_specs(50, 100, 10, range_ratio=0.5, seed=1)
    assert all(50 <= s.prompt_tokens <= 150 and 5 <= s.output_tokens <= 15 for s in specs)
    conv = [{"conversations": [{"from": "human", "value": "hi " * 40}, {"from": "gpt", "value": "yo " * 30},
                               {"from": "human", "value": "more " * 10}, {"from": "gpt", "value": "ok " * 5}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(conv))
    sg = sharegpt_specs(p, 10)
    assert len(sg) == 2 and sg[1].cached_tokens > 0 and sg[1].prompt_tokens > sg[0].prompt_tokens
    p.write_text("{}")
    with pytest.raises(ValueError):
        sharegpt_specs(p, 10)


def test_bad_hit_config_is_rejected():
    with pytest.raises(ValueError):
        HitDistribution(bins=((0.0, 0.5),), weights=(1.0, 2.0))
    with pytest.raises(ValueError):
        HitDistribution(bins=((0.5, 1.2),), weights=(1.0,))
