"""`s3`: pages as S3 objects (boto3 in a bounded thread pool).

`endpoint_url` points at any S3-compatible server. With `skip_existing` a put is
conditional (`If-None-Match: *`): a page already stored is not written again. Retries and
timeouts come from config; credentials come from boto3's default chain (or config) and
are never logged.

Leases (`Store.hint`) are object tags (`tags`, on by default): every page is written
tagged `kvtier-lease-until=0` and `kvtier-priority=0`; a lease sets `kvtier-lease-until`
to its end (Unix seconds) and a hint `kvtier-priority` (a hint without one keeps the
tag's), and the end of a lease on kvtier's clock (or a release) sets it back to 0. A
bucket lifecycle rule that expires objects tagged `kvtier-lease-until=0` then drops only
unleased pages (docs/stores.md, "Leases and priorities"). Tags never fail a write: a
tagged PUT refused (`AccessDenied`: credentials without `s3:PutObjectTagging`;
`NotImplemented`: a server without tagging) whose untagged retry is stored turns tags
off for this store (logged once, counted in `tags_refused`). With tags off pages are
written untagged and a hint applies to none.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.backends.base import FRAME_SLACK, MANIFEST_LIMIT, Store, StoredPage
from kvtier.backends.leases import Leases
from kvtier.errors import StoreError, StoreTimeout, StoreUnavailable
from kvtier.secrets import mask_credentials, redact_url
from kvtier.validate import check_positive

log = logging.getLogger(__name__)

_MISSING = ("404", "NoSuchKey", "NotFound")
# a tagged PUT refused so: credentials without s3:PutObjectTagging, a server without tags
_TAGS_REFUSED = ("AccessDenied", "NotImplemented")
LEASE_TAG, PRIORITY_TAG = "kvtier-lease-until", "kvtier-priority"
_PLAIN_TAGS = f"{LEASE_TAG}=0&{PRIORITY_TAG}=0"  # a page as written: no lease


@dataclass(slots=True, frozen=True)
class S3StoreConfig:
    bucket: str = "kvtier"
    prefix: str = ""  # object key prefix inside the bucket, before the kvtier key
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None
    max_workers: int = 16
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 10.0
    skip_existing: bool = True
    create_bucket: bool = False
    max_page_bytes: int = 1 << 30  # a larger object is no page: never read whole
    # lease tags on every page (docs/stores.md, "Leases and priorities")
    tags: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.tags, bool):
            raise ValueError(
                f"tags={self.tags!r}: true (pages tagged with their lease and priority) "
                "or false (untagged: a hint applies to none)"
            )
        check_positive(
            self, "max_workers", "max_attempts", "max_page_bytes", integer=True
        )
        check_positive(self, "connect_timeout_s", "read_timeout_s")
        if not self.bucket:
            raise ValueError("bucket='': name the bucket")

    def __repr__(self) -> str:  # never print credentials
        return f"S3StoreConfig(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self._endpoint()!r})"

    def _endpoint(self) -> str | None:
        """endpoint_url as it may be shown: a password in it (`http://user:pw@host`) masked."""
        return None if self.endpoint_url is None else redact_url(self.endpoint_url)


class S3Store(Store):
    config_class = S3StoreConfig
    name = "s3"

    def __init__(
        self,
        config: S3StoreConfig = S3StoreConfig(),
        timeout_s: float = 30.0,
        clock=None,
    ) -> None:
        super().__init__(timeout_s, clock)
        self._leases = Leases(self.clock)
        self.tagging = config.tags  # off for good once a tagged PUT is refused
        self.tags_refused = 0  # tagged PUTs refused, then stored untagged
        self._tags_lock = threading.Lock()
        import boto3
        from botocore.config import Config

        self.config = config
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            region_name=config.region,
        )
        self.client = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=Config(
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                # a call the store gave up on (timeout_s) must not hold its thread, and so
                # the caller's pages (and a close), much longer: each attempt's socket
                # times out no later than that
                connect_timeout=min(config.connect_timeout_s, timeout_s),
                read_timeout=min(config.read_timeout_s, timeout_s),
                max_pool_connections=config.max_workers,
            ),
        )
        self._pool = ThreadPoolExecutor(
            config.max_workers, thread_name_prefix="kvtier-s3"
        )
        if config.create_bucket:
            self._create_bucket()

    def _create_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.create_bucket(Bucket=self.config.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise self._map_error("create_bucket", exc) from exc
        except Exception as exc:
            raise self._map_error("create_bucket", exc) from exc

    def _object(self, key: str) -> str:
        return f"{self.config.prefix}{key}"

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _head(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.config.bucket, Key=self._object(key))
            return True
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return False
            raise

    def _fetch(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None where missing; with `limit`, a ranged GET of at most
        `limit + 1` bytes (a longer object, planted by anyone who can write the bucket,
        then fails to decode: a counted miss, never read whole)."""
        from botocore.exceptions import ClientError

        extra = {} if limit is None else {"Range": f"bytes=0-{limit}"}
        try:
            return self.client.get_object(
                Bucket=self.config.bucket, Key=self._object(key), **extra
            )["Body"].read()
        except ClientError as exc:
            if _code(exc) in _MISSING or _code(exc) == "InvalidRange":  # empty: no page
                return None
            raise

    def _put(self, key: str, page) -> bool:
        from botocore.exceptions import ClientError

        extra = {"IfNoneMatch": "*"} if self.config.skip_existing else {}
        header, payload = page  # the checksum is computed here, in the I/O thread
        body = header + payload
        tagged = self.tagging
        try:
            try:
                self._put_object(key, body, tagged, extra)
            except ClientError as exc:
                if not (tagged and _code(exc) in _TAGS_REFUSED):
                    raise
                self._put_object(key, body, False, extra)  # its failure is the error
                self._tags_off(_code(exc))
        except ClientError as exc:
            if _code(exc) in ("PreconditionFailed", "412"):
                return True  # already stored (keys are content hashes)
            raise
        return True

    def _put_object(self, key: str, body: bytes, tagged: bool, extra: dict) -> None:
        self.client.put_object(
            Bucket=self.config.bucket,
            Key=self._object(key),
            Body=body,
            **({"Tagging": _PLAIN_TAGS} if tagged else {}),
            **extra,
        )

    def _tags_off(self, code: str) -> None:
        """A tagged PUT was refused (`code`) and the same page untagged was not: pages are
        written untagged from now on (an I/O thread; logged once)."""
        with self._tags_lock:
            self.tags_refused += 1
            if not self.tagging:
                return
            self.tagging = False
        log.warning(
            "s3 store (bucket %r): a tagged PUT was refused (%s) and the page was "
            "stored untagged: pages are written without lease tags from now on, hints "
            "apply to none, and a lifecycle rule filtering on %s=0 no longer expires new "
            "pages. Grant s3:PutObjectTagging (and s3:GetObjectTagging) or set "
            'store tags: false (docs/stores.md, "Leases and priorities")',
            self.config.bucket,
            code,
            LEASE_TAG,
        )

    def _jobs(self, fn, *columns) -> list:
        loop = asyncio.get_running_loop()
        return [loop.run_in_executor(self._pool, fn, *args) for args in zip(*columns)]

    async def _exists(self, keys):
        return list(await asyncio.gather(*self._jobs(self._head, keys)))

    async def _get(self, keys):
        return await self._get_upto(
            keys, [self.config.max_page_bytes + FRAME_SLACK] * len(keys)
        )

    async def _get_upto(self, keys, limits):
        return list(await asyncio.gather(*self._jobs(self._fetch, keys, limits)))

    async def _set(self, keys, frames):
        await self._end_leases()
        # the jobs read the caller's page buffers: a cancelled call waits for them
        return list(await self._in_threads(self._jobs(self._put, keys, frames)))

    def _remove(self, keys: list[str]) -> int:
        present = [k for k in keys if self._head(k)]
        for start in range(0, len(present), 1000):
            chunk = present[start : start + 1000]
            self.client.delete_objects(
                Bucket=self.config.bucket,
                Delete={
                    "Objects": [{"Key": self._object(k)} for k in chunk],
                    "Quiet": True,
                },
            )
        return len(present)

    async def _delete(self, keys):
        return await self._run(self._remove, keys)

    def _list_page(
        self, token: str | None, batch: int
    ) -> tuple[list[StoredPage], str | None]:
        kwargs = {
            "Bucket": self.config.bucket,
            "Prefix": self.config.prefix,
            "MaxKeys": batch,
        }
        if token:
            kwargs["ContinuationToken"] = token
        resp = self.client.list_objects_v2(**kwargs)
        pages = [
            StoredPage(
                o["Key"][len(self.config.prefix) :],
                o["Size"],
                o["LastModified"].timestamp(),
            )
            for o in resp.get("Contents", [])
        ]
        return pages, resp.get("NextContinuationToken") if resp.get(
            "IsTruncated"
        ) else None

    async def _scan(self, batch):
        token = None
        while True:
            pages, token = await self._run(self._list_page, token, batch)
            yield pages
            if token is None:
                return

    async def _put_meta(self, name, data):
        await self._run(
            lambda: self.client.put_object(
                Bucket=self.config.bucket, Key=self._object(name), Body=bytes(data)
            )
        )

    async def _get_meta(self, name):
        return await self._run(self._fetch, name, MANIFEST_LIMIT)

    async def _close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _map_error(self, op, exc):
        from botocore import exceptions as bex

        if isinstance(exc, (bex.ConnectTimeoutError, bex.ReadTimeoutError)):
            return StoreTimeout(f"s3.{op}: {type(exc).__name__}")
        if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectionClosedError)):
            return StoreUnavailable(
                f"s3.{op}: {type(exc).__name__}: cannot reach {self.config._endpoint() or 'AWS'}"
            )
        if isinstance(exc, bex.ClientError):  # botocore's text may quote the URL
            return StoreError(mask_credentials(f"s3.{op}: {_code(exc)}: {exc}"))
        if isinstance(exc, bex.BotoCoreError):
            return StoreError(mask_credentials(f"s3.{op}: {type(exc).__name__}: {exc}"))
        return super()._map_error(op, exc)

    def _extra_stats(self):
        return {
            "bucket": self.config.bucket,
            "endpoint_url": self.config._endpoint(),
            "leases": len(self._leases),
            "tags": self.tagging,
            "tags_refused": self.tags_refused,
        }

    # -- leases ----------------------------------------------------------------------------

    async def _hint(self, keys, lease_s, priority):
        """Tag each present object with the lease's end (Unix seconds; 0: none) and the
        priority (None: the tag's own); how many objects were there (none with tags
        off). Only a running lease is remembered (to be tagged 0 at its end): a priority
        lives in the tag alone."""
        await self._end_leases()
        if not self.tagging:
            return 0
        if lease_s is None:
            self._leases.forget(keys)
        else:
            for key in keys:
                self._leases.apply(key, lease_s, 0)
        until = 0 if lease_s is None else int(time.time() + lease_s) + 1
        done = await asyncio.gather(
            *self._jobs(self._tag, keys, [until] * len(keys), [priority] * len(keys))
        )
        self._leases.forget(k for k, here in zip(keys, done) if not here)
        return sum(done)

    async def _end_leases(self) -> None:
        """Leases that ended on kvtier's clock: tagged unleased again (priority kept)."""
        ended = self._leases.expire()
        if not ended:
            return
        self._leases.forget(ended)  # the priority stays in the tag
        if not self.tagging:  # turned off since: nothing to untag, nor the right to
            return
        got = await asyncio.gather(
            *self._jobs(self._tag, ended, [0] * len(ended), [None] * len(ended)),
            return_exceptions=True,
        )
        failed = [r for r in got if isinstance(r, Exception)]
        if failed:  # the tag stays (a lifecycle rule keeps the page): logged, no error
            self.counters.errors += 1
            self.complain("error", f"untagging {len(failed)} ended leases: {failed[0]}")

    def _tag(self, key: str, until: int, priority: int | None) -> bool:
        """Set the object's lease tags (priority None: the one its tag has, read first:
        S3 replaces an object's tags whole); False where it is not there."""
        from botocore.exceptions import ClientError

        try:
            if priority is None:
                got = self.client.get_object_tagging(
                    Bucket=self.config.bucket, Key=self._object(key)
                )["TagSet"]
                priority = _priority({t["Key"]: t["Value"] for t in got})
            tags = [
                {"Key": LEASE_TAG, "Value": str(until)},
                {"Key": PRIORITY_TAG, "Value": str(priority)},
            ]
            self.client.put_object_tagging(
                Bucket=self.config.bucket,
                Key=self._object(key),
                Tagging={"TagSet": tags},
            )
        except ClientError as exc:
            if _code(exc) in _MISSING:
                return False
            raise
        return True


def _priority(tags: dict[str, str]) -> int:
    """The priority an object's tags hold (0 where none, or not an integer)."""
    try:
        return int(tags.get(PRIORITY_TAG, "0"))
    except ValueError:
        return 0


def _code(exc) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
