"""TLS for gRPC, set up by `rgpu-admin install-units`: the cluster's CA and the pool's certificate.

Making certificates is pure (PEM in, PEM out); `set_up_tls` does the file work:
- the CA: the admin's (`--ca-cert`/`--ca-key`), else the one already in the TLS folder, else a new
  one (`ca.crt` 0644, `ca.key` 0600). A host whose rgpu.toml (copied from the pool host) names a
  CA file that is not there is refused: making a second CA would split the cluster.
- the pool's certificate (`pool.crt`, `pool.key` 0600, owned by the pool's user), for the names
  clients dial, made where the CA's key is at hand (the pool host). Elsewhere only the CA is used.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rgpu.errors import ConfigError

COMPONENT = "install-units"
CA_DAYS = 3650
CERT_DAYS = 825


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def make_ca(name: str = "rgpu cluster CA") -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new CA that may sign only end certificates."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(CA_DAYS)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue_server_cert(ca_cert_pem: bytes, ca_key_pem: bytes, names: list[str]) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a gRPC server answering to `names` (host names or IPs)."""
    if not names:
        raise ConfigError(COMPONENT, "no name for the pool's certificate", "",
                          "give --tls-name with the host name clients dial")
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(CERT_DAYS)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def certificate_names(cert_pem: bytes) -> list[str]:
    """The names a certificate answers to (its subjectAltName entries)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + \
        [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def default_names(pool_hosts: list[str]) -> list[str]:
    """The pool hosts clients are configured with, this host's names, and loopback."""
    names: list[str] = []
    for name in [*pool_hosts, socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1"]:
        if name and name not in names:
            names.append(name)
    return names


@dataclass(frozen=True)
class TlsFiles:
    ca_file: str
    cert_file: str   # "" where this host makes no pool certificate (no CA key here)
    key_file: str
    made: tuple[str, ...]   # the files written, for the admin's eyes


def _write(path: Path, data: bytes, mode: int, owner: str | None = None) -> None:
    ids = None
    if owner and os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(owner)
        except KeyError:
            raise ConfigError(COMPONENT, f"user {owner} does not exist", f"{path.name} must be readable by it",
                              "create the user first (useradd --system rgpu) or pass --poold-user") from None
        ids = entry.pw_uid, entry.pw_gid
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    if ids is not None:
        os.chown(tmp, *ids)
    os.replace(tmp, path)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(COMPONENT, f"cannot read {what} {path}", exc.strerror or str(exc),
                          "give a readable file") from None


def set_up_tls(tls_dir: Path, *, configured_ca: str, names: list[str], ca_cert: Path | None = None,
               ca_key: Path | None = None, poold_user: str | None = None) -> TlsFiles:
    """Make (or take) the CA and, where its key is at hand, the pool's certificate in `tls_dir`.
    `configured_ca` is the tls_ca_file the config already names ("" : none)."""
    if (ca_cert is None) != (ca_key is None):
        raise ConfigError(COMPONENT, "--ca-cert and --ca-key go together", "",
                          "give both (the admin's CA), or neither (install-units makes or reuses one)")
    made: list[str] = []
    try:
        tls_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        ca_path = tls_dir / "ca.crt"
        key_path = tls_dir / "ca.key"
        if ca_cert is not None and ca_key is not None:
            ca_pem = _read(ca_cert, "CA certificate")
            ca_key_pem: bytes | None = _read(ca_key, "CA key")
            if ca_cert.resolve() != ca_path.resolve():
                _write(ca_path, ca_pem, 0o644)
                made.append(str(ca_path))
        elif configured_ca:
            if not Path(configured_ca).is_file():
                raise ConfigError(COMPONENT, f"the CA certificate {configured_ca} that rgpu.toml names is missing",
                                  "this host would otherwise make a CA of its own, which the pool's certificate "
                                  "does not come from",
                                  f"copy ca.crt from the pool host to {configured_ca}, then run install-units again")
            ca_path = Path(configured_ca)
            ca_pem = _read(ca_path, "CA certificate")
            own_key = ca_path.with_name("ca.key")
            ca_key_pem = own_key.read_bytes() if own_key.is_file() else None
        elif ca_path.is_file():
            ca_pem = _read(ca_path, "CA certificate")
            ca_key_pem = key_path.read_bytes() if key_path.is_file() else None
        else:
            ca_pem, ca_key_pem = make_ca()
            _write(key_path, ca_key_pem, 0o600)
            _write(ca_path, ca_pem, 0o644)
            made += [str(ca_path), str(key_path)]
        if ca_key_pem is None:   # a client or GPU node: it trusts the CA and makes nothing
            return TlsFiles(str(ca_path), "", "", tuple(made))
        cert_path, cert_key_path = tls_dir / "pool.crt", tls_dir / "pool.key"
        cert_pem, cert_key_pem = issue_server_cert(ca_pem, ca_key_pem, names)
        _write(cert_key_path, cert_key_pem, 0o600, poold_user)
        _write(cert_path, cert_pem, 0o644)
        made += [str(cert_path), str(cert_key_path)]
    except OSError as exc:
        raise ConfigError(COMPONENT, f"cannot write TLS files to {tls_dir}", exc.strerror or str(exc),
                          "run as root, or give --tls-dir a writable folder") from None
    return TlsFiles(str(ca_path), str(cert_path), str(cert_key_path), tuple(made))

