"""TLS for every gRPC connection: elasticd's port (Agent + Control), the leader's and the
agents' channels to other nodes, and elasticctl. Files are PEM, named like etcdctl's
(``--cacert``, ``--cert``, ``--key``). Without files everything is plaintext (loopback,
a private network, or tests); with a certificate and key, elasticd serves only TLS and
requires clients to present a certificate signed by ``cacert`` when one is given.
"""

from __future__ import annotations

import dataclasses

import grpc


class TlsError(ValueError):
    pass


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TlsError(f"cannot read the {what} {path}: {e.strerror}") from None


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    cacert: str = ""
    cert: str = ""
    key: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cacert or self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        ca = _read(self.cacert, "CA certificate") if self.cacert else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.cacert, "CA certificate") if self.cacert else None,
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None)

    def aio_channel(self, address: str, options: list[tuple[str, object]] | None = None) -> grpc.aio.Channel:
        if self.enabled:
            return grpc.aio.secure_channel(address, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def channel(self, address: str) -> grpc.Channel:
        if self.enabled:
            return grpc.secure_channel(address, self.channel_credentials())
        return grpc.insecure_channel(address)
