"""Store pages of several device pages (`store.page_tokens`; docs/stores.md).

At page size 1 a device page is one token: one store page per device page made each
request move hundreds of keys, files and frames of a few hundred bytes. With `group` G > 1
a store page holds G consecutive device pages of a sequence, aligned in it (its pages
kG..kG+G-1), keyed by the hash of its last page, whose chain covers every token before it:
a key names one content. A sequence's pages past its last whole store page are not stored
until a longer sequence covers them: the backup of the node that holds a store page's last
page stores it, reading the pages before its first one from its ancestors' host copies
(`lead_in`, kvtier/cache/page_groups.py, protected with it: host copies form a prefix
from the root). The scheduler counts device pages as before: present, granted and landed
are device pages.

A read lands in a buffer of its own and is copied into the granted host pages only once
it verified: a read abandoned stuck writes into that buffer, never into a host page."""

from __future__ import annotations

from functools import partial

import numpy as np

# `worker` below is the StorageWorker (storage.py, which imports this module), through its
# public calls, `op` its PrefetchOp or BackupOp: named in the docstrings, not imported.


def ends(first: int, count: int, group: int) -> range:
    """Indices among `count` pages, the first being page `first` of its sequence, of the
    pages that end a store page."""
    return range((group - 1 - first) % group, count, group)


async def exists(worker, op) -> tuple[int, int]:
    """(Device pages the store holds, store pages they are in): the leading run of whole
    store pages within the op's pages."""
    last = ends(op.keys.first, len(op.keys), worker.group)
    found = await worker.call(lambda: worker.store.batch_exists(op.keys.at(last)))
    return (last[found - 1] + 1 if found else 0), found


async def read(worker, op, pages: np.ndarray) -> str | None:
    """Read the store pages holding the granted `pages` (op.landed grows as they verify);
    why it stopped early ("stopped", or "partial": a miss or a page that did not verify), or None."""
    g, pb = worker.group, worker.mirror.page_bytes
    granted = len(pages)
    wanted = [e for e in ends(op.keys.first, len(op.keys), g) if e - g + 1 < granted]
    for start in range(0, len(wanted), worker.chunk):
        if op.stop:
            return "stopped"
        batch = wanted[start : start + worker.chunk]
        async with (
            worker.read_slots
        ):  # bounds the buffers in flight (max_inflight_prefetch_bytes)
            buffers = [bytearray(g * pb) for _ in batch]
            asked = worker.clock()
            ok = await worker.call(
                partial(worker.store.batch_get_into, op.keys.at(batch), buffers)
            )
            worker.speed.observe_read(len(batch) * g, worker.clock() - asked)
        bad = next((i for i, good in enumerate(ok) if not good), len(ok))
        op.store_bytes += (
            sum(ok[bad + 1 :]) * g * pb
        )  # store pages past a bad one verified too (unused)
        for last, buf in zip(batch[:bad], buffers):
            lo, hi = max(0, last - g + 1), min(last + 1, granted)
            skip = lo - (last - g + 1)  # pages of the store page the tree already holds
            worker.mirror.write_pages(
                pages[lo:hi],
                np.frombuffer(buf, np.uint8).reshape(g, pb)[skip : skip + hi - lo],
            )
            op.store_bytes += (
                g * pb
            )  # the whole store page crossed, the pages skipped too
            op.landed = hi  # after its bytes are in place
        worker.moved()
        if bad < len(ok):
            return "partial"
    return None


async def backup(worker, op) -> list[bool]:
    """Store the store pages whose last page is one of the op's, ~8 MiB a call (each a copy
    of its pages: at most that much more memory); per device page of the op, is it stored."""
    g, keys = worker.group, op.keys
    lead = op.lead_in if op.lead_in is not None else np.empty(0, np.int64)
    pages = np.concatenate([lead, op.host_pages])
    at = (
        len(lead) - g + 1
    )  # index in `pages` of the first page of the store page ending at op page 0
    whole = [e for e in ends(keys.first, len(keys), g) if e + at >= 0]
    stored = op.ok = [False] * len(
        keys
    )  # filled call by call: a later call that raises keeps these
    for start in range(0, len(whole), worker.chunk):
        batch = whole[start : start + worker.chunk]
        views = worker.payloads(pages[batch[0] + at : batch[-1] + at + g])
        base = batch[0] + at
        payloads = [b"".join(views[e + at - base : e + at - base + g]) for e in batch]
        ok = await worker.call(
            partial(worker.store.batch_set, keys.at(batch), payloads)
        )
        for last, good in zip(batch, ok):
            if good:
                op.store_bytes += g * worker.mirror.page_bytes  # its lead-in pages too
                lo = max(0, last - g + 1)
                stored[lo : last + 1] = [True] * (last + 1 - lo)
    return stored
