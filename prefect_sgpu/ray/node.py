"""The program every node of a ``@ray_launch`` job runs.

Node 0 starts a Ray head on the job's port, waits until every other node has
joined, then runs the user's function once as the Ray driver (the same rank entry
point as ``@distributed``, so logs, the result envelope and failures behave alike).
The other nodes join the head and wait until node 0 says the job is done. Every node
stops exactly its own Ray processes on the way out, and stops itself when the
driver's heartbeat goes stale.

Coordination goes through the job folder (``ray/head-up``, ``ray/node-<i>.joined``,
``ray/done``), as everything else between the driver and nodes does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prefect_sgpu.launch.node_agent import StopNode, watch_heartbeat, job_folder, node_main
from prefect_sgpu.ray.node_process import RAY_ENV, RayNodeProcess, RayNodeSpec, head_env, ray_ip
from prefect_sgpu.ray.token_auth import installed_ray_version, require_token_auth

POLL_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from prefect_sgpu.launch.node_agent import node_parser

    p = node_parser("prefect-sgpu-ray-node")
    p.add_argument("--gcs-endpoint", required=True, help="host:port of node 0's Ray GCS")
    p.add_argument("--node-ip", required=True)
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--num-gpus", type=int, default=None)
    p.add_argument("--heartbeat-ttl", type=float, default=0.0)
    p.add_argument("--join-timeout", type=float, default=600.0)
    p.add_argument("--metrics-to-mlflow", action="store_true")
    p.add_argument("--metrics-interval", type=float, default=5.0)
    p.add_argument("--shm-size", default="")
    p.add_argument("--runtime-env", default="", help="Ray's job config JSON for the driver's ray.init()")
    return p.parse_args(argv)


def _size_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def _private_dir(node_index: int) -> str:
    """A new folder for this node's Ray session: private (0700), unpredictable, short.

    Ray keeps its sockets, logs and session files in ``ray/`` under it. Ray makes every
    folder it uses world-writable (0777), the one it is given included, so that one is
    a child of this private folder: no other user can reach anything below it, and a
    fixed name in the shared temp folder could be taken over first. Short, because Ray
    puts unix sockets under it and their paths are limited to 107 bytes.
    """
    return tempfile.mkdtemp(prefix=f"sgpu-ray{node_index}-", dir=tempfile.gettempdir())


def _wait_for(paths: list[Path], timeout: float, what: str, give_up: Path | None = None) -> bool:
    """Wait until every path exists; False when ``give_up`` appears first."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if give_up is not None and give_up.exists():
            return False
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"{what}: still waiting for {missing} after {timeout:g}s")
        time.sleep(POLL_S)
    return True


def _cluster_token(payload_key: str) -> str:
    """This job's Ray auth token: derived from the job's key, so every node (and only they) has it."""
    from prefect_sgpu.protocol.jobfolder import derive_key

    return derive_key(payload_key, b"prefect-sgpu ray cluster token")


def _rank_env(gcs: str, runtime_env: str = "") -> dict[str, str]:
    """The driver process: rank 0 of a one-rank job (rank_main takes the payload key out). A job's
    ``runtime_env`` goes where ``ray job submit`` puts it, Ray's job-config variable, which ``ray.init()``
    merges with its own."""
    from prefect_sgpu.ray.runtime_env import JOB_CONFIG_ENV

    return {**os.environ, "RAY_ADDRESS": gcs, "SGPU_RAY_ADDRESS": gcs, "RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            **({JOB_CONFIG_ENV: runtime_env} if runtime_env else {})}


def _start_metrics(gcs: str, interval: float, job_dir: Path,
                   stop_file: Path) -> subprocess.Popen[bytes] | None:
    if not os.environ.get("MLFLOW_RUN_ID"):
        return None
    out = open(job_dir / "agent" / "ray-metrics.out", "ab")  # noqa: SIM115 - lives as long as the sampler
    env = {k: v for k, v in os.environ.items() if k != "SGPU_PAYLOAD_KEY"}
    return subprocess.Popen(
        [sys.executable, "-m", "prefect_sgpu.ray.metrics", f"--address={gcs}", f"--interval={interval:g}",
         f"--stop-file={stop_file}"],
        env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
    )


def _stop_child(proc: subprocess.Popen[Any] | None, grace: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _run_head(args: argparse.Namespace, node: RayNodeProcess, gcs: str, marks: Path) -> int:
    node.start(timeout=args.join_timeout)
    (marks / "head-up").write_text(gcs)
    _wait_for([marks / f"node-{i}.joined" for i in range(1, args.nnodes)], args.join_timeout,
              "nodes joining the Ray head")
    print(f"[sgpu-ray] all {args.nnodes} node(s) joined the Ray cluster at {gcs}", flush=True)
    sampler = (_start_metrics(gcs, args.metrics_interval, Path(args.job_dir), marks / "driver-done")
               if args.metrics_to_mlflow else None)
    driver = subprocess.Popen([sys.executable, "-u", "-m", "prefect_sgpu.launch.rank_main",
                               f"--run-id={args.run_id}"], env=_rank_env(gcs, args.runtime_env), stdin=subprocess.DEVNULL)
    try:
        while driver.poll() is None:
            if not node.alive():
                print("[sgpu-ray] the Ray head exited while the driver was running", file=sys.stderr, flush=True)
                _stop_child(driver)
                return 1
            time.sleep(POLL_S)
        return int(driver.returncode)
    finally:
        _stop_child(driver)
        (marks / "driver-done").write_text("done")  # the sampler takes its last sample and leaves
        if sampler is not None:
            try:
                sampler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _stop_child(sampler)
        (marks / "done").write_text("done")


def _run_worker(args: argparse.Namespace, node: RayNodeProcess, marks: Path) -> int:
    done = marks / "done"
    if not _wait_for([marks / "head-up"], args.join_timeout, "the Ray head", give_up=done):
        return 0
    node.start(timeout=args.join_timeout, should_stop=done.exists)
    (marks / f"node-{args.node_index}.joined").write_text(socket.gethostname())
    while not done.exists():
        if not node.alive():
            print("[sgpu-ray] this node's Ray processes exited before the job was done", file=sys.stderr,
                  flush=True)
            return 1
        time.sleep(POLL_S)
    return 0


def run(args: argparse.Namespace) -> int:
    job_dir = Path(args.job_dir)
    folder = job_folder(job_dir)
    if args.shm_size:  # our own PID + mount namespace: a private /dev/shm, as on a separate host,
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm_size}", "tmpfs", "/dev/shm"], check=True)
        # and a /proc that shows this namespace's pids (Ray looks its own processes up there)
        subprocess.run(["mount", "-t", "proc", "proc", "/proc"], check=True)
    if args.heartbeat_ttl > 0:
        threading.Thread(target=watch_heartbeat, args=(folder, args.heartbeat_ttl),
                         daemon=True).start()
    marks = job_dir / "ray"
    marks.mkdir(parents=True, exist_ok=True)
    # a cluster only this job's nodes and driver can join (token auth), whatever ~/.ray holds
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=_cluster_token(os.environ["SGPU_PAYLOAD_KEY"]))
    host, port = args.gcs_endpoint.rsplit(":", 1)
    head_ip = ray_ip(host, keep_loopback=args.nnodes == 1)
    gcs = f"{head_ip}:{port}"
    if args.node_index == 0:  # the driver and the sampler beside the head see what its processes see
        os.environ.update(RAY_ENV, **head_env(head_ip))
    private = _private_dir(args.node_index)
    spec = RayNodeSpec(
        node_ip=args.node_ip, temp_dir=os.path.join(private, "ray"), num_cpus=args.num_cpus,
        num_gpus=args.num_gpus, gcs_port=int(port) if args.node_index == 0 else None,
        head_address=None if args.node_index == 0 else gcs, single_node=args.nnodes == 1,
        # Ray sizes its object store from /dev/shm: keep it inside a private one
        object_store_memory=_size_bytes(args.shm_size) // 2 if args.shm_size else None,
    )
    env = {k: v for k, v in os.environ.items() if k != "SGPU_PAYLOAD_KEY"}
    node = RayNodeProcess(spec, env=env)
    status: dict[str, Any] = {"node": args.node_index, "host": socket.gethostname(), "exit_code": 0,
                              "failures": {}}
    try:
        require_token_auth(installed_ray_version())  # an older Ray ignores RAY_AUTH_MODE: no auth at all
        if args.node_index == 0:
            code = _run_head(args, node, gcs, marks)
            if code:
                status["failures"]["0"] = {"exit_code": code, "signal": None, "local_rank": 0}
        else:
            code = _run_worker(args, node, marks)
        status["exit_code"] = code
    except StopNode as exc:
        status.update(exit_code=143, stopped=f"signal {exc}")
    except Exception as exc:  # noqa: BLE001 - a node that cannot start or join ends the job
        status.update(exit_code=2, error=f"{type(exc).__name__}: {exc}")
        print(f"[sgpu-ray] node {args.node_index}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish stopping Ray before leaving
        node.stop()
    if status["exit_code"] == 0:
        shutil.rmtree(private, ignore_errors=True)
    else:
        print(f"[sgpu-ray] Ray's own logs of this node stay in {spec.temp_dir}", file=sys.stderr, flush=True)
    from prefect_sgpu.protocol.jobfolder import NodeStatus

    folder.put_status(args.node_index, NodeStatus(**status))
    return int(status["exit_code"])


def main(argv: list[str] | None = None) -> int:
    return node_main(parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
