"""The emulated backend's per-role profile (services/emulation.py): which chips each role emulates, the KV
scale after rounding, and clear errors for a scenario or system that does not fit."""

from __future__ import annotations

import pytest

from pdd.engine.emulated_backend import profile as emulation
from pdd.engine.emulated_backend.settings import EmulationSettings
from pdd.shared.config import ConfigError, load_config
from pdd.shared.roles import Role


def test_report_roles_run_on_the_scenarios_chips() -> None:
    cfg = EmulationSettings(scenario="report", system="pdd")
    p, rld, md = (emulation.profile(cfg, role) for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE))
    assert (p.chip, p.chips) == ("GPU-A (H800-class)", 8)
    assert (rld.chip, rld.chips) == ("GPU-A (H800-class)", 8)
    assert (md.chip, md.chips) == ("GPU-B (H200-class)", 8)
    # MD's chips have more memory and bandwidth: more KV room, shorter decode steps
    assert md.cost_model.kv_capacity_tokens > p.cost_model.kv_capacity_tokens
    assert md.cost_model.step_time(1, 1000) < p.cost_model.step_time(1, 1000)
    # 50,000 modeled bytes per token / 1000 -> 48 real bytes (3 x the 16-byte granule): scale 1/1041.67
    assert p.real_kv_bytes_per_token == 48 and p.scale == pytest.approx(50000 / 48)
    assert p.describe()["kv_scale"] == pytest.approx(1041.67)


def test_relay_without_its_own_chip_sits_on_the_prefill_chip() -> None:
    naive = EmulationSettings(scenario="report", system="naive")  # roles: prefill A, decode B; no relay
    assert emulation.profile(naive, Role.RELAY).chip == "GPU-A (H800-class)"


def test_head_dim_rounds_to_the_nearest_granule_and_never_below_one() -> None:
    assert emulation.head_dim_for(64, 1) == 4
    assert emulation.head_dim_for(50000, 1000) == 3
    assert emulation.head_dim_for(64, 1000) == 1  # scale capped by the pool's smallest layout


@pytest.mark.parametrize("field, value, says", [("scenario", "no-such-scenario", "emulation.scenario"),
                                                ("system", "nope", "no system 'nope'")])
def test_bad_scenario_or_system_is_a_config_error(field, value, says) -> None:
    with pytest.raises(ConfigError, match=says):
        emulation.profile(EmulationSettings(**{field: value}), Role.PREFILL)


def test_config_refuses_bad_emulation_values(tmp_path) -> None:
    path = tmp_path / "pdd.yaml"
    path.write_text("model: {backend: gpu}\n")
    with pytest.raises(ConfigError, match="model.backend: unknown engine backend 'gpu'"):
        load_config(path, environ={})
    path.write_text("model: {backend: emulated}\nemulation: {kv_scale: 0.5, time_dilation: 0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    text = str(err.value)
    assert "emulation.kv_scale" in text and "emulation.time_dilation" in text
