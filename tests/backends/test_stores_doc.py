"""docs/stores.md's local S3 recipe runs as written against moto's server."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_local_s3_recipe_creates_its_bucket_and_replays(s3_server, tmp_path):
    """The recipe's bucket `kv` is shorter than S3's 3-63 characters: its replay failed at
    start with InvalidBucketName. Its commands run here against moto's server (started by
    the fixture in place of the recipe's `moto_server -p 5000 &`), with fewer requests."""
    import boto3

    text = (ROOT / "docs" / "stores.md").read_text()
    block = re.search(r"A local S3 to try it.*?```bash\n(.*?)```", text, re.S).group(1)
    server, command = block.split("\n", 1)
    assert server == "moto_server -p 5000 &"
    assert command.rstrip().endswith("tierctl replay --config s3 --verify")
    bucket = re.search(r"KVTIER_STORE_BUCKET=(\S+)", command).group(1)
    script = command.replace("http://127.0.0.1:5000", s3_server.url).rstrip()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", f"{script} --requests 4"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "verified                 4 requests match" in out.stdout
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] > 0
