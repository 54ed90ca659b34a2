"""The snapshot store's drivers: the contract each keeps (a directory; an S3 bucket on moto's S3 server
and on a RADOS Gateway), found by name; private files; settings and credentials that never show a
secret; the store's own trouble as a retryable error.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.ceph_cluster import RadosGatewayForTests
from tests.snapshot_stores import FAKE_SECRET, moto_endpoint, s3_store, store
from vbs import drivers
from vbs.errors import DriverError, InvalidParameter, SnapshotStoreUnavailable
from vbs.net.ports import free_port
from vbs.snapshot_store import ObjectMissing, SnapshotStore
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.s3 import S3Store

pytestmark = pytest.mark.unit

__all__ = ["moto_endpoint", "store"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parents[1]


def test_objects_put_get_head_delete_and_list_by_prefix(store: SnapshotStore) -> None:
    store.put("manifests/snap-00000000000000001", b"one")
    store.put("chunks/ab/ab01", b"two")
    store.put("chunks/ab/ab01", b"two, replaced")
    store.put("chunks/cd/cd01", b"")

    assert store.get("chunks/ab/ab01") == b"two, replaced"
    assert store.get("chunks/cd/cd01") == b""
    info = store.head("chunks/ab/ab01")
    assert info is not None and info.size == len(b"two, replaced") and info.modified > 0
    assert store.has("manifests/snap-00000000000000001") and not store.has("chunks/ab/nothing")
    assert store.head("chunks/ab/nothing") is None
    assert sorted(i.key for i in store.list("chunks/")) == ["chunks/ab/ab01", "chunks/cd/cd01"]
    assert [i.key for i in store.list("chunks/a")] == ["chunks/ab/ab01"]
    assert len(list(store.list(""))) == 3
    with pytest.raises(ObjectMissing):
        store.get("chunks/ab/nothing")

    store.delete("chunks/ab/ab01")
    store.delete("chunks/ab/ab01")  # a repeat is no error
    assert not store.has("chunks/ab/ab01")
    with pytest.raises(Exception, match="invalid snapshot store key"):
        store.put("../escape", b"x")


def test_a_dir_store_keeps_private_files_in_private_directories(tmp_path: Path) -> None:
    store = DirStore.from_config({"path": str(tmp_path / "s")}, default_dir=tmp_path / "unused")
    store.put("chunks/ab/" + "ab" * 32, b"x")

    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "s" / "chunks" / "ab").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "s" / "chunks" / "ab" / ("ab" * 32)).stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "s" / "chunks" / "ab").glob(".*"))  # no temp file left
    with pytest.raises(InvalidParameter, match="settings: nosuch"):
        DirStore.from_config({"nosuch": "value-123"}, default_dir=tmp_path)


def test_s3_settings_errors_name_the_setting_never_its_value(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameter) as caught:
        S3Store.from_config({"bucket": "b", "aws_secret_access_key": FAKE_SECRET}, default_dir=tmp_path)
    assert "aws_secret_access_key" in caught.value.message and FAKE_SECRET not in caught.value.message


def test_s3_credentials_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text(f"[default]\naws_access_key_id = A\naws_secret_access_key = {FAKE_SECRET}\n")
    creds.chmod(0o640)

    with pytest.raises(DriverError, match="make it 0600") as caught:
        S3Store.from_config({"bucket": "vbs-test", "credentials_file": str(creds)}, default_dir=tmp_path)
    assert FAKE_SECRET not in caught.value.message


def test_an_s3_store_never_shows_its_secret(moto_endpoint: str, tmp_path: Path) -> None:
    store = s3_store(moto_endpoint, tmp_path)
    store.put("chunks/ab/x1", b"x")
    broken = S3Store(store.options.model_copy(update={"bucket": "no-such-bucket"}))

    with pytest.raises(DriverError) as caught:
        broken.put("chunks/ab/x1", b"x")

    for text in (store.describe(), repr(store), caught.value.message, str(store.options)):
        assert FAKE_SECRET not in text
    assert "NoSuchBucket" in caught.value.message


@pytest.mark.integration
def test_a_radosgw_store_refuses_wrong_keys_and_a_missing_bucket_by_name(radosgw: RadosGatewayForTests,
                                                                         tmp_path: Path) -> None:
    store = s3_store(radosgw.endpoint, tmp_path, credentials=radosgw.credentials)
    store.put("chunks/ab/x1", b"x")
    wrong = tmp_path / "wrong-credentials"
    wrong.write_text(f"[default]\naws_access_key_id = AKIAVBSTESTWRONG0000\naws_secret_access_key = {FAKE_SECRET}\n")
    wrong.chmod(0o600)
    refused = S3Store(store.options.model_copy(update={"credentials_file": wrong}))
    missing = S3Store(store.options.model_copy(update={"bucket": "no-such-bucket"}))

    with pytest.raises(DriverError) as bad_key:
        refused.get("chunks/ab/x1")
    with pytest.raises(DriverError) as no_bucket:
        missing.put("chunks/ab/x1", b"x")

    assert "refused: InvalidAccessKeyId" in bad_key.value.message and "None" not in bad_key.value.message
    assert "refused: NoSuchBucket" in no_bucket.value.message and "None" not in no_bucket.value.message
    for text in (bad_key.value.message, no_bucket.value.message, store.describe()):
        assert FAKE_SECRET not in text and radosgw.secret_key() not in text
    assert store.get("chunks/ab/x1") == b"x"


def test_an_unreachable_s3_store_is_retryable(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text(f"[default]\naws_access_key_id = A\naws_secret_access_key = {FAKE_SECRET}\n")
    creds.chmod(0o600)
    store = S3Store.from_config({"bucket": "vbs-test", "endpoint_url": f"http://127.0.0.1:{free_port()}",
                                 "credentials_file": str(creds), "max_attempts": 1, "connect_timeout_s": 1},
                                default_dir=tmp_path)

    with pytest.raises(SnapshotStoreUnavailable):
        store.has("chunks/ab/x1")


def test_an_s3_store_without_credentials_says_where_they_come_from(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = S3Store.from_config({"bucket": "vbs-test", "endpoint_url": "http://127.0.0.1:9"}, default_dir=tmp_path)

    with pytest.raises(DriverError, match="no S3 credentials"):
        store.has("chunks/ab/x1")


def test_snapshot_stores_are_drivers_found_by_name() -> None:
    assert {"dir", "s3"} <= set(drivers.available("snapshot_store"))
    assert drivers.load("snapshot_store", "dir") is DirStore and drivers.load("snapshot_store", "s3") is S3Store
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vbs.snapshot_stores"]
    assert declared == {"dir": "vbs.snapshot_store.dir:DirStore", "s3": "vbs.snapshot_store.s3:S3Store"}


def test_a_dir_store_whose_directory_is_a_file_says_so_as_its_error(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "store")
    (tmp_path / "store" / "chunks").mkdir()
    (tmp_path / "store" / "chunks" / "ab").write_bytes(b"")  # where a fan-out directory goes
    with pytest.raises(DriverError, match="the snapshot store could not write"):
        store.put("chunks/ab/" + "ab" * 32, b"x")
