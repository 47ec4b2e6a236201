"""Shared fixtures: a real nats-server per test session, and service subprocess helpers."""

from __future__ import annotations

import pytest

from pdd.shared.natsserver import start_nats_server


@pytest.fixture(scope="session")
def nats_server():
    server = start_nats_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url
