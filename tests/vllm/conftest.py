"""vLLM backend tests: skipped where vLLM is not installed; one vLLM engine for the whole session (vLLM keeps
its attention layers in process-wide state, so a process holds one engine)."""

from __future__ import annotations

import importlib.util
import os

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = ("vLLM is not installed here: bash scripts/install_vllm.sh, then "
               ".venv-vllm/bin/python -m pytest tests/vllm")
KV_MB = 256
BLOCK_SIZE = 32
# float32 by default: the same tokens on every CPU; PDD_VLLM_TEST_DTYPE=bfloat16 runs the suite in bf16
DTYPE = os.environ.get("PDD_VLLM_TEST_DTYPE", "float32")


def pytest_collection_modifyitems(config, items):
    if VLLM_MISSING:
        for item in items:
            if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vllm_engine():
    """One vLLM engine in the test process (``DTYPE``), no decode-side caching."""
    from pdd.engine.vllm_backend.engine import VllmEngine

    return VllmEngine(dtype=DTYPE, kv_memory_bytes=KV_MB << 20, block_size=BLOCK_SIZE, cache_finished=False,
                      num_threads=1)


def run_to_end(engine, rid: str) -> list[int]:
    """Step ``engine`` until it is idle; the tokens ``rid`` produced."""
    tokens: list[int] = []
    while engine.has_work():
        for out in engine.step():
            if out.rid == rid:
                tokens.extend(out.token_ids)
    return tokens
