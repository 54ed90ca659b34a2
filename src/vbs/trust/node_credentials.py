"""Per-node credentials: each storage node and host has its own token, derived by the controller.

A node's token is ``<kind>.<name>.<generation>.<mac>`` where ``mac`` is an HMAC-SHA256 of the kind,
name and generation under the controller's node secret (``<data_dir>/node-secret``, 0600, made on
the controller's first start). So the controller stores no per-node secret, a token names the one
node it belongs to (a storage node's token cannot report as another node, nor as a host), and one
node's token is revoked alone by raising that node's generation (``vbs rotate-keys --node``).

Rotation without downtime: the new generation is current at once, the previous one stays accepted
until the node is first seen with the new token (its next heartbeat after it reloaded its token
file); the controller calls each node with the generation the node last authenticated with.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from vbs.errors import AuthFailure, InvalidParameter
from vbs.system.files import write_private

NodeKind = Literal["storage", "host"]
NAME_RE = re.compile(r"[a-z0-9][a-z0-9.-]{0,62}")
TOKEN_RE = re.compile(r"(storage|host)\.([a-z0-9][a-z0-9.-]{0,62})\.([0-9]{1,9})\.([A-Za-z0-9_-]{43})")
# Whatever is wrong with a node token, the answer is the same (it must not say which nodes exist).
REFUSED = "missing or wrong node credential"


@dataclass(frozen=True)
class NodeIdentity:
    kind: NodeKind
    name: str
    generation: int


def _check_name(kind: str, name: str) -> None:
    if kind not in ("storage", "host"):
        raise InvalidParameter(f"a node is a storage node or a host, not {kind[:20]!r}")
    if not NAME_RE.fullmatch(name):
        raise InvalidParameter(f"invalid node name {name[:70]!r}")


class NodeKeyring:
    """The controller's side: makes, checks and rotates node tokens."""

    def __init__(self, secret_path: Path, state_path: Path) -> None:
        self.secret_path = secret_path
        self.state_path = state_path
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], int] = {}
        # Each file as last read, keyed by its (inode, mtime, size): every heartbeat and every call to an
        # agent needs both, and they change only when an operator rotates or replaces them.
        self._files: dict[Path, tuple[tuple[int, int, int], str]] = {}

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> NodeKeyring:
        return cls(data_dir / "node-secret", data_dir / "node-credentials.json")

    def ensure(self) -> NodeKeyring:
        """Make the node secret if this install has none yet (mode 0600)."""
        if self.secret_path.exists():
            return self
        self.secret_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(self.secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return self  # another process made it first: use theirs
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(48))
            fh.flush()
            os.fsync(fh.fileno())
        return self

    def _read(self, path: Path) -> str:
        """``path``'s text, read again only when the file changed (FileNotFoundError if it is gone)."""
        st = path.stat()
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._files.get(path)
        if cached is None or cached[0] != stamp:
            cached = (stamp, path.read_text())
            self._files[path] = cached
        return cached[1]

    def _secret(self) -> bytes:
        return self._read(self.secret_path).strip().encode()

    def _state(self) -> dict[str, dict[str, int]]:
        try:
            data = json.loads(self._read(self.state_path))
        except FileNotFoundError:
            return {}
        return {str(k): {kk: int(vv) for kk, vv in v.items()} for k, v in data.items()}

    def _save(self, state: dict[str, dict[str, int]]) -> None:
        write_private(self.state_path, json.dumps(state, indent=1, sort_keys=True))

    def _mac(self, kind: str, name: str, generation: int) -> str:
        digest = hmac.new(self._secret(), f"{kind}\0{name}\0{generation}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def _generations(self, kind: str, name: str) -> tuple[int, int | None]:
        entry = self._state().get(f"{kind}/{name}", {})
        return entry.get("generation", 1), entry.get("previous")

    def token(self, kind: str, name: str, generation: int | None = None) -> str:
        """The node's current token (or that of ``generation``)."""
        _check_name(kind, name)
        gen = generation if generation is not None else self._generations(kind, name)[0]
        return f"{kind}.{name}.{gen}.{self._mac(kind, name, gen)}"

    def token_for_calls(self, kind: str, name: str) -> str:
        """What the controller presents when it calls the node: the generation it last saw the node use."""
        current, previous = self._generations(kind, name)
        seen = self._seen.get((kind, name))
        return self.token(kind, name, seen if seen in (current, previous) else current)

    def verify(self, token: str) -> NodeIdentity:
        m = TOKEN_RE.fullmatch(token)
        if m is None:
            raise AuthFailure(REFUSED)
        kind, name, gen_s, mac = m.groups()
        gen = int(gen_s)
        current, previous = self._generations(kind, name)
        good = hmac.compare_digest(mac.encode(), self._mac(kind, name, gen).encode())
        if not good or gen not in (current, previous):
            raise AuthFailure(REFUSED)
        with self._lock:
            self._seen[(kind, name)] = gen
            if gen == current and previous is not None:
                state = self._state()
                state.get(f"{kind}/{name}", {}).pop("previous", None)
                self._save(state)
        return NodeIdentity(kind, name, gen)  # type: ignore[arg-type]

    def rotate(self, kind: str, name: str) -> str:
        """Make a new generation current (the old one stays valid until the node uses the new one)."""
        _check_name(kind, name)
        with self._lock:
            state = self._state()
            current, _ = self._generations(kind, name)
            state[f"{kind}/{name}"] = {"generation": current + 1, "previous": current}
            self._save(state)
        return self.token(kind, name, current + 1)

    def revoke(self, kind: str, name: str) -> None:
        """Invalidate every token the node holds now, at once (a leaked or retired node)."""
        _check_name(kind, name)
        with self._lock:
            state = self._state()
            current, _ = self._generations(kind, name)
            state[f"{kind}/{name}"] = {"generation": current + 1}
            self._save(state)


class TokenSource:
    """An agent's side: its own token, from config/env or a file it re-reads when it changes.

    After a reload the previous token stays accepted for ``grace_s`` so that calls the controller
    makes before it sees the node's new token still pass."""

    GRACE_S = 300.0

    def __init__(self, token: str | None, path: Path | None = None) -> None:
        self._fixed = token
        self._path = path
        self._mtime: float | None = None
        self._current: str | None = token
        self._previous: tuple[str, float] | None = None
        self._lock = threading.Lock()

    @property
    def configured(self) -> bool:
        return self._fixed is not None or self._path is not None

    def current(self) -> str | None:
        if self._path is None:
            return self._fixed
        with self._lock:
            try:
                mtime = self._path.stat().st_mtime
            except FileNotFoundError:
                return self._current
            if mtime != self._mtime:
                new = self._path.read_text().strip() or None
                if self._current is not None and new != self._current:
                    self._previous = (self._current, time.monotonic() + self.GRACE_S)
                self._current, self._mtime = new, mtime
            return self._current

    def accepts(self, given: str) -> bool:
        current = self.current()
        ok = current is not None and hmac.compare_digest(given.encode(), current.encode())
        prev = self._previous
        if prev is not None and time.monotonic() < prev[1]:
            ok = hmac.compare_digest(given.encode(), prev[0].encode()) or ok
        return ok
