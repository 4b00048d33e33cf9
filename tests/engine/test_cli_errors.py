"""tierctl's errors as a new user meets them: one line naming the field, the value and what
is allowed, a non-zero exit, no traceback; and what was silently accepted is refused.
Each case failed on main as its comment says."""

import gzip
import json
import subprocess
import sys

import pytest

from kvtier.cli.main import main


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvtier"


def one_line(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (
            ["replay", "--seed", "-1"],
            {},
            "--seed -1: must be an integer >= 0",
        ),  # main: numpy's words, no flag
        (
            ["bench"],
            {},
            "bench: name a benchmark: transfer, stores, tree, cache or vllm_tier",
        ),  # main: "required: name, rest"
        (
            ["store", "purge", "--namespace", "nothex"],
            {},
            "'nothex': a namespace id is 32 lowercase hex digits",
        ),
        (
            ["replay", "--requests", "1"],
            {"KVTIER_POOL_DEVICE": "gpu"},
            "device='gpu': allowed: cpu, cuda or cuda:N",
        ),
        (
            ["store", "ls", "--config", "redis"],
            {"KVTIER_STORE_URL": "redis://127.0.0.1:1", "KVTIER_STORE_TIMEOUT_S": "1"},
            "redis.scan: ConnectionError",
        ),  # main: a traceback
        (
            ["stats", "--config", "redis"],
            {"KVTIER_STORE_URL": "redis://127.0.0.1:1", "KVTIER_STORE_TIMEOUT_S": "1"},
            "redis.scan: ConnectionError",
        ),  # main: a traceback
        (
            ["replay", "--plot", "/nonexistent/dir/hits.png"],
            {},
            "--plot '/nonexistent/dir/hits.png': cannot write there",
        ),
        (
            ["bench", "cache", "--page-size", "2", "--store-page-tokens", "3"],
            {},
            "--store-page-tokens 3: must be a positive multiple of --page-size 2",
        ),
        (
            ["bench", "cache", "--page-size", "2", "--store-page-tokens", "0"],
            {},
            "--store-page-tokens 0: must be a positive multiple of --page-size 2",
        ),
    ],
)
def test_one_line_errors(argv, env, message, capsys, cache_home, monkeypatch):
    if "--plot" in argv:
        pytest.importorskip("matplotlib")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert message in one_line(argv, capsys)


def test_a_cuda_pool_on_a_cpu_only_torch_is_one_line(capsys, cache_home, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    monkeypatch.setenv("KVTIER_POOL_DEVICE", "cuda")
    assert "pool.device='cuda': this torch sees no CUDA device" in one_line(
        ["replay", "--requests", "1"], capsys
    )


def test_bad_traces_are_refused_by_line(tmp_path, capsys, cache_home):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(
        gzip.compress(b'{"session": "s", "prompt": [1, 2], "output_len": 2}\n')
    )
    assert f"{gz}:1: not UTF-8 text" in one_line(
        ["replay", "--trace", str(gz)], capsys
    )  # main: no file named
    bools = tmp_path / "b.jsonl"
    bools.write_text(
        json.dumps({"session": "s", "prompt": [True, False], "output_len": 2}) + "\n"
    )
    assert "JSON true/false are not token ids" in one_line(
        ["replay", "--trace", str(bools)], capsys
    )  # main: ran


def test_config_into_a_closed_pipe_is_quiet():
    """main: `tierctl config | head -1` ended in a BrokenPipeError traceback (here the reader
    has closed the pipe before anything is written)."""
    out = subprocess.run(
        f"{sys.executable} -m kvtier.cli.main config | (exec 0<&-; sleep 3)",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_config_names_the_engine_threads(capsys):
    assert main(["config"]) == 0
    assert "engine.torch_threads = " in capsys.readouterr().out


def test_store_ls_escapes_what_a_manifest_holds(cache_home, capsys):
    """main: a manifest's fields went to the terminal raw, escape sequences included."""
    assert main(["replay", "--requests", "6", "--json"]) == 0
    capsys.readouterr()
    [manifest] = [p for p in cache_home.rglob("manifest.json")]
    data = json.loads(manifest.read_text())
    data["model_id"] = "evil\x1b[2J\x1b]0;pwned\x07"
    manifest.write_text(json.dumps(data))
    assert main(["store", "ls"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "evil\\x1b" in out


def test_the_manifest_comes_back_when_the_store_lost_it(cache_home, monkeypatch):
    """main: written once per process, before the first backup; once lost (a failed write,
    Redis eviction, a TTL) never again, and `store purge --tenant` then deleted none of the
    tenant's pages."""
    from kvtier.cache import TieredCache
    from kvtier.config import shipped_default
    from kvtier.cli.replay import with_weights
    from kvtier.config import load_config
    from kvtier.storeio import writes
    from kvtier.engine.engine import Engine
    from kvtier.engine.model import ModelConfig, TinyTransformer
    from kvtier.engine.workloads import generate

    monkeypatch.setattr(writes, "MANIFEST_CHECK_EVERY", 1)
    model = TinyTransformer(ModelConfig(seed=0))
    cache = TieredCache(with_weights(load_config(shipped_default()), model))
    engine = Engine(cache, model)
    turns = generate("multiturn", 16, model.config.vocab, 0)
    engine.run(turns[:4])
    cache.drain()
    [manifest] = list(cache_home.rglob("manifest.json"))
    manifest.unlink()  # the store dropped it
    engine.run(turns[4:])
    cache.drain()
    cache.close()
    assert manifest.exists()


@pytest.mark.parametrize(
    "yaml_text,env,field",
    [
        (
            'store: {backend: redis, url: "redis://x:1/0", password: 12345}\n',
            {},
            "store.password: expected a string",
        ),
        (
            "store: {backend: s3, bucket: b, secret_access_key: [sekrit, b]}\n",
            {},
            "store.secret_access_key: expected",
        ),
        ("store: {backend: redis}\n", {"KVTIER_STORE_URL": "sekrit"}, "url=(not shown"),
    ],
)
def test_a_malformed_secret_is_refused_without_its_value(
    yaml_text, env, field, tmp_path, capsys, monkeypatch
):
    """main: the error quoted the value (a numeric password, a list secret key, a URL with no ':')."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err = one_line(["config", "--config", str(cfg)], capsys)
    assert field in err and "12345" not in err and "sekrit" not in err


def test_a_quoted_yaml_boolean_is_refused(tmp_path, capsys, monkeypatch):
    """main: `fsync: "no"` (a string in YAML) was taken as false; the environment's strings still are."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text('store: {backend: file, fsync: "no"}\n')
    assert (
        "store.fsync='no': expected true or false (quoted, it is a string in YAML)"
        in one_line(["config", "--config", str(cfg)], capsys)
    )
    monkeypatch.setenv("KVTIER_STORE_FSYNC", "no")
    assert (
        main(["config"]) == 0
        and "store.fsync = False  (env KVTIER_STORE_FSYNC)" in capsys.readouterr().out
    )
