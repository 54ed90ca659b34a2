"""The ``command`` resolver: an operator's profile maps a cloud's id to ``host vm``.

The profile (kind ``resolver``) has one command, ``resolve``, whose argv may use ``{id}`` — typed by
the profile itself (``[placeholders] id = "…"``: the cloud's own id pattern) — and whose ``lines``
pattern picks ``(?P<host>…)`` and ``(?P<vm>…)`` from the output. Configured as
``resolvers = {lab = "command:lab"}`` (a profile name looked up in ``resolver_profile_dirs``, or a
path). Exit status 0 with no matching line: the cloud does not know the id.
"""

from __future__ import annotations

from vbs.config import ControllerConfig
from vbs.controller.db import Database
from vbs.controller.resolvers.base import Location
from vbs.errors import InvalidParameter
from vbs.profiles import CommandSchema, Profile, ProfileSchema, load_profile

__all__ = ["CommandResolver", "RESOLVER_PROFILES"]

RESOLVER_PROFILES = ProfileSchema(
    kind="resolver",
    commands={"resolve": CommandSchema(frozenset({"id"}), description="print `host vm` of the instance")},
    typed_by_profile=frozenset({"id"}),
)


class CommandResolver:
    def __init__(self, profile: Profile) -> None:
        spec = profile.commands["resolve"]
        if spec.lines is None or not {"host", "vm"} <= set(spec.lines.groupindex):
            raise InvalidParameter(f"profile {profile.path}: [commands.resolve] needs lines with the groups "
                                   "(?P<host>…) and (?P<vm>…)")
        self.profile = profile
        self.id_pattern = profile.placeholders["id"].pattern or ""

    @classmethod
    def from_config(cls, scheme: str, argument: str | None, cfg: ControllerConfig) -> CommandResolver:
        if not argument:
            raise InvalidParameter(f"resolvers: {scheme} = \"command:PROFILE\" names its profile")
        return cls(load_profile(RESOLVER_PROFILES, argument, cfg.resolver_profile_dirs))

    def locate(self, db: Database, cloud_id: str) -> Location | None:
        out = self.profile.run("resolve", {"id": cloud_id})
        for found in out.matches(self.profile.commands["resolve"]):
            if "host" in found and "vm" in found:
                return Location(found["host"], found["vm"])
        return None
