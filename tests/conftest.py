"""Shared fixtures: a real nats-server per test session, and service subprocess helpers.

A test run stopped with SIGTERM ends like Ctrl-C: every fixture and ``finally`` tears down, so no
nats-server, `pdd up` or service started by a test outlives the run (tests/e2e/test_up_lifetime.py).
"""

from __future__ import annotations

import signal

import pytest

from pdd.launch.natsserver import start_nats_server


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"test run stopped by {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def nats_server():
    server = start_nats_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny seeded Llama checkpoint (real HF folder + tokenizer) for services under test."""
    from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0, max_position_embeddings=1024)
