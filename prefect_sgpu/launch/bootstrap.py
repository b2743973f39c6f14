"""What a remote node runs at boot (``python -m prefect_sgpu.launch.bootstrap``): the bridge between the store and the node agent.

This module is the command line: it opens the node host its ``--host`` names
(:func:`prefect_sgpu.launch.node_host.open_host`) and the store its ``--store`` URL names
(:func:`prefect_sgpu.store.open_store`), then runs
:class:`prefect_sgpu.launch.node_bootstrap.NodeBootstrap` (the protocol over the store, in
parts: :mod:`~prefect_sgpu.launch.node_job`, :mod:`~prefect_sgpu.launch.node_sync`,
:mod:`~prefect_sgpu.launch.node_liveness`). What it asks of the cloud (who am I, read a
secret, is a reclaim notice out, end this machine) goes through the node host. On EC2
(``--host ec2``, :mod:`prefect_sgpu.launch.ec2_host`) the
instance's user-data is a few lines of shell that start this program; it holds
no credentials (the instance profile grants S3, SSM and ``ec2:TerminateInstances``
on itself) and no key. The program:

1. learns who it is from its node host (on EC2, IMDSv2: instance id, AMI launch index =
   node index, private IP);
2. reads the job key from the secret whose name it derives from its own ``--run-id``
   (:func:`prefect_sgpu.protocol.jobfolder.ssm_key_parameter`; never from a document), waiting for it
   at most ``--heartbeat-ttl`` seconds;
3. announces itself (a sealed ``nodes/node-<i>.alive``, refreshed while it lives by a thread of
   its own, so that no upload, however slow, holds it back past the driver's ``node_silence_s``;
   silent in a folder once it wrote its status there) and waits for its launch document,
   written by the driver once every node is up. Only a document sealed with the job key
   *and bound to this node index and this instance id* is run; anything else (unsigned,
   another job's, node 1's copied to node 0's key, bound to no instance) is refused with a
   log line and waited past: whoever can write the store can delay a node, never run code on it;
4. copies the payload into a local job folder (the ranks verify it) and runs the
   node agent against that folder, with the job key in its environment;
5. in a loop, ships what rank logs, metric files and its agent's output gained since the
   last tick as appended pieces (``Store.append``: re-uploading a growing log whole ships its
   size on every tick), writes each whole once at the end, uploads sealed result envelopes, copies the driver's sealed heartbeat
   down verbatim (the agent verifies it too), and finally re-seals the agent's status
   bound to this instance;
6. watches the host for a reclaim notice (on EC2 a spot interruption or a rebalance
   recommendation): it tells the ranks (the ``preempt`` file ``runtime.preemption_requested()``
   reads; a ``Checkpointer`` saves at once) and the driver (a sealed ``nodes/node-<i>.notice``),
   which relaunches the job on new capacity once this node is gone;
7. obeys a sealed ``stop`` from the driver for its own gang (``--gang``: the relaunch it
   belongs to; a lost gang's stop written back after a relaunch is refused), and when no *new*
   heartbeat (a higher sequence number under a valid seal) has arrived for ``--heartbeat-ttl``
   seconds (the driver died) stops the agent and terminates its own instance, so a dead driver
   cannot leak paid VMs. Staleness is measured on this node's monotonic clock: clock skew
   does not matter, and a forged or replayed heartbeat keeps nothing alive.

With ``--lease`` the machine serves a warm lease's jobs one after another
(:mod:`prefect_sgpu.launch.lease_node`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefect_sgpu.launch.node_bootstrap import NodeBootstrap
from prefect_sgpu.launch.node_host import DEFAULT_HOST, HOSTS, NodeIdentity, open_host
from prefect_sgpu.launch.node_job import KEY_ENV
from prefect_sgpu.store import open_store
from prefect_sgpu.launch.node_sync import PROGRESS_UPLOAD_S
from prefect_sgpu.procs.processes import node_log as _log

__all__ = ["KEY_ENV", "NODE_DIR_ENV", "PROGRESS_UPLOAD_S", "NodeBootstrap", "NodeIdentity", "main", "parse_args"]

NODE_DIR_ENV = "PREFECT_SGPU_NODE_DIR"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="prefect-sgpu-bootstrap")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"the node host: one of {sorted(HOSTS)}, or a 'module:Class' (default: {DEFAULT_HOST})")
    p.add_argument("--store", required=True, help="URL of the job store (s3://bucket/prefix, a folder)")
    p.add_argument("--run-id", required=True)
    p.add_argument("--region", default=None)
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--store-kms-key", default=None, help="KMS key of the store's objects (SSE-KMS)")
    p.add_argument("--bucket-owner", default=None, help="account id that must own the store's bucket")
    p.add_argument("--heartbeat-ttl", type=float, default=900.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--lease", action="store_true",
                   help="the instance belongs to a warm lease (--run-id is the lease's id): serve its assigned jobs")
    p.add_argument("--gang", type=int, default=0,
                   help="which gang of the job the instance serves (a relaunch: 1, 2, ...); only its stop is obeyed")
    p.add_argument("--node-index", type=int, default=None,
                   help="the node this instance replaces (launched alone after a loss); default: its launch index")
    p.add_argument("--backstop-marker", default=None,
                   help="created once this program has taken over from the user-data's backstop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from prefect_sgpu.store import default_home

    args = parse_args(argv)
    host = open_host(args.host, region=args.region, endpoint_url=args.endpoint_url)
    node: NodeBootstrap | None = None
    try:
        identity = host.identity()
        store = open_store(args.store, region=args.region, endpoint_url=args.endpoint_url,
                           kms_key_id=args.store_kms_key, bucket_owner=args.bucket_owner)
        node_dir = Path(os.environ.get(NODE_DIR_ENV) or default_home() / "node-jobs")
        node = NodeBootstrap(store, args.run_id, identity, node_dir, args.heartbeat_ttl, interval=args.interval,
                             lease=args.lease, host=host, gang=args.gang,
                             node_index=args.node_index)
        if args.backstop_marker:
            Path(args.backstop_marker).touch()  # from here on this program watches the node
        return node.run()
    except Exception as exc:  # noqa: BLE001 - without this program nobody watches the node
        if node is None:
            import traceback

            _log(f"bootstrap failed before it knew its instance: {type(exc).__name__}: {exc}\n"
                 f"{traceback.format_exc()}")
            return host.power_off("no identity, no way to terminate through the API")
        code = node.crashed(exc)
        if not node.terminated:  # crashed() could not terminate the instance through the API
            return host.power_off("termination through the API failed")
        return code


if __name__ == "__main__":
    sys.exit(main())
