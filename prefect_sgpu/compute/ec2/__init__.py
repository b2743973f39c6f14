"""GPU VMs on EC2, one role per module.

- ``settings``: the block's fields, validated before any call (``EC2Settings``);
- ``request``: the pure request builder (``run_instances`` request, tags, user-data);
- ``instances``: instance lifecycle (gang launch with AZ/market failover, waits, teardown, cost);
- ``compute``: the compute contract on top of them (job folder messages through S3).

The node side (what the instances run) is :mod:`prefect_sgpu.launch.bootstrap`.
"""
