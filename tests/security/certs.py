"""Throwaway TLS material for tests, made with the openssl CLI (no Python crypto dependency)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


@dataclass
class ThrowawayPKI:
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_file: str  # a CA that signed nothing here: verifying against it must fail


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-addext", "subjectKeyIdentifier=hash", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid:always\n" + ext)
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
         "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
         "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_pki(directory: Path) -> ThrowawayPKI:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and an unrelated CA."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, "server", "ca", "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    return ThrowawayPKI(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"),
                   str(d / "client.key"), str(d / "other-ca.pem"))
