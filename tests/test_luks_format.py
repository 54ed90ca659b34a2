"""LUKS containers made by qemu-img: formatting survives QEMU's failed timing of the key derivation.

QEMU times PBKDF2 on the thread's CPU clock before it writes a header; on a kernel whose clock ticks
coarsely the timing can read 0 ms and qemu-img refuses ("Unable to get accurate CPU usage"), on these
machines in about 2 tries out of 5. An encrypted volume must not fail for that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from vbs.errors import DriverError
from vbs.storage import luks
from vbs.system import argv

MiB = 1 << 20
KEY = SecretStr("a passphrase for tests")


class FlakyQemuImg:
    """``argv.run`` as qemu-img behaves here: ``failures`` refusals (each after making the file), then
    success, or one other error."""

    def __init__(self, failures: int, other: str | None = None) -> None:
        self.failures, self.other, self.calls = failures, other, 0

    def __call__(self, args: list[str], timeout: float) -> None:
        self.calls += 1
        target = Path(args[-2] if args[1] == "create" else args[-1])
        assert not target.exists(), "each try starts from no file"
        target.write_bytes(b"")
        if self.other is not None:
            raise DriverError(f"qemu-img exited with 1: {self.other}")
        if self.calls <= self.failures:
            raise DriverError(f"qemu-img exited with 1: qemu-img: {target}: Unable to get accurate CPU usage")
        target.write_bytes(b"LUKS\xba\xbe")


@pytest.mark.unit
def test_a_failed_timing_of_the_key_derivation_is_tried_again(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    qemu_img = FlakyQemuImg(failures=3)
    monkeypatch.setattr(argv, "run", qemu_img)
    luks.format_luks(tmp_path / "vol.partial", 64 * MiB, KEY)
    assert qemu_img.calls == 4 and (tmp_path / "vol.partial").read_bytes() == b"LUKS\xba\xbe"


@pytest.mark.unit
def test_other_failures_and_endless_timing_failures_are_errors(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    other = FlakyQemuImg(failures=0, other="Could not create: No space left on device")
    monkeypatch.setattr(argv, "run", other)
    with pytest.raises(DriverError, match="No space left"):
        luks.format_luks(tmp_path / "a", 64 * MiB, KEY)
    assert other.calls == 1
    endless = FlakyQemuImg(failures=10**6)
    monkeypatch.setattr(argv, "run", endless)
    with pytest.raises(DriverError, match="accurate CPU usage"):
        luks.format_luks(tmp_path / "b", 64 * MiB, KEY)
    assert endless.calls == luks.CALIBRATION_TRIES


@pytest.mark.integration
def test_real_qemu_img_formats_every_time(tmp_path: Path) -> None:
    """Three formats in a row with the real qemu-img: without the retry, all three succeed about one time
    in five here. Each is a real container of the asked payload, opened by qemu-img with the key."""
    for n in range(3):
        path = tmp_path / f"vol{n}"
        luks.format_luks(path, 16 * MiB, KEY)
        assert luks.header_bytes(path) > 0
        assert path.stat().st_size == 16 * MiB + luks.header_bytes(path)
