"""What an operator's own config file and environment meet on the command line: a file of
only `store:` over the shipped default, errors that name the user's file and line, and
variables of kvtier's prefix that are not kvtier's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.cli.main import main
from kvtier.config import load_config
from kvtier.errors import KvtierConfigError


def test_a_file_of_only_store_overrides_the_shipped_default_key_by_key(
    tmp_path, capsys
):
    """`tierctl replay --config mine.yaml` with a file of only `store:` once failed on a pool
    geometry the user never wrote (the dataclass defaults, not the shipped default)."""
    mine = tmp_path / "mine.yaml"
    mine.write_text("# mine\nstore:\n  backend: memory\n")
    assert main(["config", "--config", str(mine)]) == 0
    out = capsys.readouterr().out
    assert f"store.backend = 'memory'  (file {mine}, line 3)" in out
    assert "pool.num_kv_heads = 2  (shipped config default)" in out
    assert (
        "store.root" not in out
    )  # the default's file-store options went with its backend
    assert main(["replay", "--config", str(mine), "--requests", "2"]) == 0
    assert "requests                 2" in capsys.readouterr().out


def test_a_typo_in_a_store_only_file_names_the_users_file_and_line(tmp_path, capsys):
    """`store: {backnd: file}` was blamed on `store.backend='none'`, a value the user never
    wrote; the error names the key the typo is close to, the file and the line."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "store:\n  backend: memory\n  capacity_bytes: 1048576\n  backnd: file\n"
    )
    assert main(["replay", "--config", str(mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "tierctl: store.backnd: unknown key (did you mean 'backend'?); allowed with "
        "store.backend='memory': backend, key_prefix"
    ), err
    assert err.endswith(f"(file {mine}, line 4)"), err
    # without the shipped default beneath (an engine's load_config): not blamed on 'none'
    only = tmp_path / "only.yaml"
    only.write_text("\nstore:\n  backnd: file\n")
    with pytest.raises(KvtierConfigError) as exc:
        load_config(only, env={})
    assert "store.backend is not set" in str(exc.value)
    assert "not allowed with store.backend='none'" not in str(exc.value)
    assert str(exc.value).endswith(f"(file {only}, line 3)")
    section = tmp_path / "section.yaml"
    section.write_text("store:\n  backend: memory\nstroe: {}\n")
    with pytest.raises(KvtierConfigError, match=r"did you mean 'store'\?.*line 3\)$"):
        load_config(section, env={})


def test_an_unknown_kvtier_variable_is_one_warning_not_a_failed_start(tmp_path):
    """A deployment setting an unrelated `KVTIER_HOME` could not start (exit 2)."""
    env = {
        **os.environ,
        "KVTIER_HOME": "/srv/kvtier",
        "KVTIER_STOR_BACKEND": "memory",
        "KVTIER_STORE_BACKEND": "memory",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd(), *filter(None, [env.get("PYTHONPATH")])]
    )
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "store.backend = 'memory'  (env KVTIER_STORE_BACKEND)" in run.stdout
    warnings = run.stderr.strip().splitlines()
    assert len(warnings) == 2, warnings
    assert any(
        w.startswith("env KVTIER_STOR_BACKEND: no such setting, ignored")
        and "did you mean KVTIER_STORE_BACKEND?" in w
        for w in warnings
    ), warnings
    assert any(
        w.startswith("env KVTIER_HOME: no such setting, ignored (no setting is close;")
        for w in warnings
    ), warnings
    bad = {**env, "KVTIER_POOL_SIZE": "lots"}
    run = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "config"],
        capture_output=True,
        text=True,
        env=bad,
        timeout=120,
    )
    assert run.returncode == 2
    assert "pool.size='lots': expected an integer (env KVTIER_POOL_SIZE)" in run.stderr


def test_bench_vllm_tier_without_vllm_is_one_line_naming_the_install():
    """`tierctl bench vllm_tier` on a machine without vLLM printed a raw traceback."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # import vllm raises ImportError
        "from kvtier.cli.main import main\n"
        "sys.exit(main(['bench', 'vllm_tier', '--repeat', '1']))\n"
    )
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.getcwd(), *filter(None, [env.get("PYTHONPATH")])]
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(
        "tierctl bench vllm_tier: needs vLLM 0.33.0's offloading classes"
    )
    assert "pip install --no-deps vllm==0.33.0" in lines[0]
    assert "requirements-engines.txt" in lines[0]


class SchemalessStore:
    """A plugin store without a `config_class`: its options reach it as a dict, so kvtier
    cannot tell which keys it takes."""


def test_a_plugin_store_without_a_config_class_gets_only_the_options_written_for_it(
    tmp_path, capsys
):
    """A file naming such a plugin under tierctl's shipped default handed it the file
    store's root, capacity_bytes and fsync (and `tierctl config` listed them as its
    options): the options of a backend that a later layer switched away from go with it,
    as a built-in backend's do."""
    from kvtier.config import shipped_default

    backend = "tests.engine.test_operator_config:SchemalessStore"
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"store:\n  backend: {backend}\n  endpoint: tcp://x\n")
    cfg = load_config(mine, base=shipped_default(), env={})
    assert cfg.store.options == {"endpoint": "tcp://x"}
    assert main(["config", "--config", str(mine)]) == 0
    out = capsys.readouterr().out
    assert f"store.endpoint = 'tcp://x'  (file {mine}, line 3)" in out
    assert "store.root" not in out and "store.fsync" not in out
    # the same backend named again by a later layer keeps the options written for it
    again = load_config(
        mine, base=shipped_default(), env={"KVTIER_STORE_BACKEND": backend}
    )
    assert again.store.options == {"endpoint": "tcp://x"}
    # switched to by the environment over the shipped default: only the env's options
    env = {"KVTIER_STORE_BACKEND": backend, "KVTIER_STORE_ENDPOINT": "tcp://y"}
    assert load_config(None, base=shipped_default(), env=env).store.options == {
        "endpoint": "tcp://y"
    }


def test_a_file_naming_its_store_backend_gets_that_stores_settings_as_an_engine_does(
    tmp_path, capsys
):
    """The same YAML meant one store to an engine (its adapters read it alone) and another
    to tierctl: `store: {backend: file, root: R}` took the shipped demo's capacity_bytes of
    2 GiB (and timeout_s 10) under tierctl, where the engine holds the file store's 16 GiB,
    so a `tierctl serve` or `replay` on the engine's shared root evicted everyone's pages
    down to 2 GiB, and `tierctl config` showed settings the engine never uses. A file that
    names its backend brings its whole store section; the rest still comes key by key."""
    from kvtier.config import shipped_default

    mine = tmp_path / "engine.yaml"
    mine.write_text(f"store:\n  backend: file\n  root: {tmp_path / 'l3'}\n")
    engine = load_config(mine, env={})  # what an engine's adapter reads
    tierctl = load_config(mine, base=shipped_default(), env={})
    assert tierctl.store == engine.store
    assert tierctl.store.options.capacity_bytes == 16 << 30
    assert tierctl.pool.num_kv_heads == 2  # the shipped pool, as before
    assert main(["config", "--config", str(mine)]) == 0
    out = capsys.readouterr().out
    assert "store.capacity_bytes = 17179869184  (default)" in out
    assert "store.timeout_s = 5.0  (default)" in out
    # without a backend the file's keys go on the shipped default's store, key by key
    mine.write_text(f"store:\n  root: {tmp_path / 'l3'}\n")
    tierctl = load_config(mine, base=shipped_default(), env={})
    assert tierctl.store.backend == "file"
    assert tierctl.store.options.capacity_bytes == 2 << 30
