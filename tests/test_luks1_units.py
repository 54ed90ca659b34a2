"""LUKS1 read without QEMU (vbs.qemu.luks1, docs/ebs-direct.md "Encrypted snapshots"): a container that
qemu-img writes from known data is opened with its passphrase and its payload decrypted back to that data,
from any sector; a wrong passphrase opens nothing; what is no LUKS1 container of QEMU's default cipher is
refused. (The key slot's PBKDF2 is timed short here: ``iter-time``; the format is QEMU's default else.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vbs.qemu import luks1
from vbs.storage.luks import header_bytes, run_luks_writer

pytestmark = pytest.mark.unit

MIB = 1 << 20
PASSPHRASE = b"a passphrase for the tests of luks1"


def container(tmp_path: Path, plain: bytes) -> bytes:
    (tmp_path / "plain.raw").write_bytes(plain)
    (tmp_path / "key").write_bytes(PASSPHRASE)
    # Through the storage agent's runner: qemu-img's timing of the key derivation fails now and then on a
    # loaded machine ("Unable to get accurate CPU usage"), and that runner tries again.
    run_luks_writer(["qemu-img", "convert", "-q", "--object", f"secret,id=k,file={tmp_path / 'key'}", "-f", "raw",
                     str(tmp_path / "plain.raw"), "-O", "luks", "-o", "key-secret=k,iter-time=10",
                     str(tmp_path / "c.luks")], tmp_path / "c.luks", 120)
    return (tmp_path / "c.luks").read_bytes()


def test_a_container_qemu_img_wrote_decrypts_to_what_it_was_given(tmp_path: Path) -> None:
    plain = os.urandom(2 * MIB) + bytes(MIB) + os.urandom(MIB)
    data = container(tmp_path, plain)
    header = luks1.parse_header(data)
    assert header.payload_offset == header_bytes(tmp_path / "c.luks") and header.payload_offset % 512 == 0
    assert len(header.slots) == 1 and header.material_end() <= header.payload_offset
    key = luks1.open_volume_key(header, data[:header.material_end()], PASSPHRASE)
    assert len(key) == header.key_bytes
    payload = data[header.payload_offset:]
    assert len(payload) == len(plain) and payload[:4096] != plain[:4096]
    for start, length in ((0, MIB), (512, 4096), (2 * MIB, MIB), (3 * MIB + 1536, 512 * 1024 - 1536)):
        got = luks1.decrypt(key, payload[start:start + length], start)
        assert got == plain[start:start + length], start
    with pytest.raises(ValueError):  # sectors only
        luks1.decrypt(key, payload[:1000], 0)


def test_a_wrong_passphrase_or_what_is_no_container_opens_nothing(tmp_path: Path) -> None:
    data = container(tmp_path, os.urandom(MIB))
    header = luks1.parse_header(data)
    with pytest.raises(luks1.WrongKey):
        luks1.open_volume_key(header, data[:header.material_end()], b"another passphrase")
    with pytest.raises(luks1.NotLuks):  # the key material is cut short
        luks1.open_volume_key(header, data[:4096], PASSPHRASE)
    with pytest.raises(luks1.NotLuks):
        luks1.parse_header(bytes(luks1.HEADER_BYTES))
    with pytest.raises(luks1.NotLuks):  # LUKS2
        luks1.parse_header(data[:6] + b"\0\2" + data[8:luks1.HEADER_BYTES])
    with pytest.raises(luks1.NotLuks):  # another cipher mode
        luks1.parse_header(data[:40] + b"cbc-essiv:sha256".ljust(32, b"\0") + data[72:luks1.HEADER_BYTES])
