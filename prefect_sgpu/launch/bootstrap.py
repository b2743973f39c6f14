"""What an EC2 node runs at boot: the bridge between the S3 store and the node agent.

The instance's user-data is a few lines of shell that start this program; it holds
no credentials (the instance profile grants S3, SSM and ``ec2:TerminateInstances``
on itself) and no payload key. The program:

1. learns who it is from IMDSv2 (instance id, AMI launch index = node index, private IP;
   ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` points it elsewhere, as botocore honours it);
2. announces itself (``nodes/node-<i>.alive``, refreshed while it lives) and waits for
   its launch document (``nodes/node-<i>.launch.json``), written by the driver once
   every node is up: the node agent's argv and environment;
3. reads the payload signing key from the SSM SecureString parameter the document
   names (the key is never at rest in S3 in plain text), downloads the payload into a
   local job folder and runs the unchanged node agent against that folder;
4. in a loop, uploads rank logs (each grown log is re-uploaded whole: S3 objects cannot
   be appended to), result envelopes and finally the node's status, and copies the
   driver's heartbeat down;
5. obeys a ``stop`` marker from the driver, and when the driver's heartbeat has not
   changed for ``--heartbeat-ttl`` seconds (the driver died) stops the agent and
   terminates its own instance, so a dead driver cannot leak paid VMs.

Staleness is measured on this node's monotonic clock (how long the heartbeat *value*
has not changed), so clock skew between the driver and the node does not matter.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect_sgpu.launch.processes import kill_and_reap

DEFAULT_IMDS = "http://169.254.169.254/"
IMDS_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # the variable botocore itself honours
NODE_DIR_ENV = "PREFECT_SGPU_NODE_DIR"
STOP_KEY = "stop"


def alive_key(index: int) -> str:
    return f"nodes/node-{index}.alive"


def launch_key(index: int) -> str:
    return f"nodes/node-{index}.launch.json"


def status_key(index: int) -> str:
    return f"nodes/node-{index}.json"


def render_user_data(
    store_uri: str,
    run_id: str,
    region: str,
    heartbeat_ttl: float,
    endpoint_url: str | None = None,
    python: str = "python3",
    setup: str = "",
) -> str:
    """The instance's user-data: a short shell script, with no credential in it.

    ``setup`` (shell lines, e.g. installing prefect-sgpu into the AMI's Python) runs first.
    """
    argv = [python, "-m", "prefect_sgpu.launch.bootstrap", f"--store={store_uri}", f"--run-id={run_id}",
            f"--region={region}", f"--heartbeat-ttl={heartbeat_ttl:g}"]
    if endpoint_url:
        argv.append(f"--endpoint-url={endpoint_url}")
    lines = [
        "#!/bin/bash",
        "# prefect-sgpu node: S3 access comes from the instance profile; nothing secret here",
        "set -euo pipefail",
        "export PYTHONUNBUFFERED=1",
        *([setup.strip()] if setup.strip() else []),
        "exec " + shlex.join(argv),
    ]
    return "\n".join(lines) + "\n"


# --- identity from IMDSv2 ----------------------------------------------------------


@dataclass(frozen=True)
class NodeIdentity:
    instance_id: str
    launch_index: int
    private_ip: str


def _imds_base() -> str:
    return os.environ.get(IMDS_ENV, DEFAULT_IMDS).rstrip("/") + "/"


def _imds_token(base: str, timeout: float) -> str:
    request = urllib.request.Request(
        base + "latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def _imds_get(base: str, token: str, path: str, timeout: float) -> str:
    request = urllib.request.Request(
        base + "latest/meta-data/" + path, headers={"X-aws-ec2-metadata-token": token}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode().strip()


def fetch_identity(attempts: int = 30, timeout: float = 2.0) -> NodeIdentity:
    """Instance id, launch index and private IP from IMDSv2 (token PUT, then GETs)."""
    base = _imds_base()
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            token = _imds_token(base, timeout)
            return NodeIdentity(
                instance_id=_imds_get(base, token, "instance-id", timeout),
                launch_index=int(_imds_get(base, token, "ami-launch-index", timeout)),
                private_ip=_imds_get(base, token, "local-ipv4", timeout),
            )
        except (OSError, ValueError) as exc:  # the metadata service may lag right after boot
            last = exc
            time.sleep(min(0.2 * (attempt + 1), 2.0))
    raise RuntimeError(f"instance metadata service at {base} did not answer: {last}")


# --- the node ------------------------------------------------------------------------


def _log(message: str) -> None:
    print(f"[sgpu-bootstrap] {message}", flush=True)


class NodeBootstrap:
    """One node's life: announce, wait for the launch document, run the agent, sync, clean up."""

    def __init__(
        self,
        store: Any,
        run_id: str,
        identity: NodeIdentity,
        node_dir: Path,
        heartbeat_ttl: float,
        region: str | None = None,
        endpoint_url: str | None = None,
        interval: float = 1.0,
        grace: float = 10.0,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.identity = identity
        self.index = identity.launch_index
        self.job_dir = node_dir / run_id
        self.heartbeat_ttl = heartbeat_ttl
        self.region = region
        self.endpoint_url = endpoint_url
        self.interval = interval
        self.grace = grace
        self.phase = "waiting"
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._beat_value: bytes | None = None
        self._beat_seen = time.monotonic()
        self._alive_seq = 0
        self._alive_at = 0.0
        self._key_parameter: str | None = None
        self._agent: subprocess.Popen[bytes] | None = None
        self._error_logged = 0.0

    # -- store helpers ----------------------------------------------------------

    def _client(self, service: str) -> Any:
        from prefect_sgpu.store_s3 import s3_client

        return s3_client(region=self.region, endpoint_url=self.endpoint_url, service=service)

    def publish_alive(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._alive_at < max(self.interval * 2, 1.0):
            return
        self._alive_at = now
        self._alive_seq += 1
        doc = {"instance_id": self.identity.instance_id, "private_ip": self.identity.private_ip,
               "node": self.index, "phase": self.phase, "seq": self._alive_seq, "time": time.time(),
               "host": socket.gethostname()}
        self.store.put(self.run_id, alive_key(self.index), json.dumps(doc).encode())

    def _store_error(self, what: str, exc: Exception) -> None:
        """Store calls in the loop may fail for a while (botocore already retried): try again next
        tick. The heartbeat TTL bounds how long: a driver unreachable that long counts as gone."""
        now = time.monotonic()
        if now - self._error_logged > 30.0:
            self._error_logged = now
            _log(f"{what} failed, retrying: {type(exc).__name__}: {exc}")

    def heartbeat_stale(self) -> bool:
        """Has the driver's heartbeat not changed for ``heartbeat_ttl`` seconds (node clock)?"""
        try:
            value = self.store.get(self.run_id, "heartbeat")
        except Exception as exc:  # noqa: BLE001 - no news is not a change
            self._store_error("reading the driver's heartbeat", exc)
            value = self._beat_value
        now = time.monotonic()
        if value != self._beat_value:
            self._beat_value = value
            self._beat_seen = now
            if value is not None:  # the agent's own watch reads this file, in this node's clock
                from prefect_sgpu.store import atomic_write

                atomic_write(self.job_dir / "heartbeat", f"{time.time():.3f}".encode())
        return self.heartbeat_ttl > 0 and now - self._beat_seen > self.heartbeat_ttl

    def stop_requested(self) -> bool:
        try:
            return self.store.get(self.run_id, STOP_KEY) is not None
        except Exception as exc:  # noqa: BLE001
            self._store_error("reading the stop marker", exc)
            return False

    # -- phases -----------------------------------------------------------------

    def wait_for_launch(self) -> dict[str, Any] | None:
        """The launch document, or None when the driver stopped the job or went away."""
        while True:
            raw = None
            try:
                self.publish_alive()
                raw = self.store.get(self.run_id, launch_key(self.index))
            except Exception as exc:  # noqa: BLE001
                self._store_error("reading the launch document", exc)
            if raw:
                doc: dict[str, Any] = json.loads(raw)
                if doc.get("instance_id") not in (None, self.identity.instance_id):
                    raise RuntimeError(
                        f"launch document for node {self.index} names instance {doc['instance_id']}, "
                        f"this is {self.identity.instance_id}"
                    )
                return doc
            if self.stop_requested():
                return None
            if self.heartbeat_stale():
                return None
            time.sleep(self.interval)

    def payload_key(self, doc: dict[str, Any]) -> str | None:
        name = doc.get("payload_key_parameter")
        if not name:
            return None
        self._key_parameter = name
        response = self._client("ssm").get_parameter(Name=name, WithDecryption=True)
        return str(response["Parameter"]["Value"])

    def prepare(self, doc: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """Local job folder with the payload; the agent's argv and env pointed at it."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        blob = self.store.get(self.run_id, "payload.bin")
        if blob is None:
            raise RuntimeError(f"payload.bin of job {self.run_id} is not in the store")
        from prefect_sgpu.store import atomic_write

        atomic_write(self.job_dir / "payload.bin", blob)
        self.heartbeat_stale()
        argv = [f"--job-dir={self.job_dir}" if a.startswith("--job-dir=") else a for a in doc["argv"]]
        if len(argv) > 2 and argv[1] == "-m":  # the driver's interpreter path means nothing here
            argv[0] = sys.executable
        env = {**os.environ, **{str(k): str(v) for k, v in doc.get("env", {}).items()},
               "SGPU_JOB_DIR": str(self.job_dir), "SGPU_RUN_ID": self.run_id}
        key = self.payload_key(doc)
        if key is not None:
            env["SGPU_PAYLOAD_KEY"] = key
        return argv, env

    def start_agent(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = self.job_dir / "agent" / f"node-{self.index}.out"
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "ab") as fh:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    # -- syncing ----------------------------------------------------------------

    def _upload_if_changed(self, path: Path, key: str) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        mark = (st.st_size, st.st_mtime_ns)
        if self._uploaded.get(key) == mark:
            return
        self.store.put(self.run_id, key, path.read_bytes())
        self._uploaded[key] = mark

    def sync_up(self) -> None:
        """Logs first, then envelopes: a reader that sees an envelope also sees its log."""
        for kind, pattern in (("logs", "rank-*.log"), ("results", "rank-*.bin")):
            folder = self.job_dir / kind
            if folder.is_dir():
                for path in sorted(folder.glob(pattern)):
                    self._upload_if_changed(path, f"{kind}/{path.name}")
        self._upload_if_changed(self.job_dir / "agent" / f"node-{self.index}.out",
                                f"agent/node-{self.index}.out")

    def finish(self, code: int | None, reason: str | None = None) -> None:
        """Final sync, then the node's status (last: the driver reads results once it sees it)."""
        self.sync_up()
        path = self.job_dir / status_key(self.index)
        if path.is_file():
            status = json.loads(path.read_text())
        else:
            status = {"node": self.index, "host": socket.gethostname(), "exit_code": code or 1,
                      "failures": {}, "error": reason or f"node agent exited with code {code} and no status"}
        status.setdefault("instance_id", self.identity.instance_id)
        self.store.put(self.run_id, status_key(self.index), json.dumps(status).encode())

    def sync_quietly(self) -> None:
        """One tick's uploads (logs, envelopes, alive); a failure waits for the next tick."""
        try:
            self.sync_up()
            self.publish_alive()
        except Exception as exc:  # noqa: BLE001
            self._store_error("uploading logs and results", exc)

    def finish_reliably(self, code: int | None, reason: str | None = None) -> bool:
        """The node's outcome must reach the driver: retry until it does or the driver is gone."""
        while True:
            try:
                self.finish(code, reason)
                return True
            except Exception as exc:  # noqa: BLE001
                self._store_error("uploading the node's outcome", exc)
            if self.heartbeat_stale():
                return False
            time.sleep(self.interval)

    def stop_agent(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM the agent (it stops its ranks), ``grace`` seconds, then SIGKILL what is left."""
        import psutil

        if proc.poll() is not None:
            return
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        proc.terminate()
        _, alive = psutil.wait_procs(tree, timeout=self.grace)
        kill_and_reap(alive)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def terminate_self(self, reason: str) -> int:
        """The driver is gone: delete the job's key parameter and terminate this instance."""
        _log(f"{reason}: terminating instance {self.identity.instance_id}")
        self.phase = "terminating"
        try:
            self.publish_alive(force=True)
        except Exception:  # noqa: BLE001 - termination matters more than the notice
            pass
        if self._key_parameter and self.index == 0:
            try:
                self._client("ssm").delete_parameter(Name=self._key_parameter)
            except Exception:  # noqa: BLE001 - the parameter may already be gone
                pass
        self._client("ec2").terminate_instances(InstanceIds=[self.identity.instance_id])
        return 0

    def crashed(self, exc: BaseException) -> int:
        """This program failed: tell the driver (the job fails now, not at its timeout), power off."""
        import traceback

        _log(f"bootstrap failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if self._agent is not None:
            self.stop_agent(self._agent)
        try:
            status = {"node": self.index, "host": socket.gethostname(), "exit_code": 2, "failures": {},
                      "error": f"node bootstrap failed: {type(exc).__name__}: {exc}",
                      "instance_id": self.identity.instance_id}
            self.store.put(self.run_id, status_key(self.index), json.dumps(status).encode())
        except Exception:  # noqa: BLE001 - the store may be what failed
            pass
        try:
            return self.terminate_self("node bootstrap failed") or 2
        except Exception:  # noqa: BLE001 - the driver's release terminates the instance
            return 2

    # -- the whole life ---------------------------------------------------------

    def run(self) -> int:
        me = self.identity
        _log(f"node {self.index} ({me.instance_id}, {me.private_ip}) of job {self.run_id}")
        self.publish_alive(force=True)
        doc = self.wait_for_launch()
        if doc is None:
            if self.stop_requested():
                _log("the driver stopped the job before this node was started")
                return self.watch_until_gone()
            return self.terminate_self(f"driver heartbeat unchanged for {self.heartbeat_ttl:g}s")
        argv, env = self.prepare(doc)
        self.phase = "running"
        proc = self._agent = self.start_agent(argv, env)
        _log(f"node agent started (pid {proc.pid})")
        self.publish_alive(force=True)
        while True:
            code = proc.poll()
            if code is not None:
                _log(f"node agent exited with code {code}")
                if not self.finish_reliably(code):
                    return self.terminate_self(f"driver heartbeat unchanged for {self.heartbeat_ttl:g}s")
                self.phase = "finished"
                return self.watch_until_gone()
            self.sync_quietly()
            if self.stop_requested():
                _log("stop requested by the driver")
                self.stop_agent(proc)
                if not self.finish_reliably(proc.poll(), "stopped by the driver"):
                    return self.terminate_self(f"driver heartbeat unchanged for {self.heartbeat_ttl:g}s")
                self.phase = "stopped"
                return self.watch_until_gone()
            if self.heartbeat_stale():
                self.stop_agent(proc)
                try:  # what the ranks left, for whoever looks later
                    self.finish(proc.poll(), "driver heartbeat went stale")
                except Exception as exc:  # noqa: BLE001
                    self._store_error("uploading the node's outcome", exc)
                return self.terminate_self(f"driver heartbeat unchanged for {self.heartbeat_ttl:g}s")
            time.sleep(self.interval)

    def watch_until_gone(self) -> int:
        """The work is done; the driver terminates this instance. If it never does, do it."""
        while True:
            try:
                self.publish_alive()
            except Exception as exc:  # noqa: BLE001
                self._store_error("announcing this node", exc)
            if self.heartbeat_stale():
                return self.terminate_self(f"driver heartbeat unchanged for {self.heartbeat_ttl:g}s")
            time.sleep(self.interval)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefect-sgpu-bootstrap")
    p.add_argument("--store", required=True, help="s3://bucket/prefix of the job store")
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--heartbeat-ttl", type=float, default=900.0)
    p.add_argument("--interval", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from prefect_sgpu.store import default_home
    from prefect_sgpu.store_s3 import S3Store

    args = parse_args(argv)
    identity = fetch_identity()
    store = S3Store(args.store, region=args.region, endpoint_url=args.endpoint_url)
    node_dir = Path(os.environ.get(NODE_DIR_ENV) or default_home() / "node-jobs")
    node = NodeBootstrap(store, args.run_id, identity, node_dir, args.heartbeat_ttl, region=args.region,
                         endpoint_url=args.endpoint_url, interval=args.interval)
    try:
        return node.run()
    except Exception as exc:  # noqa: BLE001 - without this program nobody watches the node
        return node.crashed(exc)


if __name__ == "__main__":
    sys.exit(main())
