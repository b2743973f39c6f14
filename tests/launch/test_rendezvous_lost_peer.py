"""An elastic job's rendezvous that loses a node restarts the ranks still running, without a collective failing.

Real torch elastic handlers (the ``sgpu-c10d`` backend, three in this process, one rendezvous store on
127.0.0.1): torch's agent restarts healthy ranks when ``num_nodes_waiting()`` is above 0, and counts only
nodes waiting to join there; a node whose keep-alives stopped (its machine vanished) must count too, or the
survivors' ranks go on in the old world (``prefect_sgpu.launch.rendezvous._restart_on_lost_peer``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from prefect_sgpu.launch import rendezvous

#: the rendezvous stores the tests host, alive as long as this process (as a node 0 agent keeps its own)
_STORES: list[Any] = []


def _handlers(monkeypatch: pytest.MonkeyPatch, count: int, min_nodes: int, max_nodes: int) -> list[Any]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    monkeypatch.setenv(rendezvous.ROUND_ENV, "")  # the handlers set them for the ranks; restored after the test
    monkeypatch.setenv(rendezvous.PREVIOUS_NODES_ENV, "")
    monkeypatch.setattr(rendezvous, "JOINED_ROUNDS", [])
    # no workers' store hosted per round (there are no ranks here): torch publishes a free port's address
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rendezvous.register()
    store = rendezvous.host_store("127.0.0.1", 0)
    _STORES.append(store)
    return [rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend=rendezvous.BACKEND, endpoint=f"127.0.0.1:{store.port}", run_id=f"lost-peer-{id(store)}",
        min_nodes=min_nodes, max_nodes=max_nodes, local_addr="127.0.0.1", join_timeout=20,
        last_call_timeout=1, keep_alive_interval=1, keep_alive_max_attempt=3)) for _ in range(count)]


def _join(handlers: list[Any]) -> list[int]:
    """Every handler joins the next round at once; the world sizes they got."""
    worlds: list[int] = []

    def join(handler: Any) -> None:
        worlds.append(handler.next_rendezvous().world_size)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return worlds


def _waiting_within(handler: Any, seconds: float) -> int:
    limit = time.monotonic() + seconds
    while True:
        count = handler.num_nodes_waiting()
        if count or time.monotonic() > limit:
            return count
        time.sleep(0.2)


def test_a_node_whose_keep_alives_stop_restarts_the_other_agents_ranks_and_a_closed_round_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = handlers = _handlers(monkeypatch, 3, min_nodes=2, max_nodes=3)
    try:
        assert _join(handlers) == [3, 3, 3]
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0  # everyone alive: nothing to restart
        c._stop_heartbeats()  # its machine vanished: no keep-alive, no exit from the rendezvous
        # dropped after 3 keep-alives of 1 s missed: the agents still in the round restart their ranks
        assert _waiting_within(a, 10) >= 1 and _waiting_within(b, 10) >= 1
        assert _join([a, b]) == [2, 2]  # and meet again without it
        assert a.num_nodes_waiting() == 0  # the new round lost no one
        b.shutdown()  # an agent whose ranks ended closes the rendezvous: nothing restarts after that
        time.sleep(4.0)  # past its keep-alives: dropped, yet nothing restarts
        assert a.num_nodes_waiting() == 0
    finally:
        for handler in handlers:
            handler._stop_heartbeats()


def test_a_fixed_size_rendezvous_that_loses_a_node_restarts_nothing_here(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = handlers = _handlers(monkeypatch, 2, min_nodes=2, max_nodes=2)
    try:
        assert _join(handlers) == [2, 2]
        b._stop_heartbeats()
        assert _waiting_within(a, 3) == 0  # a fixed-size job's lost node is the driver's recovery
    finally:
        for handler in handlers:
            handler._stop_heartbeats()
