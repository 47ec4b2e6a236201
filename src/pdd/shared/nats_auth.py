"""How a service authenticates to NATS: nats-py connect options for credentials and TLS, and telling
credentials or TLS the server refuses (fatal: retrying cannot help) from a server that is down.

Apart from bus.py because it is configuration and its checking, not messaging: it reads
``nats.*`` auth/TLS settings and raises ConfigError for unusable ones, before any connection.
"""

from __future__ import annotations

import ssl
from typing import Any

from nats import errors as nats_errors

from pdd.shared.config import ConfigError, NatsConfig


def is_fatal_connect_error(exc: BaseException) -> bool:
    """Errors on the first connection that mean our credentials or TLS setup are wrong, not the network."""
    if isinstance(exc, (nats_errors.AuthorizationError, nats_errors.InvalidUserCredentialsError,
                        nats_errors.SecureConnRequiredError, nats_errors.SecureConnWantedError,
                        ssl.SSLCertVerificationError)):
        return True
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication expired" in text or "authentication revoked" in text


def tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    """The client TLS context for ``nats.tls`` (None when TLS is not asked for)."""
    if not config.wants_tls:
        return None
    tls = config.tls
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"nats.tls.ca_file: cannot load CA certificates from {tls.ca_file}: {exc}") from None
    if tls.cert_file:
        try:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"nats.tls.cert_file/key_file: cannot load {tls.cert_file} with key {tls.key_file}: "
                              f"{exc}") from None
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def connect_options(config: NatsConfig) -> dict[str, Any]:
    """nats-py ``connect`` keyword arguments for authentication and TLS; ConfigError when unusable."""
    opts: dict[str, Any] = {}
    if config.token:
        opts["token"] = config.token
    if config.user:
        opts["user"] = config.user
        opts["password"] = config.password
    if config.nkey_seed_file or config.credentials_file:
        try:
            import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
        except ImportError:
            field = "nkey_seed_file" if config.nkey_seed_file else "credentials_file"
            raise ConfigError(f"nats.{field} needs the 'nkeys' package: pip install nkeys "
                              f"(or pip install 'nats-py[nkeys]')") from None
        if config.credentials_file:
            opts["user_credentials"] = config.credentials_file
        else:
            opts["nkeys_seed"] = config.nkey_seed_file
    ctx = tls_context(config)
    if ctx is not None:
        opts["tls"] = ctx
        if config.tls.hostname:
            opts["tls_hostname"] = config.tls.hostname
    return opts


def describe_refusal(exc: BaseException, handshake_drops: int) -> tuple[str, str]:
    """What went wrong on a refused first connection and which settings to check; ``handshake_drops``
    is how many times in a row the server closed the connection in the handshake (0 if not why)."""
    if handshake_drops:
        what = f"the server closed the connection during the handshake {handshake_drops} times in a row"
        fix = ("nats.tls.cert_file/key_file (the server may require a client certificate) and the "
               "server's log")
    elif isinstance(exc, ssl.SSLError):
        what, fix = "TLS handshake failed", "nats.tls (ca_file, cert_file/key_file, hostname)"
    else:
        what, fix = "credentials refused", ("nats.token, nats.user/password, nats.nkey_seed_file or "
                                            "nats.credentials_file")
    return what, fix
