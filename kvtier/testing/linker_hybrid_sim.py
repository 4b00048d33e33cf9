"""The linker fault simulator's hybrid setups (`python benchmarks/fault_sim.py --linker
--hybrid`): SGLang's calls into kvtier's linker for a (FULL, SWA) or (FULL, MAMBA) model,
every copy and store call of every pool resolved in any order with any outcome.

A seeded scheduler plays SGLang's `UnifiedRadixCache` around a real `PoolCores` (one
`LinkerCore` per pool, pools.py), each pool with its own `SimStreams` and `LookupStore`
(linker_sim.py). What SGLang does, and the simulator too: a computed prompt offloads its
KV pages, with SWA its trailing pages still SWA-resident (any number of them), with Mamba
the state at its end under its last page key; the device pages and state slot stay
stable until the offload is consumed. A lookup sends the KV keys and each side pool's
window (SWA: the model's window in pages; Mamba: 1); a load takes one of the lengths it
answered (a rank's agreed one), with the SWA window and the Mamba state ending there.

Checked after every step: every pool's accounting; a lookup answers no length whose KV
page, SWA window page or Mamba state was never offloaded; every load that finished True
put each pool's bytes in its slots (the KV pages, the SWA window, the state of the length
loaded: a function of the page key, as SGLang's keys name content); a released device
page or slot is never written again. `--plant NAME` (HYBRID_PLANTED) runs a linker with a
known bug, which the simulator must find.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.hashing import Namespace
from kvtier.integrations.sglang.linker.core import LinkerCore, LinkerSettings
from kvtier.integrations.sglang.linker.pools import KV, PoolCores, Side, StateRows
from kvtier.storeio.breaker import BreakerConfig
from kvtier.testing.episodes import write_actions
from kvtier.testing.linker_sim import LookupStore, page_keys, run_episodes
from kvtier.testing.misuse import Violation
from kvtier.testing.parts import SimStreams
from kvtier.tiers.indices import page_slots
from kvtier.tiers.mirror import MirrorConfig
from kvtier.tiers.pool import DeviceKVPool, PoolConfig

LAYERS = 2  # of each pool; the model's layers alternate: kv, side, kv, side
SCRIBBLE = -7.0
# a copy's outcomes: mostly ok, as a load lands only when every pool's copy did
OUTCOMES = ["ok"] * 6 + ["fail_before", "fail_after"]
DEVICE_PAGES = 32
STATES = 16


class _NearestStateCores(PoolCores):
    """Planted bug: a Mamba length is restorable where any state lies at or before it,
    and its load restores the nearest earlier state (a boundary it was not taken at)."""

    def lookup(self, rid, keys, windows):
        lengths = super().lookup(
            rid, keys, {n: w for n, w in windows.items() if n != "mamba"}
        )
        mamba = self.cores["mamba"]
        held = [mamba.index.get(k) is not None for k in keys]
        return [p for p in lengths if any(held[:p])]

    def load(self, rid, kv, sides):
        m = sides.get("mamba")
        if m is not None:
            mamba = self.cores["mamba"]
            have = [k for k in kv.keys if mamba.index.get(k) is not None]
            key = m.keys[0] if m.keys[0] in have or not have else have[-1]
            sides = {**sides, "mamba": Side([key], m.slots)}
        return super().load(rid, kv, sides)


class _WindowBlindCores(PoolCores):
    """Planted bug: a lookup checks the side pool at the longest length only (the side
    keys SGLang sends), and answers every shorter length the KV allows."""

    def lookup(self, rid, keys, windows):
        lengths = super().lookup(rid, keys, {})
        if not lengths:
            return lengths
        full = super().lookup(rid, keys, windows)
        return lengths if full and full[-1] == lengths[-1] else full


class _ShiftedWindowCores(PoolCores):
    """Planted bug: a load restores the SWA window ending one page before its length."""

    def load(self, rid, kv, sides):
        swa = sides.get("swa")
        p, w = len(kv.keys), 0 if swa is None else len(swa.keys)
        if swa is not None and p > w:
            sides = {**sides, "swa": Side(kv.keys[p - 1 - w : p - 1], swa.slots)}
        return super().load(rid, kv, sides)


HYBRID_PLANTED = {
    "swa-window-shifted": _ShiftedWindowCores,
    "mamba-state-from-another-boundary": _NearestStateCores,
    "side-window-of-the-longest-only": _WindowBlindCores,
}


@dataclass(frozen=True)
class HybridSetup:
    side: str  # "swa" or "mamba"
    page_size: int
    layout: str
    host_ratio: float
    window: int  # SWA window in pages
    store: bool
    group: int = 1  # the KV pool's engine pages in a store page (side pools store one)

    @classmethod
    def draw(cls, rng: random.Random) -> HybridSetup:
        return cls(
            rng.choice(["swa", "mamba"]),
            rng.choice([1, 4]),
            rng.choice(["page_first", "layer_first"]),
            rng.choice([0.25, 0.5, 1.0]),
            rng.choice([1, 2, 3]),
            rng.random() < 0.85,
            rng.choice([1, 2, 4]),
        )


def _seeded(key: str, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(key[:12], 16) * 31 + salt)


class HybridSim:
    def __init__(self, seed: int, setup: HybridSetup, plant: str | None = None):
        self.rng = random.Random(seed)
        self.setup = s = setup
        ps = s.page_size
        self.streams: dict[str, SimStreams] = {}
        self.stores: dict[str, LookupStore] = {}
        kv_cfg = PoolConfig(
            size=ps * DEVICE_PAGES,
            num_layers=LAYERS,
            page_size=ps,
            num_kv_heads=1,
            head_dim=2,
            dtype="float32",
        )
        pools = {KV: DeviceKVPool(kv_cfg)}
        if s.side == "swa":
            pools["swa"] = DeviceKVPool(kv_cfg)
        else:
            self.temporal = torch.zeros(LAYERS, STATES + 1, 2, 2)
            self.conv = torch.zeros(LAYERS, STATES + 1, 3, dtype=torch.bfloat16)
            pools["mamba"] = StateRows(
                [[self.temporal[i], self.conv[i]] for i in range(LAYERS)]
            )
        self.pools = pools
        cores = {name: self._core(name, pool) for name, pool in pools.items()}
        owner = {}
        for i in range(LAYERS):
            owner[2 * i] = (KV, i)
            owner[2 * i + 1] = (s.side, i)
        self.core = HYBRID_PLANTED.get(plant, PoolCores)(cores, owner)
        self.free = {
            KV: list(range(1, DEVICE_PAGES + 1)),
            "swa": list(range(1, DEVICE_PAGES + 1)),
            "mamba": list(range(0, STATES)),
        }
        self.scribbled: dict[str, set[int]] = {n: set() for n in self.free}
        self.offered: dict[str, set[str]] = {n: set() for n in self.free}
        self.offloads: list[dict[str, list[int]]] = []
        self.queued: dict[str, dict] = {}
        self.started: list[tuple[int, list[dict]]] = []
        self.prompts = [[self.rng.randrange(6) for _ in range(8)] for _ in range(3)]
        self.next_rid = 0
        self.log: list[str] = []

    def _core(self, name: str, pool: DeviceKVPool) -> LinkerCore:
        streams = self.streams[name] = SimStreams(self.rng)
        store = None
        if self.setup.store:
            store = self.stores[name] = LookupStore(random.Random(self.rng.random()))
        settings = LinkerSettings(
            Namespace("sim", "float32", f"sim-{name}", pool.config.page_size),
            mirror=MirrorConfig(ratio=self.setup.host_ratio, layout=self.setup.layout),
            read_wait_s=0.0,
            breaker=BreakerConfig(failures=3, backoff_s=0.0),
            store_group=self.setup.group if name == KV else 1,  # as hybrid.py's
        )
        return LinkerCore(pool, settings, store, streams=streams.factory)

    # -- the bytes: a function of the page key, per pool ---------------------------------

    def want(self, name: str, key: str, layer: int) -> list[torch.Tensor]:
        if name == "mamba":
            g = _seeded(key, 100 + layer)
            return [
                torch.rand((2, 2), generator=g) + 1.0,
                (torch.rand((3,), generator=g) + 1.0).to(torch.bfloat16),
            ]
        g = _seeded(key, layer + (0 if name == KV else 50))
        return [torch.rand((self.setup.page_size, 4), generator=g) + 1.0]

    def _slots(self, name: str, units: list[int]) -> torch.Tensor:
        if name == "mamba":
            return torch.tensor(units, dtype=torch.int64)
        arr = np.array(units, dtype=np.int64)
        return torch.from_numpy(page_slots(arr, self.setup.page_size))

    def write(self, name: str, key: str, unit: int, value: float | None = None) -> None:
        slots = self._slots(name, [unit])
        for layer in range(LAYERS):
            if name == "mamba":
                t, c = self.want(name, key, layer) if value is None else (value, value)
                self.temporal[layer, unit] = t
                self.conv[layer, unit] = c
                continue
            pool = self.pools[name]
            v = self.want(name, key, layer)[0] if value is None else None
            if v is None:
                v = torch.full((len(slots), 4), value)
            pool.set_kv(layer, slots, v[:, None, 0:2], v[:, None, 2:4])

    def read(self, name: str, unit: int, layer: int) -> list[torch.Tensor]:
        if name == "mamba":
            return [self.temporal[layer, unit], self.conv[layer, unit]]
        pool, slots = self.pools[name], self._slots(name, [unit])
        return [
            torch.cat(
                [pool.k_buffer(layer)[slots, 0], pool.v_buffer(layer)[slots, 0]], dim=1
            )
        ]

    def take(self, name: str, n: int) -> list[int] | None:
        free = self.free[name]
        if len(free) < n:
            return None
        units = [free.pop(self.rng.randrange(len(free))) for _ in range(n)]
        for u in units:
            if u in self.scribbled[name]:
                got = self.read(name, u, 0)
                if not all(bool((g.float() == SCRIBBLE).all()) for g in got):
                    raise Violation(
                        f"{name} device unit {u} was written after SGLang released it"
                    )
            self.scribbled[name].discard(u)
        return units

    def give(self, name: str, units: list[int]) -> None:
        for u in units:
            self.write(name, "", u, SCRIBBLE)
            self.scribbled[name].add(u)
        self.free[name] += units

    def give_all(self, held: dict[str, list[int]]) -> None:
        for name, units in held.items():
            self.give(name, units)

    # -- plumbing ---------------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.log.append(what)

    def settle(self) -> None:
        async def spin():
            for _ in range(40):
                await asyncio.sleep(0)

        for core in self.core.cores.values():
            if core.l3 is not None:
                asyncio.run_coroutine_threadsafe(spin(), core.l3.loop).result(30)

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

    def windows(self, keys: list[str]) -> dict[str, int]:
        side = self.setup.side
        return {side: min(self.setup.window, len(keys)) if side == "swa" else 1}

    # -- SGLang's calls ---------------------------------------------------------------------

    def step(self) -> None:
        r = self.rng.random()
        for limit, action in (
            (0.14, self.compute),
            (0.26, self.poll),
            (0.42, self.request),
            (0.50, self.start),
            (0.54, self.cancel),
            (0.66, self.forward),
            (0.78, self.resolve_copy),
            (0.97, self.resolve_store),
            (1.0, self.reset),
        ):
            if r < limit:
                action()
                break
        self.settle()
        self.check()

    def compute(self) -> None:
        keys = self.prompt()
        side = self.setup.side
        n_side = 1  # Mamba: the state at the end
        if side == "swa":  # the pages still SWA-resident, a trailing run (mostly all)
            n_side = len(keys)
            if self.rng.random() < 0.4:
                n_side = self.rng.randint(0, len(keys))
        kv_pages = self.take(KV, len(keys))
        if kv_pages is None:
            return
        side_units = self.take(side, n_side)
        if side_units is None:
            self.give(KV, kv_pages)
            return
        side_keys = keys[len(keys) - n_side :] if side == "swa" else [keys[-1]]
        for k, p in zip(keys, kv_pages):
            self.write(KV, k, p)
        for k, u in zip(side_keys, side_units):
            self.write(side, k, u)
        sides = {side: Side(side_keys, self._slots(side, side_units))} if n_side else {}
        self.note(f"offload {len(keys)} kv pages, {side} {len(side_keys)} of them")
        if not self.core.offload(Side(keys, self._slots(KV, kv_pages)), sides):
            raise Violation("offload refused a well-formed call (ranks would diverge)")
        self.offered[KV].update(keys)
        self.offered[side].update(side_keys if n_side else [])
        self.offloads.append({KV: kv_pages, side: side_units})

    def poll(self) -> None:
        n = self.core.num_completed_offloads()
        take = n if self.rng.random() < 0.5 else self.rng.randrange(n + 1)
        for _ in range(take):
            ok = self.core.pop_completed_offload()
            self.give_all(self.offloads.pop(0))
            self.note(f"offload consumed: {ok}")

    def _needs(self, keys: list[str], p: int) -> dict[str, list[str]]:
        """What restoring length p reads, per pool."""
        side = self.setup.side
        w = self.windows(keys)[side]
        return {KV: keys[:p], side: keys[max(0, p - w) : p]}

    def request(self) -> None:
        keys = self.prompt()
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        found = self.core.lookup(rid, keys, self.windows(keys))
        self.note(f"lookup {rid} {len(keys)} pages -> {found}")
        for p in found:
            for name, need in self._needs(keys, p).items():
                never = [k for k in need if k not in self.offered[name]]
                if never:
                    raise Violation(
                        f"lookup {rid} answered length {p}, whose {name} page "
                        f"{keys.index(never[0])} was never offloaded"
                    )
        if not found or rid in self.queued or self.rng.random() < 0.2:
            return
        agreed = self.rng.choice(found)
        need = self._needs(keys, agreed)
        held: dict[str, list[int]] = {}
        for name, ks in need.items():
            units = self.take(name, len(ks))
            if units is None:
                self.give_all(held)
                return
            held[name] = units
        side = self.setup.side
        sides = {side: Side(need[side], self._slots(side, held[side]))}
        if not self.core.load(rid, Side(need[KV], self._slots(KV, held[KV])), sides):
            raise Violation("load refused a well-formed call (ranks would diverge)")
        for name, core in self.core.cores.items():
            doomed = core.loads.queued[rid].doomed
            if doomed is not None:
                raise Violation(
                    f"lookup {rid} promised length {agreed} its {name} load cannot "
                    f"land: {doomed}"
                )
        self.queued[rid] = {"rid": rid, "need": need, "held": held}
        self.note(f"load {rid} {agreed} pages")

    def start(self) -> None:
        index = self.core.start_layer_wise_loading()
        if (index < 0) != (not self.queued):
            raise Violation(
                f"start_layer_wise_loading -> {index} with {len(self.queued)} loads queued"
            )
        if index >= 0:
            self.started.append((index, list(self.queued.values())))
            self.queued = {}
            self.note(f"start batch {index}")

    def cancel(self) -> None:
        if not self.queued:
            return
        rid = self.rng.choice(sorted(self.queued))
        if not self.core.cancel_queued_load(rid):
            raise Violation(f"cancel_queued_load({rid}) refused a queued load")
        self.give_all(self.queued.pop(rid)["held"])
        self.note(f"cancel {rid}")

    def forward(self) -> None:
        if not self.started:
            return
        index, loads = self.started.pop(0)
        batch = self.core.counter.batches.get(index, {})
        for name, i in batch.items():
            store = self.stores.get(name)
            if store is not None and self.rng.random() < 0.7:
                for call in [c for c in store.pending if c.op == "get_into"]:
                    outcome = self.rng.choice(
                        ["ok"] * 10 + ["corrupt", "swap", "miss", "error"]
                    )
                    self.note(f"{name} store get_into x{len(call.keys)}: {outcome}")
                    store.resolve(call, outcome, self.rng)
                self.settle()
            streams = self.streams[name]
            handle = self.core.cores[name].counter.handles.get(i)
            for job in [j for j in streams.pending if j.handle is handle]:
                outcome = self.rng.choice(OUTCOMES)
                self.note(f"{name} load batch {i} copy: {outcome}")
                streams.resolve(job, outcome, self.rng)
        self.core.counter.set_consumer(index)
        for layer in range(2 * LAYERS):
            self.core.counter.wait_until(layer)
        landed = self.core.finish_layer_wise_loading(index)
        self.note(f"finish batch {index}: {landed}")
        for load in loads:
            if landed:
                self._check_loaded(load)
            self.give_all(load["held"])

    def _check_loaded(self, load: dict) -> None:
        for name, keys in load["need"].items():
            for i, (k, u) in enumerate(zip(keys, load["held"][name])):
                for layer in range(LAYERS):
                    got, want = self.read(name, u, layer), self.want(name, k, layer)
                    if not all(torch.equal(g, w) for g, w in zip(got, want)):
                        raise Violation(
                            f"load {load['rid']} finished True but its {name} page {i} "
                            f"layer {layer} holds other bytes"
                        )

    def resolve_copy(self) -> None:
        writes = [
            (s, j)
            for s in self.streams.values()
            for j in s.pending
            if j.stream == "linker-write"
        ]
        if writes:
            streams, job = self.rng.choice(writes)
            outcome = self.rng.choice(OUTCOMES)
            self.note(f"offload copy: {outcome}")
            streams.resolve(job, outcome, self.rng)

    def resolve_store(self) -> None:
        calls = [(s, c) for s in self.stores.values() for c in s.pending]
        if not calls:
            return
        store, call = self.rng.choice(calls)
        if call.timed_out and self.rng.random() < 0.6:
            return
        if (
            not call.timed_out
            and self.rng.random() < 0.15
            and store.fire_deadline(call)
        ):
            self.note(f"store {call.op} x{len(call.keys)}: times out (still running)")
            return
        outcome = self.rng.choice(
            ["ok"] * 3
            + ["error", "corrupt", "truncate", "swap", "false_failure", "miss"]
        )
        self.note(f"store {call.op} x{len(call.keys)}: {outcome}")
        store.resolve(call, outcome, self.rng)

    def _answer_everything(self) -> None:
        self.settle()
        for _ in range(400):
            calls = [(s, c) for s in self.stores.values() for c in s.pending]
            jobs = [(s, j) for s in self.streams.values() for j in s.pending]
            if calls:
                store, call = calls[0]
                store.resolve(call, self.rng.choice(["ok", "error"]), self.rng)
            elif jobs:
                jobs[0][0].resolve(jobs[0][1], "ok", self.rng)
            else:
                return
            self.settle()
        raise Violation(
            "copies or store calls keep coming after everything was answered"
        )

    def reset(self) -> None:
        self.note("reset")
        self._answer_everything()
        self.core.reset()
        for held in self.offloads:
            self.give_all(held)
        for _, loads in self.started:
            for load in loads:
                self.give_all(load["held"])
        for load in self.queued.values():
            self.give_all(load["held"])
        self.offloads, self.started, self.queued = [], [], {}
        for name, core in self.core.cores.items():
            alloc = core.mirror.allocator
            if alloc.available_size() != alloc.size or core.index.pins:
                raise Violation(
                    f"after reset: {name} host free {alloc.available_size()}/"
                    f"{alloc.size}, {len(core.index.pins)} pins"
                )

    def close(self) -> None:
        self.reset()
        self.note("close")
        self.core.close()


def report(out, exc, ep_seed, setup, step, log, plant) -> None:
    print(
        f"VIOLATION at step {step} of hybrid linker episode seed {ep_seed} ({setup})",
        file=out,
    )
    print(
        f"  {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        file=out,
    )
    flags = f" --plant {plant}" if plant else ""
    print(
        "  reproduce: python benchmarks/fault_sim.py --linker --hybrid "
        f"--episode-seed {ep_seed} --steps {step + 1}{flags}",
        file=out,
    )
    print("  the last actions:", file=out)
    for line in log[-15:]:
        print(f"    {line}", file=out)


def run_episode(ep_seed: int, steps: int, plant: str | None = None, actions=None):
    """(step, exception, setup, log) of the first violation, or None."""
    setup = HybridSetup.draw(random.Random(ep_seed))
    side = PLANT_SIDE.get(plant, setup.side)
    if side != setup.side:  # a planted bug in one pool runs that pool's setups
        setup = HybridSetup(side, *[getattr(setup, f) for f in _REST])
    sim, i = HybridSim(ep_seed, setup, plant), 0
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
        write_actions(actions, f"hybrid linker episode {ep_seed}", sim.log)
        return i, exc, setup, sim.log
    write_actions(actions, f"hybrid linker episode {ep_seed}", sim.log)
    return None


PLANT_SIDE = {
    "mamba-state-from-another-boundary": "mamba",
    "swa-window-shifted": "swa",
    "side-window-of-the-longest-only": "mamba",
}
_REST = ("page_size", "layout", "host_ratio", "window", "store", "group")


def run(
    steps: int,
    seed: int,
    episode: int = 400,
    plant: str | None = None,
    out=None,
    actions=None,
) -> int:
    return run_episodes(
        steps, seed, episode, plant, out, actions, run_episode, report, "hybrid linker"
    )
