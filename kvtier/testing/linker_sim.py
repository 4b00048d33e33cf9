"""The fault simulator's linker mode: SGLang's calls into kvtier's linker, every copy and
store call resolved in any order with any outcome (`python benchmarks/fault_sim.py --linker`).

A seeded scheduler plays SGLang's `UnifiedRadixCache` around a real `LinkerCore` (host
index, mirror, storage thread) whose streams are `SimStreams` and whose store is a
`SimStore` (parts.py): copies complete, fail before or after some layers, or wait; store
writes and reads answer, fail, damage frames, report false failures or time out and
finish late. `batch_exists` answers at once (SGLang's lookup waits for it) with a drawn
outcome. What SGLang does, and the simulator too: offload a prompt's pages from device
slots it keeps stable until the offload is consumed (then frees and scribbles on them),
consume completed offloads in order, look up, load what the ranks agreed (any length up
to the lookup's), start loads, cancel queued ones, run the forward's per-layer waits and
finish, reset.

Checked after every step: the linker's accounting (host pages free + published + reserved,
each reserved page owned by one op; pins as their owners hold them); every load that
finished True put exactly each page's KV in its slots; a released device slot is never
written again. At the end of an episode every page is free. `--plant NAME` runs a linker
with a known bug (PLANTED), which the simulator must find.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache.hints import LeaseBoundError
from kvtier.storeio.breaker import BreakerConfig
from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.testing.episodes import write_actions
from kvtier.integrations.sglang.linker.loads import Loads
from kvtier.testing.misuse import Violation
from kvtier.testing.parts import SimStore, SimStreams
from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig

LAYERS = 2
SCRIBBLE = -7.0  # what the simulator writes into a device slot it released


class _UnverifiedReadLoads(Loads):
    """Planted bug: a load does not check that its store reads verified (it waits for them
    to end, then copies whatever the host pages hold)."""

    def _wait_read(self, op) -> None:
        if not op.read.finished:
            super()._wait_read(op)


class _UnverifiedReadCore(LinkerCore):
    loads_type = _UnverifiedReadLoads


class _EarlyPopCore(LinkerCore):
    """Planted bug: an offload counts as completed before its device -> host copy ran."""

    def num_completed_offloads(self) -> int:
        self.store_ops.reap()
        return len(self.offloads.ops)

    def pop_completed_offload(self) -> bool:
        op = self.offloads.ops[0]
        if op.handle is not None and not op.handle.done:
            op.handle.done = True  # as if the copy had finished
        return super().pop_completed_offload()


class _RoomBlindLookupCore(LinkerCore):
    """Planted bug: a lookup counts the store's whole leading run, whatever host room a
    load would find to read it into."""

    def lookup(self, rid, keys) -> int:
        self.store_ops.reap()
        end, _ = self.index.run(keys)
        if end < len(keys) and self.l3 is not None:
            end += self.l3.leading_run(keys[end:])
        return end


class _RunBlindRoomCore(LinkerCore):
    """Planted bug: a lookup counts the host run its load will pin as room for the store
    pages after it (a pinned page cannot be evicted)."""

    def lookup(self, rid, keys) -> int:
        self._reap()
        index = self.index
        end, _ = index.run(keys)
        if end < len(keys) and self.l3 is not None:
            room = index.room()
            if room > 0:
                stored = self.store_ops.leading_run(keys[end : end + room])
                end, _ = index.run(keys, end + stored, room - stored)
        return end


PLANTED = {
    "unverified-store-read": _UnverifiedReadCore,
    "early-offload-completion": _EarlyPopCore,
    "lookup-ignores-host-room": _RoomBlindLookupCore,
    "lookup-counts-pinned-room": _RunBlindRoomCore,
}


class LookupStore(SimStore):
    """SimStore whose `batch_exists` answers at once (a lookup waits on it): ok, a miss or
    an error, drawn; reads and writes wait for the simulator."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.exists_rng = rng

    async def _exists(self, keys):
        present = [k in self._pages for k in keys]
        outcome = self.exists_rng.choice(["ok"] * 8 + ["miss", "error"])
        if outcome == "error":
            raise ConnectionResetError("sim: connection reset")
        if outcome == "miss" and present:
            present[self.exists_rng.randrange(len(present))] = False
        return present


@dataclass(frozen=True)
class LinkerSetup:
    page_size: int
    layout: str
    host_pages: int
    store: bool
    group: int = 1  # engine pages in a store page, on average (linker/store_pages.py)

    @classmethod
    def draw(cls, rng: random.Random) -> LinkerSetup:
        return cls(
            rng.choice([1, 4]),
            rng.choice(["page_first", "layer_first"]),
            rng.choice([6, 16, 32]),
            rng.random() < 0.85,
            rng.choice([1, 2, 4]),
        )


def page_keys(pages: list[int]) -> list[str]:
    """SGLang's page keys: a sha256 chain over the pages' tokens."""
    keys, last = [], b""
    for t in pages:
        last = hashlib.sha256(last + str(t).encode()).digest()
        keys.append(last.hex())
    return keys


class LinkerSim:
    def __init__(self, seed: int, setup: LinkerSetup, plant: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.setup = setup
        ps = setup.page_size
        self.device_pages = 32
        self.pool = DeviceKVPool(
            PoolConfig(
                size=ps * self.device_pages,
                num_layers=LAYERS,
                page_size=ps,
                num_kv_heads=1,
                head_dim=2,
                dtype="float32",
            )
        )
        self.streams = SimStreams(self.rng)
        self.store = (
            LookupStore(random.Random(self.rng.random())) if setup.store else None
        )
        page_bytes = ps * 4 * LAYERS * 4
        settings = LinkerSettings(
            Namespace("sim", "float32", "sim", ps),
            mirror=MirrorConfig(
                size_bytes=page_bytes * setup.host_pages, layout=setup.layout
            ),
            read_wait_s=0.0,
            breaker=BreakerConfig(failures=3, backoff_s=0.0),
            store_group=setup.group,
        )  # no wall clock decides
        self.now = 0.0  # the linker's clock: one tick a step (leases expire on it)
        self.core = PLANTED.get(plant, LinkerCore)(
            self.pool,
            settings,
            self.store,
            streams=self.streams.factory,
            clock=lambda: self.now,
        )
        self.free = list(
            range(1, self.device_pages + 1)
        )  # device pages the "tree" may hand out
        self.scribbled: set[int] = set()
        self.offloads: list[
            list[int]
        ] = []  # device pages each pending offload reads, in order
        self.queued: dict[str, tuple[list[str], list[int]]] = {}
        self.started: list[tuple[int, list[tuple[str, list[str], list[int]]]]] = []
        self.prompts = [[self.rng.randrange(6) for _ in range(8)] for _ in range(3)]
        self.next_rid = 0
        self.log: list[str] = []

    # -- the bytes -----------------------------------------------------------------------------

    def kv(self, key: str, layer: int) -> torch.Tensor:
        """The KV of one page (per slot, K and V of width 2): a function of its key."""
        g = torch.Generator().manual_seed(int(key[:12], 16) * 31 + layer)
        return torch.rand((self.setup.page_size, 4), generator=g) + 1.0

    def write(self, key: str, page: int) -> None:
        slots = torch.from_numpy(page_slots(np.array([page]), self.setup.page_size))
        for layer in range(LAYERS):
            v = self.kv(key, layer)
            self.pool.set_kv(layer, slots, v[:, None, 0:2], v[:, None, 2:4])

    def read(self, page: int, layer: int) -> torch.Tensor:
        slots = torch.from_numpy(page_slots(np.array([page]), self.setup.page_size))
        return torch.cat(
            [self.pool.k_buffer(layer)[slots, 0], self.pool.v_buffer(layer)[slots, 0]],
            dim=1,
        )

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        pages = [self.free.pop(self.rng.randrange(len(self.free))) for _ in range(n)]
        for p in pages:
            if p in self.scribbled and not bool((self.read(p, 0) == SCRIBBLE).all()):
                raise Violation(f"device page {p} was written after SGLang released it")
            self.scribbled.discard(p)
        return pages

    def give(self, pages: list[int]) -> None:
        for p in pages:
            slots = torch.from_numpy(page_slots(np.array([p]), self.setup.page_size))
            for layer in range(LAYERS):
                self.pool.set_kv(
                    layer,
                    slots,
                    torch.full((len(slots), 1, 2), SCRIBBLE),
                    torch.full((len(slots), 1, 2), SCRIBBLE),
                )
            self.scribbled.add(p)
        self.free += pages

    def slots(self, pages: list[int]) -> torch.Tensor:
        return torch.from_numpy(
            page_slots(np.array(pages, dtype=np.int64), self.setup.page_size)
        )

    # -- plumbing ------------------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.log.append(what)

    def settle(self) -> None:
        if self.core.l3 is None:
            return

        async def spin():
            for _ in range(40):
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(spin(), self.core.l3.loop).result(30)

    def check(self) -> None:
        problems = self.core.check_accounting()
        if problems:
            raise Violation("; ".join(problems))

    def prompt(self) -> list[str]:
        base = self.rng.choice(self.prompts)
        n = self.rng.randrange(1, len(base) + 1)
        return page_keys(
            base[:n] + ([self.rng.randrange(6)] if self.rng.random() < 0.3 else [])
        )

    # -- SGLang's calls ------------------------------------------------------------------------

    def step(self) -> None:
        self.now += 1.0
        r = self.rng.random()
        for limit, action in (
            (0.14, self.compute),
            (0.26, self.poll),
            (0.42, self.request),
            (0.50, self.start),
            (0.54, self.cancel),
            (0.66, self.forward),
            (0.78, self.resolve_copy),
            (0.93, self.resolve_store),
            (0.96, self.lease),
            (0.97, self.aborted),
            (1.0, self.reset),
        ):
            if r < limit:
                action()
                break
        self.settle()
        self.check()

    def compute(self) -> None:
        keys = self.prompt()
        pages = self.take(len(keys))
        if pages is None:
            return
        for k, p in zip(keys, pages):
            self.write(k, p)
        self.note(f"offload {len(keys)} pages from device {pages}")
        if not self.core.offload(keys, self.slots(pages)):
            raise Violation("offload refused a well-formed call (ranks would diverge)")
        self.offloads.append(pages)

    def poll(self) -> None:
        n = self.core.num_completed_offloads()
        take = n if self.rng.random() < 0.5 else self.rng.randrange(n + 1)
        for _ in range(take):
            ok = self.core.pop_completed_offload()
            self.give(self.offloads.pop(0))
            self.note(f"offload consumed: {ok}")

    def request(self) -> None:
        keys = self.prompt()
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        found = self.core.lookup(rid, keys)
        self.note(f"lookup {rid} {len(keys)} pages -> {found}")
        if found == 0 or rid in self.queued or self.rng.random() < 0.2:
            return
        # one rank (or ranks that agree) loads all it found; another rank may have found fewer
        agreed = found if self.rng.random() < 0.5 else self.rng.randint(1, found)
        pages = self.take(agreed)
        if pages is None:
            return
        if not self.core.load(rid, keys[:agreed], self.slots(pages)):
            raise Violation("load refused a well-formed call (ranks would diverge)")
        doomed = self.core.loads.queued[rid].doomed
        if doomed is not None:  # nothing ran between the lookup and this load
            raise Violation(
                f"lookup {rid} promised {found} pages its load cannot land: {doomed}"
            )
        self.queued[rid] = (keys[:agreed], pages)
        self.note(f"load {rid} {agreed} pages into device {pages}")

    def lease(self) -> None:
        """An agent's host lease on a prompt (pins its host pages, and those published
        later, until released or expired: up to half the host tier per tenant), or the
        release of one."""
        hints = self.core.hints
        if hints.leases and self.rng.random() < 0.4:
            lease = hints.leases[self.rng.choice(sorted(hints.leases))]
            gone = hints.release(lease.keys, lease.tenant)
            self.note(f"release {gone} leases of {lease.tenant}")
            return
        keys, ttl = self.prompt(), self.rng.randint(1, 300)
        tenant = self.rng.choice(["a", "b"])
        try:
            lease = hints.pin(keys, ttl, ("host",), tenant)
        except LeaseBoundError:
            self.note(f"lease {tenant} {len(keys)} pages: over its bound")
            return
        self.note(
            f"lease {tenant} {len(keys)} pages for {ttl} steps: {len(lease.pinned)} pinned"
        )

    def aborted(self) -> None:
        """Requests matched, then aborted before their load (SGLang tells the linker
        nothing): lookups that no load follows."""
        for _ in range(self.rng.randint(2, 6)):
            keys = self.prompt()
            self.note(
                f"lookup, then abort: {len(keys)} pages -> {self.core.lookup('x', keys)}"
            )

    def start(self) -> None:
        index = self.core.start_layer_wise_loading()
        if (index < 0) != (not self.queued):
            raise Violation(
                f"start_layer_wise_loading -> {index} with {len(self.queued)} loads queued"
            )
        if index >= 0:
            self.started.append(
                (index, [(rid, k, p) for rid, (k, p) in self.queued.items()])
            )
            self.queued = {}
            self.note(f"start batch {index}")

    def cancel(self) -> None:
        if not self.queued:
            return
        rid = self.rng.choice(sorted(self.queued))
        if not self.core.cancel_queued_load(rid):
            raise Violation(f"cancel_queued_load({rid}) refused a queued load")
        self.give(self.queued.pop(rid)[1])
        self.note(f"cancel {rid}")

    def forward(self) -> None:
        """The oldest started batch: its copy resolves, the forward waits layer by layer,
        then SGLang asks whether it landed; only then may it use the bytes."""
        if not self.started:
            return
        index, loads = self.started.pop(0)
        if (
            self.store is not None and self.rng.random() < 0.7
        ):  # its store reads answer first
            for call in [c for c in self.store.pending if c.op == "get_into"]:
                outcome = self.rng.choice(
                    ["ok"] * 6 + ["corrupt", "swap", "miss", "error"]
                )
                self.note(f"store get_into x{len(call.keys)}: {outcome}")
                self.store.resolve(call, outcome, self.rng)
            self.settle()
        for job in [
            j
            for j in self.streams.pending
            if j.handle is self.core.counter.handles.get(index)
        ]:
            outcome = self.rng.choice(["ok", "ok", "ok", "fail_before", "fail_after"])
            self.note(f"load batch {index} copy: {outcome}")
            self.streams.resolve(job, outcome, self.rng)
        self.core.counter.set_consumer(index)
        for layer in range(LAYERS):
            self.core.counter.wait_until(layer)
        landed = self.core.finish_layer_wise_loading(index)
        self.note(f"finish batch {index}: {landed}")
        for rid, keys, pages in loads:
            if landed:
                self._check_loaded(rid, keys, pages)
            self.give(pages)

    def _check_loaded(self, rid: str, keys: list[str], pages: list[int]) -> None:
        for i, (k, p) in enumerate(zip(keys, pages)):
            for layer in range(LAYERS):
                if not torch.equal(self.read(p, layer), self.kv(k, layer)):
                    raise Violation(
                        f"load {rid} finished True but page {i} layer {layer} holds other bytes"
                    )

    def resolve_copy(self) -> None:
        writes = [j for j in self.streams.pending if j.stream == "linker-write"]
        if writes:
            job = self.rng.choice(writes)
            outcome = self.rng.choice(["ok", "ok", "ok", "fail_before", "fail_after"])
            self.note(f"offload copy: {outcome}")
            self.streams.resolve(job, outcome, self.rng)

    def resolve_store(self) -> None:
        if self.store is None or not self.store.pending:
            return
        call = self.rng.choice(self.store.pending)
        if call.timed_out and self.rng.random() < 0.6:
            return
        if (
            not call.timed_out
            and self.rng.random() < 0.15
            and self.store.fire_deadline(call)
        ):
            self.note(f"store {call.op} x{len(call.keys)}: times out (still running)")
            return
        outcome = self.rng.choice(
            [
                "ok",
                "ok",
                "ok",
                "error",
                "corrupt",
                "truncate",
                "swap",
                "false_failure",
                "miss",
            ]
        )
        self.note(
            f"store {call.op} x{len(call.keys)}: {outcome}{' (late)' if call.timed_out else ''}"
        )
        self.store.resolve(call, outcome, self.rng)

    def _answer_everything(self) -> None:
        self.settle()
        for _ in range(200):
            if self.store is not None and self.store.pending:
                self.store.resolve(
                    self.store.pending[0], self.rng.choice(["ok", "error"]), self.rng
                )
            elif self.streams.pending:
                self.streams.resolve(self.streams.pending[0], "ok", self.rng)
            else:
                return
            self.settle()
        raise Violation(
            "copies or store calls keep coming after everything was answered"
        )

    def reset(self) -> None:
        """SGLang's reset: the linker quiesces; SGLang then drops what it had pending."""
        self.note("reset")
        self._answer_everything()
        self.core.reset()
        for pages in self.offloads:
            self.give(pages)
        for _, loads in self.started:
            for _, _, pages in loads:
                self.give(pages)
        for _, pages in self.queued.values():
            self.give(pages)
        self.offloads, self.started, self.queued = [], [], {}
        alloc = self.core.mirror.allocator
        if alloc.available_size() != alloc.size or self.core.index.pins:
            raise Violation(
                f"after reset: host free {alloc.available_size()}/{alloc.size}, "
                f"{len(self.core.index.pins)} pins"
            )

    def close(self) -> None:
        self.reset()
        self.note("close")
        self.core.close()


def report(
    out,
    exc: Exception,
    ep_seed: int,
    setup: LinkerSetup,
    step: int,
    log: list[str],
    plant: str | None,
) -> None:
    print(
        f"VIOLATION at step {step} of linker episode seed {ep_seed} ({setup})", file=out
    )
    print(
        f"  {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        file=out,
    )
    flags = f" --plant {plant}" if plant else ""
    print(
        f"  reproduce: python benchmarks/fault_sim.py --linker --episode-seed {ep_seed} --steps {step + 1}{flags}",
        file=out,
    )
    print("  the last actions:", file=out)
    for line in log[-15:]:
        print(f"    {line}", file=out)


def run_episode(ep_seed: int, steps: int, plant: str | None = None, actions=None):
    """(step, exception, setup, log) of the first violation, or None. `actions`: a text
    file for the episode's action log, or None."""
    setup = LinkerSetup.draw(random.Random(ep_seed))
    sim, i = LinkerSim(ep_seed, setup, plant), 0
    try:
        for i in range(steps):  # noqa: B007 (i is reported on a failure)
            sim.step()
        sim.close()
    except Exception as exc:
        try:
            sim._answer_everything()
            sim.core.close()
        except Exception:
            pass
        write_actions(actions, f"linker episode {ep_seed}", sim.log)
        return i, exc, setup, sim.log
    write_actions(actions, f"linker episode {ep_seed}", sim.log)
    return None


def run(
    steps: int,
    seed: int,
    episode: int = 400,
    plant: str | None = None,
    out=None,
    actions=None,
) -> int:
    return run_episodes(
        steps, seed, episode, plant, out, actions, run_episode, report, "linker"
    )


def run_episodes(
    steps, seed, episode, plant, out, actions, one, report_one, label: str
) -> int:
    """`steps` steps in episodes of `episode` (`one(ep_seed, n, plant, actions)`: a
    failure or None), each failure reported by `report_one`; the number of violations."""
    # the stdout of the call, not of the import
    out = sys.stdout if out is None else out
    master = random.Random(seed)
    done = violations = 0
    while done < steps:
        ep_seed = master.randrange(1 << 30)
        n = min(episode, steps - done)
        failure = one(ep_seed, n, plant, actions)
        if failure is not None:
            violations += 1
            step, exc, setup, log = failure
            report_one(out, exc, ep_seed, setup, step, log, plant)
        done += n
    print(
        f"{label} fault sim: {steps} steps{' with ' + plant if plant else ''}, "
        f"{violations} violations",
        file=out,
    )
    return violations
