"""The one per-process cache: at most `kept` entries, thread-safe (one lock guards every read and write).

FIFO by default (the oldest stored goes first; a read does not refresh an entry), or LRU (`lru=True`: a
read or a new put makes an entry the newest). A value that may still change is not kept: `put(...,
final=False)` stores nothing and evicts nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from sqlalchemy.orm import Session


class ProcessCache:
    """A bounded key → value map shared by the threads of one process."""

    def __init__(self, kept: int, *, lru: bool = False) -> None:
        self.kept = kept
        self.lru = lru
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value kept under `key`, or `default`; under LRU a hit makes the entry the newest."""
        with self._lock:
            if key not in self._items:
                return default
            if self.lru:
                self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: Hashable, value: Any, *, final: bool = True) -> None:
        """Keep `value` under `key` when it can no longer change (`final`); past `kept` entries the oldest
        go. A key already kept gets the new value (and, under LRU, becomes the newest)."""
        if not final:
            return
        with self._lock:
            self._items[key] = value
            if self.lru:
                self._items.move_to_end(key)
            while len(self._items) > self.kept:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def keys(self) -> list[Hashable]:
        """The kept keys, oldest (next to go) first: a snapshot."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


def database_of(session: Session) -> str:
    """The session's database URL: the first part of a per-process cache's keys."""
    return session.get_bind().url.render_as_string()
