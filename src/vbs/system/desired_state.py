"""What an agent must re-create after a restart: a typed list of items in one private JSON file.

Export drivers write what should exist *before* they make it in their daemon, so that after a
crash at any point the daemon can be brought back to the file (``check()``, an agent restart), and
never holds something the agent does not know about. The file is mode 0600 (it holds secrets such
as CHAP passwords and export names), versioned, and replaced atomically: a reader sees the old or
the new list, never half of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from vbs.errors import DriverError
from vbs.system.files import write_private

__all__ = ["DesiredState"]

M = TypeVar("M", bound=BaseModel)


class DesiredState(Generic[M]):
    """The list of ``item`` models kept in ``path``.

    ``upgrades`` turns the JSON of an older version into this version's list of item dicts (an
    agent upgraded under running exports must not forget them); any other version reads as empty.
    """

    def __init__(self, path: Path, item: type[M], *, version: int = 1,
                 upgrades: Mapping[int, Callable[[dict[str, Any]], list[dict[str, Any]]]] | None = None) -> None:
        self.path = path
        self.version = version
        self.upgrades = dict(upgrades or {})
        self._items = TypeAdapter(list[item])  # type: ignore[valid-type]

    def load(self) -> list[M]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise DriverError(f"unreadable desired state {self.path}: {exc}") from exc
        if not isinstance(data, dict):
            return []
        version = data.get("version")
        if version == self.version:
            raw = data.get("items", [])
        elif isinstance(version, int) and version in self.upgrades:
            try:
                raw = self.upgrades[version](data)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a malformed older file
                raise DriverError(f"unreadable desired state {self.path} (version {version}): {exc!r}") from exc
        else:
            return []
        try:
            items: list[M] = self._items.validate_python(raw)
        except ValidationError as exc:
            raise DriverError(f"unreadable desired state {self.path}: {exc.error_count()} bad items") from exc
        return items

    def save(self, items: Iterable[M]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        payload = {"version": self.version, "items": [i.model_dump(mode="json") for i in items]}
        write_private(self.path, json.dumps(payload, indent=1) + "\n")
