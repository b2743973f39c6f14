"""The c10d rendezvous of a job's node agents: torch elastic's, listening on the node's own address only.

torch elastic's c10d backend has node 0's agent create the rendezvous ``TCPStore``, and its
dynamic rendezvous has whichever agent becomes rendezvous rank 0 create a second one, the store
the workers' process groups bootstrap from (``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``). A ``TCPStore`` server listens on every interface whatever host
it is given, and torch elastic unpickles the rendezvous state the first one holds. So here:

- node 0's agent binds the rendezvous socket itself to (its address, the rendezvous port) and
  hands it to a ``TCPStore`` server (``master_listen_fd``) that it keeps for the job
  (:func:`host_store`); every agent, node 0's too, joins the rendezvous as a client of that store;
- the workers' store is made the same way, on the address of the agent that hosts it;
- the rendezvous id (the key under which the state lives, ``TORCHELASTIC_RUN_ID`` in the ranks)
  is derived from the job key and the gang (:func:`rendezvous_id`): every agent computes it from
  the key and ``SGPU_GANG`` in its environment, so it is on no command line, no one without the
  key can name it in advance, and an agent of a lost gang that comes back late (a kept node 0
  hosts the next gang's rendezvous on the same address and port) looks for its own gang's state
  and never joins the next gang's.

Each round an agent joins is recorded in the rendezvous store (the round's node count, under
:data:`ROUNDS_KEY`), and the agent tells the ranks it then starts which round they run in and how
many nodes the job's previous round had (:data:`ROUND_ENV`, :data:`PREVIOUS_NODES_ENV`): an elastic
job's ranks learn that the world changed since its last start (``prefect_sgpu.runtime``), a node that
joined late as well as one that was there before.

Both go through torch elastic's own handler registry (backend :data:`BACKEND`): the launcher, the
c10d backend and the dynamic rendezvous are torch's; only where their two stores listen changes.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters

logger = logging.getLogger(__name__)
#: the rendezvous backend name node agents give ``LaunchConfig``
BACKEND = "sgpu-c10d"
#: what the rendezvous id is derived for (``jobfolder.derive_key``)
PURPOSE = b"prefect-sgpu c10d rendezvous id"
#: seconds a store server waits on its own operations (torch's default for the workers' store)
STORE_TIMEOUT_S = 300.0
#: the rendezvous round the ranks of this node run in (set by the agent before it starts them)
ROUND_ENV = "SGPU_MEMBERSHIP_ROUND"
#: nodes of the job's round before that one; empty in its first round
PREVIOUS_NODES_ENV = "SGPU_PREVIOUS_NODES"
#: where each round's node count is kept in the rendezvous store (``<key>/<round>``)
ROUNDS_KEY = "sgpu/membership/round"
#: the rounds this agent joined, in order (empty: it ran no rank yet)
JOINED_ROUNDS: list[int] = []


def rendezvous_id(job_key: str, gang: int) -> str:
    """Gang ``gang``'s rendezvous id: the same on every node of that gang holding the job key,
    another for every other gang of the job, unguessable without the key."""
    from prefect_sgpu.protocol.jobfolder import derive_key

    if isinstance(gang, bool) or not isinstance(gang, int) or gang < 0:
        raise ValueError(f"gang {gang!r}: the rendezvous id needs a gang number >= 0")
    return derive_key(job_key, PURPOSE + b" gang " + str(gang).encode())


#: the listening sockets this process's stores hold (file descriptors)
_HOSTED_FDS: list[int] = []


def close_hosted_sockets() -> None:
    """In a rank forked from an agent: close the agent's listening sockets it inherited, so the
    agent's stores accept on the agent's own socket alone, and the rank holds none of them."""
    while _HOSTED_FDS:
        try:
            os.close(_HOSTED_FDS.pop())
        except OSError:
            pass


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` alone (never every interface); ``port`` 0: any free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own: no TIME_WAIT wait
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout_s: float = STORE_TIMEOUT_S) -> "TCPStore":
    """A ``TCPStore`` server listening on ``host``:``port`` only; ``port`` 0: a free one (``.port``).

    The store takes the socket for its lifetime, which is this process's: the socket is never
    closed under it (the non-libuv server aborts the process when its listening socket goes).
    """
    from torch.distributed import TCPStore

    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    kwargs = {"is_master": True, "master_listen_fd": sock.fileno(), "wait_for_workers": False,
              "timeout": datetime.timedelta(seconds=timeout_s)}
    try:
        try:
            store = TCPStore(host, bound, **kwargs)
        except (RuntimeError, ValueError):
            # a torch whose libuv server takes no listening socket: its older server does
            store = TCPStore(host, bound, use_libuv=False, **kwargs)
    except BaseException:
        sock.close()
        raise
    _HOSTED_FDS.append(sock.detach())
    return store


def _create_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    """torch's c10d rendezvous as a client of the store node 0 hosts, with the workers' store moved."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params.config["is_host"] = False  # node 0's agent hosts the store itself (host_store), on its address
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    if not callable(getattr(handler, "_create_tcp_store_server", None)):
        raise RuntimeError("this torch's dynamic rendezvous creates the workers' store in a way prefect-sgpu "
                           "does not know; it would listen on every interface")
    # the workers' store: the same server, on this agent's own address (the handler passes its node's, from local_addr)
    handler._create_tcp_store_server = host_store  # type: ignore[attr-defined]
    handler.get_backend = lambda: BACKEND  # type: ignore[method-assign]  # torch checks it is the one asked for
    _record_rounds(handler, store)
    _restart_on_lost_peer(handler)
    return handler


def _record_rounds(handler: "RendezvousHandler", store: "TCPStore") -> None:
    """After each round this agent joins: the workers' store told right (:func:`workers_store_of_round`),
    the round's node count kept in the rendezvous store, and the round and the previous round's node count
    put where the ranks the agent starts next read them (its environment, which torch elastic's workers
    inherit, forked or spawned)."""
    join = handler.next_rendezvous

    def next_rendezvous() -> object:
        info = workers_store_of_round(handler, join())
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        number = getattr(state, "round", None)
        if not isinstance(number, int):  # a torch whose handler keeps no round: nothing to tell
            return info
        store.set(f"{ROUNDS_KEY}/{number}", str(info.world_size))
        os.environ[ROUND_ENV] = str(number)
        os.environ[PREVIOUS_NODES_ENV] = previous_round_nodes(store, number)
        JOINED_ROUNDS.append(number)
        return info

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def _restart_on_lost_peer(handler: "RendezvousHandler") -> None:
    """A round that lost a node is left for the next one, by every agent still in it, while its ranks run.

    torch elastic's agent restarts healthy ranks only for nodes *waiting* to join
    (``num_nodes_waiting() > 0``, checked every monitor interval); a node whose keep-alives lapsed is
    dropped from the round's participants (``_sanitize``, on every state sync) but restarts nothing. Ranks
    that talk to the lost node fail and restart the round; ranks that do not (between collectives, or
    blocked on a peer whose machine vanished without a connection reset, which gloo and NCCL notice only
    at their timeout) would go on in a world that no longer exists, and an elastic job would never meet
    again without the node. So here ``num_nodes_waiting`` also counts the participants the agent's round
    lost: fewer than it joined with, in the same completed and open round, and still at least the
    rendezvous' ``min_nodes``, restarts the ranks, and the agents meet in the next round without the lost
    node (torch's own path for a membership change, not counted against ``max_restarts``). A fixed-size
    job's rendezvous (``min_nodes == max_nodes``), a round below ``min_nodes`` (the driver relaunches the
    gang) and a closed rendezvous (an agent whose ranks ended shuts it) restart nothing here."""
    join, waiting = handler.next_rendezvous, handler.num_nodes_waiting
    #: the round this agent joined last and its node count
    joined: dict[int, int] = {}

    def next_rendezvous() -> object:
        info = join()
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        joined.clear()
        if isinstance(getattr(state, "round", None), int):
            joined[state.round] = info.world_size  # type: ignore[union-attr]
        return info

    def num_nodes_waiting() -> int:
        count = waiting()  # syncs the state: a node whose keep-alives lapsed is no participant any more
        state = getattr(getattr(handler, "_state_holder", None), "state", None)
        nodes = joined.get(getattr(state, "round", None))  # type: ignore[arg-type]
        settings = getattr(handler, "settings", None)
        fewest, most = getattr(settings, "min_nodes", 0), getattr(settings, "max_nodes", 0)
        if (nodes is not None and fewest < most and state.complete and not state.closed  # type: ignore[union-attr]
                and fewest <= len(state.participants) < nodes):  # type: ignore[union-attr]
            logger.warning(
                "round %d lost %d of its %d node(s); its ranks restart in the next round without them",
                state.round, nodes - len(state.participants), nodes)  # type: ignore[union-attr]
            return max(count, 1)
        return count

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]


def workers_store_of_round(handler: "RendezvousHandler", info: "RendezvousInfo") -> "RendezvousInfo":
    """The round's workers' store, the same on every agent of it, in every round, not only the first.

    torch elastic's dynamic rendezvous (2.14) publishes the workers' store (``MASTER_ADDR``,
    ``MASTER_PORT``, under the round's prefix of the rendezvous store) only in an agent's first round
    or where it has just become rank 0 without a store of its own; in a later round it hands back what
    it cached. When an elastic job grows, the agent that stays rank 0 so never publishes it for the new
    round, and the joining node waits for ``MASTER_ADDR`` until it times out, while rank 0 waits for the
    joiner's role (the rank-change case of the same cache: pytorch/pytorch issue #182221, "AssertionError
    in elastic c10d rendezvous when rank changes"). Here rank 0 publishes its own store in every round
    and every other agent reads the round's.

    Each round after the agent's first gets a new workers' store (:func:`new_round_store`): the ranks of a
    round bootstrap their process groups from it under the same keys as the last round's ranks did
    (``default_pg/...``, no round in them), and in a store kept from round to round a rank of the new world
    read the old world's addresses (gloo: "connectFullMesh failed ... Connection refused")."""
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    server = getattr(handler, "_shared_tcp_store_server", None)
    node = getattr(handler, "_this_node", None)
    if os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1" or node is None:
        return info  # torch builds it afresh in every round
    if info.rank == 0:
        if server is None:
            return info
        if JOINED_ROUNDS:
            server = handler._shared_tcp_store_server = new_round_store(node.addr)  # type: ignore[attr-defined]
        boot = RendezvousStoreInfo(master_addr=node.addr, master_port=server.port)
        info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, boot.master_addr.encode())
        info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(boot.master_port).encode())
    else:
        boot = RendezvousStoreInfo.build(info.rank, info.store, local_addr=node.addr)
    handler._bootstrap_store_info = boot  # type: ignore[attr-defined]
    return RendezvousInfo(info.store, info.rank, info.world_size, boot)


#: the workers' stores of this agent's later rounds, alive as long as the agent (a server must outlive its socket)
_ROUND_STORES: list["TCPStore"] = []


def new_round_store(host: str) -> "TCPStore":
    """A new, empty workers' store for a round, on ``host`` alone, at a free port."""
    store = host_store(host, 0)
    _ROUND_STORES.append(store)
    return store


def previous_round_nodes(store: "TCPStore", number: int) -> str:
    """The node count of the latest round before ``number`` that some agent joined ("" when none)."""
    for earlier in range(number - 1, -1, -1):
        key = f"{ROUNDS_KEY}/{earlier}"
        if store.check([key]):
            return store.get(key).decode()
    return ""


def register() -> None:
    """Make :data:`BACKEND` known to torch elastic in this process (again: no change)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)


def logs_specs(log_dir: str) -> object:
    """torch elastic's ``DefaultLogsSpecs`` in ``log_dir``, whose run folder is not named after the
    rendezvous id (torch names it ``<rendezvous id>_<random>``)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class _LogsSpecs(DefaultLogsSpecs):
        def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
            return super()._make_log_dir(log_dir, "run")

    return _LogsSpecs(log_dir=log_dir)
