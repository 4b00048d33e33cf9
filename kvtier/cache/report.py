"""What a cache says about itself: its start-up line and `stats()`.

Read from any thread (a metrics scrape): every number is a snapshot its owner takes
atomically (request ages, prefetch starts, host accounting under its lock).
"""

from __future__ import annotations

import time

from kvtier.tree import Tier

D, H = Tier.DEVICE, Tier.HOST


def describe(cache) -> str:
    c, mirror = cache.config, cache.mirror
    shown = (
        "none"
        if mirror is None
        else (
            f"{c.mirror.layout} {mirror.size} slots ({'pinned' if mirror.pinned else 'plain memory'}) io={mirror.io}"
        )
    )
    store = cache.controller.store
    return (
        f"tree page_size={c.pool.page_size} eviction={c.tree.eviction_policy.value} hash={c.tree.hash_algo} | "
        f"pool {c.pool.attention} {c.pool.num_layers} layers {c.pool.size} slots {c.pool.dtype} {c.pool.device} | "
        f"mirror {shown} | write={c.controller.write_policy.value} prefetch={c.controller.prefetch_policy.value} "
        f"threads on CPUs {c.controller.cpus or 'any'} | "
        f"store {store.name if store else 'none'}{_store_pages(c) if store else ''} | namespace {cache.namespace.id}"
    )


def _store_pages(c) -> str:
    return (
        "" if c.store_pages == 1 else f" (store pages of {c.store.page_tokens} tokens)"
    )


def stats(cache) -> dict:
    tiers = {
        "device": _tier_sizes(
            cache.tree, D, cache.config.pool.size, cache.slots.device_free()
        )
    }
    if cache.mirror is not None:
        tiers["host"] = _tier_sizes(
            cache.tree, H, cache.mirror.size, cache.controller.host_available()
        )
    c = cache.controller
    out = {
        "counters": cache.stats_obj.as_dict(),
        "tiers": tiers,
        "queues": {**c.queue_sizes(), **_request_ages(cache)},
    }
    if cache.events is not None:
        out["events"] = cache.events.stats()
    if c.store is not None:
        out["store"] = {
            **c.store.stats(),
            **c.storage.breaker.stats(),
            **c.storage.speed.stats(),
        }
    return out


def _request_ages(cache) -> dict:
    """Requests held (acquired, not finished) and waiting for a prefetch, with the age of
    the oldest of each: one that only grows is a request an engine forgot, or one never
    named ready."""
    held, oldest = cache.requests.ages()
    waiting = cache.prefetcher.waiting_since()
    return {
        "requests_held": held,
        "oldest_held_s": oldest,
        "requests_waiting": len(waiting),
        "oldest_waiting_s": max(
            (time.perf_counter() - t for t in waiting), default=0.0
        ),
    }


def _tier_sizes(tree, tier: Tier, total: int, free: int) -> dict:
    return {
        "total_tokens": total,
        "free_tokens": free,
        "evictable_tokens": tree.evictable_size(tier),
        "protected_tokens": tree.protected_size(tier),
    }
