"""Process plumbing that the driver side (``compute/``) and the node side (``launch/``) share.

Neither side owns it: the local compute is a driver that starts node processes on its own
machine, and a remote lease node starts warm nodes the same way, so both need the same
process helpers, the same channel to a warm node and the same wire format to the agent
template. Keeping them here lets ``compute/`` stay free of imports from ``launch/``.
"""
