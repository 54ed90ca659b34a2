"""A RADOS Gateway (Debian's ``radosgw``, Ceph 16) on an embedded single-node cluster: the S3 store the
snapshot store's ``s3`` driver is tested against (docs/snapshots.md "Drivers and settings").

``EmbeddedRadosGateway(cluster).start()`` gives the gateway a cephx user of its own
(``client.rgw.vbs``, its keyring written by ``ceph auth`` into the cluster's 0700 directory, never on
an argv), starts ``radosgw`` with the beast frontend on a free 127.0.0.1 port as this process's child,
and waits until it answers. ``s3_user(uid, path)`` makes (or finds) an S3 user with ``radosgw-admin`` and
writes its keys, read from the tool's stdout, to ``path`` in the AWS credentials format (0600);
``create_bucket(name, path)`` makes a bucket of that user. ``stop()`` stops the gateway by its PID; stop it
before the cluster.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions

from vbs.errors import DriverError, InvalidParameter
from vbs.net.ports import PortPicker
from vbs.rigs.ceph import EmbeddedCeph
from vbs.snapshot_store.s3 import read_credentials
from vbs.system.files import write_private
from vbs.system.processes import stop_child

__all__ = ["EmbeddedRadosGateway"]

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_NAME = "rgw.vbs"
_UID_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
# radosgw's keys: 20 upper-case letters and digits, 40 characters of base64's alphabet.
_ACCESS_RE = re.compile(r"[A-Z0-9]{20}")
_SECRET_RE = re.compile(r"[A-Za-z0-9/+]{40}")


class EmbeddedRadosGateway:
    """One ``radosgw`` on ``cluster`` (which must be running): ``start()``, ``endpoint``, ``s3_user()``,
    ``stop()``."""

    def __init__(self, cluster: EmbeddedCeph, *, threads: int = 64) -> None:
        self.cluster = cluster
        self.threads = threads
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise InvalidParameter("the RADOS Gateway is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.cluster.root / "log" / f"client.{_NAME}.log"

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the gateway (its cephx user made the first time) and wait until it answers HTTP."""
        if self._proc is not None:
            raise InvalidParameter("the RADOS Gateway is running")
        root = self.cluster.root
        keyring = root / f"ceph.client.{_NAME}.keyring"  # where ceph.conf's [client] keyring points
        if not keyring.exists():
            self.cluster.ceph("auth", "get-or-create", f"client.{_NAME}", "mon", "allow rw", "osd", "allow rwx",
                              "-o", str(keyring))
        keyring.chmod(0o600)
        data = root / "rgw"
        data.mkdir(mode=0o700, exist_ok=True)
        self.port = PortPicker()()
        self._proc = self.cluster.start_daemon(f"client.{_NAME}", [
            "radosgw", "-f", "--conf", str(self.cluster.conf_path), "--id", _NAME,
            f"--rgw_frontends=beast endpoint=127.0.0.1:{self.port}", f"--rgw_data={data}",
            f"--log_file={self.log_path}", f"--rgw_thread_pool_size={self.threads}"])
        try:
            self._wait_answering(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_answering(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise DriverError(f"radosgw exited (code {self._proc.returncode}); see {self.log_path}")
            if self._answers():
                return
            if time.monotonic() > deadline:
                raise DriverError(f"radosgw did not answer on {self.endpoint} within {timeout:g}s; see {self.log_path}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        """Whether an anonymous ListBuckets gets an HTTP answer (200: the gateway serves requests)."""
        assert self.port is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", "/")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def s3_user(self, uid: str, credentials: Path) -> None:
        """An S3 user ``uid`` (made unless it exists) whose keys go to ``credentials``, a 0600 file in the
        AWS credentials format (profile ``default``). The keys are read from radosgw-admin's stdout."""
        if not _UID_RE.fullmatch(uid):
            raise InvalidParameter(f"invalid RADOS Gateway user id {uid[:64]!r}")
        try:
            info = self._admin("user", "info", f"--uid={uid}")
        except DriverError:
            info = self._admin("user", "create", f"--uid={uid}", f"--display-name=VBS {uid}")
        keys = [k for k in info.get("keys", []) if isinstance(k, dict) and k.get("user") == uid]
        if not keys:
            raise DriverError(f"radosgw-admin gave the user {uid} no S3 keys")
        access, secret = str(keys[0].get("access_key", "")), str(keys[0].get("secret_key", ""))
        # Checked so that nothing but a key can end up in the file (a newline would add settings).
        if not _ACCESS_RE.fullmatch(access) or not _SECRET_RE.fullmatch(secret):
            raise DriverError(f"radosgw-admin gave the user {uid} keys of an unexpected form")
        write_private(credentials, f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n")

    def create_bucket(self, name: str, credentials: Path) -> None:
        """A bucket ``name`` of the user whose keys are in ``credentials`` (nothing if it has it already)."""
        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              **read_credentials(credentials, "default"))
        try:
            client.create_bucket(Bucket=name)
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code != "BucketAlreadyOwnedByYou":
                raise DriverError(f"the RADOS Gateway on {self.endpoint} refused the bucket {name}: {code}") from None

    def _admin(self, *args: str) -> dict[str, Any]:
        out = self.cluster.run_tool(["radosgw-admin", "--conf", str(self.cluster.conf_path), "--id", "admin",
                                     "--format=json", *args])
        try:
            answer = json.loads(out)
        except ValueError:
            raise DriverError(f"radosgw-admin {args[0]} {args[1]} did not answer JSON") from None
        if not isinstance(answer, dict):
            raise DriverError(f"radosgw-admin {args[0]} {args[1]} did not answer an object")
        return answer

    def stop(self) -> None:
        """Stop the gateway by its PID (SIGTERM, then SIGKILL) and wait until it is gone."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_child(proc, timeout=STOP_TIMEOUT_S, what="radosgw")
