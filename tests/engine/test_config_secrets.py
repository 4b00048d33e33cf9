"""Config errors never quote a secret, whatever the shape of the bad value; a tenant key file
is read as a store page is (a regular file, bounded), so a FIFO or a device is a clear error
and never a hang or a MemoryError. Each case failed on the old code as its comment says."""

import os
import resource
import subprocess
import sys

import pytest

from kvtier.cli.main import main

PW = "Sekr1tPW"  # a password or salt that no message may contain


def one_line(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "yaml_text,env,field",
    [
        # old: url='http://app:Sekr1tPW@db:6379/0' (a wrong scheme quoted the URL whole)
        (
            f'store: {{backend: redis, url: "http://app:{PW}@db:6379/0"}}\n',
            {},
            "url='http://app:***@db:6379/0': must start with redis://",
        ),
        (
            "store: {backend: redis}\n",
            {"KVTIER_STORE_URL": f"redis//app:{PW}@db:6379/0"},
            "url='redis//app:***@db:6379/0': must start with redis://",
        ),
        (  # a password holding an '@' (redis-py splits user info at the last one)
            f'store: {{backend: redis, url: "http://app:x@{PW}@db:6379/0"}}\n',
            {},
            "url='http://app:***@db:6379/0': must start with redis://",
        ),
        (  # the cluster config's URL
            f'store: {{backend: redis, cluster: true, url: "ftp://app:{PW}@n1:7000/0"}}\n',
            {},
            "url='ftp://app:***@n1:7000/0'",
        ),
        (
            "store: {backend: redis, cluster: true}\n",
            {"KVTIER_STORE_URL": f"app:{PW}@n1:7000"},
            "url='app:***@n1:7000'",
        ),
        (  # a URL list where a string belongs
            f'store: {{backend: redis, url: ["redis://app:{PW}@db:6379/0"]}}\n',
            {},
            "store.url=['redis://app:***@db:6379/0']: expected a string",
        ),
        (
            f'store: {{backend: s3, bucket: b, endpoint_url: ["http://ak:{PW}@s3:9000"]}}\n',
            {},
            "store.endpoint_url=['http://ak:***@s3:9000']: expected a string",
        ),
        (
            f'store: {{backend: s3, bucket: b, endpoint_url: "http://ak:{PW}@s3:9000"}}\n',
            {"KVTIER_STORE_MAX_WORKERS": "many"},
            "store.max_workers='many': expected an integer",
        ),
        # old: namespace.tenant_salt=['Sekr1tPW', 'b']: expected a string
        (
            f"namespace: {{tenant_salt: [{PW}, b]}}\n",
            {},
            "namespace.tenant_salt=***: expected a string",
        ),
        (
            f"namespace: {{tenant_salt: {{name: {PW}}}}}\n",
            {},
            "namespace.tenant_salt=***: expected a string",
        ),
        (  # an error about another field of the section
            f"namespace: {{tenant_salt: {PW}, encrypt: maybe}}\n",
            {},
            "namespace.encrypt='maybe': expected true or false",
        ),
        (
            "namespace: {encrypt: true}\n",
            {"KVTIER_NAMESPACE_TENANT_SALT": PW},
            "encrypt=True: needs namespace.tenant_key",
        ),
        (  # a section that is a URL, not a mapping
            f'store: "redis://app:{PW}@db:6379/0"\n',
            {},
            "store: expected a mapping of keys, got 'redis://app:***@db:6379/0'",
        ),
        (  # YAML's own error quotes the line
            f"store: {{backend: redis, url: redis://app:{PW}@db:6379/0\n",
            {},
            "not valid YAML",
        ),
    ],
)
def test_no_config_error_quotes_a_secret(
    yaml_text, env, field, tmp_path, capsys, monkeypatch
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    err = one_line(["config", "--config", str(cfg)], capsys)
    assert field in err and PW not in err, err


def _tierctl_config(tmp_path, key_file: str) -> subprocess.CompletedProcess:
    """`tierctl config` with `key_file` as the tenant key file, in a process whose memory is
    capped (the old code read /dev/zero until MemoryError) and that a hang cannot outlive."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"namespace: {{tenant_key_file: '{key_file}'}}\n")

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,  # the old code never returned from a FIFO
        preexec_fn=cap_memory,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


def test_a_fifo_as_tenant_key_file_is_refused_not_waited_on(tmp_path):
    """old: start-up blocked in open() for a writer that never came (the timeout expired)."""
    fifo = tmp_path / "tenant.key"
    os.mkfifo(fifo)
    done = _tierctl_config(tmp_path, str(fifo))
    assert done.returncode == 2, done.stderr
    assert (
        f"namespace.tenant_key_file={str(fifo)!r}: not a regular file (a FIFO)"
        in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_a_device_or_huge_tenant_key_file_is_refused_without_reading_it_whole(
    tmp_path,
):
    """old: /dev/zero raised MemoryError (a traceback); a 1 GiB sparse file was read whole."""
    done = _tierctl_config(tmp_path, "/dev/zero")
    assert done.returncode == 2, done.stderr
    assert (
        "namespace.tenant_key_file='/dev/zero': not a regular file (a character device)"
        in done.stderr
    )
    huge = tmp_path / "huge.key"
    with open(huge, "wb") as f:
        f.truncate(3 << 30)  # sparse: larger than the process may hold
    done = _tierctl_config(tmp_path, str(huge))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "larger than 65536 bytes" in done.stderr


@pytest.mark.parametrize(
    "url,masked",
    [
        (f"redis://app:x@{PW}@db:6379/0", "redis://app:***@db:6379/0"),
        (f"redis://app:x/{PW}@db:6379/0", "redis://app:***@db:6379/0"),
        (f"rediss://:x@{PW}@db:6379", "rediss://:***@db:6379"),
    ],
)
def test_tierctl_config_masks_a_password_holding_an_at_or_a_slash(
    url, masked, tmp_path, capsys
):
    """old: `store.url = 'redis://app:***@Sekr1tPW@db:6379/0'`: the mask stopped at the
    password's first '@' (or was not made at a '/') and printed the rest of it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f'store: {{backend: redis, url: "{url}"}}\n')
    assert main(["config", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert PW not in out and f"store.url = {masked!r}" in out, out
