"""tierctl: replay, serve + stats --url, stats --config, bench, and bad input (exit 2, one line)."""

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from kvtier.cli.main import main
from kvtier.config import shipped_default
from kvtier.cli.serve import Limits, Listener, Server
from kvtier.cli.serve_app import build_app
from tests.backends.stores import new_key


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


def test_replay_30_verified_with_hits_on_mirror_and_file_store(cache_home, capsys):
    assert main(["replay", "--requests", "30", "--verify", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (
        s["requests"] == 30
        and s["verified_requests"] == 30
        and s["max_logit_diff"] <= 1e-5
    )
    assert s["hit_rate"] > 0
    assert s["hit_tokens"]["host"] > 0 and s["hit_tokens"]["storage"] > 0
    assert s["prefill_tokens_computed"] < s["prefill_tokens_without_cache"]
    assert any(cache_home.rglob("*")), (
        "the default config's file store lives under $XDG_CACHE_HOME/kvtier"
    )


def test_replay_prints_a_table(cache_home, capsys):
    assert main(["replay", "--requests", "6", "--workload", "agent"]) == 0
    out = capsys.readouterr().out
    for label in (
        "requests",
        "hit tokens   device",
        "host",
        "store",
        "hit rate",
        "prefill computed",
        "bytes moved",
        "throughput",
    ):
        assert label in out


def test_replay_skips_store_loads_slower_than_the_prefill_rate(cache_home, capsys):
    """A model that prefills 10^9 tokens/s: every store load (after the first, which measures
    the store, and one probe) is slower than recomputing, so it is skipped, said, and the
    results still verify."""
    assert main(["replay", "--requests", "30"]) == 0  # a first server fills the store
    capsys.readouterr()
    assert (
        main(
            ["replay", "--requests", "30", "--verify", "--prefill-tokens-per-s", "1e9"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "store too slow" in out and "prefetches skipped" in out
    assert "verified                 30 requests match" in out


def test_stats_config_inspects_a_filled_file_store(cache_home, tmp_path, capsys):
    assert main(["replay", "--requests", "8"]) == 0
    capsys.readouterr()
    assert main(["stats", "--config", shipped_default(), "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    assert (
        inv["store"] == "file"
        and inv["pages"] > 0
        and inv["bytes"] > 0
        and len(inv["namespaces"]) == 1
    )
    assert main(["stats", "--config", shipped_default()]) == 0
    assert "pages" in capsys.readouterr().out


def test_serve_and_stats_url_end_to_end(cache_home, capsys):
    server = Server(shipped_default())
    listener = Listener(
        build_app(server), "127.0.0.1", 0, Limits(log_level="warning")
    ).start()
    url = listener.url
    try:

        def post(path, body):
            req = urllib.request.Request(
                url + path,
                data=json.dumps(body).encode(),
                method="POST",
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())

        prompt = list(range(1, 300))
        first = post("/generate", {"prompt": prompt, "max_new_tokens": 4})
        second = post("/generate", {"prompt": prompt, "max_new_tokens": 4})
        assert first["output"] == second["output"] and len(first["output"]) == 4
        assert first["cached_tokens"] == 0 and second["hits"]["device"] > 0
        with pytest.raises(urllib.error.HTTPError) as err:
            post("/generate", {"prompt": [100000]})
        assert err.value.code == 400
        # JSON true is not a token id nor a count (Python counts bools as ints); a misspelt
        # field would have run with the default; a session is a string
        for body, message in [
            ({"prompt": [True, False]}, "prompt must be a non-empty list of token ids"),
            (
                {"prompt": [1, 2], "max_new_tokens": True},
                "max_new_tokens=True: must be an integer",
            ),
            (
                {"prompt": [1, 2], "max_new_token": 2},
                "unknown field 'max_new_token'; allowed: "
                "max_new_tokens, prompt, session",
            ),
            ({"prompt": [1, 2], "session": 5}, "session=5: must be a string"),
        ]:
            with pytest.raises(urllib.error.HTTPError) as err:
                post("/generate", body)
            assert (
                err.value.code == 400
                and message in json.loads(err.value.read())["error"]
            )
        # review #6: a prompt larger than the pool is a JSON 4xx; the server keeps serving
        with pytest.raises(urllib.error.HTTPError) as err:
            post("/generate", {"prompt": [1] * 5000, "max_new_tokens": 4})
        assert (
            err.value.code == 413 and "at most" in json.loads(err.value.read())["error"]
        )
        for body in (b"not json", b"[1, 2]"):
            req = urllib.request.Request(url + "/generate", data=body, method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 400 and "error" in json.loads(err.value.read())
        assert post("/generate", {"prompt": prompt[:20], "max_new_tokens": 2})["output"]
        server.cache.check_accounting()
        assert main(["stats", "--url", url, "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["counters"]["device_hit_tokens"] > 0 and "device" in stats["tiers"]
        assert main(["stats", "--url", url]) == 0
        assert "device" in capsys.readouterr().out
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            assert b"kvtier_device_hit_tokens_total" in resp.read()
        assert post("/flush", {}) == {"flushed": True}
        third = post("/generate", {"prompt": prompt, "max_new_tokens": 4})
        assert third["output"] == first["output"] and third["hits"]["device"] == 0
        assert third["hits"]["storage"] > 0  # the store kept its pages across the flush
    finally:
        listener.stop()
        server.close()


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["replay", "--requests", "abc"],
            "argument --requests: invalid int value: 'abc'",
        ),
        (
            ["replay", "--config", "missing.yaml"],
            "config file 'missing.yaml': not found",
        ),
        (
            ["replay", "--workload", "poetry", "--requests", "2"],
            "workload='poetry': allowed values are multiturn",
        ),
        (["stats"], "one of the arguments --url --config is required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["bench", "nothing"], "invalid choice: 'nothing'"),
        (["replay", "--verify", "2"], "--verify 2.0: a fraction in (0, 1]"),
        (["replay", "--verify", "0"], "--verify 0.0: a fraction in (0, 1]"),
        (
            ["replay", "--prefill-tokens-per-s", "0"],
            "--prefill-tokens-per-s 0.0: must be a number of tokens per second > 0",
        ),
        (
            ["replay", "--trace", "t.jsonl", "--requests", "5"],
            "--requests and --workload do not apply",
        ),
        (
            ["replay", "--trace", "missing.jsonl"],
            "--trace 'missing.jsonl': no such file",
        ),
        (["replay", "--batch", "0"], "--batch 0: must be >= 1 (requests per forward)"),
        (["store", "purge", "--older-than", "soon"], "expected a number and a unit"),
        (["store", "ls", "--config", "memory"], None),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, cache_home):
    if (
        message is None
    ):  # a memory store belongs to its process: there is nothing to list, and it says so
        assert main(argv) == 0 and "0 namespaces" in capsys.readouterr().out
        return
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_invalid_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pool: {size: 64, num_layers: 4, colour: red}\n")
    assert main(["replay", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "tierctl: pool.colour: unknown key; allowed: size, num_layers, page_size, attention, "
        f"num_kv_heads, head_dim, v_head_dim, kv_lora_rank, rope_dim, dtype, device (file {bad}, "
        "line 1)"
    )


def test_console_script_is_installed():
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "--version"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.startswith("tierctl ")


def test_bench_tree_runs(capsys):
    assert main(["bench", "tree", "--sessions", "20", "--turns", "2"]) == 0
    assert "tree: match time ratio" in capsys.readouterr().out


def test_bench_cache_says_when_sglang_is_missing(capsys, monkeypatch):
    """Without SGLang the comparison line says why and the ratio is against the bare tree."""
    monkeypatch.setitem(sys.modules, "sglang", None)  # find_spec: not installed
    assert (
        main(
            [
                "bench",
                "cache",
                "--sessions",
                "8",
                "--turns",
                "2",
                "--rounds",
                "1",
                "--page-size",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert (
        "SGLang: sglang is not installed (pip install --no-deps sglang==0.5.23)"
        in lines[-4]
    ), lines[-4]
    assert re.fullmatch(
        r"cache: hit rate \d\.\d{3}x bound, scheduler \d+\.\d{2}x bare tree", lines[-1]
    ), lines[-1]


@pytest.mark.parametrize("cpus", ["auto", "all"])
def test_bench_cache_ends_with_the_line_the_issue_reads(capsys, cpus):
    """The last line's exact shape (ratios only: no timing is asserted), and the header
    names where kvtier's threads ran. Against SGLang: tests/integrations/test_sglang_device.py."""
    assert (
        main(
            [
                "bench",
                "cache",
                "--sessions",
                "8",
                "--turns",
                "3",
                "--rounds",
                "1",
                "--baseline",
                "bare",
                "--kvtier-cpus",
                cpus,
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(
        r"cache: hit rate \d\.\d{3}x bound, scheduler \d+\.\d{2}x bare tree", lines[-1]
    ), lines[-1]
    assert "SGLang: not asked for (--baseline bare)" in lines[-4], lines[-4]
    assert re.fullmatch(
        r"scheduler ratio round by round \(each against the baseline of its own round\): "
        r"\d+\.\d{2}x",
        lines[-3],
    ), lines[-3]
    assert re.search(r"kvtier's threads on CPUs \S+$", lines[0]), lines[0]
    if cpus == "all":
        assert lines[0].endswith("CPUs any")


async def test_bench_cache_store_memory_runs_the_all_tiers_arm_on_the_memory_store(
    capsys, tmp_path
):
    """`--store memory`: the header says so, and the store's loop ran but no file store
    thread. One alive before, another store's, is not the arm's: in the suite, leftovers of
    earlier tests were counted as its threads."""
    from kvtier.backends.file import FileStore, FileStoreConfig

    other = FileStore(FileStoreConfig(root=str(tmp_path / "other")))
    assert (
        await other.batch_exists([new_key()]) == 0
    )  # its I/O thread runs from here on
    assert (
        main(
            [
                "bench",
                "cache",
                "--sessions",
                "8",
                "--turns",
                "3",
                "--rounds",
                "1",
                "--baseline",
                "bare",
                "--store",
                "memory",
            ]
        )
        == 0
    )
    await other.close()
    lines = capsys.readouterr().out.strip().splitlines()
    assert ", memory store (store pages of 16 tokens); " in lines[0], lines[0]
    threads = next(line for line in lines if line.startswith("kvtier's own threads"))
    assert "kvtier-storage" in threads and "kvtier-file" not in threads, threads
    assert re.fullmatch(
        r"cache: hit rate \d\.\d{3}x bound, scheduler \d+\.\d{2}x bare tree", lines[-1]
    ), lines[-1]


def test_replay_plot_writes_a_png(cache_home, tmp_path, capsys):
    pytest.importorskip(
        "matplotlib", reason="--plot needs the optional [plot] extra (matplotlib)"
    )
    out = tmp_path / "hits.png"
    assert main(["replay", "--requests", "4", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_of_another_models_weights_is_not_served_their_kv(cache_home, capsys):
    """Review #4: seed 1 has other weights; on a store filled by seed 0 it must verify."""
    assert main(["replay", "--requests", "12", "--seed", "0", "--json"]) == 0
    capsys.readouterr()
    assert (
        main(["replay", "--requests", "12", "--seed", "1", "--verify", "--json"]) == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["verified_requests"] == 12 and s["verify_failures"] == []


def test_replay_counts_add_up_on_docqa(cache_home, capsys):
    """Review #8: device + host + store hits + computed == prompt tokens, every replay."""
    assert main(["replay", "--requests", "12", "--workload", "docqa", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    h = s["hit_tokens"]
    assert (
        s["counts_add_up"]
        and h["device"] + h["host"] + h["storage"] + s["prefill_tokens_computed"]
        == s["prompt_tokens"]
    )


def test_replay_with_page_size_1_hits_the_store_on_a_second_run(
    cache_home, capsys, monkeypatch
):
    """Review #3: page_size 1 with the page_first mirror (the default layout) works."""
    monkeypatch.setenv("KVTIER_POOL_PAGE_SIZE", "1")
    assert main(["replay", "--requests", "10", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (
        first["bytes"]["host_to_store"] > 0
    )  # multi-token writes reached host and store
    assert main(["replay", "--requests", "10", "--verify", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["hit_tokens"]["storage"] > 0 and second["verified_requests"] == 10


def test_replay_with_store_pages_of_16_tokens_at_page_size_1_verifies_and_ls_shows_them(
    cache_home, capsys, monkeypatch
):
    monkeypatch.setenv("KVTIER_POOL_PAGE_SIZE", "1")
    monkeypatch.setenv("KVTIER_STORE_PAGE_TOKENS", "16")
    assert main(["replay", "--requests", "10", "--json"]) == 0
    capsys.readouterr()
    assert main(["replay", "--requests", "10", "--verify", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["hit_tokens"]["storage"] > 0 and second["verified_requests"] == 10
    assert main(["store", "ls", "--json"]) == 0
    [ns] = json.loads(capsys.readouterr().out)["namespaces"]
    assert (ns["page_size"], ns["store_pages"]) == (1, 16)
    assert main(["store", "ls"]) == 0
    assert "  1x16 " in capsys.readouterr().out
    assert main(["store", "verify"]) == 0


def test_replay_against_an_unwritable_store_root_shows_the_failed_writes(
    cache_home, capsys
):
    cache_home.mkdir(parents=True)
    (cache_home / ".kvtier-store").write_text('{"format": 1}')  # a kvtier store, but
    (cache_home / "kvtier").write_text(
        "not a directory"
    )  # every page's directory fails to appear
    assert main(["replay", "--requests", "12", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    # no page goes to the store before its namespace's manifest (retried at every backup)
    assert s["store"]["errors"] > 0 and s["bytes"]["host_to_store"] == 0
    assert main(["replay", "--requests", "12"]) == 0
    assert "store trouble" in capsys.readouterr().out


def test_config_never_prints_a_password(tmp_path, capsys):
    cfg = tmp_path / "pw.yaml"
    cfg.write_text(
        "store: {backend: redis, url: 'rediss://app:hunter2@cache.internal:6380/0'}\n"
    )
    assert main(["config", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out and "rediss://app:***@cache.internal:6380/0" in out


def test_config_and_errors_never_print_the_tenant_key(
    tmp_path, capsys, monkeypatch, cache_home
):
    key = "d00d" * 16
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", key)
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert (
        "namespace.tenant_key = ***  (env KVTIER_NAMESPACE_TENANT_KEY)" in out
        and "d00d" not in out
    )
    assert main(["replay", "--requests", "4"]) == 0 and main(["store", "verify"]) == 0
    assert main(["store", "purge", "--tenant", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "d00d" not in captured.out + captured.err
    monkeypatch.setenv("KVTIER_NAMESPACE_TENANT_KEY", key[:-2])
    for argv in (["config"], ["replay", "--requests", "2"], ["store", "verify"]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert (
            "namespace.tenant_key: key 1 of 1 is 62 characters" in captured.err
            and "d00d" not in captured.err
        )


def test_switching_the_store_to_memory_by_env_just_works(
    cache_home, capsys, monkeypatch
):
    monkeypatch.setenv("KVTIER_STORE_BACKEND", "memory")
    assert main(["replay", "--requests", "10", "--verify"]) == 0
    assert "verified                 10 requests" in capsys.readouterr().out


def test_store_ls_du_verify_prune_purge_on_a_filled_file_store(cache_home, capsys):
    assert main(["replay", "--requests", "10"]) == 0
    capsys.readouterr()
    assert main(["store", "ls", "--json"]) == 0
    [ns] = json.loads(capsys.readouterr().out)["namespaces"]
    assert (
        ns["model_id"] == "kvtier-reference-tiny"
        and ns["dtype"] == "float32"
        and ns["page_size"] == 16
    )
    assert ns["pages"] > 0 and ns["manifest"] and ns["newest"] is not None
    assert main(["store", "du", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == ns["bytes"]
    assert main(["store", "verify"]) == 0
    assert f"{ns['pages']} good, 0 bad" in capsys.readouterr().out
    victim = next(p for p in cache_home.rglob("*") if p.is_file() and len(p.name) == 64)
    blob = bytearray(victim.read_bytes())
    blob[-5] ^= 0xFF
    victim.write_bytes(bytes(blob))
    assert main(["store", "verify"]) == 1
    out = capsys.readouterr().out
    assert "1 bad" in out and victim.name in out
    assert main(["store", "verify", "--prune"]) == 0
    assert main(["store", "verify"]) == 0
    assert f"{ns['pages'] - 1} good, 0 bad" in capsys.readouterr().out.splitlines()[-1]
    assert main(["store", "purge", "--tenant", "nobody", "--dry-run"]) == 0
    assert "would delete 0 pages" in capsys.readouterr().out
    assert main(["store", "purge", "--namespace", ns["namespace"]]) == 0
    assert f"deleted {ns['pages'] - 1} pages" in capsys.readouterr().out
    assert main(["store", "ls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["namespaces"] == []


def test_serve_token_body_cap_and_unknown_paths(cache_home):
    server = Server(shipped_default())
    listener = Listener(
        build_app(server, token="s3cret", max_body=4096),
        "127.0.0.1",
        0,
        Limits(log_level="warning"),
    ).start()
    url = listener.url

    def call(path, body=None, token="s3cret"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(
            url + path, data=body, headers=headers, method="POST" if body else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    try:
        assert (
            call("/stats", token=None)[0] == 401
            and call("/stats", token="wrong")[0] == 401
        )
        assert call("/stats")[0] == 200
        assert call("/nowhere")[0] == 404 and call("/nowhere", b"{}")[0] == 404
        code, body = call("/generate", json.dumps({"prompt": [1] * 3000}).encode())
        assert code == 413 and "at most 4096" in body["error"]
        assert (
            call(
                "/generate",
                json.dumps({"prompt": [1, 2, 3], "max_new_tokens": 2}).encode(),
            )[0]
            == 200
        )
    finally:
        listener.stop()
        server.close()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["serve", "--host", "0.0.0.0"], "needs a token"),
        (["serve", "--port", "99999"], "must be in 0..65535"),
    ],
)
def test_serve_startup_errors_are_one_line(argv, message, capsys, cache_home):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_serve_port_in_use_is_one_line(capsys, cache_home):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and len(err.strip().splitlines()) == 1


def test_serve_drains_on_sigterm(cache_home, tmp_path):
    import os
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home.parent)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("tierctl serve: http://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_bench_refuses_an_unknown_store(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "stores", "--only", "bogus"])
    assert exc.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_bench_help_names_its_command(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "transfer", "--help"])
    assert capsys.readouterr().out.startswith("usage: tierctl bench transfer")


def test_help_does_not_import_torch():
    code = "import sys; from kvtier.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
