"""The snapshot store contract: a flat namespace of immutable objects, by key.

A driver (``dir``, ``s3``, or a third party's, found through ``vbs.drivers``) knows nothing of
snapshots: it puts, gets, heads, deletes and lists objects. What the objects mean (chunks,
manifests, upload markers) is ``vbs.snapshot_store.format``'s and the layout is docs/snapshots.md's.

Promises every driver keeps:
- ``put`` is atomic: a reader sees the whole new object or none of it (never half), and once ``put``
  returns the object is durable; a ``put`` of an existing key replaces it whole (and makes it young
  again: ``modified`` is the time of the last ``put``).
- reads after a write see it, and so do listings (S3 and RADOS Gateway are strongly consistent; a
  directory is, on one machine).
- ``delete`` of a missing key succeeds.
- a store may also offer ``batch`` (``BatchingStore``): puts that are atomic and visible at once but
  durable only at the batch's ``commit``, for an upload's many chunks (docs/snapshots.md, "Durability");
  an object found that may not be durable yet is trusted only once read and found whole, and the
  commit makes it durable too.
  A store without it is used through ``DurablePuts``: each put durable on return, ``commit`` nothing.
- the store's own trouble (unreachable, timed out, throttled after retries) raises
  ``SnapshotStoreUnavailable``, which callers may retry; a missing key on ``get`` raises
  ``ObjectMissing``; anything else wrong with the store's configuration is a ``DriverError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ValidationError

from vbs.errors import InvalidParameter, NotFound, matching

__all__ = ["SnapshotStore", "ObjectInfo", "ObjectMissing", "check_key", "check_prefix", "parse_options",
           "StoreBatch", "BatchingStore", "DurablePuts", "open_batch", "Trusted", "Whole"]

_Options = TypeVar("_Options", bound=BaseModel)

# Why a batch relies on an object it found: "durable" as it is (never read), or "verified": read,
# found whole by the caller's test (``Whole``), and made durable by the batch's commit.
Trusted = Literal["durable", "verified"]
Whole = Callable[[bytes], bool]

# Keys are made by vbs.snapshot_store.format; this only keeps a bad one from escaping a directory or
# a bucket prefix. Segments start with a letter or digit, so "." and ".." (and hidden temp files) never match.
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_KEY_RE = re.compile(rf"{_SEGMENT}(/{_SEGMENT}){{0,7}}")
_PREFIX_RE = re.compile(rf"({_SEGMENT}/){{0,7}}({_SEGMENT})?")


def _well_formed(pattern: re.Pattern[str], what: str, text: str) -> str:
    return matching(pattern, text, f"snapshot store {what}", shown=80)


def check_key(key: str) -> str:
    """``key`` if it is a well-formed object key (``chunks/ab/ab12…``), else ``InvalidParameter``."""
    return _well_formed(_KEY_RE, "key", key)


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a well-formed listing prefix (``""``, ``"manifests/"``, ``"chunks/a"``)."""
    return _well_formed(_PREFIX_RE, "prefix", prefix)


def parse_options(model: type[_Options], options: Mapping[str, Any], driver: str) -> _Options:
    """A driver's ``options`` validated by its pydantic ``model``; ``InvalidParameter`` naming the wrong
    settings, never their values (they may be secrets)."""
    try:
        return model.model_validate(dict(options))
    except ValidationError as exc:
        fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors())
        raise InvalidParameter(f"invalid {driver} snapshot store settings: {fields}") from None


class ObjectMissing(NotFound):
    """The store holds no object of this key."""

    code = "SnapshotStore.ObjectMissing"

    def __init__(self, key: str) -> None:
        super().__init__(f"the snapshot store holds no object {key}", key=key)
        self.key = key


@dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing or a head shows it: its key, its size in bytes and the time (seconds
    since the epoch, by the store's clock) of its last ``put``."""

    key: str
    size: int
    modified: float


@runtime_checkable
class SnapshotStore(Protocol):
    """A place that keeps snapshot objects: a directory, an S3 bucket (under a prefix)."""

    name: str

    @classmethod
    def from_config(cls, options: Mapping[str, Any], *, default_dir: Path) -> SnapshotStore:
        """The store ``options`` describe (the driver's own settings, validated by the driver; an
        error names the setting, never its value). ``default_dir`` is where a store that keeps files
        keeps them when the options do not say (``<data-dir>/snapshots``)."""
        ...

    def describe(self) -> str:
        """Where the store is, for logs and errors: never a secret (``s3://bucket/prefix at URL``)."""
        ...

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The object's bytes; ``ObjectMissing`` if there is none."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and age, or None if there is none."""
        ...

    def has(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in no promised order."""
        ...


class StoreBatch(Protocol):
    """Puts made durable together (docs/snapshots.md, "Durability"): each ``put`` is atomic and visible
    at once, and durable once ``commit`` returns."""

    def put(self, key: str, data: bytes) -> None: ...

    def trusted(self, key: str, whole: Whole) -> Trusted | None:
        """Whether the object ``key`` already there may be relied on without putting it again, and why:
        it is durable, or it may not be, but its bytes pass ``whole`` (the caller's check of their
        content) and ``commit`` makes it durable. None if it is missing or must be put again."""
        ...

    def commit(self) -> None: ...


@runtime_checkable
class BatchingStore(Protocol):
    """A store whose puts are cheaper made durable many at a time (a directory: one fsync each)."""

    def batch(self, trust_before: float) -> StoreBatch:
        """A batch in which an object already in the store is ``trusted`` as durable, unread, only if
        its last put was before ``trust_before`` (seconds since the epoch, by the store's clock): the
        caller's word that every put before then was committed. A younger one is read and checked."""
        ...


class DurablePuts:
    """The batch of a store whose every put is durable when it returns (S3: a PUT is)."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store

    def put(self, key: str, data: bytes) -> None:
        self.store.put(key, data)

    def trusted(self, key: str, whole: Whole) -> Trusted | None:
        return "durable" if self.store.has(key) else None

    def commit(self) -> None:
        return None


def open_batch(store: SnapshotStore, trust_before: Callable[[], float]) -> StoreBatch:
    """``store``'s own batch if it has one (``trust_before`` is then asked once), else ``DurablePuts``."""
    if isinstance(store, BatchingStore):
        return store.batch(trust_before())
    return DurablePuts(store)
