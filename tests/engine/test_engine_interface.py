"""The engine interface is stated once (engine/interface.py): the torch engine satisfies it, and the
services reach nothing of an engine outside it."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from pdd.engine.torch_backend.engine import TorchEngine
from pdd.engine.interface import EngineBackend, load_engine
from pdd.shared.config import PDDConfig
from pdd.shared.engines import engine_plugins

from .conftest import make_engine

ROOT = Path(__file__).resolve().parents[2] / "src" / "pdd"
# The modules that hold an engine: the runner, the engine-service base, the decoder base and the roles.
SERVICE_MODULES = ["engine_runner", "engine_service", "decoder_service", "prefill", "relay", "main_decode"]


def protocol_members() -> dict[str, object]:
    """Name -> the Protocol's function or property, for every public member it states."""
    return {n: v for n, v in vars(EngineBackend).items()
            if not n.startswith("_") and isinstance(v, (property, type(protocol_members)))}


def test_protocol_states_what_the_design_lists() -> None:
    """the engine interface (engine/interface.py): add/abort, step, export and import KV blocks, extend by
    known tokens, stop at a position, prefix-hit queries; and every member says what it changes."""
    members = protocol_members()
    for name in ("add_request", "abort", "step", "request_blocks", "release", "kv_buffers", "prepare_import",
                 "commit_import", "extend_known", "stop_at", "cached_prefix_len", "layout"):
        assert name in members, name
    for name, member in members.items():
        doc = (member.fget if isinstance(member, property) else member).__doc__
        assert doc and doc.strip(), f"EngineBackend.{name} has no docstring"


@pytest.fixture(scope="module")
def engine(llama_path) -> TorchEngine:
    return make_engine(llama_path, load_tokenizer=False)


def assert_conforms(engine: EngineBackend) -> None:
    """``engine`` is an ``EngineBackend`` and each method has the Protocol's parameters (names, kinds, defaults);
    properties are values. Every backend's test calls this."""
    cls = type(engine).__name__
    assert isinstance(engine, EngineBackend)
    for name, member in protocol_members().items():
        assert hasattr(engine, name), f"{cls} lacks {name}"
        if isinstance(member, property):
            assert not callable(getattr(engine, name)), f"{cls}.{name} should be a value, not a method"
            continue
        impl = getattr(type(engine), name)
        assert callable(impl), f"{cls}.{name} is not a method"
        want = inspect.signature(member)
        have = inspect.signature(impl)
        assert list(have.parameters) == list(want.parameters), f"{cls}.{name}{have} vs EngineBackend.{name}{want}"
        for pname, p in want.parameters.items():
            q = have.parameters[pname]
            assert q.kind == p.kind, f"{cls}.{name}: parameter {pname} kind {q.kind} vs {p.kind}"
            assert q.default == p.default, f"{cls}.{name}: parameter {pname} default {q.default!r} vs {p.default!r}"


def test_torch_engine_satisfies_the_protocol(engine: TorchEngine) -> None:
    assert_conforms(engine)


def test_new_members_behave(engine: TorchEngine) -> None:
    """The members added for the interface answer what the internals they replace did."""
    k, v = engine.kv_buffers()
    assert k is engine.pool.k_cache and v is engine.pool.v_cache
    assert len(k) == engine.layout.num_layers and k[0].shape[:2] == (engine.num_total_blocks(), engine.block_size)
    assert engine.linear_kernel == engine.model.linear_kernel
    assert not engine.has_request("x")
    engine.add_request("x", [1, 2, 3, 4, 5], max_new_tokens=2)
    assert engine.has_request("x")
    while engine.has_work():
        engine.step()
    assert not engine.has_request("x")
    assert isinstance(engine.drain_cache_events(), list) and engine.drain_cache_events() == []
    assert engine.cached_prefix_len([1, 2, 3, 4, 5]) == 4  # the finished request's first block is cached


def test_load_engine(llama_path) -> None:
    assert {"torch", "emulated", "vllm"} <= set(engine_plugins())
    config = PDDConfig(model={"path": llama_path, "block_size": 4, "kv_memory_mb": 1, "dtype": "float32"})
    eng = load_engine(config, "prefill", True)
    assert isinstance(eng, TorchEngine) and isinstance(eng, EngineBackend)
    assert eng.kv_buffers()[0][0].dtype == torch.float32 and eng.block_size == 4
    if importlib.util.find_spec("vllm") is None:  # the vllm backend says how to get it (tests/vllm test it where it is)
        with pytest.raises(RuntimeError, match="bash scripts/install_vllm.sh"):
            load_engine(PDDConfig(model={"backend": "vllm"}), "prefill", True)


def _engine_attrs(tree: ast.AST) -> list[tuple[str, int]]:
    """``X.engine.<attr>``, ``engine.<attr>`` (a local bound to the engine) and ``.runner.engine.<attr>``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Attribute) and base.attr == "engine":
            found.append((node.attr, node.lineno))
        elif isinstance(base, ast.Name) and base.id == "engine":
            found.append((node.attr, node.lineno))
    return found


def test_services_use_only_the_protocol() -> None:
    members = set(protocol_members())
    bad, seen = [], set()
    for mod in SERVICE_MODULES:
        path = ROOT / "roles" / f"{mod}.py"
        for attr, line in _engine_attrs(ast.parse(path.read_text(), str(path))):
            seen.add(attr)
            if attr not in members:
                bad.append(f"roles/{mod}.py:{line}: engine.{attr}")
    assert not bad, "services reach engine attributes outside EngineBackend (engine/interface.py):\n" + "\n".join(bad)
    assert {"add_request", "abort", "step", "kv_buffers", "prepare_import"} <= seen  # the scan sees the uses


def test_services_do_not_name_the_concrete_engine() -> None:
    """Only engine/interface.py's load_engine constructs a backend; the services type against the Protocol."""
    for mod in SERVICE_MODULES:
        tree = ast.parse((ROOT / "roles" / f"{mod}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("pdd.engine.") or node.module.startswith(
                    ("pdd.engine.core", "pdd.engine.interface")), f"roles/{mod}.py imports {node.module}"
