"""TLS for every gRPC connection: elasticd's port (Agent + Control), the leader's and the
agents' channels to other nodes, and elasticctl. Files are PEM, named like etcdctl's
(``--cacert``, ``--cert``, ``--key``). Without files everything is plaintext (loopback,
a private network, or tests); with a certificate and key, elasticd serves only TLS and
requires clients to present a certificate signed by ``cacert`` when one is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import shutil
import threading

import grpc

log = logging.getLogger("mselastic.tls")


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

    def stamp(self) -> tuple[tuple[int, int, int], ...]:
        """The files' modification times (0: missing): what changes when a certificate is renewed."""
        return tuple(_mtime(p) for p in (self.cacert, self.cert, self.key))

    def server_configuration(self) -> grpc.ServerCertificateConfiguration:
        """The certificate, key and CA as they are now; TlsError when the key is not the
        certificate's (a renewal half written) or a file cannot be read."""
        return self._configuration()[0]

    def _configuration(self) -> tuple[grpc.ServerCertificateConfiguration, bytes]:
        """(the configuration, the certificate's PEM) as the files are now."""
        if self.key and os.path.exists(self.key) and os.stat(self.key).st_mode & 0o077:
            raise TlsError(f"{self.key} may be read by others (mode {os.stat(self.key).st_mode & 0o777:o}): chmod 600 it")
        key, cert = _read(self.key, "TLS key"), _read(self.cert, "TLS certificate")
        _check_pair(cert, key, self.cert)
        ca = _read(self.cacert, "CA certificate") if self.cacert else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca), cert

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that read the files again whenever one has changed (each new connection
        asks): a certificate renewed in place (``elasticctl certs issue`` again, or the site's
        tooling) is served from the next connection on, without a restart. A half-written or
        mismatched pair is not taken: the previous one serves until the files agree again."""
        reloader = _Reloader(self)  # (the files' stamp first: a change after it is read again)
        return grpc.dynamic_ssl_server_credentials(self.server_configuration(), reloader.fetch,
                                                   require_client_authentication=bool(self.cacert))

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


def _mtime(path: str) -> tuple[int, int, int]:
    """What changes when ``path`` is written anew (its inode too: a file replaced within one tick of
    a coarse clock); zeros when it is missing."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st else (0, 0, 0)


def _check_pair(cert_pem: bytes, key_pem: bytes, where: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
    except ValueError as e:
        raise TlsError(f"{where}: not a PEM certificate and key ({e})") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise TlsError(f"{where}: the key is not this certificate's")


class _Reloader:
    """gRPC's certificate fetcher for :meth:`TlsFiles.server_credentials` (called on a gRPC
    thread at every handshake): a new configuration when the files changed and agree, else None
    (keep serving the current one)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.seen = files.stamp()
        self.lock = threading.Lock()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self.lock:
            stamp = self.files.stamp()
            if stamp == self.seen:
                return None
            self.seen = stamp
            try:
                config, pem = self.files._configuration()
            except TlsError as e:
                log.error("TLS certificate not reloaded, the previous one still serves: %s", e)
                return None
            log.info("TLS certificate reloaded: %s", describe(pem))
            return config


def describe(cert: str | bytes) -> str:
    """A certificate (its file, or its PEM) in a few words: its subject, serial and last day."""
    from cryptography import x509

    pem = cert if isinstance(cert, bytes) else _read(cert, "TLS certificate")
    loaded = x509.load_pem_x509_certificate(pem)
    return (f"{loaded.subject.rfc4514_string()}, serial {loaded.serial_number:x}, valid until "
            f"{loaded.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")


#: How long a CA and a certificate it signs are valid unless told (``elasticctl certs --days``;
#: 825 days was the CA/Browser Forum's longest for a server certificate from 2018 to 2020). A
#: renewal is ``certs issue`` again, served without a restart (:meth:`TlsFiles.server_credentials`).
CA_DAYS, CERT_DAYS = 3650, 825

#: The roles a certificate can carry (its subject's organisation), see mselastic.daemon.auth.
ROLES = ("node", "admin", "viewer")


def _write_private(path: str, data: bytes, mode: int) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a file: elasticd reads its
    certificate again while it runs; a crash leaves the old file or the new one, synced), with
    ``mode`` from the start; never through a link planted where the scratch file goes."""
    scratch = f"{path}.new{os.getpid()}"
    if os.path.lexists(scratch):
        os.unlink(scratch)
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def make_ca(directory: str, name: str = "mselastic CA", days: int = CA_DAYS) -> tuple[str, str]:
    """A CA in ``directory``: ca.pem (0644), ca-key.pem (0600) and its revocation list crl.pem,
    empty; refuses to overwrite one."""
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
    _write_crl(directory)
    return cert_path, key_path


def issue(directory: str, name: str, role: str, hosts: tuple[str, ...] = (), days: int = CERT_DAYS) -> tuple[str, str]:
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


def revoke(directory: str, name: str) -> tuple[str, int]:
    """Add the certificate ``directory``/NAME.pem (or the PEM file ``name``) to the CA's
    revocation list ``directory``/crl.pem (signed by its key; the ones revoked before stay).
    Returns the list's path and the certificate's serial."""
    from cryptography import x509

    path = name if name.endswith(".pem") else os.path.join(directory, f"{name}.pem")
    try:
        cert = x509.load_pem_x509_certificate(_read(path, "certificate to revoke"))
    except ValueError:
        raise TlsError(f"{path} is not a PEM certificate") from None
    return _write_crl(directory, cert), cert.serial_number


def _write_crl(directory: str, cert: object = None) -> str:
    """``directory``/crl.pem anew: the serials it held, and ``cert``'s (an x509.Certificate the CA
    signed) when given; signed by the CA's key. ``certs ca`` writes it empty, so that elasticd's
    ``tls_crl`` can name it from the first day."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization

    ca_cert = x509.load_pem_x509_certificate(_read(os.path.join(directory, "ca.pem"), "CA certificate"))
    ca_key = serialization.load_pem_private_key(_read(os.path.join(directory, "ca-key.pem"), "CA key"), None)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(now)
               .next_update(max(ca_cert.not_valid_after_utc, now + datetime.timedelta(days=1))))
    crl_path = os.path.join(directory, "crl.pem")
    serials: set[int] = set()
    number = 1
    if os.path.exists(crl_path):
        old = x509.load_pem_x509_crl(_read(crl_path, "revocation list"))
        number = _crl_number(old) + 1
        for entry in old:
            serials.add(entry.serial_number)
            builder = builder.add_revoked_certificate(entry)
    builder = builder.add_extension(x509.CRLNumber(number), critical=False)
    if isinstance(cert, x509.Certificate):
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise TlsError(f"that certificate was not signed by the CA in {directory}") from None
        if cert.serial_number not in serials:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(now).build())
    crl = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    _write_private(crl_path, crl.public_bytes(serialization.Encoding.PEM), 0o644)
    return crl_path


def _crl_number(crl: object) -> int:
    """A revocation list's number (CRLNumber; 0 without one): each list ``certs revoke`` writes
    counts one up, so that an older list copied over a newer one is seen as such."""
    from cryptography import x509

    assert isinstance(crl, x509.CertificateRevocationList)
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


class Revocations:
    """The serials a revocation list (``tls_crl``, PEM, signed by the CA ``cacert``) names, read
    again whenever the file changes: a revoked certificate is refused from the next call on, on
    every node the list is copied to, without a restart. A list that does not load or is not the
    CA's is refused at start (TlsError) and, later, logged and not taken (the previous one holds)."""

    def __init__(self, crl: str, cacert: str) -> None:
        self.crl, self.cacert = crl, cacert
        self._stamp = (0, 0, 0)
        self._serials: frozenset[int] = frozenset()
        self._number = -1
        if crl:
            self._stamp = _mtime(crl)
            self._serials, self._number = self._load()

    def _load(self) -> tuple[frozenset[int], int]:
        from cryptography import x509

        try:
            crl = x509.load_pem_x509_crl(_read(self.crl, "revocation list"))
        except ValueError as e:
            raise TlsError(f"{self.crl}: not a PEM revocation list ({e})") from None
        ca = x509.load_pem_x509_certificate(_read(self.cacert, "CA certificate"))
        if crl.issuer != ca.subject or not crl.is_signature_valid(ca.public_key()):  # type: ignore[arg-type]
            raise TlsError(f"{self.crl}: not signed by the CA {self.cacert}")
        number = _crl_number(crl)
        if number < self._number:
            raise TlsError(f"{self.crl}: list number {number} is older than the one in force ({self._number})")
        return frozenset(entry.serial_number for entry in crl), number

    def serials(self) -> frozenset[int]:
        """The revoked serials as the file says now (one stat a call)."""
        if not self.crl:
            return self._serials
        stamp = _mtime(self.crl)
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                serials, number = self._load()
            except TlsError as e:
                log.error("revocation list not reloaded, the previous one holds: %s", e)
            else:
                if serials != self._serials:
                    log.info("revocation list %s reloaded: %d certificate(s) revoked", self.crl, len(serials))
                self._serials, self._number = serials, number
        return self._serials


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
