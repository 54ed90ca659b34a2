"""TLS on every HTTP API: ``vbs up --tls`` makes a private CA; the vbs CLI, boto3 and the AWS CLI
work against it with the CA; agents take only clients with a certificate from that CA (mutual TLS),
plain HTTP gets nowhere, and a controller on a public address will not start without TLS.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.conftest import VBS, Vbs, VbsUp, free_port
from vbs.trust.pki import CertificateAuthority, peer_certificate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vbs]:
    tmp = tmp_path_factory.mktemp("tls")
    up = VbsUp(tmp / "var", tmp / "up.log", extra=["--tls"])
    try:
        up.start()
        ca = tmp / "var" / "ca.pem"
        vbs = Vbs(f"https://127.0.0.1:{up.port}", tmp / "var")
        vbs.http = httpx.Client(base_url=vbs.endpoint, timeout=30, verify=ssl.create_default_context(cafile=str(ca)),
                                headers={"authorization": f"Bearer {vbs.key.bearer}"})
        yield vbs
    finally:
        up.stop()


def test_the_cli_boto3_and_the_aws_cli_work_over_https_with_the_ca(tls_up: Vbs) -> None:
    vbs = tls_up
    ca = str(vbs.data_dir / "ca.pem")
    env = {**os.environ, "VBS_ENDPOINT": vbs.endpoint, "VBS_CA_BUNDLE": ca,
           "VBS_ACCESS_KEY_ID": vbs.key.access_key_id, "VBS_SECRET_ACCESS_KEY": vbs.key.secret_access_key}
    made = subprocess.run([*VBS, "-o", "json", "create-volume", "--size", "1", "--wait"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    ec2 = boto3.client("ec2", endpoint_url=vbs.endpoint, region_name="us-east-1", verify=ca,
                       aws_access_key_id=vbs.key.access_key_id, aws_secret_access_key=vbs.key.secret_access_key)
    vol = ec2.create_volume(Size=2, AvailabilityZone="us-east-1a")["VolumeId"]
    aws_env = {**os.environ, "AWS_ACCESS_KEY_ID": vbs.key.access_key_id,
               "AWS_SECRET_ACCESS_KEY": vbs.key.secret_access_key, "AWS_DEFAULT_REGION": "us-east-1"}
    listed = subprocess.run([sys.executable, "-m", "awscli", "ec2", "describe-volumes", "--endpoint-url",
                             vbs.endpoint, "--ca-bundle", ca, "--output", "json"], env=aws_env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert vol in listed.stdout
    # Without the CA nobody is fooled into trusting the endpoint: the CLI refuses it.
    untrusted = subprocess.run([*VBS, "-o", "json", "describe-volumes"],
                               env={k: v for k, v in env.items() if k != "VBS_CA_BUNDLE"},
                               capture_output=True, text=True, timeout=60)
    assert untrusted.returncode != 0
    assert "TLS" in untrusted.stderr or "certificate" in untrusted.stderr


def test_plain_http_gets_no_answer_from_any_service(tls_up: Vbs) -> None:
    vbs = tls_up
    urls = [vbs.endpoint] + [n["url"] for n in vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]] + [
        h["url"] for h in vbs.http.get("/v1/hosts").json()["hosts"]]
    assert all(u.startswith("https://") for u in urls)
    for url in urls:
        with pytest.raises(httpx.HTTPError):
            r = httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
            raise AssertionError(f"{url} answered plain HTTP: {r.status_code}")


def test_agents_take_only_clients_with_a_certificate_from_the_ca(tls_up: Vbs, tmp_path: Path) -> None:
    vbs = tls_up
    ca = str(vbs.data_dir / "ca.pem")
    agent = vbs.http.get("/v1/storage-nodes").json()["storage_nodes"][0]["url"]
    token = (vbs.data_dir / "agents" / "storage-storage-1.token").read_text().strip()
    auth = {"authorization": f"Bearer {token}"}
    # Even holding the node's token, a client without a certificate does not get through the handshake.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{agent}/v1/exports", headers=auth, verify=ssl.create_default_context(cafile=ca), timeout=5)
    # Nor does one with a certificate from another CA.
    rogue = CertificateAuthority.in_data_dir(tmp_path).issue_in(tmp_path / "tls", "controller", ["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(str(rogue.cert), str(rogue.key))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{agent}/v1/exports", headers=auth, verify=ctx, timeout=5)
    # The install's own certificate (what the controller presents) does.
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(str(vbs.data_dir / "tls" / "controller.pem"), str(vbs.data_dir / "tls" / "controller-key.pem"))
    assert httpx.get(f"{agent}/v1/exports", headers=auth, verify=ctx, timeout=5).status_code == 200


def test_the_controller_takes_a_heartbeat_only_with_the_nodes_certificate_naming_its_address(
        tls_up: Vbs, tmp_path: Path) -> None:
    """Mutual TLS towards the controller too: a node's token alone (stolen from its disk) is not
    enough, nor is another node's certificate; and a node reports only an address it was issued."""
    vbs = tls_up
    ca, tls = str(vbs.data_dir / "ca.pem"), vbs.data_dir / "tls"
    token = (vbs.data_dir / "agents" / "storage-storage-1.token").read_text().strip()
    before = vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]
    node = next(n for n in before if n["name"] == "storage-1")
    beat = {"name": "storage-1", "url": node["url"], "address": "127.0.0.1",
            "started_at": "2026-01-01T00:00:00Z", "pools": []}

    def send(cert: str | None, body: dict[str, object]) -> httpx.Response:
        ctx = ssl.create_default_context(cafile=ca)
        if cert is not None:
            ctx.load_cert_chain(str(tls / f"{cert}.pem"), str(tls / f"{cert}-key.pem"))
        return httpx.post(f"{vbs.endpoint}/internal/v1/storage-heartbeat", json=body, verify=ctx, timeout=10,
                          headers={"authorization": f"Bearer {token}"})

    assert send(None, beat).status_code == 401  # the token without a certificate
    assert send("host-1", beat).status_code == 401  # another node's certificate
    lying = send("storage-1", beat | {"address": "192.0.2.7"})
    assert lying.status_code == 403 and "certificate does not name" in lying.json()["error"]["message"]
    # Nothing the refused heartbeats said was recorded.
    after = {n["name"]: n for n in vbs.http.get("/v1/storage-nodes").json()["storage_nodes"]}
    # Not the empty list the refused beats carried. The node's own heartbeats go on meanwhile and may
    # report other free bytes (other tests write to the same file system): all else must be the same.
    def stable(pools: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: v for k, v in p.items() if k != "free_bytes"} for p in pools]

    assert node["pools"] and stable(after["storage-1"]["pools"]) == stable(node["pools"])


def test_issue_cert_makes_a_node_certificate_with_its_name_and_addresses(tmp_path: Path) -> None:
    data = tmp_path / "var"
    made = subprocess.run([*VBS, "issue-cert", "storage-9", "--host", "10.0.0.9", "--host", "St9.Example",
                           "--data-dir", str(data)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    cert = x509.load_pem_x509_certificate((data / "tls" / "storage-9.pem").read_bytes())
    peer = peer_certificate(cert.public_bytes(serialization.Encoding.DER))
    assert peer.common_name == "storage-9"
    assert peer.names_address("10.0.0.9") and peer.names_address("st9.example")
    assert not peer.names_address("10.0.0.10")
    assert (data / "tls" / "storage-9-key.pem").stat().st_mode & 0o777 == 0o600
    assert data.stat().st_mode & 0o777 == 0o700
    again = subprocess.run([*VBS, "issue-cert", "storage-9", "--host", "10.0.0.9", "--data-dir", str(data)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists already" in again.stderr


def test_a_controller_on_a_public_address_without_tls_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    env |= {"VBS_ACCESS_KEY_ID": "VBSKTESTTESTTEST0001", "VBS_SECRET_ACCESS_KEY": "s" * 40}
    proc = subprocess.run([*VBS, "controller", "--host", "0.0.0.0", "--port", str(free_port()), "--data-dir",
                           str(tmp_path / "var")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "listening on 0.0.0.0 without TLS" in proc.stderr
