"""Instance-id resolvers: ``attach-volume --instance SCHEME:ID`` with an external cloud's ids.

``i-…`` is VBS's own instance id. Any other id is ``SCHEME:ID`` (``nova:2f1c…``): the controller's
config maps each scheme to a resolver plug-in (entry-point group ``vbs.resolvers``, found like
drivers) with its argument — ``resolvers = {nova = "libvirt-metadata", lab = "command:lab"}``. A
resolver checks the id against its own strict pattern and answers the (host, VM) it names; the
instance is then the VM that host's agent reports. Nothing about an id reaches a command unchecked.

Resolving happens before any row is locked: a command resolver may take its time.
"""

from __future__ import annotations

import re
from typing import Any

from vbs import drivers
from vbs.config import DRIVER_NAME_RE, ControllerConfig
from vbs.controller.db import Database
from vbs.controller.resolvers.base import InstanceResolver, Location
from vbs.errors import DriverError, InvalidParameter, NotFound

__all__ = ["Resolvers", "InstanceResolver", "Location", "SCHEME_RE", "is_cloud_ref"]

SCHEME_RE = r"[a-z][a-z0-9-]{0,31}"
_SETTING_RE = rf"(?P<driver>{DRIVER_NAME_RE.strip('^$')})(?::(?P<arg>[A-Za-z0-9_./-]{{1,255}}))?"


def is_cloud_ref(instance_id: str) -> bool:
    """Whether an instance id is ``SCHEME:ID`` (an external cloud's), not VBS's own ``i-…``."""
    return ":" in instance_id


class Resolvers:
    """The resolvers of one controller, by scheme; made at start (a broken one stops it)."""

    def __init__(self, by_scheme: dict[str, InstanceResolver]) -> None:
        self.by_scheme = by_scheme

    @classmethod
    def from_config(cls, cfg: ControllerConfig) -> Resolvers:
        found: dict[str, InstanceResolver] = {}
        for scheme, setting in cfg.resolvers.items():
            m = re.fullmatch(_SETTING_RE, setting)
            if not re.fullmatch(SCHEME_RE, scheme) or m is None:
                raise InvalidParameter(f"resolvers: {scheme[:40]!r} = {setting[:80]!r}: expecting SCHEME = "
                                       "\"DRIVER\" or \"DRIVER:ARGUMENT\"")
            resolver_cls: Any = drivers.load("resolver", m["driver"])
            resolver = resolver_cls.from_config(scheme, m["arg"], cfg)
            if not isinstance(resolver, InstanceResolver):
                raise DriverError(f"resolver {m['driver']!r} does not fulfil the InstanceResolver contract")
            found[scheme] = resolver
        return cls(found)

    def locate(self, db: Database, ref: str) -> Location:
        """The (host, VM) that ``ref`` (``SCHEME:ID``) names; 4xx with the reason otherwise."""
        scheme, _, cloud_id = ref.partition(":")
        resolver = self.by_scheme.get(scheme)
        if resolver is None:
            known = ", ".join(sorted(self.by_scheme)) or "none are configured"
            raise InvalidParameter(f"Unknown instance id scheme '{scheme[:32]}' in '{ref[:80]}' (known: {known}).",
                                   code="InvalidInstanceID.Malformed")
        if not re.fullmatch(resolver.id_pattern, cloud_id):
            raise InvalidParameter(f"Invalid {scheme} instance id '{cloud_id[:80]}' (expecting "
                                   f"{resolver.id_pattern}).", code="InvalidInstanceID.Malformed")
        where = resolver.locate(db, cloud_id)
        if where is None:
            raise NotFound(f"The instance {ref[:120]} does not exist.", code="InvalidInstanceID.NotFound")
        return where
