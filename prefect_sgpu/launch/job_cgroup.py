"""A cgroup of its own for each job a node serves: every process of the job ends with it.

A node's bootstrap kills what a job left by walking its own descendants (it is a child
subreaper, so orphans come back to it). A walk is a snapshot: a process that forks while it is
taken, or one that keeps forking new children and exiting, can outlive it. A cgroup cannot be
outrun. Before a job's node agent starts, the bootstrap makes a cgroup (v2) for the job below
its own, and the agent enters it before it runs anything (a cold agent through a shell that
writes its own pid into ``cgroup.procs`` and then execs; an agent forked by the lease's warm
node writes its pid right after the fork). Every process the job starts is born in it. When
the job ends, one write to ``cgroup.kill`` (Linux 5.14) ends them all at once, forks in flight
included, and the empty cgroup is removed. On an older kernel its processes are killed, read
from ``cgroup.procs``, until none is left.

Only where the node can: root, and a cgroup v2 hierarchy it may write (Amazon Linux 2023,
Ubuntu 22.04 and later, and the Deep Learning AMIs built on them; Amazon Linux 2 mounts only
cgroup v1). Elsewhere the bootstrap says why once and kills by its walk alone, as before. A process of the job that moves itself to
another cgroup (it runs as root) leaves it; one that asks systemd to start a unit never was in
it (``docs/security.md``).

Standard library only: it runs in the node's bootstrap.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

#: where the cgroup v2 hierarchy is mounted when /proc/self/mountinfo cannot say
DEFAULT_ROOT = Path("/sys/fs/cgroup")


def cgroup2_root(mountinfo: str = "/proc/self/mountinfo") -> Path | None:
    """The mount point of the cgroup v2 hierarchy (``/sys/fs/cgroup``, or ``.../unified`` on a hybrid host)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[1].split(" ", 1)[0] == "cgroup2":
            return Path(fields[0].split(" ")[4].replace("\\040", " "))
    return None


def own_cgroup(proc: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 path ("/system.slice/cloud-final.service"), from its ``0::`` line."""
    try:
        for line in Path(proc).read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None


class JobCgroup:
    """One job's cgroup: ``command`` puts a new process in it, ``join`` the calling one, ``kill`` ends it."""

    def __init__(self, path: "Path | str") -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"JobCgroup({str(self.path)!r})"

    @classmethod
    def create(cls, name: str) -> "tuple[JobCgroup | None, str]":
        """A new cgroup ``name`` below this process's own; (None, why) where the node cannot make one."""
        if not name or name.startswith(".") or any(not (c.isalnum() or c in "-_.") for c in name):
            return None, f"{name!r} is not a plain cgroup name"
        if os.geteuid() != 0:
            return None, "the bootstrap does not run as root"
        root, own = cgroup2_root(), own_cgroup()
        if root is None or own is None:
            return None, "this machine has no cgroup v2 hierarchy"
        path = root / own.lstrip("/") / name
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:  # a crashed bootstrap's, of the same job and node: end what is in it
            made = cls(path)
            made.kill()
            try:
                path.mkdir(mode=0o755)
            except OSError as exc:
                return None, f"{path}: {exc}"
        except OSError as exc:
            return None, f"{path}: {exc}"
        return cls(path), ""

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def command(self, argv: list[str]) -> list[str]:
        """``argv``, started in this cgroup: a shell writes its own pid into it and execs ``argv``."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs), *argv]

    def join(self) -> None:
        """Move the calling process (and what it starts from now on) into this cgroup."""
        with open(self.procs, "w") as fh:
            fh.write(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.procs.read_text().split()]
        except (OSError, ValueError):
            return []

    def populated(self) -> bool:
        try:
            for line in (self.path / "cgroup.events").read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] != "0"
        except OSError:
            return False
        return bool(self.pids())

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL every process in the cgroup, wait until it is empty, remove it; how many there were.

        Idempotent; a cgroup that could not be emptied within ``timeout`` is left (and said so by
        :attr:`path` still existing)."""
        if not self.path.exists():
            return 0
        found = len(self.pids())
        deadline = time.monotonic() + timeout
        kill_file = self.path / "cgroup.kill"
        while self.populated() and time.monotonic() < deadline:
            if kill_file.exists():
                try:
                    kill_file.write_text("1")
                except OSError:
                    pass
            else:  # before Linux 5.14: by pid, again while new ones appear
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.01)
        while time.monotonic() < deadline:
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # busy for a moment after its last process exited
                time.sleep(0.02)
        return found
