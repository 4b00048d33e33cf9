"""Test doubles whose every outcome a test chooses: transfer streams and a store.

They are real implementations of kvtier's interfaces (a `TransferStream`, a `Store`), not
mocks: the cache, controller and storage thread run unchanged on top of them. Nothing
happens until the test resolves it, in any order, with any outcome:

- a copy (device->host write, host->device load) completes, fails before copying, or
  fails after copying some layers; or it stays pending while the forward gives up on it;
- a store call answers, raises, answers with damaged frames (a flipped byte, a truncated
  frame, another key's frame), reports a stored page as failed, or runs out of time and
  *still completes later*, writing into the buffers it was handed (as a thread of the
  file store would).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from kvtier.backends.base import verify_into
from kvtier.backends.memory import MemoryStore, MemoryStoreConfig
from kvtier.tiers.streams import Handle, TransferStream
from kvtier.errors import TransferError


@dataclass(eq=False)
class Job:
    stream: str  # "write" or "load"
    run: Any  # job(handle)
    handle: Handle


class _FailAfter:
    """A handle proxy that fails the job once `layer` has been copied."""

    def __init__(self, handle: Handle, layer: int) -> None:
        self.handle, self.layer = handle, layer

    def layer_done(self, layer: int) -> None:
        if layer == self.layer:
            raise TransferError(f"sim: copy failed after layer {layer}")
        self.handle.layer_done(layer)


class SimStreams:
    """Makes the controller's streams; holds their jobs until `resolve` runs one."""

    def __init__(self, rng: random.Random) -> None:
        self.pending: list[Job] = []
        self.rng = rng  # outcomes of jobs somebody blocks on
        self.auto: random.Random | None = None  # set: jobs run as they are submitted

    def factory(self, name: str, device) -> SimStream:
        return SimStream(self, name)

    def resolve(self, job: Job, outcome: str, rng: random.Random) -> None:
        """outcome: ok | fail_before | fail_after (some layers copied, then an error)."""
        self.pending.remove(job)
        h = job.handle
        try:
            if outcome == "fail_before":
                raise TransferError("sim: copy failed before it started")
            if outcome == "fail_after":
                layers = h.num_layers
                job.run(_FailAfter(h, rng.randrange(layers)) if layers else h)
                raise TransferError("sim: copy failed after it wrote")
            job.run(h)
        except TransferError as exc:
            h.fail(exc)
        else:
            h.finish()

    def resolve_all(self, rng: random.Random) -> None:
        while self.pending:
            self.resolve(
                self.pending[0], rng.choice(["ok", "ok", "ok", "fail_after"]), rng
            )


class SimStream(TransferStream):
    def __init__(self, owner: SimStreams, name: str) -> None:
        self.owner, self.name = owner, name

    def submit(self, job, handle: Handle) -> Handle:
        j = Job(self.name, job, handle)
        self.owner.pending.append(j)
        if self.owner.auto is not None:
            self.owner.resolve(
                j,
                self.owner.auto.choice(["ok", "ok", "ok", "fail_before"]),
                self.owner.auto,
            )
        return handle

    def close(self) -> None:
        pass

    def wait(self, handle: Handle, timeout: float) -> bool:
        """Whoever blocks on a pending job (a drain, write-back eviction) makes it run now."""
        for job in [j for j in self.owner.pending if j.handle is handle]:
            self.owner.resolve(
                job,
                self.owner.rng.choice(["ok", "ok", "ok", "fail_before"]),
                self.owner.rng,
            )
        return handle.done


@dataclass(eq=False)
class Call:
    """One raw store call waiting for the test."""

    op: str  # exists | get_into | set
    keys: list[str]
    args: tuple
    done: asyncio.Future
    task: asyncio.Task | None = None
    timed_out: bool = False
    extra: dict = field(default_factory=dict)


class SimStore(MemoryStore):
    """An in-memory store whose every call waits until the test resolves it (`resolve`,
    called from another thread while the store's loop is idle; `settle()` then lets the
    loop run). Reads verify frames with kvtier's own frame code, as every store does."""

    name = "sim"

    def __init__(self) -> None:
        super().__init__(MemoryStoreConfig(capacity_bytes=1 << 30), timeout_s=1e9)
        self.pending: list[Call] = []
        self.deadlines: dict[asyncio.Task, Callable[[], None]] = {}
        self.auto: random.Random | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- the store's side (its event loop) ----------------------------------------------------

    def _arm_deadline(
        self, op: str, task: asyncio.Task, fire: Callable[[], None]
    ) -> Callable[[], None]:
        """A call's deadline is the test's to fire (`fire_deadline`)."""
        self.deadlines[task] = fire
        return lambda: self.deadlines.pop(task, None)

    async def _wait(self, op: str, keys: list[str], *args) -> Call:
        self.loop = asyncio.get_running_loop()
        call = Call(op, keys, args, self.loop.create_future(), asyncio.current_task())
        self.pending.append(call)
        if self.auto is not None:
            self._answer(
                call,
                self.auto.choice(["ok", "ok", "ok", "error", "corrupt"]),
                self.auto,
            )
        return call

    async def _exists(self, keys):
        call = await self._wait("exists", keys)
        return await call.done

    async def _set(self, keys, frames):
        call = await self._wait("set", keys, frames)
        return (await self._in_threads([call.done]))[0]

    async def _get_into(self, keys, parsed, views):
        call = await self._wait("get_into", keys, parsed, views)
        return (await self._in_threads([call.done]))[0]

    async def _get(self, keys):
        call = await self._wait("get", keys)
        return (await self._in_threads([call.done]))[0]

    # -- the test's side (its thread) ---------------------------------------------------------

    def deadline_of(self, call: Call) -> Callable[[], None] | None:
        return self.deadlines.get(call.task)

    def resolve(self, call: Call, outcome: str, rng: random.Random) -> None:
        """Answer `call` (the loop must be idle): ok | error | corrupt | truncate | swap |
        false_failure | miss. A call whose deadline fired first completes late."""
        self._answer(call, outcome, rng)

    def _answer(self, call: Call, outcome: str, rng: random.Random) -> None:
        if call in self.pending:
            self.pending.remove(call)
        try:
            result = getattr(self, f"_do_{call.op}")(call, outcome, rng)
        except ConnectionResetError as exc:
            self._settle(call.done, exc=exc)
            return
        self._settle(call.done, result=result)

    def _settle(self, fut: asyncio.Future, result=None, exc=None) -> None:
        def apply():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        if self.auto is not None:
            apply()  # we are on the loop already
        else:
            self.loop.call_soon_threadsafe(apply)

    def fire_deadline(self, call: Call) -> bool:
        """The call runs out of time now; it stays pending and completes (late) when
        resolved. False if its deadline is not armed."""
        fire = self.deadline_of(call)
        if fire is None or call.timed_out:
            return False
        call.timed_out = True
        self.loop.call_soon_threadsafe(fire)
        return True

    def _do_exists(self, call: Call, outcome: str, rng):
        if outcome == "error":
            raise ConnectionResetError("sim: connection reset")
        present = [k in self._pages for k in call.keys]
        if outcome in ("miss", "false_failure") and present:
            present[rng.randrange(len(present))] = False
        return present

    def _do_set(self, call: Call, outcome: str, rng):
        if outcome == "error":
            raise ConnectionResetError("sim: connection reset")
        (frames,) = call.args
        ok = []
        for key, (header, payload) in zip(call.keys, frames):
            blob = header + bytes(
                payload
            )  # read the caller's page now, as a writer thread would
            if outcome == "corrupt" and rng.random() < 0.5:
                blob = blob[:-1] + bytes([blob[-1] ^ 0x5A])
            self._drop(key)
            self._pages[key] = blob
            self.used_bytes += len(blob)
            ok.append(not (outcome == "false_failure" and rng.random() < 0.5))
        return ok

    def _do_get_into(self, call: Call, outcome: str, rng):
        if outcome == "error":
            raise ConnectionResetError("sim: connection reset")
        parsed, views = call.args
        out = []
        others = list(self._pages.values())
        for key, (_, ns, h), view in zip(call.keys, parsed, views):
            blob = self._pages.get(key)
            if (
                blob is not None
                and outcome in ("corrupt", "truncate", "swap")
                and rng.random() < 0.5
            ):
                if outcome == "corrupt":
                    blob = blob[:-1] + bytes([blob[-1] ^ 0x5A])
                elif outcome == "truncate":
                    blob = blob[: rng.randrange(len(blob))]
                elif others:
                    blob = rng.choice(others)
            if outcome == "miss" and rng.random() < 0.5:
                blob = None
            result = verify_into(
                blob, ns, h, view, self.codec
            )  # into the caller's buffer, as a reader thread would
            out.append(
                None
                if result is True and outcome == "false_failure" and rng.random() < 0.5
                else result
            )
        return out

    def _do_get(self, call: Call, outcome: str, rng):
        """`_do_get_into`'s outcomes, the frames returned (`batch_get` verifies them)."""
        if outcome == "error":
            raise ConnectionResetError("sim: connection reset")
        out = []
        others = list(self._pages.values())
        for key in call.keys:
            blob = self._pages.get(key)
            if blob is not None and rng.random() < 0.5:
                if outcome == "corrupt":
                    blob = blob[:-1] + bytes([blob[-1] ^ 0x5A])
                elif outcome == "truncate":
                    blob = blob[: rng.randrange(len(blob))]
                elif outcome == "swap" and others:
                    blob = rng.choice(others)
                elif outcome == "miss":
                    blob = None
            out.append(blob)
        return out

    def resolve_all(self, rng: random.Random) -> None:
        for call in list(self.pending):
            self.resolve(call, rng.choice(["ok", "ok", "error", "corrupt"]), rng)


def watch_copies(cache, stray: list[str]) -> None:
    """Store pages of several pages are read into their own buffer, then copied into host
    pages (store_pages.py, on the storage thread while the simulator waits in `settle`):
    each copy may write only pages a prefetch owns and has not inserted; a stray one is
    noted in `stray` (the simulator raises it at its next check)."""
    mirror, ctl = cache.mirror, cache.controller
    write = mirror.write_pages

    def watched(pages, data):
        owned = set()
        for op in ctl.prefetch_ops():
            if op.host_pages is not None:
                owned |= set(op.host_pages[op.inserted :].tolist())
        if not set(pages.tolist()) <= owned:
            stray.append(
                f"a store page's copy is about to write host pages "
                f"{sorted(set(pages.tolist()) - owned)} that no prefetch owns any more"
            )
        write(pages, data)

    mirror.write_pages = watched
