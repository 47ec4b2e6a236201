"""Engine backends are plugins: an entry point of the ``pdd.engines`` group is all a backend needs to be found,
configured and built (shared/engines.py); a config key no backend knows is refused with its name, and a key
the chosen backend ignores is warned about with its name (shared/config.py)."""

from __future__ import annotations

import textwrap
import warnings

import pytest

from pdd.engine.interface import EngineBackend, load_engine
from pdd.shared.config import ConfigError, ConfigWarning, load_config
from pdd.shared.engines import engine_plugins

TOY = """
from pydantic import BaseModel

from pdd.engine.emulated_backend.engine import EmulatedEngine
from pdd.shared.cost_model import CostModel
from pdd.shared.engines import EnginePlugin


class ToySettings(BaseModel):
    model_config = {"extra": "forbid"}
    toy_blocks: int = 8


def build(config, role, cache_finished):
    s = config.engine_settings()
    return EmulatedEngine(CostModel(p0=0.0, d0=0.0), num_blocks=s.toy_blocks, block_size=config.model.block_size,
                          cache_finished=cache_finished)


PLUGIN = EnginePlugin(name="toy", model_settings=ToySettings, build="pdd_toy_backend:build")
"""


@pytest.fixture
def toy_backend(tmp_path, monkeypatch):
    """A backend that exists only as an installed distribution with one ``pdd.engines`` entry point."""
    (tmp_path / "pdd_toy_backend.py").write_text(TOY)
    dist = tmp_path / "pdd_toy_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pdd-toy-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pdd.engines]\ntoy = pdd_toy_backend:PLUGIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine_plugins.cache_clear()
    yield
    engine_plugins.cache_clear()


def _config(tmp_path, text: str, environ: dict[str, str] | None = None):
    path = tmp_path / "pdd.yaml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, environ=environ or {})


def test_a_backend_registered_only_by_an_entry_point_is_found_configured_and_built(toy_backend, tmp_path) -> None:
    assert {"torch", "emulated", "vllm", "toy"} <= set(engine_plugins())
    config = _config(tmp_path, "model: {backend: toy, block_size: 4, toy_blocks: 6}\n")
    engine = load_engine(config, "main-decode", True)
    assert isinstance(engine, EngineBackend) and engine.num_total_blocks() == 6 and engine.block_size == 4
    engine.add_request("r", [1, 2, 3], max_new_tokens=3)
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.token_ids]
    assert len(out) == 3
    with pytest.raises(ConfigError, match="toy_blocks"):  # its settings are typed: a bad value names the key
        _config(tmp_path, "model: {backend: toy, toy_blocks: many}\n")


def test_without_its_entry_point_the_backend_is_unknown(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown engine backend 'toy'.*emulated, torch, vllm"):
        _config(tmp_path, "model: {backend: toy}\n")


@pytest.mark.parametrize("text, names", [("model: {batch_invariantt: false}\n", "model.batch_invariantt"),
                                         ("emulatoin: {scenario: small}\n", "emulatoin")])
def test_a_key_no_backend_knows_is_refused_by_name(tmp_path, text, names) -> None:
    with pytest.raises(ConfigError, match=f"{names}: unknown field; check the spelling"):
        _config(tmp_path, text)


def test_an_env_override_of_an_unknown_key_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match="model.dtypo"):
        _config(tmp_path, "model: {}\n", {"PDD__MODEL__DTYPO": "float32"})


@pytest.mark.parametrize("text, names", [
    ("model: {backend: vllm, batch_invariant: false}\n", "model.batch_invariant: means nothing to engine backend "
                                                         "'vllm'"),
    ("model: {backend: torch}\nemulation: {time_dilation: 2}\n", "emulation: means nothing to engine backend 'torch'"),
])
def test_a_known_key_the_chosen_backend_ignores_is_warned_about_by_name(tmp_path, text, names) -> None:
    with pytest.warns(ConfigWarning, match=names):
        _config(tmp_path, text)


def test_the_chosen_backends_keys_are_typed_and_env_overrides_them(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # nothing here is ignored
        config = _config(tmp_path, "model: {batch_invariant: false, dtype: float32}\n",
                         {"PDD__MODEL__BATCH_INVARIANT": "true", "PDD__MODEL__KV_MEMORY_MB": "64"})
        assert config.engine_settings().batch_invariant is True and config.engine_settings().kv_memory_mb == 64
        emulated = _config(tmp_path, "model: {backend: emulated}\nemulation: {scenario: small}\n",
                           {"PDD__EMULATION__TIME_DILATION": "3"})
        assert emulated.engine_section().scenario == "small" and emulated.engine_section().time_dilation == 3.0


def test_a_backend_section_that_is_not_a_mapping_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="emulation"):
        _config(tmp_path, "model: {backend: emulated}\nemulation: 5\n")
    empty = _config(tmp_path, "model: {backend: emulated}\nemulation:\n")  # an empty section: its defaults
    assert empty.engine_section().scenario == "report"
