"""A small certificate authority for a fleet: CA, server and client certificates, and the CRL.

Uses the ``cryptography`` package (``pip install 'safl-edge[deploy]'``).  Keys are EC P-256.
Private keys are written atomically with mode 0600 (never readable by others, not even for
an instant); a client certificate's common name is the participant id the brokers grant.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from edge_client.errors import SaflError

__all__ = ["make_ca", "issue", "write_crl", "serial_of", "write_private"]


def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:
        raise SaflError("provisioning needs cryptography: pip install 'safl-edge[deploy]'") from exc
    return x509, hashes, serialization, ec, NameOID, ExtendedKeyUsageOID


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_key(key, path: Path) -> None:
    _, _, serialization, _, _, _ = _x509()
    write_private(path, key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))


def make_ca(folder: Path, name: str, days: int = 3650) -> tuple[Path, Path]:
    """Create ``ca.pem`` and ``ca.key`` in ``folder``."""
    x509, hashes, serialization, ec, NameOID, _ = _x509()
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"safl {name} CA")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    (folder / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, folder / "ca.key")
    return folder / "ca.pem", folder / "ca.key"


def issue(ca_dir: Path, out_cert: Path, out_key: Path, common_name: str, *,
          hosts: tuple[str, ...] = (), server: bool = False, days: float = 825,
          backdate_days: int = 0) -> None:
    """Issue a certificate signed by the fleet CA (server certs carry ``hosts`` as SANs).

    Valid from ``backdate_days`` ago (plus five minutes of clock skew) for ``days`` from now.
    """
    x509, hashes, serialization, ec, NameOID, EKU = _x509()
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(days=backdate_days, minutes=5))
               .not_valid_after(now + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(
                   [EKU.SERVER_AUTH] if server else [EKU.CLIENT_AUTH]), critical=False))
    if hosts:
        names = []
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out_cert.parent.mkdir(parents=True, exist_ok=True)
    out_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, out_key)


def serial_of(cert: Path) -> int:
    """The serial number of a PEM certificate."""
    x509 = _x509()[0]
    return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number


def write_crl(ca_dir: Path, serials: list[int], days: int = 365) -> Path:
    """Write ``ca_dir/crl.pem``, signed by the fleet CA, revoking ``serials``.

    Brokers load it with ``crlfile`` and refuse a revoked certificate at the TLS handshake.
    OpenSSL refuses every client once the CRL's next update has passed, so re-run
    ``safl provision`` (which rewrites it) within ``days``.
    """
    x509, hashes, serialization, _, _, _ = _x509()
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    now = dt.datetime.now(dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - dt.timedelta(minutes=5))
               .next_update(now + dt.timedelta(days=days)))
    for serial in sorted(set(serials)):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    path = ca_dir / "crl.pem"
    path.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    return path
