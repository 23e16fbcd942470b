"""TLS for every gRPC connection: elasticd's port (Agent + Control), the leader's and the
agents' channels to other nodes, and elasticctl. Files are PEM, named like etcdctl's
(``--cacert``, ``--cert``, ``--key``). Without files everything is plaintext (loopback,
a private network, or tests); with a certificate and key, elasticd serves only TLS and
requires clients to present a certificate signed by ``cacert`` when one is given.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil

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
        """A channel to ``address`` (``unix:PATH``: elasticd's local socket, never TLS)."""
        if self.enabled and not address.startswith("unix:"):
            return grpc.aio.secure_channel(address, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(address, options=options)

    def channel(self, address: str) -> grpc.Channel:
        if self.enabled and not address.startswith("unix:"):
            return grpc.secure_channel(address, self.channel_credentials())
        return grpc.insecure_channel(address)


#: The roles a certificate can carry (its subject's organisation), see mselastic.daemon.auth.
ROLES = ("node", "admin", "viewer")


def _write_private(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with open(fd, "wb") as f:
        f.write(data)


def make_ca(directory: str, name: str = "mselastic CA", days: int = 3650) -> tuple[str, str]:
    """A CA in ``directory``: ca.pem (0644) and ca-key.pem (0600); refuses to overwrite one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert_path, key_path = os.path.join(directory, "ca.pem"), os.path.join(directory, "ca-key.pem")
    if os.path.exists(key_path):
        raise TlsError(f"{key_path} exists already; a new CA would orphan every certificate it signed")
    os.makedirs(directory, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), 0o600)
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def issue(directory: str, name: str, role: str, hosts: tuple[str, ...] = (), days: int = 825) -> tuple[str, str]:
    """A certificate for ``name`` (its CN: a node's id, or a person's name) with ``role`` (its O),
    signed by the CA in ``directory``: NAME.pem and NAME-key.pem (0600). A node's certificate also
    serves (``hosts``: the addresses and names other nodes and elasticctl dial)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if role not in ROLES:
        raise TlsError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if role == "node" and not hosts:
        raise TlsError("a node certificate needs --host (the addresses others reach this node at)")
    ca_cert = x509.load_pem_x509_certificate(_read(os.path.join(directory, "ca.pem"), "CA certificate"))
    ca_key = serialization.load_pem_private_key(_read(os.path.join(directory, "ca-key.pem"), "CA key"), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name), x509.NameAttribute(NameOID.ORGANIZATION_NAME, role)])
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if role == "node" else [])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if hosts:
        names: list[x509.GeneralName] = []
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem")
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()), 0o600)
    _write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def private_pki(directory: str, name: str, host: str, renew_days: int = 30) -> tuple[str, str, str]:
    """(certificate, key, CA) for a service only this machine's root may talk to (the embedded
    etcd): a CA and one certificate that both serves ``host`` and authenticates its client, in
    ``directory`` (mode 0700). Reused while it loads and has more than ``renew_days`` left; else
    (missing, torn by a crash, expiring) made anew in a scratch folder and put in place whole."""
    from cryptography import x509

    files = tuple(os.path.join(directory, f) for f in (f"{name}.pem", f"{name}-key.pem", "ca.pem", "ca-key.pem"))
    try:
        with open(files[0], "rb") as f:
            left = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc - datetime.datetime.now(
                datetime.timezone.utc)
        if left > datetime.timedelta(days=renew_days) and all(os.path.getsize(f) > 0 for f in files):
            os.chmod(directory, 0o700)
            return files[0], files[1], files[2]
    except (OSError, ValueError):
        pass  # missing or unreadable: made anew
    scratch = f"{directory}.new{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch, mode=0o700)
    make_ca(scratch, name=f"mselastic {name} CA (this machine only)")
    issue(scratch, name, "node", (host,))
    if os.path.exists(directory):
        old = f"{directory}.old{os.getpid()}"
        os.replace(directory, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(scratch, directory)
    return files[0], files[1], files[2]
