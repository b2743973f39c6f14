"""The job mailbox on S3: what lets a driver behind NAT run nodes on EC2.

Same key layout as :class:`~prefect_sgpu.store.LocalStore` (``<prefix>/<run_id>/<key>``).
Every call goes through one boto3 client from :func:`prefect_sgpu.aws.client`, whose retries
are botocore's own (``standard`` or ``adaptive`` mode), so throttling and transient 5xx errors are
retried with backoff rather than failing a job. Log tailing reads only the new
bytes of a rank log with a ranged GET.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect_sgpu import aws
from prefect_sgpu.aws import error_code as _error_code
from prefect_sgpu.errors import SGPUConfigError, SGPUError
from prefect_sgpu.store import Listed, Objects, Store, count_process_request

BODY_ATTEMPTS = 3
#: the folder beside an object that holds its appended pieces (``logs/rank-00000.log.parts/...``)
PARTS = ".parts"
#: the error codes of an object that is not there
NOT_FOUND = ("NoSuchKey", "404", "NotFound")
#: objects at least this large (payloads, results) go up in parts through boto3's transfer manager:
#: one PUT holds at most 5 GB, and parts of a large object go up side by side
MULTIPART_BYTES = 64 * 1024 * 1024
#: the store's KMS key and expected bucket owner, as nodes and ranks get them (:meth:`S3Store.env`)
KMS_ENV = "SGPU_STORE_KMS_KEY"
OWNER_ENV = "SGPU_STORE_BUCKET_OWNER"
#: the write argument boto3's managed transfers refuse (s3transfer's ALLOWED_UPLOAD_ARGS lacks it:
#: https://github.com/boto/s3transfer/issues/355 "Support BucketKeyEnabled for upload_file"); they get it
#: from :func:`with_bucket_keys`' event handler instead
BUCKET_KEY = "BucketKeyEnabled"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix"); raises SGPUConfigError otherwise."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise SGPUConfigError("store_uri", uri, "an s3://bucket[/prefix] URI")
    return parsed.netloc, parsed.path.strip("/")


#: an HTTP date (RFC 7231's IMF-fixdate), as S3 writes its ``Date`` header
_HTTP_DATE = re.compile(r"[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT")


def http_date(value: str, whose: str) -> float:
    """Seconds since the epoch of a ``Date`` header. A header repeated on the way (a proxy adding
    its own) reads as its earliest date: ages judged on it can only come out shorter."""
    from email.utils import parsedate_to_datetime

    found = [parsedate_to_datetime(text).timestamp() for text in _HTTP_DATE.findall(value or "")]
    if not found:
        raise SGPUError(f"{whose} answered without a Date header ({value!r}): its clock cannot be read")
    return min(found)


def _bucket_key(params: dict[str, Any], **_: Any) -> None:
    """An SSE-KMS write without a word on S3 Bucket Keys gets one (botocore's parameter-build event)."""
    if params.get("ServerSideEncryption") == "aws:kms":
        params.setdefault(BUCKET_KEY, True)


def with_bucket_keys(client: Any) -> None:
    """Every SSE-KMS ``PutObject`` and ``CreateMultipartUpload`` of ``client`` asks for an S3 Bucket Key,
    including those of boto3's managed transfers, which refuse ``BucketKeyEnabled`` among their extra
    arguments. Without a Bucket Key S3 asks KMS for a data key for every object written and read (billed
    per request, and throttled at the account's KMS request quota); with one, once per bucket key's life
    (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucket-key.html, "Reducing the cost of SSE-KMS
    with Amazon S3 Bucket Keys"). Registering again changes nothing."""
    for operation in ("PutObject", "CreateMultipartUpload"):
        client.meta.events.register(f"before-parameter-build.s3.{operation}", _bucket_key,
                                    unique_id=f"prefect-sgpu-bucket-key-{operation}")


def transfer_args(client: Any, write_args: dict[str, Any]) -> dict[str, Any]:
    """``write_args`` as boto3's managed transfers take them: without ``BucketKeyEnabled``, which
    ``client`` then adds to the transfer's own requests (:func:`with_bucket_keys`)."""
    if write_args.get(BUCKET_KEY):
        with_bucket_keys(client)
    return {k: v for k, v in write_args.items() if k != BUCKET_KEY}


def read_object(client: Any, **request: Any) -> tuple[dict[str, Any], bytes]:
    """GET and read the body; a body that fails its checksum is fetched again.

    botocore retries the request but not a body that arrived damaged (or, with an
    object overwritten mid-read, cut short); the next GET sees a whole object.
    """
    from botocore.exceptions import FlexibleChecksumError, IncompleteReadError, ResponseStreamingError

    for attempt in range(BODY_ATTEMPTS):
        response = client.get_object(**request)
        try:
            return response, bytes(response["Body"].read())
        except (FlexibleChecksumError, IncompleteReadError, ResponseStreamingError):
            if attempt == BODY_ATTEMPTS - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
    raise AssertionError("unreachable")


def request_kind(method: str, url: str) -> str:
    """An S3 request's kind as S3 bills it (https://aws.amazon.com/s3/pricing/, "Requests & data
    retrievals"): a GET that lists is a LIST (the PUT tier), a POST ``?delete`` a DELETE (free)."""
    method, query = method.upper(), urlparse(url).query
    if method == "GET" and ("list-type" in query or "prefix=" in query):
        return "LIST"
    if method == "POST" and "delete" in query.split("&"):
        return "DELETE"
    return method


class S3Store(Store):
    """``s3://bucket/prefix``: one folder per job, readable by the driver and every node."""

    def __init__(
        self,
        uri: str,
        session: Any | None = None,
        region: str | None = None,
        endpoint_url: str | None = None,
        retry_mode: str = "standard",
        client: Any | None = None,
        kms_key_id: str | None = None,
        bucket_owner: str | None = None,
    ) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.region = region
        self.endpoint_url = endpoint_url
        #: SSE-KMS with this key for every object written; without one, SSE-S3 (AES256), asked explicitly
        self.kms_key_id = kms_key_id or None
        #: the account that must own the bucket (ExpectedBucketOwner on every call): a bucket of the
        #: same name in another account (deleted and re-created by someone else) gets nothing
        self.bucket_owner = bucket_owner or None
        self.client = client or aws.client("s3", session, region, endpoint_url, retry_mode)
        self._requests: dict[str, int] = {}
        self._requests_lock = threading.Lock()
        self.client.meta.events.register("request-created.s3", self._count_request,
                                         unique_id=f"sgpu-store-requests-{id(self)}")

    def _count_request(self, request: Any, **_: Any) -> None:
        """Every HTTP attempt this store's client sends, by S3's billing kind (each attempt is billed)."""
        kind = request_kind(str(getattr(request, "method", "")), str(getattr(request, "url", "")))
        with self._requests_lock:
            self._requests[kind] = self._requests.get(kind, 0) + 1
        count_process_request(kind)

    def request_counts(self) -> dict[str, int]:
        with self._requests_lock:
            return dict(self._requests)

    def __repr__(self) -> str:
        return f"S3Store({self.root_uri!r})"

    @property
    def root_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    @classmethod
    def from_env(cls, uri: str, **options: Any) -> "S3Store":
        """The store as the driver configured it for this node or rank (encryption, bucket owner)."""
        options.setdefault("kms_key_id", os.environ.get(KMS_ENV) or None)
        options.setdefault("bucket_owner", os.environ.get(OWNER_ENV) or None)
        return cls(uri, **options)

    def env(self) -> dict[str, str]:
        """What a node or rank needs to write this store as the driver does (see :meth:`from_env`)."""
        return {k: v for k, v in ((KMS_ENV, self.kms_key_id), (OWNER_ENV, self.bucket_owner)) if v}

    def objects(self, *, store_settings: bool = True) -> "S3Objects":
        return S3Objects(self.client, self.bucket, self.prefix, self.write_args() if store_settings else {},
                         self.owner_args() if store_settings else {})

    def owner_args(self) -> dict[str, str]:
        return {"ExpectedBucketOwner": self.bucket_owner} if self.bucket_owner else {}

    def write_args(self) -> dict[str, Any]:
        """Extra arguments of every write: server-side encryption (SSE-KMS with an S3 Bucket Key: see
        :func:`with_bucket_keys`) and the expected bucket owner."""
        sse: dict[str, Any] = ({"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": self.kms_key_id, BUCKET_KEY: True}
                               if self.kms_key_id else {"ServerSideEncryption": "AES256"})
        return {**sse, **self.owner_args()}

    def runs(self) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        names: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, **self.owner_args(), Prefix=base, Delimiter="/"):
            names += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(n for n in names if n and not n.startswith("."))

    def top(self, run_id: str) -> tuple[dict[str, float], set[str]]:
        """One delimited listing: the folder's own objects and its sub-folders, never their contents."""
        base = self._key(run_id) + "/"
        files: dict[str, float] = {}
        folders: set[str] = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, **self.owner_args(), Prefix=base, Delimiter="/"):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(base):]
                if name and not name.startswith("."):
                    files[name] = obj["LastModified"].timestamp()
            folders.update(p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return files, folders

    def clock(self) -> float:
        """S3's own clock: the ``Date`` of its answer to a one-key listing of the store (the service
        that stamps ``LastModified``). Whole seconds, rounded down, so an age judged on it is never
        longer than the object's real age; a listing writes nothing (a dry run stays a dry run).

        Raises :class:`~prefect_sgpu.errors.SGPUError` when the endpoint's answer has no date."""
        base = f"{self.prefix}/" if self.prefix else ""
        answer = self.client.list_objects_v2(Bucket=self.bucket, Prefix=base, MaxKeys=1, **self.owner_args())
        headers = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        return http_date(headers.get("date", ""), f"the store {self.root_uri}")

    def _key(self, run_id: str, key: str = "") -> str:
        parts = [p for p in (self.prefix, run_id, key.lstrip("/")) if p]
        return "/".join(parts)

    def uri(self, run_id: str, key: str = "") -> str:
        return f"s3://{self.bucket}/{self._key(run_id, key)}"

    def put(self, run_id: str, key: str, data: bytes) -> None:
        if len(data) >= MULTIPART_BYTES:
            import io

            from boto3.s3.transfer import TransferConfig

            config = TransferConfig(multipart_threshold=MULTIPART_BYTES,
                                    multipart_chunksize=max(MULTIPART_BYTES // 4, 5 * 1024 * 1024))
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(run_id, key),
                                       ExtraArgs=transfer_args(self.client, self.write_args()), Config=config)
            return
        self.client.put_object(Bucket=self.bucket, Key=self._key(run_id, key), Body=data, **self.write_args())

    # -- objects that grow: one small object per appended piece ----------------------------------
    #
    # S3 cannot append, and uploading a growing log whole every second ships its size again on
    # every upload (bytes grow with the square of the log). An appended piece is its own object,
    # ``<key>.parts/<offset, 16 digits>``; ``get``/``read_from``/``list`` read the pieces as one
    # object until ``seal_appended`` writes it whole (once) and drops them.

    def append(self, run_id: str, key: str, offset: int, data: bytes) -> None:
        self.put(run_id, f"{key}{PARTS}/{offset:016d}", data)

    def seal_appended(self, run_id: str, key: str, data: bytes) -> None:
        self.put(run_id, key, data)
        self._delete_under(self._key(run_id, key) + PARTS + "/")

    def _parts(self, run_id: str, key: str, from_offset: int = 0) -> list[tuple[int, int, str]]:
        """``(offset, size, full key)`` of the appended pieces of ``key`` starting at ``from_offset`` or later."""
        base = self._key(run_id, key) + PARTS + "/"
        args: dict[str, Any] = {"StartAfter": f"{base}{from_offset - 1:016d}"} if from_offset > 0 else {}
        found: list[tuple[int, int, str]] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, **args, **self.owner_args()):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(base):]
                if name.isdigit():
                    found.append((int(name), int(obj["Size"]), obj["Key"]))
        return sorted(found)

    def _read_parts(self, run_id: str, key: str, offset: int) -> bytes | None:
        """The appended pieces of ``key`` from ``offset`` on, joined; None when it has none at all."""
        parts = self._parts(run_id, key, offset)  # a reader that read whole pieces asks from a piece's start
        if parts and parts[0][0] > offset:  # ``offset`` is inside a piece: find it among them all
            parts = self._parts(run_id, key)
        if not parts:
            return None
        chunks = []
        for start, size, full in parts:
            if start + size <= offset:
                continue
            _response, data = self._read(Key=full)
            chunks.append(data[max(offset - start, 0):])
        return b"".join(chunks)

    def _read(self, **request: Any) -> tuple[dict[str, Any], bytes]:
        return read_object(self.client, Bucket=self.bucket, **request, **self.owner_args())

    def _whole_or_parts(self, whole: Any, parts: Any) -> Any:
        """``whole()``; when the object is not there whole, ``parts()`` (its appended pieces). A piece
        gone between listing and reading means the object was sealed meanwhile: ``whole()`` once more."""
        from botocore.exceptions import ClientError

        for sealing in (True, False):
            try:
                return whole()
            except ClientError as exc:
                if _error_code(exc) not in NOT_FOUND:
                    raise
            try:
                return parts()
            except ClientError as gone:
                if not sealing or _error_code(gone) not in NOT_FOUND:
                    raise
        raise AssertionError("unreachable")

    def get(self, run_id: str, key: str) -> bytes | None:
        return self._whole_or_parts(lambda: self._read(Key=self._key(run_id, key))[1],
                                    lambda: self._read_parts(run_id, key, 0))

    def read_from(self, run_id: str, key: str, offset: int) -> bytes:
        """Bytes from ``offset`` to the end (a ranged GET): what a log tailer has not seen yet."""
        from botocore.exceptions import ClientError

        def whole() -> bytes:
            try:
                response, data = self._read(Key=self._key(run_id, key), Range=f"bytes={max(offset, 0)}-")
            except ClientError as exc:
                if _error_code(exc) in ("InvalidRange", "416"):
                    return b""
                raise
            # a store that ignores Range answers 200 with the whole object
            if response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200 and offset:
                data = data[offset:]
            return data

        return self._whole_or_parts(whole, lambda: self._read_parts(run_id, key, max(offset, 0)) or b"")

    def versions(self, run_id: str, prefix: str) -> dict[str, str]:
        """The objects directly under ``prefix`` with their ETags, an object still being appended
        to included (one delimited listing: its pieces are not enumerated; its token is fixed)."""
        base = self._key(run_id, prefix.rstrip("/")) + "/"
        root = self._key(run_id) + "/"
        found: dict[str, str] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, **self.owner_args(), Prefix=base, Delimiter="/"):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(root):]
                if not rel.rsplit("/", 1)[-1].startswith("."):
                    found[rel] = str(obj.get("ETag", "")) + str(obj.get("LastModified", ""))
            for common in page.get("CommonPrefixes", []):
                rel = common["Prefix"][len(root):].rstrip("/")
                if rel.endswith(PARTS) and not rel.rsplit("/", 1)[-1].startswith("."):
                    found.setdefault(rel[: -len(PARTS)], PARTS)
        return found

    def listing(self, run_id: str, prefix: str) -> dict[str, Listed]:
        """One listing (a page per 1000 keys) of everything under ``prefix``: each whole object with
        its size and ETag, and each object still appended to with its pieces, so a reader of many
        growing logs learns which grew, and by which pieces, without a request per log."""
        base = self._key(run_id, prefix.rstrip("/")) + "/"
        rel_base = prefix.rstrip("/") + "/"
        whole: dict[str, Listed] = {}
        pieces: dict[str, list[tuple[int, int, str]]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, **self.owner_args()):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(base):]
                head, _, tail = name.partition("/")
                if head.startswith("."):
                    continue
                if not tail:
                    whole[rel_base + name] = Listed(rel_base + name, int(obj.get("Size", 0)),
                                                    str(obj.get("ETag", "")) + str(obj.get("LastModified", "")))
                elif head.endswith(PARTS) and tail.isdigit():
                    pieces.setdefault(rel_base + head[: -len(PARTS)], []).append(
                        (int(tail), int(obj.get("Size", 0)), obj["Key"]))
        found = dict(whole)
        for key, parts in pieces.items():
            if key in found:  # sealed: the whole object is all of it
                continue
            parts.sort()
            end = max(start + size for start, size, _ in parts)
            found[key] = Listed(key, end, f"{PARTS}-{len(parts)}-{end}", tuple(parts))
        return found

    def get_at_most(self, run_id: str, key: str, limit: int) -> tuple[bytes | None, bool]:
        """A ranged GET of the first ``limit + 1`` bytes (an object still appended to: its pieces)."""
        from botocore.exceptions import ClientError

        def whole() -> bytes:
            try:
                response, data = self._read(Key=self._key(run_id, key), Range=f"bytes=0-{max(limit, 0)}")
            except ClientError as exc:
                if _error_code(exc) in ("InvalidRange", "416"):  # an empty object
                    return b""
                raise
            return data

        data = self._whole_or_parts(whole, lambda: self._read_parts(run_id, key, 0))
        if data is None:
            return None, True
        return data[:limit], len(data) <= limit

    def read_range(self, run_id: str, listed: Listed, offset: int, limit: int) -> bytes:
        """At most ``limit`` bytes from ``offset``: ranged GETs of the listed pieces that hold them (no
        listing), or of the whole object; a piece gone since the listing means the object was sealed."""
        from botocore.exceptions import ClientError

        offset, stop = max(offset, 0), max(offset, 0) + max(limit, 0)
        if stop <= offset:
            return b""
        if listed.pieces:
            chunks: list[bytes] = []
            try:
                for start, size, full in listed.pieces:
                    if start + size <= offset or start >= stop:
                        continue
                    first, last = max(offset - start, 0), min(stop - start, size) - 1
                    response, data = self._read(Key=full, Range=f"bytes={first}-{last}")
                    if response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200:
                        data = data[first:last + 1]  # a store that ignores Range
                    chunks.append(data)
                return b"".join(chunks)
            except ClientError as exc:
                if _error_code(exc) not in NOT_FOUND:
                    raise
        try:
            response, data = self._read(Key=self._key(run_id, listed.key), Range=f"bytes={offset}-{stop - 1}")
        except ClientError as exc:
            if _error_code(exc) in ("InvalidRange", "416", *NOT_FOUND):
                return b""
            raise
        if response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 200:
            data = data[offset:stop]
        return data

    def delete(self, run_id: str, key: str) -> None:
        """Delete one object (with its appended pieces), or every object under ``key/`` (a "folder")."""
        full = self._key(run_id, key)
        self._delete_under(full.rstrip("/") + "/", full, full.rstrip("/") + PARTS + "/")

    def _delete_under(self, prefix: str, *more: str) -> None:
        """Every object under ``prefix`` (and under, or at, each of ``more``)."""
        batch: list[dict[str, str]] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for where in (prefix, *more):
            if not where.endswith("/"):
                batch.append({"Key": where})
                continue
            for page in paginator.paginate(Bucket=self.bucket, **self.owner_args(), Prefix=where):
                batch += [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        for start in range(0, len(batch), 1000):
            self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch[start:start + 1000], "Quiet": True}, **self.owner_args()
            )


class S3Objects(Objects):
    """The objects under ``s3://bucket/prefix``, by key relative to it, each call with ``write_args``
    (encryption) or ``owner_args`` (the expected bucket owner) as the store that opened it adds them."""

    def __init__(self, client: Any, bucket: str, prefix: str, write_args: dict[str, Any] | None = None,
                 owner_args: dict[str, str] | None = None) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.write_args = dict(write_args or {})
        self.owner_args = dict(owner_args or {})

    def __repr__(self) -> str:
        return f"S3Objects({self.uri!r})"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def _key(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, key.lstrip("/")) if p)

    def keys(self, under: str = "") -> list[str]:
        root = self.prefix + "/" if self.prefix else ""
        prefix = root + (under.strip("/") + "/" if under else "")
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                           **self.owner_args):
            keys += [obj["Key"][len(root):] for obj in page.get("Contents", [])]
        return keys

    def exists(self, key: str) -> bool:
        """A HEAD: False on any error answer (S3 answers 403, not 404, to a caller that may not list)."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key), **self.owner_args)
        except ClientError:
            return False
        return True

    def get(self, key: str) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return read_object(self.client, Bucket=self.bucket, Key=self._key(key), **self.owner_args)[1]
        except ClientError as exc:
            if _error_code(exc) in NOT_FOUND:
                return None
            raise

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **self.write_args)

    def upload(self, key: str, path: Path) -> None:
        """boto3's managed transfer: a large file goes up in parts, side by side."""
        self.client.upload_file(str(path), self.bucket, self._key(key),
                                ExtraArgs=transfer_args(self.client, self.write_args) or None)

    def download(self, key: str, path: Path) -> None:
        self.client.download_file(self.bucket, self._key(key), str(path), ExtraArgs=self.owner_args or None)

    def delete(self, keys: list[str]) -> None:
        """One key: a DELETE of its own; more: batches of 1000 (one request each)."""
        if len(keys) == 1:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(keys[0]), **self.owner_args)
            return
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start:start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True},
                                       **self.owner_args)
