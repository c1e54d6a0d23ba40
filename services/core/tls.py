"""TLS on the public ports: a certificate and its key from `TOLLGATE_TLS_CERT` and
`TOLLGATE_TLS_KEY` (PEM files), both or neither. Without them the ports speak plaintext,
for a stack on one machine or behind a proxy that ends TLS itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.core.config import ConfigError

TLS_CERT_ENV = "TOLLGATE_TLS_CERT"
TLS_KEY_ENV = "TOLLGATE_TLS_KEY"


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate chain and private key, read once at startup."""

    cert_path: Path
    key_path: Path
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def from_env(cls) -> ServerTls | None:
        """The pair the environment names; None when it names neither. Raises ConfigError
        naming the variable that is missing, or whose file cannot be read."""
        cert = os.environ.get(TLS_CERT_ENV, "")
        key = os.environ.get(TLS_KEY_ENV, "")
        if not cert and not key:
            return None
        for name, value in ((TLS_CERT_ENV, cert), (TLS_KEY_ENV, key)):
            if not value:
                other = TLS_KEY_ENV if name == TLS_CERT_ENV else TLS_CERT_ENV
                raise ConfigError(f"{name} is required when {other} is set")
        return cls(
            Path(cert), Path(key), _read_pem(TLS_CERT_ENV, cert), _read_pem(TLS_KEY_ENV, key)
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


def _read_pem(name: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"{name}: cannot read {path}: {error.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{name}: {path} is not a PEM file")
    return data
