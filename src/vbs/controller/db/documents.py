"""Large JSON documents read back decoded once, not at every read.

A storage node's row keeps its last heartbeat, which reports what each of its volumes holds: one entry
a volume, megabytes of JSON at 100,000 volumes. Every create-volume reads that row twice (placement,
then the workflow's storage step) and every describe page once; decoding it each time made both grow
with the number of volumes, and even at a thousand volumes (35 KB) decoding and validating it was a
tenth of the controller's CPU per create. The database hands back the same text until the next
heartbeat, so a document of more than a few lines is decoded once per text and the decoded value is
shared: callers treat values read from JSON columns as read-only (the ORM does not track changes
inside them anyway: a change is a new value assigned, never an edit in place).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Generic, TypeVar

# Below this many characters decoding is cheaper than hashing the text for the cache.
LARGE_DOCUMENT_CHARS = 1024
# Enough for the current heartbeat of a few storage nodes (and one in flight); each large document is
# megabytes of text and more once decoded, so the controller's memory bounds this, not the hit rate.
CACHED_DOCUMENTS = 8

T = TypeVar("T")

_decode_large: Callable[[str | bytes], Any] = lru_cache(maxsize=CACHED_DOCUMENTS)(json.loads)


def decode_json(text: str | bytes) -> Any:
    """``json.loads``, with large documents decoded once per distinct text (the engine's
    ``json_deserializer``: text from SQLite, bytes from psycopg)."""
    if len(text) >= LARGE_DOCUMENT_CHARS:
        return _decode_large(text)
    return json.loads(text)


class ParsedDocuments(Generic[T]):
    """A typed view of shared decoded documents, made once per document object: the same object comes
    back from ``decode_json`` while its text is unchanged, so the view made from it is still right.
    Bounded; only documents worth it (``worth``) are kept."""

    def __init__(self, parse: Callable[[Any], T], worth: Callable[[Any], bool], size: int = CACHED_DOCUMENTS) -> None:
        self._parse = parse
        self._worth = worth
        self._size = size
        # id of the document -> (the document itself, which keeps the id from being reused; its view)
        self._views: dict[int, tuple[Any, T]] = {}
        self._lock = threading.Lock()

    def view(self, document: Any) -> T:
        with self._lock:
            hit = self._views.get(id(document))
        if hit is not None and hit[0] is document:
            return hit[1]
        parsed = self._parse(document)
        if self._worth(document):
            with self._lock:
                if len(self._views) >= self._size:
                    self._views.pop(next(iter(self._views)))
                self._views[id(document)] = (document, parsed)
        return parsed
