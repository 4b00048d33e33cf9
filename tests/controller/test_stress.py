"""Seeded random workload with prefetch and backup in flight and random poll timing:
tree invariants and slot accounting hold after every step; after close every slot is free."""

import random

import numpy as np
import pytest
import torch

from tests.controller.helpers import fill, make_cache


class Request:
    def __init__(self, rid, tokens, node, cached, slots):
        self.rid, self.tokens, self.node, self.cached, self.slots = rid, tokens, node, cached, slots


def check(cache):
    cache.tree.sanity_check()
    cache.check_accounting()


@pytest.mark.parametrize("seed,write_policy,prefetch_policy", [
    (1, "write_through", "wait_complete"),
    (2, "write_through", "best_effort"),
    (3, "write_through_selective", "timeout"),
    (4, "write_back", "best_effort"),
])
def test_random_workload_keeps_invariants(seed, write_policy, prefetch_policy):
    rng = random.Random(seed)
    cache = make_cache(pool_size=96, page_size=4, ratio=1.5, write_policy=write_policy,
                       prefetch_policy=prefetch_policy, write_threshold=2,
                       prefetch_timeout_base_s=0.001, prefetch_timeout_per_1k_tokens_s=0.0)
    prefixes = [np.array([rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))]) for _ in range(6)]
    running: list[Request] = []
    next_id = 0
    for step in range(700):
        op = rng.random()
        if op < 0.35 and len(running) < 3:
            tokens = np.concatenate([rng.choice(prefixes), [rng.randrange(50) for _ in range(rng.randrange(1, 14))]])
            rid = f"r{next_id}"
            next_id += 1
            m = cache.match_prefix(tokens)
            cache.lock(m.last_device_node)
            node, cached = m.last_device_node, m.device_indices.numel()
            if rng.random() < 0.5 and cache.prefetch(rid, tokens, m):
                if rng.random() < 0.8:
                    cache.take_prefetch(rid)
                else:
                    cache.sync.abort_prefetch(rid)
                m2 = cache.match_prefix(tokens, count=False)
                if m2.host_hit_length and cache.load_back(m2.last_host_node):
                    m3 = cache.match_prefix(tokens, count=False)
                    cache.lock(m3.last_device_node)
                    cache.unlock(node)
                    node, cached = m3.last_device_node, m3.device_indices.numel()
            elif m.host_hit_length and rng.random() < 0.7 and cache.load_back(m.last_host_node):
                m3 = cache.match_prefix(tokens, count=False)
                cache.lock(m3.last_device_node)
                cache.unlock(node)
                node, cached = m3.last_device_node, m3.device_indices.numel()
            prefix = cache.match_prefix(tokens, count=False).device_indices[:cached]
            mine = cache.alloc(len(tokens) - cached)
            if mine is None:
                cache.unlock(node)
            else:
                waiter = cache.begin_forward()
                for layer in range(cache.pool.num_layers):
                    waiter.wait_layer(layer)
                fill(cache, mine, seed=step)
                running.append(Request(rid, tokens, node, cached, torch.cat([prefix, mine])))
        elif op < 0.6 and running:
            r = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.15:  # aborted: give everything back
                cache.free(r.slots[r.cached:])
                cache.unlock(r.node)
            else:
                cache.cache_finished(r.tokens, r.slots, r.node, r.cached)
        elif op < 0.7:
            cache.evict(rng.randrange(1, 40))
        elif op < 0.73 and not running:
            cache.flush()
        else:
            cache.poll()
        check(cache)
    for r in running:
        cache.cache_finished(r.tokens, r.slots, r.node, r.cached)
    cache.close()
    check(cache)
    assert cache.controller.device_alloc.available_size() == 96
    assert cache.controller.host_available() == cache.mirror.size
    s = cache.stats()["counters"]
    assert s["writes"] > 0 and s["device_hit_tokens"] > 0 and s["host_hit_tokens"] > 0 and s["loads"] > 0
    assert s["prefetches"] > 0 and s["l3_write_pages"] > 0
    if prefetch_policy == "wait_complete":
        assert s["storage_hit_tokens"] > 0
