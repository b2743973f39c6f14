"""The fake cloud's node host, and the program its machines boot.

A fake machine is a local process (in a PID namespace of its own where the kernel allows, so
that ending it ends everything it started, as terminating a VM does). It runs the real node
half, :class:`prefect_sgpu.launch.bootstrap.NodeBootstrap`, over a local job store; what the
bootstrap asks of the cloud goes through :class:`FakeNodeHost`: its identity from the command
line, secrets from files the provider writes, reclaim notices from a file the test writes, and
terminate or power-off by killing its own machine.

Run as ``python -m support.fake_node_host --store DIR --run-id ID --machine-id M --index I
--address A --secrets DIR --node-dir DIR [--lease] [--gang N]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from support.fake_stage import secret_path

from prefect_sgpu.launch.node_host import NodeIdentity

__all__ = ["FakeNodeHost", "main", "secret_path"]


class FakeNodeHost:
    """The fake cloud as one node sees it (the guarantees of :mod:`prefect_sgpu.launch.node_host`)."""

    def __init__(self, identity: NodeIdentity, secrets: Path, machine_dir: Path) -> None:
        self._identity = identity
        self.secrets = secrets
        self.machine_dir = machine_dir

    def identity(self) -> NodeIdentity:
        return self._identity

    def read_secret(self, name: str) -> str:
        return secret_path(self.secrets, name).read_text()  # FileNotFoundError until the driver wrote it

    def delete_secret(self, name: str) -> None:
        secret_path(self.secrets, name).unlink(missing_ok=True)

    def reclaim_notice(self) -> str | None:
        notice = self.machine_dir / "notice"
        return notice.read_text() if notice.exists() else None

    def rebalance_notice(self) -> str | None:
        """A rebalance recommendation the test wrote (``rebalance``): a warning, never a reclaim."""
        advice = self.machine_dir / "rebalance"
        return advice.read_text() if advice.exists() else None

    def terminate(self, identity: NodeIdentity) -> None:
        (self.machine_dir / "terminated").write_text("terminated through the API\n")
        self._end()

    def power_off(self, reason: str) -> int:
        (self.machine_dir / "terminated").write_text(f"powered off: {reason}\n")
        self._end()
        return 1

    def error_text(self, exc: BaseException) -> str:
        return type(exc).__name__

    @staticmethod
    def _end() -> None:
        """Every process of this machine dies at once: its process group, and in a PID namespace of its
        own (this program is the namespace's init there) the kernel kills the rest with it."""
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _image_versions() -> None:
    """An image with other versions than the driver's (``SGPU_FAKE_IMAGE_VERSIONS``, JSON): what this
    machine reports is what such an image's interpreter would."""
    import json

    from prefect_sgpu.protocol import versions

    other = json.loads(os.environ.get("SGPU_FAKE_IMAGE_VERSIONS") or "{}")
    if other:
        real = versions.runtime_versions()
        versions.runtime_versions = lambda: {**real, **other}  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    _image_versions()
    from prefect_sgpu.launch.bootstrap import NodeBootstrap
    from prefect_sgpu.store import LocalStore

    p = argparse.ArgumentParser()
    for name in ("--store", "--run-id", "--machine-id", "--address", "--secrets", "--node-dir", "--machine-dir"):
        p.add_argument(name, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--heartbeat-ttl", type=float, default=30.0)
    p.add_argument("--lease", action="store_true")
    p.add_argument("--gang", type=int, default=0)
    args = p.parse_args(argv)
    identity = NodeIdentity(args.machine_id, args.index, args.address)
    host = FakeNodeHost(identity, Path(args.secrets), Path(args.machine_dir))
    node = NodeBootstrap(LocalStore(args.store), args.run_id, identity, Path(args.node_dir), args.heartbeat_ttl,
                         interval=0.5, lease=args.lease, host=host, gang=args.gang)
    try:
        return node.run()
    except Exception as exc:  # noqa: BLE001 - as the real bootstrap: report, then end the machine
        code = node.crashed(exc)
        if not node.terminated:
            return host.power_off("termination through the API failed")
        return code


if __name__ == "__main__":
    sys.exit(main())
