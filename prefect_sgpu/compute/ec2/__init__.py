"""GPU VMs on EC2, one role per module.

- ``settings``: the block's fields, validated before any call (``EC2Settings``);
- ``request``: the pure request builder (``run_instances`` request, tags, user-data);
- ``instances``: the provisioner, EC2's provider (clients, job keys in SSM, cost), put together from
  ``gang_launch`` (gang launch with AZ/market failover, the wait for "running"), ``describe``
  (instance states), ``cleanup`` (terminate, groups) and ``leftovers`` (what the sweeper removes);
- ``roles``: a role of its own per job; ``doctor``: the account checks before a first job;
- ``compute``: the compute contract on top of them (job folder messages through S3).

The node side (what the instances run) is :mod:`prefect_sgpu.launch.bootstrap`.
"""
