"""A private certificate authority for one VBS install, and the certificates it issues.

``vbs up --tls`` (and ``vbs issue-cert`` on a multi-node install) keeps the CA in the data dir:
``ca.pem`` (public: what clients pass as ``verify=``/``--ca-bundle``) and ``tls/ca-key.pem``
(0600, never leaves the CA's machine). Every service gets a certificate that is valid both as a
server and as a client (mutual TLS between services); its subject common name is the node name,
which is how a controller tells which node is calling. Keys are ECDSA P-256: small and quick.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vbs.errors import InvalidParameter
from vbs.system.files import write_private

CA_DAYS = 3650
CERT_DAYS = 825
NAME_RE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
DNS_RE = re.compile(r"[A-Za-z0-9*][A-Za-z0-9.-]{0,252}")


@dataclass(frozen=True)
class CertFiles:
    """Where one certificate, its key and the CA that signed it are."""

    cert: Path
    key: Path
    ca: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            if not DNS_RE.fullmatch(h):
                raise InvalidParameter(f"invalid host name for a certificate: {h[:80]!r}") from None
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


class CertificateAuthority:
    """The install's CA, kept in ``ca_pem`` and ``key_pem``; made on first use."""

    def __init__(self, ca_pem: Path, key_pem: Path) -> None:
        self.ca_pem = ca_pem
        self.key_pem = key_pem

    @classmethod
    def in_data_dir(cls, data_dir: Path) -> CertificateAuthority:
        return cls(data_dir / "ca.pem", data_dir / "tls" / "ca-key.pem")

    def ensure(self, name: str = "VBS install CA") -> None:
        if self.ca_pem.exists() and self.key_pem.exists():
            return
        self.key_pem.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        write_private(self.key_pem, _key_pem(key).decode())
        # The CA certificate is public: clients are given it to verify the services.
        self.ca_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.ca_pem.chmod(0o644)

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.ca_pem.read_bytes())
        key = serialization.load_pem_private_key(self.key_pem.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidParameter(f"{self.key_pem} is not an EC private key")
        return cert, key

    def issue(self, name: str, hosts: list[str], cert_path: Path, key_path: Path) -> CertFiles:
        """A certificate for node ``name`` (its CN), valid for ``hosts`` (DNS names or addresses),
        usable as a TLS server and a TLS client; the key is written 0600."""
        if not NAME_RE.fullmatch(name):
            raise InvalidParameter(f"invalid node name for a certificate: {name[:80]!r}")
        self.ensure()
        ca_cert, ca_key = self._load()
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=CERT_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(_san(hosts or [name]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        cert_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(key_path, _key_pem(key).decode())
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())
        return CertFiles(cert_path, key_path, self.ca_pem)

    def issue_in(self, directory: Path, name: str, hosts: list[str]) -> CertFiles:
        """``issue`` into ``<directory>/<name>.pem`` and ``<name>-key.pem``, unless they exist."""
        files = CertFiles(directory / f"{name}.pem", directory / f"{name}-key.pem", self.ca_pem)
        if files.cert.exists() and files.key.exists():
            return files
        return self.issue(name, hosts, files.cert, files.key)


@dataclass(frozen=True)
class PeerCertificate:
    """What a verified TLS peer's certificate says: who (its CN) and where (its SAN names)."""

    common_name: str | None
    names: frozenset[str]  # IP addresses in canonical form, DNS names in lower case

    def names_address(self, address: str) -> bool:
        """Whether ``address`` (an IP or a DNS name) is one the certificate was issued for."""
        return _canonical(address) in self.names


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower()


def peer_certificate(cert_der: bytes) -> PeerCertificate:
    cert = x509.load_der_x509_certificate(cert_der)
    names: set[str] = set()
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names.update(str(ip) for ip in san.get_values_for_type(x509.IPAddress))
        names.update(n.lower() for n in san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        pass
    return PeerCertificate(_common_name(cert), frozenset(names))


def _common_name(cert: x509.Certificate) -> str | None:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = attrs[0].value if attrs else None
    return value if isinstance(value, str) else None
