"""Checks on a role's TLS files before it connects: expiry, key match, issuing CA, and the
identity (common name) a broker will know the role by."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from .config import BrokerConfig
from .errors import ConfigError

__all__ = ["check_pair", "certificate_identity", "broker_identity"]


def check_pair(ca: str, cert: str, key: str) -> None:
    """Refuse, before connecting, a certificate that is expired, not yet valid, not signed by
    the CA, or not matching its key.  Raises :class:`ConfigError` naming the key and file."""

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError("key", f"certificate {cert} does not match key {key}: "
                          f"{exc.reason}") from exc
    try:
        from cryptography import x509
    except ImportError:
        return  # without cryptography only the pair is checked
    leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    now = dt.datetime.now(dt.timezone.utc)
    if now > leaf.not_valid_after_utc:
        raise ConfigError("cert", f"certificate {cert} expired on "
                          f"{leaf.not_valid_after_utc:%Y-%m-%d}")
    if now < leaf.not_valid_before_utc:
        raise ConfigError("cert", f"certificate {cert} is not valid before "
                          f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M}")
    if ca:
        authority = x509.load_pem_x509_certificate(Path(ca).read_bytes())
        try:
            leaf.verify_directly_issued_by(authority)
        except Exception as exc:  # InvalidSignature, ValueError, TypeError: all mean "not ours"
            raise ConfigError("cert", f"certificate {cert} is not signed by the CA in "
                              f"{ca}") from exc


def certificate_identity(cert: str) -> str | None:
    """The common name of a PEM certificate: the username, and with ``safl provision``'s
    brokers the client id, the broker gives its holder.  None without ``cryptography``
    or when the certificate names no one."""
    try:
        from cryptography import x509
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    names = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else None


def broker_identity(config: BrokerConfig) -> str | None:
    """The client certificate's common name, when the certificate is the identity (a client
    certificate and no username, as ``safl provision`` writes): its brokers take it as the
    username and bind the client id to it.  None otherwise: a password login may be shared
    by several clients, each with its own client id."""
    if config.username or not config.cert:
        return None
    return certificate_identity(config.cert)
