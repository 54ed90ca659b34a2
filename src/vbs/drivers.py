"""Driver registries: backends, exports, hypervisors, instance resolvers and snapshot stores are found by name.

Each family is an entry-point group; the config names the driver (``backend = "file"``,
``export = "nbd"``, ``hypervisor = "qemu"``). VBS registers its own drivers in its pyproject; a
third party ships a driver as a package that declares the same groups, and nothing in VBS changes:

    [project.entry-points."vbs.backends"]
    mystore = "mystore.vbs:MyStoreBackend"

The object an entry point names is a driver class with a ``from_config`` class method (see the
contract of each family: ``vbs.pools.backend``, ``vbs.pools.exports``,
``vbs.host.hypervisors.base``, ``vbs.snapshot_store.contract``).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Literal

from vbs.errors import DriverError, InvalidParameter

__all__ = ["Family", "GROUPS", "load", "available"]

Family = Literal["backend", "export", "hypervisor", "resolver", "snapshot_store"]

GROUPS: dict[Family, str] = {
    "backend": "vbs.backends",
    "export": "vbs.exports",
    "hypervisor": "vbs.hypervisors",
    "resolver": "vbs.resolvers",
    "snapshot_store": "vbs.snapshot_stores",
}


def _entry_points(family: Family) -> list[EntryPoint]:
    return list(entry_points(group=GROUPS[family]))


def available(family: Family) -> list[str]:
    """The names of every installed driver of ``family``."""
    return sorted({ep.name for ep in _entry_points(family)})


def load(family: Family, name: str) -> type:
    """The driver class registered as ``name`` in ``family``'s group.

    An unknown name is the operator's mistake (InvalidParameter, naming what is installed); a
    driver that fails to import is the driver's (DriverError, with its reason).
    """
    found = [ep for ep in _entry_points(family) if ep.name == name]
    if not found:
        installed = ", ".join(available(family)) or "none"
        raise InvalidParameter(f"no {family} driver named {name!r}; installed: {installed}")
    try:
        driver = found[0].load()
    except Exception as exc:  # an ImportError, or anything a broken plug-in raises at import
        raise DriverError(f"{family} driver {name!r} ({found[0].value}) cannot be loaded: {exc}") from exc
    if not isinstance(driver, type) or not callable(getattr(driver, "from_config", None)):
        raise DriverError(f"{family} driver {name!r} ({found[0].value}) is not a driver class with from_config")
    return driver
