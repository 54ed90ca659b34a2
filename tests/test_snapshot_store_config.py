"""Where a storage agent's snapshots go: ``[storage_agent.snapshot_store]``, ``--snapshot-store`` and the S3
flags, the store the agent sets up at start, and what ``vbs up`` says of it."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import VBS
from vbs import config as cfgmod
from vbs.cli.up import Child
from vbs.cli.up_banner import banner
from vbs.cli.up_storage import choose_archive_store, choose_snapshot_store, snapshot_store_flags
from vbs.errors import InvalidParameter
from vbs.snapshot_store.dir import DirStore
from vbs.snapshot_store.s3 import S3Store
from vbs.storage.service import build_store, store_location

pytestmark = pytest.mark.unit


def test_the_spec_says_dir_s3_or_none(tmp_path: Path) -> None:
    assert cfgmod.parse_snapshot_store(f"dir:{tmp_path}/s") == {"driver": "dir", "path": str(tmp_path / "s")}
    assert cfgmod.parse_snapshot_store("none") == {"driver": "none"}
    creds = tmp_path / "creds"
    assert cfgmod.parse_snapshot_store("s3://vbs-snaps/site/a", s3_endpoint="http://rgw.example:7480",
                                       s3_credentials_file=creds) == {
        "driver": "s3", "bucket": "vbs-snaps", "prefix": "site/a", "endpoint_url": "http://rgw.example:7480",
        "credentials_file": str(creds)}
    assert cfgmod.parse_snapshot_store("s3://vbs-snaps") == {"driver": "s3", "bucket": "vbs-snaps", "prefix": ""}


@pytest.mark.parametrize(("spec", "endpoint", "says"), [
    ("s3://Bad_Bucket/x", None, "not an S3 bucket name"),
    ("s3://ok-bucket/../x", None, "not a prefix"),
    ("s3://ok-bucket/a b", None, "not a prefix"),
    ("s3://ok-bucket/x", "http://user:pw@rgw:7480", "no user or password"),
    ("s3://ok-bucket/x", "ftp://rgw", "http(s)://"),
    ("dir:", None, "needs a directory"),
    ("dir:/x", "http://rgw:7480", "--s3-endpoint goes with"),
    ("nfs://server/x", None, "expecting dir:PATH"),
])
def test_a_wrong_spec_is_refused_with_what_is_wrong(spec: str, endpoint: str | None, says: str) -> None:
    with pytest.raises(InvalidParameter) as caught:
        cfgmod.parse_snapshot_store(spec, s3_endpoint=endpoint)
    assert says in caught.value.message
    assert "pw" not in caught.value.message


def test_the_config_table_names_the_driver_and_its_settings(tmp_path: Path) -> None:
    toml = tmp_path / "vbs.toml"
    toml.write_text(f'[storage_agent]\nstate_dir = "{tmp_path}/state"\n'
                    f'[storage_agent.snapshot_store]\ndriver = "dir"\npath = "{tmp_path}/elsewhere"\n')
    cfg = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", config_file=toml, environ={})
    assert cfg.snapshot_store.driver == "dir" and cfg.snapshot_store.options() == {"path": f"{tmp_path}/elsewhere"}
    store = build_store(cfg)
    assert isinstance(store, DirStore) and store.root == tmp_path / "elsewhere"
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    # The default: a dir store in the agent's state directory.
    plain = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={},
                        overrides={"state_dir": tmp_path / "state"})
    default = build_store(plain)
    assert isinstance(default, DirStore) and default.root == (tmp_path / "state" / "snapshots").resolve()
    # A store in its default place is this node's own: reported with its name, so no other node is taken
    # to share it; one given a place is reported as itself.
    assert store_location(plain, default) == f"dir:{default.root} on storage-1"
    assert store_location(cfg, store) == f"dir:{store.root}"
    # none: snapshots stay in their pools.
    none = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={},
                       overrides={"snapshot_store": {"driver": "none"}})
    assert build_store(none) is None
    # An s3 store from the environment (JSON), set up without reaching the endpoint.
    env = {"VBS_STORAGE_AGENT_SNAPSHOT_STORE": '{"driver": "s3", "bucket": "vbs-snaps", "prefix": "p", '
                                               '"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1"}'}
    s3 = build_store(cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ=env))
    assert isinstance(s3, S3Store) and s3.describe() == "s3://vbs-snaps/p/ at http://127.0.0.1:9"


def test_a_wrong_driver_setting_is_named_not_shown() -> None:
    cfg = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={}, overrides={
        "snapshot_store": {"driver": "s3", "bucket": "vbs-snaps", "endpoint_url": "http://u:hunter2@rgw"}})
    with pytest.raises(InvalidParameter) as caught:
        build_store(cfg)
    assert "endpoint_url" in caught.value.message and "hunter2" not in caught.value.message
    with pytest.raises(InvalidParameter, match="no snapshot_store driver named 'tape'"):
        build_store(cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={},
                                overrides={"snapshot_store": {"driver": "tape"}}))


def test_vbs_up_gives_every_agent_one_store_and_says_what_it_protects(tmp_path: Path) -> None:
    data = tmp_path / "var"
    pool = data / "pool"
    choice = choose_snapshot_store(data, None, [pool])
    assert choice.where == f"dir:{data / 'snapshots'}"
    assert "protects against a lost pool directory only" in choice.note
    assert stat.S_IMODE((data / "snapshots").stat().st_mode) == 0o700
    assert choice.flags == ["--snapshot-store", f"dir:{data / 'snapshots'}"]
    agent = Child("storage-agent", "storage-1", "http://127.0.0.1:9", [], {})
    text = banner(data, ["http://127.0.0.1:8770"], [agent], data / "up.json", tls=False, store=choice)
    assert f"Snapshots go to dir:{data / 'snapshots'}; it is on the pool's own file system" in text
    s3 = {"driver": "s3", "bucket": "b-1", "prefix": "x", "endpoint_url": "http://127.0.0.1:9",
          "credentials_file": "/etc/vbs/s3"}
    assert snapshot_store_flags(s3) == ["--snapshot-store", "s3://b-1/x", "--s3-endpoint", "http://127.0.0.1:9",
                                        "--s3-credentials-file", "/etc/vbs/s3"]
    assert choose_snapshot_store(data, {"driver": "none"}, [pool]).flags == ["--snapshot-store", "none"]


def test_the_commands_refuse_a_wrong_store_before_starting(tmp_path: Path) -> None:
    for argv in (["storage-agent", "--snapshot-store", "s3://UPPER/x"],
                 ["up", "--data-dir", str(tmp_path / "var"), "--snapshot-store", "dir:/x", "--s3-endpoint",
                  "http://rgw:1"],
                 ["storage-agent", "--s3-endpoint", "http://rgw:1"]):
        proc = subprocess.run([*VBS, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert "--snapshot-store" in proc.stderr or "S3 bucket" in proc.stderr


def test_an_archive_store_is_set_as_the_snapshot_store_is_and_must_be_another(tmp_path: Path) -> None:
    assert cfgmod.parse_snapshot_store(f"dir:{tmp_path}/a", flag="--archive-store") == {
        "driver": "dir", "path": str(tmp_path / "a")}
    with pytest.raises(InvalidParameter, match="--archive-s3-endpoint goes with --archive-store"):
        cfgmod.parse_snapshot_store(f"dir:{tmp_path}/a", s3_endpoint="http://rgw:1", flag="--archive-store",
                                    s3_flags="--archive-s3")
    # Default: none (archived snapshots stay in the snapshot store).
    plain = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={},
                        overrides={"state_dir": tmp_path / "state"})
    assert plain.archive_store.driver == "none" and build_store(plain, archive=True) is None
    toml = tmp_path / "vbs.toml"
    toml.write_text(f'[storage_agent]\nstate_dir = "{tmp_path}/state"\n'
                    f'[storage_agent.snapshot_store]\ndriver = "dir"\npath = "{tmp_path}/standard"\n'
                    f'[storage_agent.archive_store]\ndriver = "dir"\npath = "{tmp_path}/archive"\n'
                    'gc_interval_s = 3600\n')
    cfg = cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", config_file=toml, environ={})
    archive = build_store(cfg, archive=True)
    assert isinstance(archive, DirStore) and archive.root == tmp_path / "archive"
    assert stat.S_IMODE(archive.root.stat().st_mode) == 0o700
    assert cfg.archive_store.gc_interval_s == 3600 and cfg.archive_store.options() == {"path": f"{tmp_path}/archive"}
    with pytest.raises(InvalidParameter, match="the archive store is the snapshot store"):
        cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={}, overrides={
            "snapshot_store": {"driver": "dir", "path": f"{tmp_path}/s"},
            "archive_store": {"driver": "dir", "path": f"{tmp_path}/s"}})
    with pytest.raises(InvalidParameter, match="needs a snapshot store"):
        cfgmod.load(cfgmod.StorageAgentConfig, "storage_agent", environ={}, overrides={
            "snapshot_store": {"driver": "none"}, "archive_store": {"driver": "dir", "path": f"{tmp_path}/s"}})


def test_vbs_up_gives_every_agent_the_archive_store_it_names(tmp_path: Path) -> None:
    data = tmp_path / "var"
    choice = choose_snapshot_store(data, None, [data / "pool"])
    assert choose_archive_store(data, None, choice) == []
    assert choose_archive_store(data, {"driver": "dir", "path": str(tmp_path / "archive")}, choice) == [
        "--archive-store", f"dir:{tmp_path / 'archive'}"]
    assert stat.S_IMODE((tmp_path / "archive").stat().st_mode) == 0o700
    with pytest.raises(InvalidParameter, match="is the snapshot store"):
        choose_archive_store(data, {"driver": "dir", "path": str(data / "snapshots")}, choice)
    s3 = {"driver": "s3", "bucket": "b-2", "prefix": "", "endpoint_url": "http://127.0.0.1:9"}
    assert snapshot_store_flags(s3, archive=True) == ["--archive-store", "s3://b-2/", "--archive-s3-endpoint",
                                                      "http://127.0.0.1:9"]
