"""A monitor that is slow to greet: ``connect_until`` waits for it until its deadline, not for a connect's
usual bound (a storage agent's qemu-storage-daemon once took over 5 s to greet on a loaded machine, and
``vbs up`` gave up on it)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vbs.qemu.qmp import QmpClient, QmpConnectionError, connect_until

pytestmark = pytest.mark.integration  # waits out a 5 s greeting

GREETING = {"QMP": {"version": {"qemu": {"major": 7, "minor": 2, "micro": 0}, "package": ""}, "capabilities": []}}
GREET_AFTER_S = 6.0  # more than QmpClient's default connect bound (5 s)


class SlowMonitor:
    """A unix-socket QMP monitor that greets ``delay`` seconds after a client connects, then answers
    ``qmp_capabilities`` and ``query-version``."""

    def __init__(self, path: Path, delay: float) -> None:
        self.path, self.delay = path, delay
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(str(path))
        self.server.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        # QMP is a stream of JSON objects: a client's commands need not end with a newline.
        decoder, pending = json.JSONDecoder(), ""
        with conn:
            time.sleep(self.delay)
            try:
                conn.sendall(json.dumps(GREETING).encode() + b"\r\n")
                while chunk := conn.recv(4096):
                    pending += chunk.decode()
                    while pending.strip():
                        try:
                            request, end = decoder.raw_decode(pending.lstrip())
                        except json.JSONDecodeError:
                            break  # the rest of it comes with the next chunk
                        pending = pending.lstrip()[end:]
                        answer = GREETING["QMP"]["version"] if request["execute"] == "query-version" else {}
                        reply = {"return": answer, **({"id": request["id"]} if "id" in request else {})}
                        conn.sendall(json.dumps(reply).encode() + b"\r\n")
            except (OSError, ValueError):
                return

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def slow_monitor(tmp_path: Path) -> Iterator[SlowMonitor]:
    monitor = SlowMonitor(tmp_path / "qmp.sock", GREET_AFTER_S)
    yield monitor
    monitor.close()


def test_a_slow_greeting_within_the_deadline_is_waited_for(slow_monitor: SlowMonitor) -> None:
    started = time.monotonic()
    with connect_until(slow_monitor.path, started + 20) as client:
        assert client.execute("query-version")["qemu"]["major"] == 7
    assert time.monotonic() - started >= GREET_AFTER_S


def test_a_plain_client_still_gives_up_after_its_connect_bound(slow_monitor: SlowMonitor) -> None:
    client = QmpClient(slow_monitor.path, connect_timeout=1.0)
    try:
        with pytest.raises(QmpConnectionError, match="no answer within 1s"):
            client.execute("query-version")
    finally:
        client.close()


def test_a_greeting_later_than_the_deadline_is_an_error(slow_monitor: SlowMonitor) -> None:
    with pytest.raises(QmpConnectionError):
        connect_until(slow_monitor.path, time.monotonic() + 2)
