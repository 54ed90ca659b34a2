"""The nbdkit driver's pure parts: the per-host trust anchor, the command line of a process, its
options. No daemon runs here (tests/test_nbdkit_export.py runs the real nbdkit)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import ValidationError

from vbs.errors import InvalidParameter
from vbs.storage.exports.nbdkit.anchor import host_anchor
from vbs.storage.exports.nbdkit.driver import NbdkitExportDriver, NbdkitOptions
from vbs.storage.exports.nbdkit.process import Listener, process_spec
from vbs.trust.pki import CertificateAuthority

pytestmark = pytest.mark.unit


@pytest.fixture
def ca_pem(tmp_path: Path) -> bytes:
    ca = CertificateAuthority(tmp_path / "ca.pem", tmp_path / "ca-key.pem")
    ca.ensure()
    return ca.ca_pem.read_bytes()


def constraints(pem: bytes) -> x509.NameConstraints:
    cert = x509.load_pem_x509_certificate(pem)
    ext = cert.extensions.get_extension_for_class(x509.NameConstraints)
    assert ext.critical
    return ext.value


def test_the_anchor_is_the_install_ca_limited_to_the_hosts_ip_address(ca_pem: bytes) -> None:
    ca = x509.load_pem_x509_certificate(ca_pem)
    anchor = x509.load_pem_x509_certificate(host_anchor(ca_pem, "10.0.0.2"))
    assert anchor.subject == ca.subject and anchor.public_key() == ca.public_key()
    assert anchor.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert constraints(host_anchor(ca_pem, "10.0.0.2")).permitted_subtrees == [
        x509.IPAddress(ipaddress.ip_network("10.0.0.2/32"))]
    assert constraints(host_anchor(ca_pem, "fd00::7")).permitted_subtrees == [
        x509.IPAddress(ipaddress.ip_network("fd00::7/128"))]


def test_a_host_known_by_name_gets_a_dns_constraint(ca_pem: bytes) -> None:
    assert constraints(host_anchor(ca_pem, "HV-A.example")).permitted_subtrees == [x509.DNSName("hv-a.example")]


def test_an_unreadable_ca_is_refused() -> None:
    with pytest.raises(InvalidParameter, match="CA certificate"):
        host_anchor(b"not a certificate", "10.0.0.2")


def test_a_process_answers_to_its_one_name_and_lists_none(tmp_path: Path) -> None:
    listener = Listener(None, "10.0.0.1", 10810, "x509", tmp_path / "tls" / "p")
    spec = process_spec(tmp_path / "run", "p", path=tmp_path / "vol.raw", name="vol-0123456789abcdef0-ab",
                        read_only=True, listener=listener, threads=16, cache="default", start_timeout=5.0)
    argv = list(spec.argv)
    assert argv[0] == "nbdkit" and "-f" not in argv  # it forks: in the foreground it dies with the agent
    assert spec.forks and spec.writes_pidfile and str(spec.pid_path) in argv
    assert ["-t", "16"] == argv[argv.index("-t"):argv.index("-t") + 2] and "-r" in argv
    assert ["-i", "10.0.0.1", "-p", "10810", "--tls=require"] == argv[argv.index("-i"):argv.index("-i") + 5]
    assert f"--tls-certificates={tmp_path / 'tls' / 'p'}" in argv and "--tls-verify-peer" in argv
    assert argv[-3:] == ["exportname=vol-0123456789abcdef0-ab", "exportname-strict=true", "exportname-list=empty"]


def test_a_unix_socket_process_has_no_tcp_listener(tmp_path: Path) -> None:
    listener = Listener(tmp_path / "s.sock", "127.0.0.1", None, "off", None)
    assert listener.argv() == ["-U", str(tmp_path / "s.sock"), "--tls=off"]
    assert Listener(None, "127.0.0.1", 1, "psk", tmp_path / "k.psk").argv()[-1] == f"--tls-psk={tmp_path / 'k.psk'}"


def test_options_are_bounded(tmp_path: Path) -> None:
    assert NbdkitOptions().model_dump() == {"threads": 16, "cache": "default", "ports": 256}
    for bad in ({"threads": 0}, {"threads": 1000}, {"cache": "writeback"}, {"ports": 0}, {"other": 1}):
        with pytest.raises(ValidationError):
            NbdkitOptions.model_validate(bad)
    with pytest.raises(InvalidParameter, match="X.509"):
        NbdkitExportDriver(tmp_path / "s", tls="x509")
    with pytest.raises(InvalidParameter, match="listen_host"):
        NbdkitExportDriver(tmp_path / "s", listen_host="a b")
    assert NbdkitExportDriver(tmp_path / "s", port=65500, ports=256).ports == range(65500, 65536)
