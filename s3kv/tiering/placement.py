"""Where chunks live: the scheduler side's map of the local tiers.

Every placement decision is made here, in the engine-core process, once for
all TP ranks: which CPU slot a chunk goes to, which disk files are written or
evicted. Workers only execute the plans. A :class:`TierIndex` is a
capacity-bounded LRU map from chunk keys to entries; an entry is *pending*
while workers write it (it is not offered as a hit and cannot be evicted) and
*ready* once every rank reported it. *Pinned* entries (a load reads them) are
not evicted either.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass


class Tier(str, enum.Enum):
    """The tiers below vLLM's own KV cache, nearest first."""

    CPU = "cpu"
    DISK = "disk"
    S3 = "s3"


@dataclass
class Entry:
    size: int
    """Units of capacity it takes: 1 for a slot, bytes for a file."""
    slot: int | None = None
    ready: bool = False
    pins: int = 0
    doomed: bool = False
    """Removed while pinned: freed when the last pin goes."""


class TierIndex:
    """An LRU map of chunk keys with a capacity, in slots or in bytes.

    With ``slots=True`` the capacity is a number of slots and each entry owns
    one (``Entry.slot``), reused after eviction. Otherwise the capacity is
    bytes and each entry's ``size`` counts against it. Not thread-safe: the
    scheduler calls it from its own thread only.
    """

    def __init__(self, name: str, capacity: int, *, slots: bool = False) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0")
        self.name = name
        self.capacity = capacity
        self.slots = slots
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        """Oldest use first."""
        self._free_slots = list(range(capacity - 1, -1, -1)) if slots else []
        self.used = 0
        self.evictions = 0

    # -- queries ---------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        """Ready to be loaded."""
        e = self._entries.get(key)
        return e is not None and e.ready and not e.doomed

    def holds_none(self, keys: Iterable[Hashable]) -> bool:
        """None of ``keys`` has an entry, ready or not: then none is ready
        (checked in one pass, without a call per key)."""
        return self._entries.keys().isdisjoint(keys)

    def has(self, key: Hashable) -> bool:
        """Ready or being written: no need to write it again."""
        e = self._entries.get(key)
        return e is not None and not e.doomed

    def get(self, key: Hashable) -> Entry | None:
        e = self._entries.get(key)
        return e if e is not None and not e.doomed else None

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready and not e.doomed)

    def keys(self) -> Iterator[Hashable]:
        """Ready keys, least recently used first."""
        return (k for k, e in self._entries.items() if e.ready and not e.doomed)

    # -- changes -----------------------------------------------------------------
    def touch(self, key: Hashable) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def _evictable(self) -> Iterator[tuple[Hashable, Entry]]:
        for k, e in self._entries.items():
            if e.ready and not e.pins and not e.doomed:
                yield k, e

    def _drop(self, key: Hashable) -> Entry:
        e = self._entries.pop(key)
        self.used -= e.size
        if e.slot is not None:
            self._free_slots.append(e.slot)
        return e

    def _make_room(self, size: int) -> list[tuple[Hashable, Entry]] | None:
        """Evict least recently used entries until ``size`` fits; None (and
        nothing evicted) if it cannot."""
        if self.slots:
            if self._free_slots:
                return []
            victim = next(self._evictable(), None)
            if victim is None:
                return None
            self.evictions += 1
            return [(victim[0], self._drop(victim[0]))]
        need = self.used + size - self.capacity
        if need <= 0:
            return []
        chosen, freed = [], 0
        for k, e in self._evictable():
            if freed >= need:
                break
            chosen.append(k)
            freed += e.size
        if freed < need:
            return None
        self.evictions += len(chosen)
        return [(k, self._drop(k)) for k in chosen]

    def reserve(self, key: Hashable, size: int = 1) -> tuple[Entry, list[tuple[Hashable, Entry]]] | None:
        """Make a pending entry for ``key``, evicting what must go.

        Returns the entry and the evicted (key, entry) pairs, whose bytes the
        caller must delete; None if ``key`` is already there or cannot fit."""
        size = 1 if self.slots else size
        if key in self._entries or size > self.capacity:
            return None
        evicted = self._make_room(size)
        if evicted is None:
            return None
        entry = Entry(size=size, slot=self._free_slots.pop() if self.slots else None)
        self._entries[key] = entry
        self.used += size
        return entry, evicted

    def commit(self, key: Hashable, size: int | None = None) -> list[tuple[Hashable, Entry]]:
        """A pending entry is written everywhere: make it ready, with its real
        size. Returns entries evicted to stay within capacity."""
        e = self._entries.get(key)
        if e is None or e.doomed:
            return []
        e.ready = True
        self._entries.move_to_end(key)
        if size is not None and not self.slots and size != e.size:
            self.used += size - e.size
            e.size = size
            if self.used > self.capacity:
                e.pins += 1  # not itself
                try:
                    return self._evict_what_can_go()
                finally:
                    e.pins -= 1
        return []

    def insert_ready(self, key: Hashable, size: int = 1) -> list[tuple[Hashable, Entry]] | None:
        """Add an entry that is already complete (found on disk at start-up)."""
        got = self.reserve(key, size)
        if got is None:
            return None
        got[0].ready = True
        return got[1]

    def abort(self, key: Hashable) -> Entry | None:
        """A pending entry failed: free it. Ready entries are left alone."""
        e = self._entries.get(key)
        if e is None or e.ready:
            return None
        return self._drop(key)

    def remove(self, key: Hashable) -> Entry | None:
        """Forget ``key`` (found missing or corrupt, or deleted by gc). A
        pinned entry is freed when its last pin is released."""
        e = self._entries.get(key)
        if e is None:
            return None
        if e.pins:
            e.doomed = True
            return None
        return self._drop(key)

    def pin(self, key: Hashable) -> bool:
        e = self._entries.get(key)
        if e is None or e.doomed:
            return False
        e.pins += 1
        return True

    def unpin(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None or e.pins == 0:
            return
        e.pins -= 1
        if e.doomed and e.pins == 0:
            self._drop(key)

    def shrink(self, capacity: int) -> list[tuple[Hashable, Entry]]:
        """Lower the capacity (the disk filled up under us) and evict down to
        it, as far as unpinned ready entries allow."""
        if self.slots:
            raise ValueError("slot capacity is fixed")
        self.capacity = max(0, capacity)
        return self._evict_what_can_go()

    def _evict_what_can_go(self) -> list[tuple[Hashable, Entry]]:
        out = []
        for k, _ in list(self._evictable()):
            if self.used <= self.capacity:
                break
            out.append((k, self._drop(k)))
            self.evictions += 1
        return out
