"""Named CLI profiles, as the AWS CLI keeps them: ``$XDG_CONFIG_HOME/vbs/config`` (``~/.config``).

::

    [default]
    endpoint = http://127.0.0.1:8770

    [profile prod]
    endpoint = https://vbs-1.example:8770,https://vbs-2.example:8770
    ca_bundle = /etc/vbs/ca.pem
    region = us-east-1
    endpoint_eu-west-1 = https://vbs.eu.example:8770

``--profile prod`` (or ``VBS_PROFILE``) takes the endpoint and CA from there unless ``--endpoint``/
``VBS_ENDPOINT`` or ``--ca-bundle``/``VBS_CA_BUNDLE`` say otherwise, and the access key from the
section ``[prod]`` of ``$XDG_CONFIG_HOME/vbs/credentials`` (``aws_access_key_id``,
``aws_secret_access_key``), after the ``VBS_ACCESS_KEY_ID``/``…SECRET…`` variables.

A region (``--region``, ``VBS_REGION``, the profile's ``region``) picks the profile's
``endpoint_<region>`` where it has one, and the CLI checks that the controller serves that region
(each VBS controller serves one): a command sent to the wrong region fails instead of acting there.
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
REGION_RE = r"[a-z0-9-]{1,32}"
_KEYS = {"endpoint", "ca_bundle", "region"}


@dataclass(frozen=True)
class CliProfile:
    name: str
    endpoint: str | None = None
    ca_bundle: str | None = None
    region: str | None = None
    region_endpoints: dict[str, str] | None = None

    def endpoint_for(self, region: str | None) -> str | None:
        """The profile's endpoint of ``region`` if it names one, else its endpoint."""
        return (self.region_endpoints or {}).get(region or "") or self.endpoint


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
    regional = {k.removeprefix("endpoint_"): v for k, v in values.items()
                if k.startswith("endpoint_") and re.fullmatch(REGION_RE, k.removeprefix("endpoint_"))}
    unknown = set(values) - _KEYS - {f"endpoint_{r}" for r in regional}
    if unknown:
        raise InvalidParameter(f"{path} [{section}]: unknown setting {sorted(unknown)[0]!r} "
                               f"(expecting {', '.join(sorted(_KEYS))} or endpoint_<region>)")
    region = values.get("region") or None
    if region is not None and not re.fullmatch(REGION_RE, region):
        raise InvalidParameter(f"{path} [{section}]: invalid region {region[:40]!r}")
    return CliProfile(name, values.get("endpoint") or None, values.get("ca_bundle") or None, region,
                      regional or None)
