"""A local compute whose capacity arrives late: some of a job's nodes start only once the job runs.

The local compute starts every node of a job at once, as if all the machines were there from the
beginning. The cloud gives GPU capacity in pieces (a launch for N instances may get fewer, and the
rest arrive minutes later: "Insufficient instance capacity", https://docs.aws.amazon.com/AWSEC2/latest/
UserGuide/troubleshooting-launch.html#troubleshooting-launch-capacity), which an elastic job
(``nodes=(min, max)``) is made for. :class:`LateNodesCompute` holds the nodes it is told to back until
the job's first ranks run (rank 0 reported progress, by default), then starts them as the local
compute does: real agents, the real rendezvous.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any, Callable

from prefect_sgpu.compute.base import Allocation, JobLaunch
from prefect_sgpu.compute.local import LocalProcessCompute


def first_rank_ran(allocation: Allocation) -> bool:
    """Rank 0 of the job reported progress (``runtime.progress``): the first round's ranks run."""
    return allocation.folder.path("progress/rank-0").exists()


class LateNodesCompute(LocalProcessCompute):
    """Local nodes where ``late`` ones start once ``ready(allocation)`` holds (polled every 0.1 s; at most
    ``wait_s`` seconds, then they start anyway)."""

    def __init__(self, late: set[int], ready: Callable[[Allocation], bool] = first_rank_ran,
                 wait_s: float = 120.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.late = set(late)
        self.ready = ready
        self.wait_s = wait_s
        #: node -> seconds after the others it was started
        self.started_late: dict[int, float] = {}

    def start(self, allocation: Allocation, launch: JobLaunch) -> None:
        now = [c for c in launch.commands if c.node not in self.late]
        later = [c for c in launch.commands if c.node in self.late]
        super().start(allocation, replace(launch, commands=now))
        if later:
            threading.Thread(target=self._start_later, args=(allocation, replace(launch, commands=later)),
                             daemon=True).start()

    def _start_later(self, allocation: Allocation, launch: JobLaunch) -> None:
        began = time.monotonic()
        while not self.ready(allocation) and time.monotonic() - began < self.wait_s:
            if allocation.released:
                return
            time.sleep(0.1)
        for command in launch.commands:
            self.started_late[command.node] = time.monotonic() - began
        super().start(allocation, launch)
