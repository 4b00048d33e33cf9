"""`memory`: an in-process store with a byte capacity and LRU eviction (a read or a
`touch` makes a page the newest)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.backends.base import Store, StoredPage
from kvtier.validate import check_positive


@dataclass(slots=True, frozen=True)
class MemoryStoreConfig:
    capacity_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        check_positive(self, "capacity_bytes", integer=True)


class MemoryStore(Store):
    config_class = MemoryStoreConfig
    name = "memory"

    def __init__(
        self,
        config: MemoryStoreConfig = MemoryStoreConfig(),
        timeout_s: float = 5.0,
        clock=None,
    ) -> None:
        super().__init__(timeout_s, clock)
        self.capacity_bytes = config.capacity_bytes
        self._pages: OrderedDict[str, bytes] = OrderedDict()
        self._meta: dict[str, bytes] = {}
        self.used_bytes = 0

    async def _exists(self, keys):
        return [k in self._pages for k in keys]

    async def _get(self, keys):
        out = []
        for k in keys:
            blob = self._pages.get(k)
            if blob is not None:
                self._pages.move_to_end(k)
            out.append(blob)
        return out

    async def _set(self, keys, frames):
        ok, evicted = [], []
        for key, (header, payload) in zip(keys, frames):
            blob = header + payload
            if len(blob) > self.capacity_bytes:
                ok.append(False)
                continue
            self._drop(key)
            while self.used_bytes + len(blob) > self.capacity_bytes:
                evicted.append(next(iter(self._pages)))
                self._drop(evicted[-1])
                self.counters.evictions += 1
            self._pages[key] = blob
            self.used_bytes += len(blob)
            ok.append(True)
        self._removed(evicted)
        # a page a later one of the batch evicted is not stored
        return [good and k in self._pages for k, good in zip(keys, ok)]

    def touch(self, keys) -> None:
        for key in keys:
            if key in self._pages:
                self._pages.move_to_end(key)

    async def _delete(self, keys):
        return sum(self._drop(k) for k in keys)

    def _drop(self, key: str) -> bool:
        blob = self._pages.pop(key, None)
        if blob is None:
            return False
        self.used_bytes -= len(blob)
        return True

    async def _scan(self, batch):
        keys = list(self._pages)
        for start in range(0, len(keys), batch):
            yield [
                StoredPage(k, len(self._pages[k]), None)
                for k in keys[start : start + batch]
                if k in self._pages
            ]

    async def _put_meta(self, name, data):
        self._meta[name] = bytes(data)

    async def _get_meta(self, name):
        return self._meta.get(name)

    def _extra_stats(self):
        return {
            "pages": len(self._pages),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
        }
