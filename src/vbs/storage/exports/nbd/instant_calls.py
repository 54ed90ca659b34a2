"""What the NBD driver's point-in-time calls share (copy_calls.py: copies, view_calls.py: views): what
they use of the driver they are mixed into, the checks of their arguments, and finding or starting one."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from vbs import ids
from vbs.errors import InvalidParameter
from vbs.pools.exports import ExportSource, FileSource
from vbs.storage.exports.supervised import check_key, source_file

from .chains import Chains
from .copies import Copies
from .state import Live, Served
from .views import Views

T_co = TypeVar("T_co", covariant=True)


class Driver(Protocol):
    """What the calls use of the driver they are mixed into."""

    _chains: Chains
    _copies: Copies
    _views: Views

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...

    def _up(self) -> None: ...

    def _load(self) -> None: ...

    def _view(self) -> Live: ...

    def _save(self) -> None: ...

    def _serving(self, key: str, source: ExportSource) -> Served | None: ...


class Instants(Protocol[T_co]):
    """The copies (copies.py) or the views (views.py) of the desired state."""

    def find(self, item_id: str) -> tuple[Served, T_co] | None: ...

    def start(self, item_id: str, served: Served, file: Path, live: Live) -> tuple[Served, T_co]: ...


def checked_args(item_id: str, key: str, source: ExportSource, file: Path, what: str) -> tuple[Path, Path]:
    """The source's file and ``file`` (the copy's target or the view's scratch file, ``what``), checked."""
    ids.check("snapshot", item_id)
    check_key(key)
    path = source_file(key, source)
    file = Path(file)
    if not file.is_absolute():
        raise InvalidParameter(f"{what} must be absolute: {file}")
    return path, file


def find_or_start(driver: Driver, instants: Instants[T_co], item_id: str, key: str, path: Path, file: Path
                  ) -> tuple[Served, T_co, Live]:
    """Under the driver's lock: the daemon up, what it has, and the copy or view ``item_id`` with the key
    it is of; started (on the key's desired item, a new one if the key has none) if it is not there yet."""
    driver._up()
    live = driver._view()
    found = instants.find(item_id)
    if found is None:
        served = driver._serving(key, FileSource(path)) or Served(key=key, path=str(path))
        found = instants.start(item_id, served, file, live)
    return (*found, live)
