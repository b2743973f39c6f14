"""The channel between a driver and its agent template process.

The driver holds the template's one channel, a ``SOCK_SEQPACKET`` socket (the template's
stdin), one JSON object a message::

    -> {"op": "launch", "id": "...", "argv": [...], "env": {...}, "cwd": "...", "out": "...",
        "namespaces": false}              with the node's GPU lease descriptors attached
    <- {"ready": pid}   {"started": pid, "id": "..."}   {"exited": code, "pid": pid}
    end of file (the driver closed it, or died): the template exits.

The driver's end is :mod:`prefect_sgpu.compute.agent_template`; the template process is
:mod:`prefect_sgpu.launch.agent_template`. Both size their messages by :data:`MAX_MESSAGE`.
"""

#: the largest launch message (its environment, mostly); a larger one starts its agent with exec
MAX_MESSAGE = 1 << 20
