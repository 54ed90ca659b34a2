"""LUKS1 containers as QEMU's ``luks`` driver writes them (docs/security.md "Encryption at rest"), read
without QEMU: the header, the volume key opened from a key slot with the passphrase, payload sectors
decrypted. What the EBS direct APIs need to answer an encrypted volume's snapshot as plaintext
(docs/ebs-direct.md "Encrypted snapshots"); the storage agent reads the payload's offset here too.

Only what QEMU writes by default is read: cipher ``aes``, mode ``xts-plain64``, 512-byte sectors whose
IV is their number from the payload's start; a key slot is PBKDF2 of the passphrase, its key material
AES-XTS encrypted from sector 0 and split by LUKS's anti-forensic splitter over the header's hash.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from vbs.errors import VbsError

__all__ = ["LUKS_MAGIC", "HEADER_BYTES", "SECTOR", "Header", "KeySlot", "NotLuks", "WrongKey", "parse_header",
           "open_volume_key", "decrypt"]

LUKS_MAGIC = b"LUKS\xba\xbe"
HEADER_BYTES = 592  # the fixed part: magic … 8 key slots
SECTOR = 512
_ACTIVE = 0x00AC71F3
_HASHES = ("sha1", "sha256", "sha512")
_SLOT = struct.Struct(">II32sII")  # active, iterations, salt, key material offset (sectors), stripes


class NotLuks(VbsError):
    """Not a LUKS1 container VBS can read (another version, cipher or mode)."""

    code = "InvalidParameterValue"
    status = 400


class WrongKey(VbsError):
    """The passphrase opens none of the container's key slots."""

    code = "KeyUnavailable"
    status = 500


@dataclass(frozen=True)
class KeySlot:
    iterations: int
    salt: bytes
    material_offset: int  # bytes from the container's start
    stripes: int


@dataclass(frozen=True)
class Header:
    hash_name: str
    payload_offset: int  # bytes from the container's start
    key_bytes: int
    digest: bytes
    digest_salt: bytes
    digest_iterations: int
    slots: tuple[KeySlot, ...]  # the active ones

    def material_end(self) -> int:
        """How far into the container the active slots' key material reaches."""
        return max((s.material_offset + self.key_bytes * s.stripes for s in self.slots), default=HEADER_BYTES)


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def parse_header(head: bytes) -> Header:
    """The header at the start of ``head`` (at least ``HEADER_BYTES``)."""
    if len(head) < HEADER_BYTES or head[:6] != LUKS_MAGIC or struct.unpack(">H", head[6:8])[0] != 1:
        raise NotLuks("not a LUKS1 container")
    cipher, mode, hash_name = _text(head[8:40]), _text(head[40:72]), _text(head[72:104])
    payload, key_bytes = struct.unpack(">II", head[104:112])
    if (cipher, mode) != ("aes", "xts-plain64") or hash_name not in _HASHES or key_bytes not in (32, 64):
        raise NotLuks(f"a LUKS1 container of {cipher}-{mode} with {hash_name} and a {key_bytes}-byte key is not "
                      "read here (QEMU's default, aes-xts-plain64, is)")
    slots = []
    for n in range(8):
        active, iterations, salt, offset, stripes = _SLOT.unpack_from(head, 208 + 48 * n)
        if active == _ACTIVE and iterations > 0 and 0 < stripes <= 65536:
            slots.append(KeySlot(iterations, salt, offset * SECTOR, stripes))
    return Header(hash_name, payload * SECTOR, key_bytes, head[112:132], head[132:164],
                  struct.unpack(">I", head[164:168])[0], tuple(slots))


def _xts(key: bytes, data: bytes, first_sector: int) -> bytes:
    """``data`` (whole sectors) decrypted with AES-XTS, the IV of each sector its number (plain64)."""
    out = bytearray()
    for n in range(len(data) // SECTOR):
        tweak = (first_sector + n).to_bytes(16, "little")
        out += Cipher(algorithms.AES(key), modes.XTS(tweak)).decryptor().update(data[n * SECTOR:(n + 1) * SECTOR])
    return bytes(out)


def _diffuse(data: bytes, hash_name: str) -> bytes:
    size = hashlib.new(hash_name).digest_size
    out = bytearray()
    for i in range(-(-len(data) // size)):
        piece = data[i * size:(i + 1) * size]
        out += hashlib.new(hash_name, i.to_bytes(4, "big") + piece).digest()[:len(piece)]
    return bytes(out)


def _af_merge(material: bytes, key_bytes: int, stripes: int, hash_name: str) -> bytes:
    """LUKS's anti-forensic merge: the key the ``stripes`` pieces of ``material`` were split from."""
    acc = bytes(key_bytes)
    for i in range(stripes - 1):
        piece = material[i * key_bytes:(i + 1) * key_bytes]
        acc = _diffuse(bytes(a ^ b for a, b in zip(acc, piece, strict=True)), hash_name)
    last = material[(stripes - 1) * key_bytes:stripes * key_bytes]
    return bytes(a ^ b for a, b in zip(acc, last, strict=True))


def open_volume_key(header: Header, head: bytes, passphrase: bytes) -> bytes:
    """The container's volume key, from the first key slot ``passphrase`` opens; ``head``: the container
    from its start to at least ``header.material_end()``. Each slot tried costs its PBKDF2 (QEMU sizes it to
    take about 2 s)."""
    if len(head) < header.material_end():
        raise NotLuks("the key material lies past the bytes given")
    for slot in header.slots:
        derived = hashlib.pbkdf2_hmac(header.hash_name, passphrase, slot.salt, slot.iterations, header.key_bytes)
        size = header.key_bytes * slot.stripes
        padded = -(-size // SECTOR) * SECTOR
        material = _xts(derived, head[slot.material_offset:slot.material_offset + padded], 0)[:size]
        key = _af_merge(material, header.key_bytes, slot.stripes, header.hash_name)
        check = hashlib.pbkdf2_hmac(header.hash_name, key, header.digest_salt, header.digest_iterations, 20)
        if hmac.compare_digest(check, header.digest):
            return key
    raise WrongKey("the passphrase opens none of the container's key slots")


def decrypt(volume_key: bytes, data: bytes, payload_position: int) -> bytes:
    """``data`` (whole sectors of the payload, from byte ``payload_position`` of it) as plaintext."""
    if payload_position % SECTOR or len(data) % SECTOR:
        raise ValueError("whole sectors only")
    return _xts(volume_key, data, payload_position // SECTOR)
