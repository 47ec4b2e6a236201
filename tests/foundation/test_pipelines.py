"""The pipeline declaration: each spec's owners, dependencies and needed roles, stated as a table, and
the one rule for what a client or operator may force."""

from __future__ import annotations

import pytest

from pdd.router.openai_schema import PDDOptions
from pdd.shared.config import ConfigError, load_config
from pdd.shared.pipelines import ROUTABLE, SPECS, Pipeline, routable, spec
from pdd.shared.roles import Role

P, RLD, MD = Role.PREFILL, Role.RELAY, Role.MAIN_DECODE


def owners(pipeline: Pipeline, position: int, relay_until: int | None) -> dict[Role, bool | None]:
    return {role: spec(pipeline).owns(role, position, relay_until) for role in (P, RLD, MD)}


def test_every_pipeline_has_a_spec_and_the_routable_ones_are_the_three_of_the_paper() -> None:
    assert set(SPECS) == set(Pipeline)
    assert ROUTABLE == (Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.P_RLD)


@pytest.mark.parametrize("pipeline, kv_to, needs", [
    (Pipeline.P_MD, {MD}, {P, MD}),
    (Pipeline.P_RLD_MD, {RLD, MD}, {P, RLD, MD}),
    (Pipeline.P_RLD, {RLD}, {P, RLD}),
    (Pipeline.RESUME, set(), set()),
])
def test_where_kv_goes_and_which_roles_a_request_needs(pipeline, kv_to, needs) -> None:
    assert spec(pipeline).kv_to == kv_to
    assert spec(pipeline).roles == needs
    assert spec(pipeline).crosses_wan == (MD in kv_to)


def test_position_zero_is_prefills_except_after_a_resume() -> None:
    for pipeline in ROUTABLE:
        assert owners(pipeline, 0, None) == {P: True, RLD: False, MD: False}
    assert owners(Pipeline.RESUME, 0, None) == {P: False, RLD: False, MD: False}


def test_direct_and_local_finish_have_one_decoder() -> None:
    assert owners(Pipeline.P_MD, 5, None) == {P: False, RLD: False, MD: True}
    assert owners(Pipeline.P_RLD, 5, None) == {P: False, RLD: True, MD: False}


def test_handoff_moves_ownership_at_the_relays_boundary() -> None:
    before = owners(Pipeline.P_RLD_MD, 7, None)
    assert before == {P: False, RLD: True, MD: None}  # MD's tokens wait until the relay names its boundary
    assert owners(Pipeline.P_RLD_MD, 7, 7) == {P: False, RLD: True, MD: False}
    assert owners(Pipeline.P_RLD_MD, 8, 7) == {P: False, RLD: False, MD: True}


def test_a_resumed_request_is_owned_by_whichever_decoder_resumed_it() -> None:
    assert owners(Pipeline.RESUME, 3, None) == {P: False, RLD: True, MD: True}


@pytest.mark.parametrize("pipeline, next_position, relay_until, deps", [
    (Pipeline.P_MD, 0, None, (P, MD)),
    (Pipeline.P_MD, 2, None, (MD,)),
    (Pipeline.P_RLD, 1, None, (P, RLD)),
    (Pipeline.P_RLD, 9, None, (RLD,)),
    (Pipeline.P_RLD_MD, 1, None, (P, RLD)),  # MD is not needed until the handoff boundary exists
    (Pipeline.P_RLD_MD, 5, None, (RLD,)),
    (Pipeline.P_RLD_MD, 5, 8, (RLD, MD)),  # the relay still owns 5..8, MD the rest
    (Pipeline.P_RLD_MD, 9, 8, (MD,)),
    (Pipeline.RESUME, 4, None, ()),  # the router tracks the one resuming instance itself
])
def test_which_roles_a_request_depends_on_now(pipeline, next_position, relay_until, deps) -> None:
    assert spec(pipeline).depends_on(next_position, relay_until) == deps


def test_only_routable_pipelines_can_be_forced(tmp_path) -> None:
    assert routable("P-MD") is Pipeline.P_MD
    for bad in ("resume", "P-XX"):
        with pytest.raises(ValueError, match="choose one of P-MD, P-RLD-MD, P-RLD"):
            routable(bad)
        with pytest.raises(ValueError):
            PDDOptions.model_validate({"pipeline": bad})
        path = tmp_path / "c.yaml"
        path.write_text(f"router: {{forced_pipeline: {bad}}}\n")
        with pytest.raises(ConfigError, match="forced_pipeline"):
            load_config(str(path), environ={})
    assert PDDOptions.model_validate({"pipeline": "P-RLD", "handoff": "catch-up"}).pipeline is Pipeline.P_RLD
