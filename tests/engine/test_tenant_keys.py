"""Tenant keys through the real engine and tierctl (docs/security.md): an attacker who can
write the store cannot make a keyed tenant serve forged KV, one who can list it cannot tell
which prompts were cached, another tenant's key reads nothing, and dropping the key drops
every page."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.backends import frame, seal
from kvtier.cli.main import main
from kvtier.engine.workloads import generate
from kvtier.hashing import page_hashes
from kvtier.tenant_keys import parse_keys

KEY_A = "a1" * 32
KEY_B = "b2" * 32


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


def replay(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["replay", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and len(p.name) == 64)


def reframe(root: Path, how: str) -> int:
    """What an attacker with write access does: every page gets another page's payload
    (the next file's body, in a cycle) under a checksum recomputed for it. `plain`: a
    plain frame with a fresh xxh3 (the attack of the issue); `sealed`: the page's own
    sealed header kept, only the body swapped."""
    files = page_files(root)
    blobs = [f.read_bytes() for f in files]
    for i, f in enumerate(files):
        ns, h = f.parents[2].name, bytes.fromhex(f.name)
        other = blobs[(i + 1) % len(blobs)]
        hs = (
            seal.HEADER_SIZE if seal.key_id_of(other) is not None else frame.HEADER_SIZE
        )
        body = other[hs:]
        f.write_bytes(
            frame.encode(ns, h, body)
            if how == "plain"
            else blobs[i][: seal.HEADER_SIZE] + body
        )
    return len(files)


def test_without_a_key_reframed_pages_are_served(cache_home, capsys):
    """The attack as filed: plain frames are checksummed, not authenticated."""
    assert replay(capsys, "--requests", "12")[0] == 0
    n = reframe(cache_home, "plain")
    assert main(["store", "verify"]) == 0
    assert f"{n} good, 0 bad" in capsys.readouterr().out
    code, s = replay(capsys, "--requests", "12", "--verify")
    assert code == 1 and s["hit_tokens"]["storage"] > 0 and s["verify_failures"]


@pytest.mark.parametrize(
    "how,encrypt", [("plain", False), ("plain", True), ("sealed", False)]
)
def test_with_a_key_every_reframed_page_is_a_miss(
    cache_home, capsys, monkeypatch, how, encrypt
):
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    monkeypatch.setenv("KVTIER_NAMESPACE_ENCRYPT", str(encrypt).lower())
    assert replay(capsys, "--requests", "12")[0] == 0
    n = reframe(cache_home, how)
    assert n > 12
    assert main(["store", "verify", "--json"]) == 1
    v = json.loads(capsys.readouterr().out)
    assert (v["good"], v["bad"], v["foreign"]) == (0, n, 0)
    code, s = replay(capsys, "--requests", "12", "--verify")
    assert code == 0 and s["verified_requests"] == 12 and s["verify_failures"] == []
    assert (
        s["hit_tokens"]["storage"] == 0
        and s["store"]["frame_failures"] > 0
        and s["store"]["hits"] == 0
    )


def first_prompts(requests: int) -> list[np.ndarray]:
    """The prompts an attacker guesses: each session's first turn (no history before it)."""
    return [
        np.array(t.prompt)
        for t in generate("multiturn", requests, 512, 0)
        if t.turn == 0
    ]


def found(root: Path, hash_algo) -> int:
    """Pages of the guessed prompts that a key listing of `root` shows, with page hashes
    made by `hash_algo` under the namespace id the listing shows."""
    listed = {(f.parents[2].name, f.name) for f in page_files(root)}
    [ns] = {ns for ns, _ in listed}
    return sum(
        (ns, h.hex()) in listed
        for p in first_prompts(20)
        for h in page_hashes(p, 16, ns, None, None, hash_algo)
    )


def test_a_key_listing_does_not_tell_which_prompts_were_cached(
    cache_home, capsys, monkeypatch
):
    assert replay(capsys, "--requests", "20")[0] == 0
    assert (
        found(cache_home, "sha256") >= 12
    )  # no key: the prompt's pages are there to be found
    for p in page_files(cache_home):
        p.unlink()
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "20")[0] == 0
    assert len(page_files(cache_home)) > 20
    assert found(cache_home, "sha256") == 0 and found(cache_home, "xxh3_128") == 0
    assert (
        found(cache_home, parse_keys(KEY_A, "test").current.page_hash("sha256")) >= 12
    )  # with the key: all there


def test_another_tenants_key_reads_nothing_and_no_key_reads_nothing(
    cache_home, capsys, monkeypatch
):
    """Two tenants of one store (same model, same salt): B's key gets 0 hits from A's pages
    and no error; without a key, A's pages are all misses too (crypto-shredding)."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "12")[0] == 0
    code, s = replay(capsys, "--requests", "12", "--verify")
    assert code == 0 and s["hit_tokens"]["storage"] > 0  # A reads its own pages
    for key in (KEY_B, None):
        if key is None:
            monkeypatch.delenv("KVTIER_NAMESPACE_TENANT_KEY")
        else:
            monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", key)
        code, s = replay(capsys, "--requests", "12", "--verify")
        assert code == 0 and s["verify_failures"] == [] and s["failed_requests"] == 0
        assert (
            s["hit_tokens"]["storage"] == 0
            and s["store"]["hits"] == 0
            and s["store"]["errors"] == 0
        )


def test_after_a_rotation_the_retired_key_forges_nothing(
    cache_home, capsys, monkeypatch
):
    """docs/security.md, "Rotating a key": the old key stays listed after the new one so that
    `store verify` and `purge` recognise its pages. The cache read with the whole ring, so
    whoever still held the retired key (a leaked one, the reason to rotate) sealed another
    page's payload under each page of the new namespace and was served. The cache reads
    with the current key only: every such page is a miss."""
    monkeypatch.setenv(
        "KVTIER_NAMESPACE_TENANT_KEY", f"{KEY_B},{KEY_A}"
    )  # B is current, A retired
    assert replay(capsys, "--requests", "12")[0] == 0
    files = page_files(cache_home)
    assert files
    retired = seal.SealedCodec(parse_keys(KEY_A, "a"))
    blobs = [f.read_bytes() for f in files]
    current = seal.SealedCodec(parse_keys(KEY_B, "b"))
    for i, f in enumerate(
        files
    ):  # what the holder of A does: another page's payload, sealed with A
        ns, h = f.parents[2].name, bytes.fromhex(f.name)
        nxt = files[(i + 1) % len(files)]
        payload = bytes(
            current.decode(
                blobs[(i + 1) % len(files)],
                nxt.parents[2].name,
                bytes.fromhex(nxt.name),
            )
        )
        header, body = retired.seal(ns, h, payload)
        f.write_bytes(header + bytes(body))
    code, s = replay(capsys, "--requests", "12", "--verify")
    assert code == 0 and s["verify_failures"] == [] and s["failed_requests"] == 0
    assert s["hit_tokens"]["storage"] == 0 and s["store"]["hits"] == 0


def test_verify_counts_a_page_of_another_key_in_a_namespace_of_ours_bad(
    tmp_path, capsys, monkeypatch
):
    """A namespace whose manifest names our key is checked strictly: every page must
    authenticate. A co-writer's frame that merely named another key id was counted
    `foreign` (not checked, never pruned); it is bad, and `--prune` deletes it."""
    import asyncio

    from kvtier.backends.file import FileStore, FileStoreConfig

    root, ns = tmp_path / "l3", "2" * 32
    ours, theirs = f"kvtier/{ns}/" + "aa" * 32, f"kvtier/{ns}/" + "bb" * 32

    async def write():
        me = FileStore(FileStoreConfig(root=str(root)))
        me.seal_with(seal.SealedCodec(parse_keys(KEY_A, "a")))
        await me.put_manifest(
            "kvtier",
            ns,
            {
                "format": 1,
                "namespace": ns,
                "tenant_key_id": parse_keys(KEY_A, "a").current.key_id.hex(),
            },
        )
        await me.batch_set([ours], [b"\1" * 256])
        other = FileStore(FileStoreConfig(root=str(root)))
        other.seal_with(seal.SealedCodec(parse_keys(KEY_B, "b")))
        await other.batch_set([theirs], [b"\2" * 256])
        for s in (me, other):
            await s.close()

    asyncio.run(write())
    config = tmp_path / "c.yaml"
    config.write_text(f"store:\n  backend: file\n  root: {root}\n")
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert (
        main(["store", "verify", "--json", "--prune", "--config", str(config)]) == 0
    )  # pruned
    v = json.loads(capsys.readouterr().out)
    assert (v["good"], v["bad"], v["foreign"], v["pruned"]) == (1, 1, 0, 1)
    assert [p["key"] for p in v["bad_pages"]] == [theirs]


@pytest.mark.parametrize("tenant_key_id", [None, "list"])
def test_verify_prunes_no_sealed_page_for_what_a_manifest_says(
    tmp_path, capsys, monkeypatch, tenant_key_id
):
    """A manifest is anyone's to write. One naming no key (or its key id as a list, which
    reads as none) made verify check the namespace as plain: every intact sealed page was
    bad, and --prune deleted them all. Such a namespace is checked page by page."""
    import asyncio

    from kvtier.backends.base import manifest_key
    from kvtier.backends.file import FileStore, FileStoreConfig

    root, ns = tmp_path / "l3", "2" * 32
    keys = [f"kvtier/{ns}/" + f"{i:02x}" * 32 for i in range(3)]
    ring = parse_keys(KEY_A, "a")

    async def write():
        s = FileStore(FileStoreConfig(root=str(root)))
        s.seal_with(seal.SealedCodec(ring))
        await s.put_manifest(
            "kvtier",
            ns,
            {"format": 1, "namespace": ns, "tenant_key_id": ring.current.key_id.hex()},
        )
        assert (
            await s.batch_set(keys, [bytes([i]) * 256 for i in range(3)]) == [True] * 3
        )
        await s.close()

    asyncio.run(write())
    manifest = {"format": 1, "namespace": ns}
    if tenant_key_id == "list":
        manifest["tenant_key_id"] = [ring.current.key_id.hex()]
    root.joinpath(*manifest_key("kvtier", ns).split("/")).write_text(
        json.dumps(manifest)
    )
    config = tmp_path / "c.yaml"
    config.write_text(f"store:\n  backend: file\n  root: {root}\n")
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert main(["store", "verify", "--json", "--prune", "--config", str(config)]) == 0
    v = json.loads(capsys.readouterr().out)
    assert (v["good"], v["bad"], v["pruned"]) == (3, 0, 0)


async def test_store_level_other_key_and_no_key_miss_every_page(tmp_path):
    """The same at the store: A's keys read with B's codec, and with none, are misses
    counted as frame failures, never errors."""
    from kvtier.backends.file import FileStore, FileStoreConfig

    cfg = FileStoreConfig(root=str(tmp_path / "l3"))
    a, b, plain = FileStore(cfg), FileStore(cfg), FileStore(cfg)
    a.seal_with(seal.SealedCodec(parse_keys(KEY_A, "a"), encrypt=True))
    b.seal_with(seal.SealedCodec(parse_keys(KEY_B, "b")))
    ns = os.urandom(16).hex()
    keys = [f"kvtier/{ns}/{os.urandom(32).hex()}" for _ in range(8)]
    pages = [os.urandom(4096) for _ in keys]
    assert await a.batch_set(keys, pages) == [True] * 8
    assert await a.batch_get(keys) == pages
    for other in (b, plain):
        assert await other.batch_exists(keys) == 8  # listed, but
        assert await other.batch_get(keys) == [None] * 8
        assert (
            await other.batch_get_into(keys, [bytearray(4096) for _ in keys])
            == [False] * 8
        )
        st = other.stats()
        assert (st["hits"], st["misses"], st["frame_failures"], st["errors"]) == (
            0,
            16,
            16,
            0,
        )
    stored = [(tmp_path / "l3").joinpath(*_split(k)).read_bytes() for k in keys]
    assert not any(
        p in s for p, s in zip(pages, stored)
    )  # encrypted: the KV bytes are not in the store
    for s in (a, b, plain):
        await s.close()


def _split(key: str) -> list[str]:
    prefix, ns, h = key.split("/")
    return [prefix, ns, h[:2], h[2:4], h]


def test_purge_tenant_works_from_the_key_when_the_manifest_is_gone(
    cache_home, capsys, monkeypatch, tmp_path
):
    assert (
        replay(capsys, "--requests", "10")[0] == 0
    )  # a tenant without a key shares the store
    plain = set(page_files(cache_home))
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "10")[0] == 0
    keyed = set(page_files(cache_home)) - plain
    assert keyed and plain
    for m in cache_home.rglob("manifest.json"):
        if json.loads(m.read_text()).get("tenant_key_id"):
            m.unlink()
    assert main(["store", "verify", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert (v["good"], v["bad"], v["orphaned"]) == (
        len(plain) + len(keyed),
        0,
        len(keyed),
    )
    monkeypatch.setenv(
        "KVTIER_NAMESPACE_TENANT_KEY", KEY_B
    )  # another tenant's key: its pages are not checked
    assert main(["store", "verify", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert (v["good"], v["bad"], v["foreign"]) == (len(plain), 0, len(keyed))
    assert main(["store", "purge", "--tenant"]) == 0
    assert "deleted 0 pages" in capsys.readouterr().out
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert main(["store", "purge", "--tenant", "--dry-run"]) == 0
    assert f"would delete {len(keyed)} pages" in capsys.readouterr().out
    assert main(["store", "purge", "--tenant"]) == 0
    assert f"deleted {len(keyed)} pages" in capsys.readouterr().out
    assert set(page_files(cache_home)) == plain


def _manifests(root: Path) -> dict[str, Path]:
    """namespace id -> its manifest file."""
    return {m.parent.name: m for m in root.rglob("manifest.json")}


def _pages_by_namespace(root: Path) -> dict[str, set[Path]]:
    out: dict[str, set[Path]] = {}
    for p in page_files(root):
        out.setdefault(p.parents[2].name, set()).add(p)
    return out


def test_an_edited_manifest_does_not_hide_a_tenants_pages_from_its_purge(
    cache_home, capsys, monkeypatch
):
    """main: purge --tenant went by the manifest's key id; a co-tenant who rewrote the
    manifest to name another key hid every page ("deleted 0 pages"). The pages authenticate
    under the tenant's key: they are found whatever the manifest says."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "10")[0] == 0
    [(ns, manifest)] = _manifests(cache_home).items()
    pages = _pages_by_namespace(cache_home)[ns]
    assert len(pages) > 10
    m = json.loads(manifest.read_text())
    m["tenant_key_id"] = parse_keys(KEY_B, "k").current.key_id.hex()
    manifest.write_text(json.dumps(m))
    assert main(["store", "purge", "--tenant"]) == 0
    assert f"deleted {len(pages)} pages" in capsys.readouterr().out
    assert page_files(cache_home) == []


def test_a_manifest_naming_a_tenants_key_does_not_make_its_purge_delete_anothers_pages(
    cache_home, capsys, monkeypatch
):
    """main: a manifest planted in tenant B's namespace with tenant A's key id made A's
    purge delete all of B's pages. B's pages do not authenticate under A's key: kept."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_B)
    assert replay(capsys, "--requests", "10")[0] == 0
    [(ns_b, manifest_b)] = _manifests(cache_home).items()
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "10")[0] == 0
    by_ns = _pages_by_namespace(cache_home)
    [ns_a] = set(by_ns) - {ns_b}
    planted = json.loads(_manifests(cache_home)[ns_a].read_text())
    manifest_b.write_text(json.dumps({**planted, "namespace": ns_b}))
    assert main(["store", "purge", "--tenant"]) == 0
    assert f"deleted {len(by_ns[ns_a])} pages" in capsys.readouterr().out
    assert _pages_by_namespace(cache_home) == {ns_b: by_ns[ns_b]}


def test_a_salt_purge_deletes_the_namespaces_made_with_it_and_says_what_it_cannot_prove(
    cache_home, capsys, monkeypatch
):
    """Without a key, a salt's namespaces are those whose id the salt makes: an edited
    manifest (its salt digest gone) hides none of them, and a manifest copied into another
    tenant's namespace (naming this salt's digest) deletes none of that tenant's pages; the
    purge says it kept them."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "other")
    assert replay(capsys, "--requests", "8")[0] == 0
    [ns_other] = _manifests(cache_home)
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "acme")
    assert replay(capsys, "--requests", "8")[0] == 0
    manifests = _manifests(cache_home)
    [ns_acme] = set(manifests) - {ns_other}
    by_ns = _pages_by_namespace(cache_home)
    acme = json.loads(manifests[ns_acme].read_text())
    manifests[ns_other].write_text(json.dumps({**acme, "namespace": ns_other}))
    manifests[ns_acme].write_text(json.dumps({**acme, "tenant": None}))
    monkeypatch.delenv("KVTIER_NAMESPACE_TENANT_SALT")
    assert main(["store", "purge", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert f"deleted {len(by_ns[ns_acme])} pages" in out
    assert (
        f"not proven the tenant's: {len(by_ns[ns_other])} pages of namespaces whose "
        "manifest names this salt but whose id it does not make" in out
    )
    assert _pages_by_namespace(cache_home) == {ns_other: by_ns[ns_other]}


def test_a_purge_with_the_key_does_not_count_pages_it_deletes_as_kept(
    cache_home, capsys, monkeypatch
):
    """A namespace of the tenant that the purge's config does not make (another page size)
    whose manifest a co-tenant edited is not proven by its salt, yet every page of it
    authenticates under the tenant's key and is deleted. The old count said all of them
    were kept ("not proven the tenant's: N pages ... kept" beside "deleted N pages"): what
    is deleted is not counted as kept."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "acme")
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    monkeypatch.setenv("KVTIER_POOL_PAGE_SIZE", "32")
    assert replay(capsys, "--requests", "8")[0] == 0
    [(ns, manifest)] = _manifests(cache_home).items()
    pages = _pages_by_namespace(cache_home)[ns]
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "model_id": "edited"}))  # salt digest kept
    monkeypatch.delenv("KVTIER_POOL_PAGE_SIZE")  # the purge's config: page size 16
    assert main(["store", "purge", "--tenant"]) == 0
    out = capsys.readouterr().out
    assert f"deleted {len(pages)} pages" in out
    assert "not proven" not in out, out
    assert page_files(cache_home) == []


def test_a_purge_with_the_key_leaves_another_key_holders_namespace_of_its_salt_unremarked(
    cache_home, capsys, monkeypatch
):
    """Two tenants with one salt and their own keys (docs/security.md): A's purge leaves
    B's namespace alone, as it is B's by its id, and does not report its pages as "not
    proven" under an "edited or copied manifest" (the old count did: B's manifest is
    intact)."""
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_SALT", "acme")
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_B)
    assert replay(capsys, "--requests", "8")[0] == 0
    [ns_b] = _manifests(cache_home)
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", KEY_A)
    assert replay(capsys, "--requests", "8")[0] == 0
    by_ns = _pages_by_namespace(cache_home)
    [ns_a] = set(by_ns) - {ns_b}
    assert main(["store", "purge", "--tenant"]) == 0
    out = capsys.readouterr().out
    assert f"deleted {len(by_ns[ns_a])} pages" in out and "not proven" not in out, out
    assert _pages_by_namespace(cache_home) == {ns_b: by_ns[ns_b]}
