"""AWS as the node's environment stage and the EC2 node host see it, from the standard library alone.

The stage (:mod:`prefect_sgpu.launch.node_env`) runs before anything is installed, so it cannot use
boto3: everything it asks of AWS is here, behind the small transport it names
(:class:`S3StageTransport`, the stage transport of ``s3://`` stores). The user-data carries this file
beside the stage (:func:`prefect_sgpu.environment.ship.stage_files`), and the stage imports it from its
own folder; it imports nothing of prefect-sgpu.

- **IMDSv2** (:func:`imds_token`, :func:`imds_get`): the instance metadata service, a token PUT then
  GETs; ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` points it elsewhere, as botocore honours it. The one
  reader of both the stage and :mod:`prefect_sgpu.launch.ec2_host`.
- **Credentials** (:class:`Credentials`): the environment's keys, else the instance profile's from IMDSv2,
  waited for while IMDS does not serve them yet (an instance profile propagates for up to ~2 minutes
  after launch) and re-read before they expire (a long environment build outlives one set).
- **Signature V4** (:func:`signed`) for S3's REST API and SSM's JSON API.
- **S3**: GET, PUT, ranged GET and the steps of a multipart upload of one bucket's objects.
- **SSM**: a SecureString's value (GetParameter WithDecryption).

Every request to AWS is retried by :func:`prefect_sgpu.retry.retrying` (carried beside this file on a
node) within :data:`CLOUD_BUDGET_S`: S3's ``SlowDown`` and 5xx, SSM's throttling, a reset connection,
an expired token (re-read first); an ``AccessDenied`` while the instance profile's role is young
(:data:`ROLE_PROPAGATION_S`: a job role's policy was just written, and IAM takes effect late); and a
bucket in another region (S3 names it in ``x-amz-bucket-region``: the request is signed again for it).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import hmac
import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Callable

if __package__:
    from prefect_sgpu import retry
else:  # on a node, before anything is installed: the user-data carries retry.py beside this file
    import retry

DEFAULT_IMDS = "http://169.254.169.254/"
IMDS_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable botocore itself honours
_UNRESERVED = "-_.~"

#: seconds the stage waits out AWS being late or busy, per request (credentials, throttling, 5xx)
CLOUD_BUDGET_S = 120.0
#: for how long after its credentials first came from IMDS an AccessDenied counts as IAM still propagating
#: the role's policy (a job role's policy is written just before its instances launch)
ROLE_PROPAGATION_S = 120.0
#: credentials are re-read from IMDS when they expire within this many seconds (EC2 rotates them well before)
REFRESH_BEFORE_S = 300.0
#: error codes of a busy service: retried (S3 SlowDown, SSM and other JSON services' throttling)
BUSY = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
                  "InternalError", "InternalServerError", "ServiceUnavailable", "RequestTimeout"})
#: the stage's S3 requests by method (:meth:`S3StageTransport._send`), and their lock
SENT: dict[str, int] = {}
_SENT = threading.Lock()
#: error codes of credentials that expired: read again, then retried
EXPIRED = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired"})
#: error codes of a refusal: retried only while the role may still be propagating
DENIED = frozenset({"AccessDenied", "AccessDeniedException", "InvalidAccessKeyId", "UnrecognizedClientException",
                    "InvalidClientTokenId"})


class TransportError(Exception):
    """A request to AWS failed: the text says what AWS answered; ``status``, ``code`` (AWS's error code)
    and ``region`` (S3's ``x-amz-bucket-region``) say it to code."""

    def __init__(self, text: str, status: int = 0, code: str = "", region: str = "") -> None:
        super().__init__(text)
        self.status, self.code, self.region = status, code, region


def _log(message: str) -> None:
    print(f"[prefect-sgpu env] {message}", flush=True)


# --- IMDSv2 ------------------------------------------------------------------------------------


def imds_base() -> str:
    return os.environ.get(IMDS_ENV, DEFAULT_IMDS).rstrip("/") + "/"


def _imds(path: str, headers: dict[str, str], method: str, timeouts: tuple[float, ...], base: str | None) -> str:
    """One IMDS request, tried once per timeout: a busy machine can answer late. An HTTP error
    (404: no such entry, 401: an expired token) is raised at once."""
    for attempt, timeout in enumerate(timeouts):
        request = urllib.request.Request((base or imds_base()) + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError:
            raise
        except OSError:  # a timeout, a reset connection
            if attempt == len(timeouts) - 1:
                raise
            time.sleep(1)
    raise AssertionError("not reached")


def imds_token(timeouts: tuple[float, ...] = (5, 10, 20), ttl: int = 21600, base: str | None = None) -> str:
    """A session token of IMDSv2 (``base``: another metadata service than :func:`imds_base`'s)."""
    return _imds("latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}, "PUT", timeouts, base)


def imds_get(path: str, token: str | None = None, timeouts: tuple[float, ...] = (5, 10, 20),
             base: str | None = None) -> str:
    """``latest/meta-data/<path>``, stripped (a new token when none is given)."""
    token = token or imds_token(timeouts, base=base)
    return _imds("latest/meta-data/" + path, {"X-aws-ec2-metadata-token": token}, "GET", timeouts, base).strip()


class CredentialsLate(Exception):
    """IMDS serves no credentials of the instance profile yet."""


def _imds_late(exc: BaseException) -> bool:
    """What IMDS answers while the instance profile propagates (404, an empty role list, a document
    whose ``Code`` is not ``Success``) or while it is busy: worth asking again."""
    return isinstance(exc, (CredentialsLate, OSError, http.client.HTTPException, ValueError))


class Credentials:
    """The node's keys: the environment's, else the instance profile's from IMDSv2 (as botocore finds them).

    IMDS may not serve the profile's credentials for a while after launch: they are waited for (with
    :func:`prefect_sgpu.retry.retrying`, :data:`CLOUD_BUDGET_S`). The profile's credentials expire: their
    ``Expiration`` is kept on the retry helper's monotonic clock, and they are read again once less than
    :data:`REFRESH_BEFORE_S` is left (EC2 serves new ones well before the old ones expire)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the stage fetches files from several threads
        self.keys: tuple[str, str, str | None] | None = None
        #: when the keys expire, on ``retry.CLOCK`` (None: never, the environment's keys)
        self.expires: float | None = None
        #: when keys first came from IMDS, on ``retry.CLOCK`` (None: the environment's keys)
        self.role_since: float | None = None

    def get(self) -> tuple[str, str, str | None]:
        with self._lock:
            if self.keys is None or (self.expires is not None
                                     and retry.CLOCK.monotonic() > self.expires - REFRESH_BEFORE_S):
                self.refresh()
            assert self.keys is not None
            return self.keys

    def renew(self) -> None:
        """AWS refused the keys as expired: read them again."""
        with self._lock:
            self.refresh()

    def role_age_s(self) -> float | None:
        """Seconds since the instance profile's keys were first read (None: the environment's keys)."""
        return None if self.role_since is None else retry.CLOCK.monotonic() - self.role_since

    def refresh(self) -> None:
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
            self.keys = (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"],
                         os.environ.get("AWS_SESSION_TOKEN") or None)
            return
        still_valid = self.keys is not None and self.expires is not None and retry.CLOCK.monotonic() < self.expires
        try:
            keys, expires = retry.retrying(self._from_imds, transient=_imds_late, budget_s=CLOUD_BUDGET_S,
                                           base_s=1.0, cap_s=10.0,
                                           what="the instance profile's credentials (IMDS)", log=_log)
        except Exception:
            if still_valid:  # the keys in hand still work: the next request asks IMDS again
                _log("IMDS served no new credentials: using the current ones until they expire")
                return
            raise
        self.keys, self.expires = keys, expires
        if self.role_since is None:
            self.role_since = retry.CLOCK.monotonic()

    @staticmethod
    def _from_imds() -> tuple[tuple[str, str, str | None], float | None]:
        token = imds_token()
        roles = imds_get("iam/security-credentials/", token).split()
        if not roles:
            raise CredentialsLate("IMDS lists no role of the instance profile yet")
        doc = json.loads(imds_get(f"iam/security-credentials/{roles[0]}", token))
        if doc.get("Code", "Success") != "Success" or not doc.get("AccessKeyId"):
            raise CredentialsLate(f"IMDS answers {doc.get('Code')!r} for the role's credentials")
        expires = None
        if doc.get("Expiration"):
            at = _dt.datetime.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
            left = (at - _dt.datetime.now(_dt.timezone.utc)).total_seconds()
            expires = retry.CLOCK.monotonic() + left
        return (doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token")), expires


def credentials() -> tuple[str, str, str | None]:
    """The environment's keys, else the instance profile's from IMDSv2 (waited for while IMDS has none)."""
    return Credentials().get()


# --- Signature V4 --------------------------------------------------------------------------------


def signed(method: str, url: str, service: str, region: str, creds: tuple[str, str, str | None],
           body: bytes = b"", extra: dict[str, str] | None = None,
           query: dict[str, str] | None = None) -> urllib.request.Request:
    """A request signed with Signature V4 (``url`` already quoted, without its query: ``query``)."""
    parts = urllib.parse.urlsplit(url)
    canonical_query = "&".join(f"{urllib.parse.quote(k, safe=_UNRESERVED)}={urllib.parse.quote(v, safe=_UNRESERVED)}"
                               for k, v in sorted((query or {}).items()))
    now = _dt.datetime.now(_dt.timezone.utc)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload, "x-amz-date": stamp, **(extra or {})}
    access, secret, token = creds
    if token:
        headers["x-amz-security-token"] = token
    names = sorted(headers)
    canonical = "\n".join([method, parts.path or "/", canonical_query, *(f"{n}:{headers[n].strip()}" for n in names), "",
                           ";".join(names), payload])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key_bytes = ("AWS4" + secret).encode()
    for part in (day, region, service, "aws4_request"):
        key_bytes = hmac.new(key_bytes, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key_bytes, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    del headers["host"]
    return urllib.request.Request(url + (f"?{canonical_query}" if canonical_query else ""),
                                  data=body if method in ("PUT", "POST") else None, method=method, headers=headers)


def _call(request: urllib.request.Request, timeout: float = 60):
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        body = exc.read()
        found = re.search(rb"<Code>([^<]+)</Code>|\"__type\"\s*:\s*\"(?:[^\"#]*#)?([^\"]+)\"", body)
        code = (found.group(1) or found.group(2)).decode() if found else ""
        region = (exc.headers.get("x-amz-bucket-region") or "") if exc.headers else ""
        raise TransportError(f"HTTP {exc.code}: {body[:300]!r}", exc.code, code, region) from None


def calling(build: Callable[[], urllib.request.Request], creds: Credentials, action: str, resource: str,
            timeout: float = 60, moved: Callable[[str], bool] | None = None):
    """(body, headers) of the request ``build()`` makes (signed anew for each attempt), retried within
    :data:`CLOUD_BUDGET_S` while AWS is busy or late (see the module's docstring). ``moved(region)``:
    S3 named the bucket's region; True when the request should go there (signed for it) at once.
    A refusal that outlasts :data:`ROLE_PROPAGATION_S` ends with the permission ``action`` named."""

    def once():
        try:
            return _call(build(), timeout)
        except TransportError as exc:
            if exc.code in EXPIRED:
                creds.renew()
            if exc.region and moved is not None and moved(exc.region):
                return _call(build(), timeout)
            raise

    def transient(exc: BaseException) -> bool:
        if isinstance(exc, TransportError):
            if exc.status >= 500 or exc.code in BUSY or exc.code in EXPIRED:
                return True
            age = creds.role_age_s()
            return exc.code in DENIED and age is not None and age < ROLE_PROPAGATION_S
        return isinstance(exc, (OSError, http.client.HTTPException))  # a reset connection, a timeout

    try:
        return retry.retrying(once, transient=transient, budget_s=CLOUD_BUDGET_S, base_s=0.5, cap_s=20.0,
                              what=f"{action} on {resource}", log=_log)
    except TransportError as exc:
        if exc.code in DENIED:
            raise TransportError(f"{action} on {resource} was refused ({exc.code}) for "
                                 f"{creds.role_age_s() or 0:.0f} s of this node's credentials: its role lacks "
                                 f"{action} (or IAM has not propagated it): {exc}", exc.status, exc.code) from None
        raise


def read_parameter(name: str, region: str, endpoint_url: str | None,
                   creds: "tuple[str, str, str | None] | Credentials") -> str:
    """An SSM SecureString's value (GetParameter WithDecryption), signed with the node's credentials."""
    base = endpoint_url.rstrip("/") + "/" if endpoint_url else f"https://ssm.{region}.amazonaws.com/"
    body = json.dumps({"Name": name, "WithDecryption": True}).encode()
    keys = creds if isinstance(creds, Credentials) else _Fixed(creds)

    def build() -> urllib.request.Request:
        return signed("POST", base, "ssm", region, keys.get(), body,
                      {"content-type": "application/x-amz-json-1.1", "x-amz-target": "AmazonSSM.GetParameter"})

    return json.loads(calling(build, keys, "ssm:GetParameter", name)[0])["Parameter"]["Value"]


class _Fixed(Credentials):
    """Keys given by the caller: used as they are."""

    def __init__(self, keys: tuple[str, str, str | None]) -> None:
        super().__init__()
        self.keys = keys

    def refresh(self) -> None:
        pass


# --- the stage's transport ------------------------------------------------------------------------


class S3StageTransport:
    """The stage's transport (:mod:`prefect_sgpu.launch.node_env`) for an ``s3://bucket/prefix`` store:
    its objects (keys relative to the store's root), SSM for secrets, IMDSv2 for the node itself.
    Every request is signed (SigV4) with the node's credentials. Objects it writes take the bucket's default
    encryption (``prefect-sgpu setup aws``: SSE-KMS under the store's key, or SSE-S3, with S3 Bucket Keys):
    naming the key here would cost the user-data's room."""

    #: where the Deep Learning AMIs mount the instance's NVMe instance store (g5, g6, p4d, p5; AWS Deep
    #: Learning AMI release notes, "AWS Deep Learning Base GPU AMI": "Amazon EC2 instance store ... mounted
    #: at /opt/dlami/nvme"): the stage builds there when the mount table lists it (node_env.use_disk)
    DISK_MOUNTS = ("/opt/dlami/nvme",)

    def __init__(self, store_uri: str, region: str, endpoint_url: str | None = None,
                 bucket_owner: str | None = None) -> None:
        bucket, _, prefix = store_uri[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.region, self.endpoint_url, self.owner = region, endpoint_url, bucket_owner
        self.bucket_region = region
        self._address(region)
        self.credentials = Credentials()
        self.credentials.get()

    def _address(self, region: str) -> None:
        """Where the bucket's objects are asked for, and in which region requests are signed. Path style
        against a custom endpoint (as botocore does) and for a bucket name with dots (a virtual host
        ``a.b.s3...`` fails TLS: S3's wildcard certificate covers one label); else virtual-host style."""
        self.bucket_region = region
        if self.endpoint_url:
            self.base, self.path_prefix = self.endpoint_url.rstrip("/"), f"/{self.bucket}"
        elif "." in self.bucket:
            self.base, self.path_prefix = f"https://s3.{region}.amazonaws.com", f"/{self.bucket}"
        else:
            self.base, self.path_prefix = f"https://{self.bucket}.s3.{region}.amazonaws.com", ""

    def _moved(self, region: str) -> bool:
        """S3 says the bucket is in ``region`` (``x-amz-bucket-region`` of a 301 PermanentRedirect or a 400):
        sign for it, and ask its regional endpoint from now on (another thread may have moved already)."""
        if region != self.bucket_region:
            _log(f"bucket {self.bucket} is in {region}, not {self.bucket_region}: asking it there")
            self._address(region)
        return True

    @property
    def creds(self) -> tuple[str, str, str | None]:
        """The node's keys now (read again from IMDS when they are about to expire)."""
        return self.credentials.get()

    @classmethod
    def from_args(cls, store_uri: str, argv: list[str]) -> "S3StageTransport":
        """From the stage's own arguments that are AWS's: ``--region``, ``--endpoint-url``, ``--bucket-owner``."""
        p = argparse.ArgumentParser(prog="prefect-sgpu-node-env (s3)")
        p.add_argument("--region", required=True)
        p.add_argument("--endpoint-url", default=None)
        p.add_argument("--bucket-owner", default=None)
        args = p.parse_args(argv)
        return cls(store_uri, args.region, args.endpoint_url, args.bucket_owner)

    @property
    def root_uri(self) -> str:
        """The store's URI as the driver's store names it (``S3Store.root_uri``): its scope derives from it."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _key(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, key) if p)

    def _request(self, method: str, key: str, body: bytes = b"", query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> urllib.request.Request:
        path = self.path_prefix + "/" + urllib.parse.quote(self._key(key), safe="/" + _UNRESERVED)
        headers = dict(headers or {})
        if method in ("PUT", "POST"):  # else urllib says form data
            headers.setdefault("content-type", "application/octet-stream")
        if self.owner:
            headers["x-amz-expected-bucket-owner"] = self.owner
        return signed(method, self.base + path, "s3", self.bucket_region, self.creds, body, headers, query)

    def _send(self, action: str, method: str, key: str, body: bytes = b"", query: dict[str, str] | None = None,
              headers: dict[str, str] | None = None, timeout: float = 60):
        """(body, headers) of one S3 request (:func:`calling`: retried, signed anew each time)."""
        def build() -> urllib.request.Request:
            # each attempt counted (S3 bills it), by method, for the bootstrap the stage execs (requests_sent)
            with _SENT:
                SENT[method] = SENT.get(method, 0) + 1
            return self._request(method, key, body, query, headers)

        return calling(build, self.credentials, action,
                       f"s3://{self.bucket}/{self._key(key)}", timeout, self._moved)

    def exec_env(self) -> dict[str, str]:
        """For the bootstrap the stage execs (node_env): what the stage sent to S3, ``GET=12,PUT=1``, which it
        reports with its first job's requests (prefect_sgpu.protocol.node_requests.STAGE_ENV)."""
        with _SENT:
            return {"SGPU_STAGE_S3_REQUESTS": ",".join(f"{k}={n}" for k, n in SENT.items())}

    def get(self, key: str) -> bytes:
        return self._send("s3:GetObject", "GET", key)[0]

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` (inclusive) of an object."""
        return self._send("s3:GetObject", "GET", key, headers={"range": f"bytes={start}-{end}"}, timeout=300)[0]

    def put(self, key: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self._send("s3:PutObject", "PUT", key, body, headers={"content-type": content_type})

    def start_upload(self, key: str) -> str:
        """A multipart upload of ``key`` (S3 takes at most 5 GB in one PUT): its id."""
        found = re.search(rb"<UploadId>([^<]+)</UploadId>", self._send("s3:PutObject", "POST", key,
                                                                        query={"uploads": ""})[0])
        if found is None:
            raise TransportError(f"no upload id for {key}")
        return found.group(1).decode()

    def put_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        """Part ``number`` (from 1) of an upload: its token for :meth:`finish_upload`."""
        query = {"partNumber": str(number), "uploadId": upload}
        return self._send("s3:PutObject", "PUT", key, data, query=query, timeout=600)[1]["ETag"]

    def finish_upload(self, key: str, upload: str, parts: list[str]) -> None:
        """The object, from the parts' tokens in order; ``parts`` empty: the upload is abandoned."""
        if not parts:
            self._send("s3:AbortMultipartUpload", "DELETE", key, query={"uploadId": upload})
            return
        body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(parts, 1))
        done = self._send("s3:PutObject", "POST", key,
                          f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode(),
                          query={"uploadId": upload}, headers={"content-type": "application/xml"})[0]
        if b"<Error>" in done:  # S3 may answer 200 with an error in the body
            raise TransportError(done[:300].decode("utf-8", "replace"))

    def read_secret(self, name: str) -> str:
        return read_parameter(name, self.region, self.endpoint_url, self.credentials)

    def instance_id(self) -> str:
        try:
            return imds_get("instance-id")
        except (OSError, urllib.error.URLError):
            return "unknown-instance"

    def launch_index(self) -> int:
        try:
            return int(imds_get("ami-launch-index"))
        except (OSError, ValueError, urllib.error.URLError):
            return -1


#: what :mod:`prefect_sgpu.launch.node_env` looks up by name in this module
TRANSPORT = S3StageTransport
