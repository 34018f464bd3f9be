"""TLS for every channel: which files, from flags or the environment, and the gRPC credentials they make.

Rules:

1. `--tls-cert/--tls-key/--tls-ca` (or `DTORCH_TLS_CERT/KEY/CA`, paths to PEM files) turn TLS on. A server
   needs a certificate and its key; a client needs the CA that signed the servers' certificates.
2. Between the controller and workers, TLS is mutual: each process presents its own certificate (signed by
   the cluster CA) as a client too, and the ports workers and the controller call each other on require
   one. Clients only check the servers (server TLS); their identity is their API key.
3. Without TLS, traffic is cleartext: fine on loopback (the embedded local cluster); listening on any other
   interface without it prints one warning line.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV = {"cert": "DTORCH_TLS_CERT", "key": "DTORCH_TLS_KEY", "ca": "DTORCH_TLS_CA"}


class TlsError(ValueError):
    """Unusable TLS settings; str() is the one-line reason."""


@dataclass(frozen=True)
class Tls:
    """PEM bytes of this process's certificate and key, and of the CA that signs the cluster's certificates."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    @classmethod
    def load(cls, cert: str | None = None, key: str | None = None, ca: str | None = None,
             env: bool = True) -> Tls | None:
        """From paths (each falls back to its environment variable); None when no TLS setting is given."""
        paths = {"cert": cert, "key": key, "ca": ca}
        if env:
            paths = {k: v or os.environ.get(ENV[k]) or None for k, v in paths.items()}
        if not any(paths.values()):
            return None
        if bool(paths["cert"]) != bool(paths["key"]):
            raise TlsError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        data = {}
        for name, path in paths.items():
            if path:
                try:
                    data[name] = Path(path).read_bytes()
                except OSError as e:
                    raise TlsError(f"cannot read the TLS {name} file {path}: {e.strerror or e}") from None
                if b"-----BEGIN" not in data[name]:
                    raise TlsError(f"the TLS {name} file {path} is not PEM")
        return cls(**data)

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise TlsError("a TLS server needs --tls-cert and --tls-key")
        if require_client_cert and self.ca is None:
            raise TlsError("mutual TLS needs --tls-ca (the CA that signs the cluster's certificates)")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """What a caller presents: the CA to check the server with, and its own certificate when it has one."""
        if self.ca is None:
            raise TlsError("a TLS client needs --tls-ca (or DTORCH_TLS_CA): the CA that signed the servers' "
                           "certificates")
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT listens on loopback only."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cleartext_warning(program: str, listen: str) -> str | None:
    """The one warning line for a cleartext listener off loopback, or None."""
    if is_loopback(listen):
        return None
    return (f"{program}: warning: listening on {listen} without TLS: API keys and tensors travel in cleartext "
            "(use --tls-cert/--tls-key/--tls-ca)")
