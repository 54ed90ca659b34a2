"""The trust anchor that admits one host's certificate only, for one nbdkit process.

nbdkit 1.32 checks a client certificate against its ``ca-cert.pem`` (``--tls-verify-peer``) but never
looks at whose it is, and its ``ip`` filter cannot match addresses in Debian's build (it was compiled
without ``inet_pton``: every address rule is refused at start-up). So each process gets an anchor of
its own: a certificate for the install CA's public key and name, carrying a name constraint that
permits only the address of the host the export is for. GnuTLS verifies the host's certificate by
the CA's key, as before, and enforces the anchor's constraint on the names the certificate holds:
one that names another address of the same kind (IP, or DNS name) is refused in the handshake.

The anchor is signed by a throw-away key (a trust anchor's own signature is not what is checked);
it is public, and nothing of the install CA's private key is needed.
"""

from __future__ import annotations

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vbs.errors import InvalidParameter

__all__ = ["host_anchor"]

_ISSUER = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "VBS per-host export anchor")])


def _permitted(address: str) -> x509.GeneralName:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return x509.DNSName(address.lower())
    return x509.IPAddress(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}"))


def host_anchor(ca_pem: bytes, address: str) -> bytes:
    """PEM of the install CA (``ca_pem``) restated as an anchor that admits only certificates whose
    names of ``address``'s kind are ``address``."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as exc:
        raise InvalidParameter(f"the install's CA certificate cannot be read: {exc}") from exc
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False)
    anchor = (
        x509.CertificateBuilder()
        .subject_name(ca.subject).issuer_name(_ISSUER)
        .public_key(ca.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(ca.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.NameConstraints(permitted_subtrees=[_permitted(address)], excluded_subtrees=None),
                       critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return anchor.public_bytes(serialization.Encoding.PEM)
