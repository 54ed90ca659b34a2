"""Only holders of an access key reach the public API: bearer token or SigV4; health stays open."""

from __future__ import annotations

import os
import subprocess

import httpx
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests.conftest import VBS, Vbs
from vbs.trust import credentials


def test_requests_without_or_with_wrong_credentials_are_refused(vbs_up: Vbs) -> None:
    for headers in ({}, {"authorization": "Bearer nope"},
                    {"authorization": f"Bearer {vbs_up.key.access_key_id}:wrong-secret-000000"},
                    {"authorization": "AWS4-HMAC-SHA256 Credential=garbage"}):
        r = httpx.get(f"{vbs_up.endpoint}/v1/volumes", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "AuthFailure"
    r = httpx.post(f"{vbs_up.endpoint}/v1/volumes", json={"size_gib": 1})
    assert r.status_code == 401
    assert vbs_up.all_volumes() == [], "a refused request changes nothing"
    assert httpx.get(f"{vbs_up.endpoint}/health").status_code == 200


def test_a_sigv4_signed_rest_request_is_accepted(vbs_up: Vbs) -> None:
    req = AWSRequest(method="GET", url=f"{vbs_up.endpoint}/v1/volumes?max_results=5")
    SigV4Auth(Credentials(vbs_up.key.access_key_id, vbs_up.key.secret_access_key), "ec2", "us-east-1").add_auth(req)
    prepared = req.prepare()
    r = httpx.get(prepared.url, headers=dict(prepared.headers))
    assert r.status_code == 200, r.text
    req = AWSRequest(method="GET", url=f"{vbs_up.endpoint}/v1/volumes")
    SigV4Auth(Credentials(vbs_up.key.access_key_id, "x" * 40), "ec2", "us-east-1").add_auth(req)
    r = httpx.get(req.prepare().url, headers=dict(req.prepare().headers))
    assert r.status_code == 401


def test_vbs_up_writes_aws_shared_credentials_and_the_cli_finds_them(vbs_up: Vbs) -> None:
    path = vbs_up.data_dir / "credentials"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert credentials.read(path, "default") == [vbs_up.key]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VBS_")}
    env.update({"VBS_ENDPOINT": vbs_up.endpoint, "XDG_CONFIG_HOME": str(vbs_up.data_dir.parent / "xdg")})
    proc = subprocess.run([*VBS, "-o", "json", "describe-volumes"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Run from the directory holding var/ (as after `make run`): ./var/credentials is found too.
    env["XDG_CONFIG_HOME"] = str(vbs_up.data_dir.parent / "elsewhere")
    proc = subprocess.run([*VBS, "-o", "json", "describe-volumes"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=vbs_up.data_dir.parent)
    assert proc.returncode == 0, proc.stderr
    # Nowhere to find a key: refused.
    (vbs_up.data_dir.parent / "empty").mkdir()
    proc = subprocess.run([*VBS, "-o", "json", "describe-volumes"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=vbs_up.data_dir.parent / "empty")
    assert proc.returncode == 1 and "AuthFailure" in proc.stderr
