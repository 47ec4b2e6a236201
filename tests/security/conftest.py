"""Fixtures for NATS security tests: throwaway TLS material (openssl CLI) and secured nats-servers."""

from __future__ import annotations

import pytest

from .certs import ThrowawayPKI, make_pki, openssl_available


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> ThrowawayPKI:
    if not openssl_available():
        pytest.skip("the openssl CLI is needed to make a throwaway CA and certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))
