"""`controller.cpus`: kvtier's own threads keep to the CPUs given, the scheduler thread is
never moved, and a value this machine cannot honour is refused before anything starts."""

import os
import threading

import numpy as np
import pytest

from kvtier.config import load_config
from kvtier.storeio.cpus import format_cpu_list, parse_cpu_list
from kvtier.errors import KvtierConfigError
from tests.controller.helpers import compute, make_cache, read_back, same_kv, settle

A = np.arange(100, 116)  # 16 tokens = 4 pages of 4
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(
    len(ALLOWED) < 2,
    reason="needs Linux and two CPUs this process may use (it keeps one for kvtier)",
)
def test_kvtier_threads_keep_to_their_cpus_through_a_store_round_trip_and_the_scheduler_stays(
    tmp_path,
):
    mine = frozenset(ALLOWED[-1:])
    before = os.sched_getaffinity(0)
    cache = make_cache(tmp_path, store="file", cpus=format_cpu_list(mine))
    kv = compute(
        cache, A, seed=3
    )  # acquire, forward, finish: its write and store backup run
    settle(cache)
    cache.flush()
    got, got_kv = read_back(
        cache, A, "again"
    )  # a prefetch from the file store, read by its I/O thread
    assert got.storage_hit == 16 and same_kv(got_kv, kv)
    settle(cache)
    ours = [
        t
        for t in threading.enumerate()
        if t.name.startswith(
            ("kvtier-storage", "kvtier-write", "kvtier-load", "kvtier-file")
        )
    ]
    names = sorted({t.name.split("_")[0] for t in ours})
    assert names == [
        "kvtier-file",
        "kvtier-load",
        "kvtier-storage",
        "kvtier-write",
    ]  # the store's, started later, too
    assert {t.name: os.sched_getaffinity(t.native_id) for t in ours} == {
        t.name: mine for t in ours
    }
    assert os.sched_getaffinity(0) == before  # the scheduler (this) thread is not moved
    assert (
        f"threads on CPUs {format_cpu_list(mine)} |" in cache.describe()
    )  # the start log line says where
    cache.tree.sanity_check()
    cache.close()


@pytest.mark.parametrize(
    "value, why",
    [
        ("x", "expected a CPU list"),
        ("3-1", "expected a CPU list"),
        pytest.param(
            "4096",
            "not ones this process may run on",
            marks=pytest.mark.skipif(
                not ALLOWED, reason="needs Linux (sched_getaffinity) to know the CPUs"
            ),
        ),
    ],
)
def test_a_cpu_list_this_machine_cannot_honour_is_refused_naming_the_field(value, why):
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(KvtierConfigError, match=rf"controller.*cpus='{value}'.*{why}"):
        make_cache(cpus=value)
    assert {t.ident for t in threading.enumerate()} == before  # no thread was started


def test_cpu_lists_read_and_print_as_taskset_writes_them():
    assert parse_cpu_list("0-2, 5,7-8") == {0, 1, 2, 5, 7, 8}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert (
        load_config(None, {"controller": {"cpus": 1}}, env={}).controller.cpus == "1"
    )  # YAML reads `cpus: 1` as int
    assert (
        load_config(None, {}, env={"KVTIER_CONTROLLER_CPUS": "0-1"}).controller.cpus
        == "0-1"
    )
