"""How `KvtierTier.lookup` answers without waiting on the network (docs/vllm.md).

Two maps, both owned by the thread that holds vLLM's manager lock (the tier's callers):

- `present`: keys this tier knows the store holds: written by one of its store jobs, or
  found by a probe. Bounded (least recently used out); a key that a load then finds
  missing (the store evicted it) or bad leaves it.
- `unreadable`: keys a load found missing or bad (bounded likewise): MISS for every
  request from then on, without a probe, until a store job of this tier writes the key
  again (vLLM recomputed the block and cascades it). The tier also deletes the row from
  the store, which is what tells other processes.
- `verdicts`: what a probe said of a key some live request asked for, in the phases of
  vLLM's own async lookups (its `LookupPhase`). A key in neither map starts a probe,
  PENDING: queued under its request, and the lookup answers RETRY; at the end of the
  step (`take_probes`) each request's queued keys become one `batch_exists` on the
  store's loop (IN_FLIGHT); its answer (`apply`) RESOLVES them into HIT or MISS. A
  verdict lives while a request that asked for it does (`release`), as vLLM's do, so a
  key stored later by another replica is seen by later requests.

`batch_exists` answers a leading run: the keys past the first missing one are MISS for
that request (vLLM stops its prefix at the first MISS anyway).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase


class Answer(Enum):
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclass(slots=True)
class Verdict:
    generation: int
    phase: LookupPhase = LookupPhase.PENDING
    found: bool = False  # what its probe said, once RESOLVED
    requests: set[str] = field(default_factory=set)


@dataclass(slots=True, frozen=True)
class Probe:
    """One request's keys for one `batch_exists`, in the order it looked them up."""

    request_id: str
    keys: tuple[bytes, ...]
    generations: tuple[int, ...]


class LookupIndex:
    """`lookup` answers `hit`, `miss` or `retry` (the engine's own values, so the caller
    maps nothing per key; `Answer`'s by default)."""

    def __init__(
        self,
        capacity: int,
        hit: object = Answer.HIT,
        miss: object = Answer.MISS,
        retry: object = Answer.RETRY,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"index_keys={capacity!r}: must be an integer >= 1")
        self.capacity = capacity
        self._hit, self._miss, self._retry = hit, miss, retry
        self.present: OrderedDict[bytes, None] = OrderedDict()
        self.verdicts: dict[bytes, Verdict] = {}
        self.unreadable: OrderedDict[bytes, None] = OrderedDict()
        self._by_request: dict[str, set[bytes]] = {}
        self._queued: dict[str, list[tuple[bytes, int]]] = {}
        self._next_generation = 0
        self.in_flight = 0  # probes sent and not yet applied
        self.probes = self.probe_keys = self.hits = self.misses = self.retries = 0

    def lookup(self, key: bytes, request_id: str):
        """HIT, MISS or RETRY (as given to the constructor): a dict lookup or two."""
        if key in self.present:
            self.present.move_to_end(key)
            self.hits += 1
            return self._hit
        verdict = self.verdicts.get(key)
        if verdict is None:
            verdict = self.verdicts[key] = Verdict(self._next_generation)
            self._next_generation += 1
            if key in self.unreadable:
                verdict.phase = LookupPhase.RESOLVED
            else:
                self._queued.setdefault(request_id, []).append(
                    (key, verdict.generation)
                )
        verdict.requests.add(request_id)
        asked = self._by_request.get(request_id)
        if asked is None:
            asked = self._by_request[request_id] = set()
        asked.add(key)
        if verdict.phase is not LookupPhase.RESOLVED:
            self.retries += 1
            return self._retry
        if verdict.found:
            self.hits += 1
            return self._hit
        self.misses += 1
        return self._miss

    def take_probes(self) -> list[Probe]:
        """The probes to send now: one per request that queued keys this step."""
        out = []
        for rid, entries in self._queued.items():
            live = []
            for k, g in entries:
                verdict = self.verdicts.get(k)
                if verdict is not None and verdict.generation == g:
                    assert verdict.phase is LookupPhase.PENDING, (
                        "a probe was queued twice: release() requeued a key it had sent"
                    )
                    verdict.phase = LookupPhase.IN_FLIGHT
                    live.append((k, g))
            if live:
                out.append(
                    Probe(rid, tuple(k for k, _ in live), tuple(g for _, g in live))
                )
        self._queued.clear()
        self.in_flight += len(out)
        self.probes += len(out)
        self.probe_keys += sum(len(p.keys) for p in out)
        return out

    def apply(self, probe: Probe, run: int) -> None:
        """The store holds the first `run` keys of `probe` (0 when it could not be asked)."""
        self.in_flight -= 1
        for i, (key, gen) in enumerate(zip(probe.keys, probe.generations)):
            verdict = self.verdicts.get(key)
            if verdict is None or verdict.generation != gen:
                continue  # released meanwhile, or asked again since
            assert verdict.phase is LookupPhase.IN_FLIGHT, (
                "a probe answered twice: take_probes() sent one key in two probes"
            )
            found = i < run and key not in self.unreadable  # a load failed it meanwhile
            verdict.phase, verdict.found = LookupPhase.RESOLVED, found
            if not verdict.requests:
                del self.verdicts[key]
            if found:
                self.remember(key)

    def remember(self, key: bytes) -> None:
        """The store holds `key` (a probe found it)."""
        self.present[key] = None
        self.present.move_to_end(key)
        while len(self.present) > self.capacity:
            self.present.popitem(last=False)

    def remember_all(self, keys: list[bytes]) -> None:
        """`remember` each of `keys`, in order (a job's: one bound check for them all)."""
        present = self.present
        for key in keys:
            present[key] = None
            present.move_to_end(key)
        while len(present) > self.capacity:
            present.popitem(last=False)

    def stored_all(self, keys: list[bytes]) -> None:
        """A store job of this tier wrote `keys`: readable again if a load had found one
        bad."""
        if self.unreadable:
            for key in keys:
                self.unreadable.pop(key, None)
        self.remember_all(keys)

    def forget(self, key: bytes, unreadable: bool = False) -> None:
        """A load could not give `key`: MISS for the requests that hold a verdict on it
        (they recompute; asking again would promote it again). With `unreadable` (the
        store answered, and the row was missing or bad) MISS for new requests too;
        without (the call failed as a whole: nothing learnt of it) unknown for them."""
        self.present.pop(key, None)
        verdict = self.verdicts.get(key)
        if verdict is not None and verdict.phase is LookupPhase.RESOLVED:
            verdict.found = False  # a newer probe still out answers for itself
        if unreadable:
            self.unreadable[key] = None
            self.unreadable.move_to_end(key)
            while len(self.unreadable) > self.capacity:
                self.unreadable.popitem(last=False)

    def release(self, request_id: str) -> None:
        """A request finished: its verdicts go unless another request holds them, or their
        probe is still out (its answer finds nothing to apply to)."""
        for key, gen in self._queued.pop(request_id, ()):
            verdict = self.verdicts.get(key)
            others = (
                sorted(verdict.requests - {request_id}) if verdict is not None else []
            )
            if (
                others and verdict.generation == gen
            ):  # not sent yet: another asker sends it
                self._queued.setdefault(others[0], []).append((key, gen))
        for key in self._by_request.pop(request_id, ()):
            verdict = self.verdicts.get(key)
            if verdict is None:
                continue
            verdict.requests.discard(request_id)
            if not verdict.requests:
                del self.verdicts[key]

    def stats(self) -> dict:
        return {
            "index_present": len(self.present),
            "index_verdicts": len(self.verdicts),
            "index_unreadable": len(self.unreadable),
            "probes": self.probes,
            "probe_keys": self.probe_keys,
            "probes_in_flight": self.in_flight,
            "lookup_hits": self.hits,
            "lookup_misses": self.misses,
            "lookup_retries": self.retries,
        }
