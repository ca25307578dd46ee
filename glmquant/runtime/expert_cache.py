"""A bounded, thread-safe LRU cache of decoded experts, with the hit/miss counts the server reports."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    """Counts since the backend was built; `capacity` 0 means every use decodes afresh."""

    capacity: int
    resident: int
    hits: int
    misses: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LRUCache(Generic[V]):
    """Least-recently-used cache holding at most `capacity` values; `get` builds a missing value with `load`.

    `load` runs under the lock, so two threads never decode the same entry twice.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0

    def get(self, key: Hashable, load: Callable[[], V]) -> V:
        with self._lock:
            if key in self._items:
                self._hits += 1
                self._items.move_to_end(key)
                return self._items[key]
            self._misses += 1
            value = load()
            if self.capacity:
                self._items[key] = value
                if len(self._items) > self.capacity:
                    self._items.popitem(last=False)
                    self._evictions += 1
            return value

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.capacity, len(self._items), self._hits, self._misses, self._evictions)
