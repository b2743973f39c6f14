"""Where jobs run: one contract (:mod:`prefect_sgpu.compute.base`), one module per compute.

- ``local``: local processes, the embedded default (one node agent per simulated node);
- ``ec2``: GPU instances per job on AWS EC2, driven through an S3 store;
- ``ray``: an existing Ray cluster, each job one Ray Train run.
"""

from prefect_sgpu.compute.base import (SECRET_ENV, AllocatedNode, Allocation, Compute, Event, JobLaunch, NodeCommand,
                                       NodeExited, NodeLost, NodeNotice, NodeUp, Released, Request,
                                       node_base_environment)

__all__ = [
    "SECRET_ENV", "AllocatedNode", "Allocation", "Compute", "Event", "JobLaunch", "NodeCommand", "NodeExited",
    "NodeLost", "NodeNotice", "NodeUp", "Released", "Request", "node_base_environment",
]
