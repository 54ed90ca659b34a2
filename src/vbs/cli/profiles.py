"""Named CLI profiles, as the AWS CLI keeps them: ``$XDG_CONFIG_HOME/vbs/config`` (``~/.config``).

::

    [default]
    endpoint = http://127.0.0.1:8770

    [profile prod]
    endpoint = https://vbs-1.example:8770,https://vbs-2.example:8770
    ca_bundle = /etc/vbs/ca.pem

``--profile prod`` (or ``VBS_PROFILE``) takes the endpoint and CA from there unless ``--endpoint``/
``VBS_ENDPOINT`` or ``--ca-bundle``/``VBS_CA_BUNDLE`` say otherwise, and the access key from the
section ``[prod]`` of ``$XDG_CONFIG_HOME/vbs/credentials`` (``aws_access_key_id``,
``aws_secret_access_key``), after the ``VBS_ACCESS_KEY_ID``/``…SECRET…`` variables.
"""

from __future__ import annotations

import configparser
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vbs.errors import InvalidParameter

__all__ = ["CliProfile", "load", "config_file", "PROFILE_RE"]

PROFILE_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_KEYS = {"endpoint", "ca_bundle"}


@dataclass(frozen=True)
class CliProfile:
    name: str
    endpoint: str | None = None
    ca_bundle: str | None = None


def config_file(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    return Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "vbs" / "config"


def load(name: str, env: dict[str, str] | None = None) -> CliProfile:
    """The profile ``name`` of the config file; ``default`` may be absent (it is then empty)."""
    if not re.fullmatch(PROFILE_RE, name):
        raise InvalidParameter(f"invalid profile name {name[:70]!r}")
    path = config_file(env)
    parser = configparser.RawConfigParser()
    if path.exists():
        try:
            parser.read_string(path.read_text())
        except (OSError, configparser.Error) as exc:
            raise InvalidParameter(f"cannot read {path}: {exc}") from exc
    section = "default" if name == "default" else f"profile {name}"
    if not parser.has_section(section):
        if name == "default":
            return CliProfile(name)
        known = sorted(s.removeprefix("profile ") for s in parser.sections())
        raise InvalidParameter(f"no profile {name!r} in {path} (it has: {', '.join(known) or 'none'})")
    values = dict(parser[section])
    unknown = set(values) - _KEYS
    if unknown:
        raise InvalidParameter(f"{path} [{section}]: unknown setting {sorted(unknown)[0]!r} "
                               f"(expecting {', '.join(sorted(_KEYS))})")
    return CliProfile(name, values.get("endpoint") or None, values.get("ca_bundle") or None)
