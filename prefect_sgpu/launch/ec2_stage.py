"""AWS as the node's environment stage and the EC2 node host see it, from the standard library alone.

The stage (:mod:`prefect_sgpu.launch.node_env`) runs before anything is installed, so it cannot use
boto3: everything it asks of AWS is here, behind the small transport it names
(:class:`S3StageTransport`, the stage transport of ``s3://`` stores). The user-data carries this file
beside the stage (:func:`prefect_sgpu.environment.ship.stage_files`), and the stage imports it from its
own folder; it imports nothing of prefect-sgpu.

- **IMDSv2** (:func:`imds_token`, :func:`imds_get`): the instance metadata service, a token PUT then
  GETs; ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` points it elsewhere, as botocore honours it. The one
  reader of both the stage and :mod:`prefect_sgpu.launch.ec2_host`.
- **Credentials**: the environment's keys, else the instance profile's from IMDSv2.
- **Signature V4** (:func:`signed`) for S3's REST API and SSM's JSON API.
- **S3**: GET, PUT, ranged GET and the steps of a multipart upload of one bucket's objects.
- **SSM**: a SecureString's value (GetParameter WithDecryption).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import hmac
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_IMDS = "http://169.254.169.254/"
IMDS_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable botocore itself honours
_UNRESERVED = "-_.~"


class TransportError(Exception):
    """A request to AWS failed: the text says what AWS answered."""


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


def credentials() -> tuple[str, str, str | None]:
    """The environment's keys, else the instance profile's from IMDSv2 (as botocore finds them)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"],
                os.environ.get("AWS_SESSION_TOKEN") or None)
    token = imds_token()
    role = imds_get("iam/security-credentials/", token).splitlines()[0]
    doc = json.loads(imds_get(f"iam/security-credentials/{role}", token))
    return doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token")


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
        raise TransportError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None


def read_parameter(name: str, region: str, endpoint_url: str | None, creds: tuple[str, str, str | None]) -> str:
    """An SSM SecureString's value (GetParameter WithDecryption), signed with the node's credentials."""
    base = endpoint_url.rstrip("/") + "/" if endpoint_url else f"https://ssm.{region}.amazonaws.com/"
    body = json.dumps({"Name": name, "WithDecryption": True}).encode()
    req = signed("POST", base, "ssm", region, creds, body,
                 {"content-type": "application/x-amz-json-1.1", "x-amz-target": "AmazonSSM.GetParameter"})
    return json.loads(_call(req)[0])["Parameter"]["Value"]


# --- the stage's transport ------------------------------------------------------------------------


class S3StageTransport:
    """The stage's transport (:mod:`prefect_sgpu.launch.node_env`) for an ``s3://bucket/prefix`` store:
    its objects (keys relative to the store's root), SSM for secrets, IMDSv2 for the node itself.
    Every request is signed (SigV4) with the node's credentials."""

    def __init__(self, store_uri: str, region: str, endpoint_url: str | None = None,
                 bucket_owner: str | None = None) -> None:
        bucket, _, prefix = store_uri[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.region, self.endpoint_url, self.owner = region, endpoint_url, bucket_owner
        if endpoint_url:  # path style, as botocore uses against a custom endpoint
            self.base, self.path_prefix = endpoint_url.rstrip("/"), f"/{bucket}"
        else:
            self.base, self.path_prefix = f"https://{bucket}.s3.{region}.amazonaws.com", ""
        self.creds = credentials()

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
        return signed(method, self.base + path, "s3", self.region, self.creds, body, headers, query)

    def get(self, key: str) -> bytes:
        return _call(self._request("GET", key))[0]

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``start .. end`` (inclusive) of an object."""
        return _call(self._request("GET", key, headers={"range": f"bytes={start}-{end}"}), timeout=300)[0]

    def put(self, key: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        _call(self._request("PUT", key, body, headers={"content-type": content_type}))

    def start_upload(self, key: str) -> str:
        """A multipart upload of ``key`` (S3 takes at most 5 GB in one PUT): its id."""
        found = re.search(rb"<UploadId>([^<]+)</UploadId>", _call(self._request("POST", key, query={"uploads": ""}))[0])
        if found is None:
            raise TransportError(f"no upload id for {key}")
        return found.group(1).decode()

    def put_part(self, key: str, upload: str, number: int, data: bytes) -> str:
        """Part ``number`` (from 1) of an upload: its token for :meth:`finish_upload`."""
        query = {"partNumber": str(number), "uploadId": upload}
        return _call(self._request("PUT", key, data, query=query), timeout=600)[1]["ETag"]

    def finish_upload(self, key: str, upload: str, parts: list[str]) -> None:
        """The object, from the parts' tokens in order; ``parts`` empty: the upload is abandoned."""
        if not parts:
            _call(self._request("DELETE", key, query={"uploadId": upload}))
            return
        body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{e}</ETag></Part>" for n, e in enumerate(parts, 1))
        done = _call(self._request("POST", key, f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode(),
                                   query={"uploadId": upload}, headers={"content-type": "application/xml"}))[0]
        if b"<Error>" in done:  # S3 may answer 200 with an error in the body
            raise TransportError(done[:300].decode("utf-8", "replace"))

    def read_secret(self, name: str) -> str:
        return read_parameter(name, self.region, self.endpoint_url, self.creds)

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
