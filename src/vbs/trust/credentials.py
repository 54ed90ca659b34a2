"""Access keys for the public APIs, kept in the AWS shared-credentials format.

``vbs up`` writes ``<data-dir>/credentials`` (profile ``default``) so that the AWS CLI, boto3 and
the ``vbs`` CLI all find the same key: ``AWS_SHARED_CREDENTIALS_FILE=<data-dir>/credentials``.
"""

from __future__ import annotations

import configparser
import io
import os
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from vbs.errors import InvalidParameter
from vbs.system.files import write_private

KEY_ID_RE = re.compile(r"^[A-Z0-9]{16,128}$")
SECRET_RE = re.compile(r"^[A-Za-z0-9/+=_-]{16,128}$")


@dataclass(frozen=True)
class AccessKey:
    access_key_id: str
    secret_access_key: str = field(repr=False)

    def __post_init__(self) -> None:
        if not KEY_ID_RE.fullmatch(self.access_key_id):
            raise InvalidParameter("an access key id is 16-128 uppercase letters and digits")
        if not SECRET_RE.fullmatch(self.secret_access_key):
            raise InvalidParameter("a secret access key is 16-128 characters of [A-Za-z0-9/+=_-]")

    @property
    def bearer(self) -> str:
        """The REST API's bearer token for this key."""
        return f"{self.access_key_id}:{self.secret_access_key}"


def generate() -> AccessKey:
    alphabet = string.ascii_uppercase + string.digits
    key_id = "VBSK" + "".join(secrets.choice(alphabet) for _ in range(16))
    return AccessKey(key_id, secrets.token_urlsafe(30)[:40])


def from_env(env: dict[str, str] | None = None) -> AccessKey | None:
    env = dict(os.environ) if env is None else env
    key_id, secret = env.get("VBS_ACCESS_KEY_ID"), env.get("VBS_SECRET_ACCESS_KEY")
    if not key_id and not secret:
        return None
    if not key_id or not secret:
        raise InvalidParameter("set both VBS_ACCESS_KEY_ID and VBS_SECRET_ACCESS_KEY, or neither")
    return AccessKey(key_id, secret)


def read(path: Path, profile: str | None = None) -> list[AccessKey]:
    """Keys of one profile, or of every profile, of a shared-credentials file."""
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(path.read_text())
    except (OSError, configparser.Error) as exc:
        raise InvalidParameter(f"cannot read credentials file {path}: {exc}") from exc
    keys = []
    for section in parser.sections():
        if profile is not None and section != profile:
            continue
        sec = parser[section]
        if "aws_access_key_id" in sec and "aws_secret_access_key" in sec:
            keys.append(AccessKey(sec["aws_access_key_id"].strip(), sec["aws_secret_access_key"].strip()))
    return keys


def write(path: Path, key: AccessKey) -> None:
    """Write ``key`` as the ``default`` profile, readable by its owner only, replaced atomically."""
    write_private(path, f"[default]\naws_access_key_id = {key.access_key_id}\n"
                        f"aws_secret_access_key = {key.secret_access_key}\n")


def ensure_file(path: Path, env: dict[str, str] | None = None) -> AccessKey:
    """The install's first key: from ``VBS_ACCESS_KEY_ID``/``…SECRET…`` if set, else kept or made once."""
    key = from_env(env)
    if key is None and path.exists():
        existing = read(path, "default")
        if existing:
            return existing[0]
    key = key or generate()
    write(path, key)
    return key


def user_file(env: dict[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/vbs/credentials``: one profile per endpoint that ``vbs up`` started here."""
    env = dict(os.environ) if env is None else env
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "vbs" / "credentials"


# One machine's own names for itself: an endpoint on any of them is the same endpoint.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def endpoint_key(endpoint: str) -> str:
    """The section of the user's credentials file for ``endpoint``: ``localhost``, ``127.0.0.1`` and
    ``[::1]`` are one host, and case and a trailing slash do not matter."""
    text = endpoint.strip().rstrip("/")
    try:
        parts = urlsplit(text)
        host, port = parts.hostname, parts.port
    except ValueError:
        return text
    if not parts.scheme or host is None:
        return text
    host = "127.0.0.1" if host in LOOPBACK_HOSTS else host
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


def _load_user_file(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser()
    if path.exists():
        parser.read_string(path.read_text())
    return parser


def _save_user_file(path: Path, parser: configparser.RawConfigParser) -> None:
    text = io.StringIO()
    parser.write(text)
    write_private(path, text.getvalue())


def register_endpoint(endpoint: str, key: AccessKey, env: dict[str, str] | None = None) -> None:
    """Remember ``key`` for ``endpoint`` so the vbs CLI on this machine finds it by itself, under the
    endpoint's normal form (:func:`endpoint_key`); an older section spelt otherwise is replaced."""
    path = user_file(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    parser = _load_user_file(path)
    section = endpoint_key(endpoint)
    for old in parser.sections():
        if old != section and endpoint_key(old) == section:
            parser.remove_section(old)
    if not parser.has_section(section):
        parser.add_section(section)
    parser.set(section, "aws_access_key_id", key.access_key_id)
    parser.set(section, "aws_secret_access_key", key.secret_access_key)
    _save_user_file(path, parser)


def unregister_endpoint(endpoint: str, key: AccessKey, env: dict[str, str] | None = None) -> None:
    """Forget ``endpoint``'s key when the install that recorded it stops: its sections (any spelling)
    that still hold ``key`` go; one another install wrote since stays."""
    path = user_file(env)
    if not path.exists():
        return
    try:
        parser = _load_user_file(path)
    except (OSError, configparser.Error):
        return
    section = endpoint_key(endpoint)
    gone = [s for s in parser.sections()
            if endpoint_key(s) == section and parser.get(s, "aws_access_key_id", fallback="").strip()
            == key.access_key_id]
    if gone:
        for s in gone:
            parser.remove_section(s)
        _save_user_file(path, parser)


def _endpoint_keys(path: Path, endpoint: str) -> list[AccessKey]:
    """The key recorded for ``endpoint`` in the user's file: its normal form's section first, then any
    older section spelt otherwise (``http://localhost:8770/``)."""
    found = read(path, endpoint_key(endpoint)) or read(path, endpoint.rstrip("/"))
    if found:
        return found
    parser = _load_user_file(path)
    for section in parser.sections():
        if endpoint_key(section) == endpoint_key(endpoint):
            found = read(path, section)
            if found:
                return found
    return []


def for_client(endpoints: Sequence[str], env: dict[str, str] | None = None, *,
               profile: str | None = None) -> AccessKey | None:
    """The key a client on this machine uses for ``endpoints`` (the controllers of one install), looked
    for in the documented order; of the keys ``vbs up`` recorded, the first endpoint's that has one.
    With a named ``profile`` (``--profile``), its section of the user's credentials file, or none."""
    env = dict(os.environ) if env is None else env
    key = from_env(env)
    if key is not None:
        return key
    if profile is not None:
        found = read(user_file(env), profile) if user_file(env).exists() else []
        if not found:
            raise InvalidParameter(f"no access key for profile {profile!r} in {user_file(env)} "
                                   f"([{profile}] aws_access_key_id, aws_secret_access_key)")
        return found[0]
    candidates: list[Callable[[], list[AccessKey]]] = []
    if env.get("VBS_CREDENTIALS_FILE"):
        candidates.append(partial(_existing, Path(env["VBS_CREDENTIALS_FILE"]), "default"))
    mine = user_file(env)
    if mine.exists():
        candidates += [partial(_endpoint_keys, mine, endpoint) for endpoint in endpoints]
    candidates.append(partial(_existing, Path("var/credentials"), "default"))
    for candidate in candidates:
        found = candidate()
        if found:
            return found[0]
    return None


def _existing(path: Path, profile: str) -> list[AccessKey]:
    return read(path, profile) if path.exists() else []
