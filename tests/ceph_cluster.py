"""A real single-node Ceph cluster for the tests (Debian's Ceph 16), one per test session and xdist worker.

It is ``vbs.rigs.ceph.EmbeddedCeph`` in a fresh 0700 directory under /tmp: a mon on free loopback ports, a
mgr and one bluestore OSD on a sparse file. Each test gets a Ceph pool of its own. At the end the
daemons are stopped by their PIDs (the OSD before the mon) and the test checks that every PID is gone.
A RADOS Gateway on it is started only for the tests that ask for one (the ``radosgw`` fixture), and stopped
the same way before the cluster.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

from vbs.rigs.ceph import EmbeddedCeph
from vbs.rigs.radosgw import EmbeddedRadosGateway


class CephForTests:
    def __init__(self, osds: int = 1) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vbs-ceph-", dir="/tmp"))
        self.cluster = EmbeddedCeph(self.dir, osds)
        self._names = itertools.count(1)

    @property
    def conf_path(self) -> Path:
        return self.cluster.conf_path

    def start(self) -> None:
        self.cluster.start()

    def admin_key(self) -> str:
        """The cephx key of client.admin, read from its keyring (to check it leaks nowhere)."""
        for line in self.cluster.admin_keyring.read_text().splitlines():
            name, sep, value = line.strip().partition("=")
            if sep and name.strip() == "key":
                return value.strip()
        raise AssertionError("no key in the admin keyring")

    def new_pool(self, size: int = 1, min_size: int = 1) -> str:
        """A new, empty RBD pool of ``size`` replicas: its name."""
        name = f"t{next(self._names)}"
        self.cluster.create_pool(name, size, min_size=min_size)
        return name

    def stop(self) -> None:
        pids = self.cluster.pids
        self.cluster.stop()
        alive = [f"{name} ({pid})" for name, pid in pids.items() if Path(f"/proc/{pid}").exists()]
        assert not alive, f"Ceph daemons still running: {alive}"
        shutil.rmtree(self.dir, ignore_errors=True)


class RadosGatewayForTests:
    """A RADOS Gateway on the session's cluster (``vbs.rigs.radosgw``), and one S3 user whose keys are in
    ``credentials`` (0600, the AWS credentials format) in the cluster's 0700 directory."""

    def __init__(self, ceph: CephForTests) -> None:
        self.gateway = EmbeddedRadosGateway(ceph.cluster)
        self.credentials = ceph.dir / "s3-credentials"

    @property
    def endpoint(self) -> str:
        return self.gateway.endpoint

    def start(self) -> None:
        self.gateway.start()
        self.gateway.s3_user("vbs-tests", self.credentials)

    def secret_key(self) -> str:
        """The user's secret key, read from its file (to check it leaks nowhere)."""
        for line in self.credentials.read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and name.strip() == "aws_secret_access_key":
                return value.strip()
        raise AssertionError("no secret key in the credentials file")

    def stop(self) -> None:
        pid = self.gateway.pid
        self.gateway.stop()
        assert pid is None or not Path(f"/proc/{pid}").exists(), f"radosgw {pid} still running"
