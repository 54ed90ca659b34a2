"""The master key that seals made access keys: rotation re-seals every secret, a controller that
holds the old key in memory follows the file, and an interrupted rotation loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from vbs.controller.auth.keys import KeyStore, MasterKey
from vbs.controller.db import AccessKeyRecord, Database

pytestmark = pytest.mark.unit


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database.for_data_dir(tmp_path)
    d.migrate()
    return d


def test_rotation_reseals_every_secret_and_a_running_store_follows(db: Database, tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    running = KeyStore(db, MasterKey(path), {})  # what a running controller holds
    made = [running.create("t", "user") for _ in range(3)]
    sealed_before = _sealed(db)
    old_file = path.read_text()

    assert MasterKey(path).rotate(db) == 3  # what `vbs rotate-keys --master-key` runs
    assert path.read_text() != old_file and len(path.read_text().split()) == 1
    assert path.stat().st_mode & 0o777 == 0o600
    assert all(_sealed(db)[k] != sealed_before[k] for k in sealed_before)
    for key in made:
        assert running.secret_of(key.access_key_id) == key.secret_access_key
    # The old key opens none of them any more.
    old_only = tmp_path / "old.key"
    old_only.write_text(old_file)
    assert all(MasterKey(old_only).open(v, k) is None for k, v in _sealed(db).items())


def test_an_interrupted_rotation_keeps_both_keys_and_the_next_one_finishes(db: Database, tmp_path: Path) -> None:
    path = tmp_path / "master.key"
    store = KeyStore(db, MasterKey(path), {})
    key = store.create("t", "admin")
    old = path.read_text()
    # As if the rotation died after writing the new key first and before re-sealing anything.
    path.write_text(_fresh_line(tmp_path) + old)
    assert store.secret_of(key.access_key_id) == key.secret_access_key  # still opens with the old line
    assert MasterKey(path).rotate(db) == 1
    assert store.secret_of(key.access_key_id) == key.secret_access_key


def _fresh_line(tmp_path: Path) -> str:
    scratch = MasterKey(tmp_path / "scratch.key")
    scratch.seal("x", "y")  # makes the file
    return scratch.path.read_text()


def _sealed(db: Database) -> dict[str, str]:
    with db.read() as s:
        return {r.id: r.sealed_secret for r in s.query(AccessKeyRecord)}


def test_the_snapshot_store_key_is_made_once_sealed_and_rotated(db: Database, tmp_path: Path) -> None:
    from vbs.controller.auth.store_key import STORE_KEY_ID, store_key
    from vbs.controller.db import VolumeKey
    from vbs.snapshot_store import StoreKey

    master = MasterKey(tmp_path / "master.key")
    first = store_key(db, master)
    assert len(first.get_secret_value()) == 64 and StoreKey(bytes.fromhex(first.get_secret_value()))
    assert store_key(db, master).get_secret_value() == first.get_secret_value()  # made once
    with db.read() as s:
        row = s.get(VolumeKey, STORE_KEY_ID)
        assert row is not None and first.get_secret_value() not in row.sealed_key
    assert MasterKey(tmp_path / "master.key").rotate(db) == 1
    assert store_key(db, MasterKey(tmp_path / "master.key")).get_secret_value() == first.get_secret_value()
    assert first.get_secret_value() not in repr(first)
