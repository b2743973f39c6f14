"""The remote-node wing, driver half: what any compute whose nodes are machines of their own shares.

- ``lease``: a warm lease, nodes kept between jobs of the same shape and handed the next
  job through the store;
- ``sweep``: the sweeper, which removes what a dead driver left in the store and the cloud.

The node half is :mod:`prefect_sgpu.launch.bootstrap` over a :mod:`~prefect_sgpu.launch.node_host`.
"""
