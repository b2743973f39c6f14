"""The job folder protocol: every key and every document between a driver and its nodes.

The store is the one mailbox between the driver and the nodes, and whoever can write
to it (a shared bucket, a shared disk) must at most be able to *delay* a job, never
run code in it or change its outcome. So every document that a node or the driver
acts on is sealed: HMAC-SHA256 with the job's key over a header that binds it to

- the job (``run_id``): a document copied from another job is refused;
- its kind (payload, heartbeat, stop, launch, alive, notice, status, result): a status cannot
  stand in for a launch document;
- its node index or rank (and on EC2 the instance id): node 1's launch document cannot start node 0.
- for results and the stop, the gang (the relaunch it belongs to, from the second gang on): a
  lost gang's result or stop written back after a relaunch is not the new gang's. A node learns
  its gang from what only the driver writes: its boot arguments (``--gang``, in the EC2
  user-data) or, on a warm lease, its sealed assignment.

Anything unsigned, foreign or rebound is refused with :class:`DocumentRefused`; a
reader that cannot tell (the driver polling for a node's status) logs the refusal
and treats the document as absent. Rank logs are the only unsigned files: they are
shown, never acted on. Relayed MLflow records are sealed one a line, with a key derived from
the job key (:mod:`prefect_sgpu.observe.mlflow_relay`).

The key itself never enters the store: locally it is in the node agent's
environment, on EC2 in an SSM SecureString whose name derives from the run id.

Layout of one job (``<store root>/<run_id>/...``)::

    payload.bin                 sealed cloudpickle of the call           driver -> ranks
    heartbeat                   sealed Heartbeat (seq, time)              driver -> nodes
    stop                        sealed Stop (bound to the gang)           driver -> nodes
    nodes/launch                one sealed LaunchDocument a node, bound   driver -> nodes
                                to node and instance (:func:`launch_bundle`)
    nodes/node-<i>.alive        sealed Alive (phase, seq)                 node i -> driver
    nodes/node-<i>.notice       sealed Notice (reclaim notice)            node i -> driver
    nodes/node-<i>.status       sealed NodeStatus (exit code, failures,   node i -> driver
                                hung ranks, reclaim notice)
    results/rank-<r>.bin        sealed result envelope                    rank r -> driver
    metrics/rank-<r>.jsonl      relayed MLflow records (remote ranks),    rank r -> driver
                                one sealed record a line
                                (:mod:`prefect_sgpu.observe.mlflow_relay`)
    progress/rank-<r>           rank r's step, sealed (:mod:`.rank_progress`) rank r -> driver
    logs/rank-<r>.log           rank r's stdout+stderr (kept after the job)
    logs/gang-<n>/rank-<r>.log  the logs of a gang relaunched after infrastructure loss
    agent/node-<i>.out          node i's agent output
    checkpoints/step-<n>/...    checkpoints (runtime.checkpoint_uri()), COMPLETE marker last: a manifest
                                sealed with the location's key, not the job's
                                (:mod:`prefect_sgpu.checkpoints.manifest`)

A warm EC2 lease (instances kept between jobs) has a folder of its own, ``<lease id>/``, with
its own key: the lease's ``heartbeat`` and ``stop``, its nodes' ``alive`` and ``notice`` while
they wait between jobs, and ``nodes/assign``: one sealed Assign (the next job's run id and a
sequence number) per node, bound to the lease, the node and the instance. A node that takes an
assignment reads that job's key from SSM (its name derives from the run id) and serves the job
in the job's own folder as above, then comes back to the lease's.

A node's own copy of the folder (on EC2, the instance's disk) holds ``preempt`` (the reclaim notice, never
uploaded); the node's hang watchdog reads the plain line of each ``progress/rank-<r>`` there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from prefect_sgpu.errors import DocumentRefused
from prefect_sgpu.protocol.limits import read_document

if TYPE_CHECKING:
    from prefect_sgpu.store import Store

logger = logging.getLogger("prefect_sgpu.protocol.jobfolder")

MAGIC = b"SGPU2\n"
BUNDLE_MAGIC = b"SGPU2-LAUNCH\n"
_DIGEST = 32

Kind = Literal["payload", "heartbeat", "stop", "launch", "alive", "notice", "status", "result", "assign",
               "rejoin", "checkpoint", "metrics", "envpack", "progress", "requests"]

# --- keys ------------------------------------------------------------------------------

PAYLOAD = "payload.bin"
HEARTBEAT = "heartbeat"
STOP = "stop"
LOGS = "logs"
RESULTS = "results"
NODES = "nodes"
AGENT = "agent"
CHECKPOINTS = "checkpoints"
#: relayed MLflow records of remote ranks (:mod:`prefect_sgpu.observe.mlflow_relay`)
METRICS = "metrics"
#: what the driver deletes when a job ends (logs and checkpoints stay)
CONTROL = (PAYLOAD, RESULTS, STOP, NODES, HEARTBEAT, METRICS)


#: every node's launch document in one object, so starting a job costs one write for any node count
LAUNCH_KEY = f"{NODES}/launch"
#: in a warm lease's folder: every node's next job, one object (:class:`Assign`)
ASSIGN_KEY = f"{NODES}/assign"
#: in a job's folder after a node was replaced: the kept nodes serve the next gang (:class:`Rejoin`)
REJOIN_KEY = f"{NODES}/rejoin"
#: a rank's gang of its job (0, or the relaunch it belongs to): what its result is bound to
GANG_ENV = "SGPU_GANG"
#: how a cold node agent starts its ranks (its ``--rank-start``, the driver's ``PREFECT_SGPU_RANK_START``):
#: ``spawn`` (each a new interpreter, as torchrun does), ``fork`` (forked from the agent) or ``auto``
RANK_STARTS = ("auto", "fork", "spawn")
#: what a run id (or lease id) may look like: it names folders, SSM parameters and tags
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"


def alive_key(node: int) -> str:
    return f"{NODES}/node-{node}.alive"


def notice_key(node: int) -> str:
    return f"{NODES}/node-{node}.notice"


def status_key(node: int) -> str:
    return f"{NODES}/node-{node}.status"


def log_key(rank: int) -> str:
    return f"{LOGS}/rank-{rank:05d}.log"


def result_key(rank: int) -> str:
    return f"{RESULTS}/rank-{rank:05d}.bin"


def agent_output_key(node: int) -> str:
    return f"{AGENT}/node-{node}.out"


def rank_of_key(key: str) -> int:
    """``logs/rank-00003.log`` -> 3."""
    return int(Path(key).stem.split("-")[1])


#: every SSM parameter prefect-sgpu writes is under this path, then under its store's scope
SSM_ROOT = "/prefect-sgpu/"


def ssm_root(scope: str) -> str:
    """``/prefect-sgpu/<scope>/``: where one store's job keys and secrets live."""
    return f"{SSM_ROOT}{scope}/"


def ssm_key_parameter(run_id: str, scope: str) -> str:
    """Where an EC2 job's key lives: derived from its store's scope and the run id, never read from a document."""
    return f"{ssm_root(scope)}{run_id}/payload-key"


def ssm_secrets_parameter(run_id: str, scope: str) -> str:
    """Where an EC2 job's ``secrets=`` values live (a SecureString of JSON), derived like the key's."""
    return f"{ssm_root(scope)}{run_id}/secrets"


def new_key() -> str:
    return secrets.token_hex(32)


def derive_key(key: str, purpose: bytes) -> str:
    """A key for one purpose, derived from the job key (HMAC-SHA256): whoever holds it can do
    that one thing, and cannot recover the job key or any other purpose's key."""
    return hmac.new(bytes.fromhex(key), purpose, hashlib.sha256).hexdigest()


# --- documents -------------------------------------------------------------------------


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Heartbeat(_Doc):
    """The driver is alive: nodes watch ``seq`` change on their own clock. ``checkpoint`` (written only when
    set): why the ranks must save a final checkpoint now, as on a reclaim notice (a cost cap)."""

    seq: int
    time: float
    checkpoint: str = ""


class Stop(_Doc):
    """Stop every rank now (cancel, timeout, another node failed)."""

    time: float
    grace: float
    reason: str = ""


class LaunchDocument(_Doc):
    """What an EC2 node runs: the node agent's argv and its environment."""

    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    #: the job has ``secrets=``: the node reads them from :func:`ssm_secrets_parameter`, never from here
    secrets: bool = False
    #: the gang it starts (0, or the relaunch): a node runs only its own gang's, so a lost gang's
    #: launch written back into the store never starts that gang again on a node kept for the next
    gang: int = Field(default=0, ge=0)


class Assign(_Doc):
    """A warm lease's node serves job ``run_id`` next (in that job's folder, with that job's key).

    ``seq`` grows with every assignment of the lease: a node takes only a higher one than it
    last took, so an old assignment written back into the store is never served twice.
    ``gang``: which gang of the job the node serves (0, or the relaunch): the job's stop is
    bound to it."""

    run_id: str = Field(pattern=RUN_ID_PATTERN)
    seq: int
    gang: int = Field(default=0, ge=0)


class Rejoin(_Doc):
    """A node of a cold job that the driver kept after another node was lost serves gang ``gang`` next
    (in the same folder, with the same key). A node takes only a gang above the one it served, so an
    old one written back is never served twice."""

    gang: int = Field(ge=1)


class Alive(_Doc):
    """A node's bootstrap is up (refreshed while it lives)."""

    phase: str
    seq: int
    time: float
    host: str = ""
    #: what this node runs calls with (:func:`prefect_sgpu.protocol.versions.runtime_versions`)
    versions: dict[str, str] = Field(default_factory=dict)
    #: when the machine's environment was ready (node clock: its stage's end, else its bootstrap's start; 0: not said)
    ready: float = 0.0


class Notice(_Doc):
    """The cloud will reclaim a node's instance (a spot interruption), or, with ``reclaim=False``,
    recommends moving work off it (a rebalance recommendation: a warning, no reclaim yet, maybe
    never). A document of its own, so that the driver reads it only when the listing shows it
    appeared or changed: a reclaim notice replaces a recommendation written before it."""

    text: str
    time: float
    reclaim: bool = True


class RankExit(_Doc):
    exit_code: int
    signal: str | None = None
    local_rank: int | None = None


class HungRank(_Doc):
    """A rank the node's watchdog found silent: for how long, its last step, its stack."""

    silent_s: float
    step: str = ""
    stack: str = ""


#: how a node's ``stopped`` reason starts when it stopped itself for want of a new driver heartbeat
HEARTBEAT_STOP = "no new driver heartbeat"


class NodeStatus(_Doc):
    """How a node's agent ended: its exit code and every failed rank's."""

    node: int
    host: str = ""
    exit_code: int
    failures: dict[str, RankExit] = Field(default_factory=dict)
    error: str | None = None
    stopped: str | None = None
    #: ranks that made no progress for the job's hang_timeout (the agent stopped the node)
    hung: dict[str, HungRank] = Field(default_factory=dict)
    #: the reclaim notice this node had received, if any
    notice: str | None = None
    #: why the machine may serve no later job (a job's cgroup it could not empty): its lease ends
    unfit: str | None = None


D = TypeVar("D", bound=_Doc)


def launch_bundle(entries: Mapping[int, bytes]) -> bytes:
    """One object holding each node's sealed launch document, length-prefixed one after another.
    The container itself is not sealed: each entry is, bound to its node and instance, so an
    edited container can only hold entries that are refused (or leave a node waiting), never
    make a node run another node's command."""
    parts = [BUNDLE_MAGIC]
    for node, blob in sorted(entries.items()):
        parts += [node.to_bytes(4, "big"), len(blob).to_bytes(4, "big"), blob]
    return b"".join(parts)


def launch_entry(bundle: bytes, node: int, run_id: str) -> bytes | None:
    """Node ``node``'s sealed entry of a launch bundle (None when the bundle has none for it)."""
    if not bundle.startswith(BUNDLE_MAGIC):
        raise DocumentRefused(f"launch documents of job {run_id} are not a launch bundle: refused")
    at = len(BUNDLE_MAGIC)
    while at < len(bundle):
        if at + 8 > len(bundle):
            raise DocumentRefused(f"launch documents of job {run_id} are cut short: refused")
        index, size = int.from_bytes(bundle[at: at + 4], "big"), int.from_bytes(bundle[at + 4: at + 8], "big")
        at += 8
        if at + size > len(bundle):
            raise DocumentRefused(f"launch documents of job {run_id} are cut short: refused")
        if index == node:
            return bundle[at: at + size]
        at += size
    return None


# --- sealing ---------------------------------------------------------------------------


def _header(kind: str, run_id: str, node: int | None, rank: int | None, instance_id: str | None,
            gang: int | None = None) -> dict[str, Any]:
    header = {"v": 2, "kind": kind, "run_id": run_id, "node": node, "rank": rank, "instance_id": instance_id}
    if gang:  # a relaunched gang's documents (the first gang's carry no gang, as before gangs were bound)
        header["gang"] = gang
    return header


def seal(key: str, kind: Kind, run_id: str, body: bytes, *, node: int | None = None, rank: int | None = None,
         instance_id: str | None = None, gang: int | None = None) -> bytes:
    """``body`` signed with the job key and bound to job, kind, node/rank, instance and gang."""
    header = json.dumps(_header(kind, run_id, node, rank, instance_id, gang), sort_keys=True).encode()
    message = len(header).to_bytes(4, "big") + header + body
    return MAGIC + hmac.new(bytes.fromhex(key), message, hashlib.sha256).digest() + message


def unseal(blob: bytes, key: str, kind: Kind, run_id: str, *, node: int | None = None, rank: int | None = None,
           instance_id: str | None = None, what: str | None = None, gang: int | None = None) -> bytes:
    """The body of a sealed document, or DocumentRefused saying why it is not this job's."""
    what = what or kind
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _DIGEST + 4:
        raise DocumentRefused(f"{what} of job {run_id} is not a signed prefect-sgpu document: refused")
    mac = blob[len(MAGIC): len(MAGIC) + _DIGEST]
    message = blob[len(MAGIC) + _DIGEST:]
    expected_mac = hmac.new(bytes.fromhex(key), message, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected_mac):
        raise DocumentRefused(f"{what} of job {run_id}: signature does not match; it was not written by this "
                              "job (forged, or from another job): refused")
    size = int.from_bytes(message[:4], "big")
    header = json.loads(message[4: 4 + size])
    expected = _header(kind, run_id, node, rank, instance_id, gang)
    if header != expected:
        raise DocumentRefused(f"{what} of job {run_id} is bound to {_binding(header)}, expected "
                              f"{_binding(expected)} (replayed or moved): refused")
    return message[4 + size:]


def _binding(header: dict[str, Any]) -> str:
    return ", ".join(f"{k}={header.get(k)}" for k in ("kind", "run_id", "node", "rank", "instance_id", "gang")
                     if header.get(k) is not None)


# --- one job's folder --------------------------------------------------------------------


class JobFolder:
    """One job's folder in a store, read and written only as sealed, typed documents."""

    def __init__(self, store: "Store", run_id: str, key: str) -> None:
        self.store = store
        self.run_id = run_id
        self.key = key
        #: which gang of the job this process serves (0, then one more at each relaunch): results and
        #: the stop are bound to it, so a lost gang's sealed result or stop written back after a
        #: relaunch is refused
        self.gang = 0
        self._beat_seq = 0
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JobFolder({self.uri()!r})"

    @classmethod
    def local(cls, path: str | Path, key: str) -> "JobFolder":
        """A folder on this machine (a node's job folder: ``<root>/<run_id>``)."""
        from prefect_sgpu.store import LocalStore

        path = Path(path)
        return cls(LocalStore(path.parent), path.name, key)

    def uri(self, key: str = "") -> str:
        return self.store.uri(self.run_id, key)

    def path(self, key: str = "") -> Path:
        """A local path in the folder (only for folders on this machine)."""
        local = self.store.local_dir(self.run_id)
        if local is None:
            raise TypeError(f"{self.uri()} is not a folder on this machine")
        return local / key if key else local

    # -- typed, sealed reads and writes ----------------------------------------------

    def _put(self, key: str, kind: Kind, body: bytes, **binding: Any) -> None:
        self.store.put(self.run_id, key, seal(self.key, kind, self.run_id, body, **binding))

    def _get(self, key: str, kind: Kind, **binding: Any) -> bytes | None:
        blob = read_document(self.store, self.run_id, key, kind)
        if blob is None:
            return None
        return unseal(blob, self.key, kind, self.run_id, what=key, **binding)

    def _put_doc(self, key: str, kind: Kind, doc: _Doc, **binding: Any) -> None:
        self._put(key, kind, doc.model_dump_json().encode(), **binding)

    def _get_doc(self, key: str, kind: Kind, model: type[D], **binding: Any) -> D | None:
        body = self._get(key, kind, **binding)
        return None if body is None else model.model_validate_json(body)

    def _get_doc_or_none(self, key: str, kind: Kind, model: type[D], **binding: Any) -> D | None:
        """For pollers: a refused document is logged once and counts as absent."""
        try:
            return self._get_doc(key, kind, model, **binding)
        except DocumentRefused as exc:
            self._note_refused(key, exc)
            return None

    def _note_refused(self, key: str, exc: Exception) -> None:
        with self._lock:
            if key in self._refused:
                return
            self._refused.add(key)
        logger.warning("%s", exc)

    # payload ---------------------------------------------------------------------------

    def put_payload(self, body: bytes) -> None:
        self._put(PAYLOAD, "payload", body)

    def payload(self) -> bytes:
        body = self._get(PAYLOAD, "payload")
        if body is None:
            raise FileNotFoundError(f"{self.uri(PAYLOAD)} is missing")
        return body

    # heartbeat and stop (driver -> nodes) --------------------------------------------

    def beat(self, checkpoint: str = "") -> Heartbeat:
        with self._lock:
            self._beat_seq += 1
            doc = Heartbeat(seq=self._beat_seq, time=time.time(), checkpoint=checkpoint)
        self._put(HEARTBEAT, "heartbeat", doc.model_dump_json(exclude_defaults=True).encode())
        return doc

    def heartbeat(self) -> Heartbeat | None:
        return self._get_doc_or_none(HEARTBEAT, "heartbeat", Heartbeat)

    def put_stop(self, grace: float, reason: str = "") -> None:
        """The stop of this folder's gang (:attr:`gang`): a relaunched gang's nodes refuse a lost
        gang's stop written back, as the driver refuses its results. The first gang's is sealed as
        before gangs were bound."""
        self._put_doc(STOP, "stop", Stop(time=time.time(), grace=grace, reason=reason), gang=self.gang)

    def stop(self) -> Stop | None:
        """The stop of this folder's gang; one of another gang (or job) is logged once and counts as absent."""
        return self._get_doc_or_none(STOP, "stop", Stop, gang=self.gang)

    # launch documents (driver -> node) -------------------------------------------------

    def seal_launch(self, node: int, doc: LaunchDocument, instance_id: str | None = None) -> bytes:
        return seal(self.key, "launch", self.run_id, doc.model_dump_json().encode(), node=node,
                    instance_id=instance_id)

    def put_launches(self, docs: Mapping[int, tuple[LaunchDocument, str | None]]) -> None:
        """Every node's launch document, each sealed and bound to its node and instance, in one write."""
        self._put_bundle(LAUNCH_KEY, "launch", docs)

    def launch(self, node: int, instance_id: str | None = None) -> LaunchDocument | None:
        """This node's launch document; DocumentRefused if what is there is not the driver's."""
        return self._bundle_entry(LAUNCH_KEY, "launch", LaunchDocument, node, instance_id,
                                  f"launch document of node {node}")

    def put_rejoins(self, docs: Mapping[int, tuple[Rejoin, str | None]]) -> None:
        """The kept nodes' next gang, each sealed and bound to its node and instance, in one write."""
        self._put_bundle(REJOIN_KEY, "rejoin", docs)

    def rejoin(self, node: int, instance_id: str | None = None) -> Rejoin | None:
        """This node's rejoin document; DocumentRefused if what is there is not the driver's."""
        return self._bundle_entry(REJOIN_KEY, "rejoin", Rejoin, node, instance_id, f"rejoin document of node {node}")

    # assignments in a warm lease's folder (driver -> idle node) ---------------------------

    def put_assignments(self, docs: Mapping[int, tuple[Assign, str | None]]) -> None:
        """Every node's next job, each sealed with the lease key and bound to its node and instance."""
        self._put_bundle(ASSIGN_KEY, "assign", docs)

    def assignment(self, node: int, instance_id: str | None = None) -> Assign | None:
        """This node's assignment; DocumentRefused if what is there is not the lease driver's."""
        return self._bundle_entry(ASSIGN_KEY, "assign", Assign, node, instance_id, f"assignment of node {node}")

    def _put_bundle(self, key: str, kind: Kind, docs: Mapping[int, tuple[_Doc, str | None]]) -> None:
        self.store.put(self.run_id, key, launch_bundle({
            node: seal(self.key, kind, self.run_id, doc.model_dump_json().encode(), node=node, instance_id=instance_id)
            for node, (doc, instance_id) in docs.items()}))

    def _bundle_entry(self, key: str, kind: Kind, model: type[D], node: int, instance_id: str | None,
                      what: str) -> D | None:
        bundle = read_document(self.store, self.run_id, key, kind)
        blob = None if bundle is None else launch_entry(bundle, node, self.run_id)
        if blob is None:
            return None
        body = unseal(blob, self.key, kind, self.run_id, what=what, node=node, instance_id=instance_id)
        return model.model_validate_json(body)

    # node reports (node -> driver) -----------------------------------------------------

    def put_alive(self, node: int, doc: Alive, instance_id: str | None = None) -> None:
        self._put_doc(alive_key(node), "alive", doc, node=node, instance_id=instance_id)

    def alive(self, node: int, instance_id: str | None = None) -> Alive | None:
        return self._get_doc_or_none(alive_key(node), "alive", Alive, node=node, instance_id=instance_id)

    def put_notice(self, node: int, doc: Notice, instance_id: str | None = None) -> None:
        self._put_doc(notice_key(node), "notice", doc, node=node, instance_id=instance_id)

    def notice(self, node: int, instance_id: str | None = None) -> Notice | None:
        return self._get_doc_or_none(notice_key(node), "notice", Notice, node=node, instance_id=instance_id)

    def node_documents(self) -> dict[str, str]:
        """The keys under ``nodes/`` with their versions (one listing): which nodes' documents exist
        and which changed, before reading any, so watching many nodes costs one call a pass
        instead of one a node. A changed alive version proves only that *someone* wrote it;
        whoever can write the store can so delay the loss of a node, never run code."""
        return self.store.versions(self.run_id, NODES)

    def put_status(self, node: int, doc: NodeStatus, instance_id: str | None = None) -> None:
        self._put_doc(status_key(node), "status", doc, node=node, instance_id=instance_id)

    def status(self, node: int, instance_id: str | None = None) -> NodeStatus | None:
        return self._get_doc_or_none(status_key(node), "status", NodeStatus, node=node, instance_id=instance_id)

    # results (rank -> driver) ----------------------------------------------------------

    def put_result(self, rank: int, body: bytes) -> None:
        self._put(result_key(rank), "result", body, rank=rank, gang=self.gang)

    def results(self) -> dict[int, bytes]:
        """Every rank's sealed envelope body that is really this job's, by rank."""
        found: dict[int, bytes] = {}
        for key in self.store.list(self.run_id, RESULTS):
            try:
                rank = rank_of_key(key)
            except (IndexError, ValueError):
                continue
            try:
                body = self._get(key, "result", rank=rank, gang=self.gang)
            except DocumentRefused as exc:
                self._note_refused(key, exc)
                continue
            if body is not None:
                found[rank] = body
        return found

    # housekeeping ----------------------------------------------------------------------

    def log_keys(self) -> list[str]:
        return self.store.list(self.run_id, LOGS)

    def reset_for_relaunch(self, gang: int) -> None:
        """Before a new gang starts: the old gang's node documents, results and stop go; its
        rank logs move to ``logs/gang-<gang>/`` (the payload, heartbeat and checkpoints stay). From now
        on results and the stop are this gang's (:attr:`gang`; its ranks learn it from :data:`GANG_ENV`,
        its nodes from their boot arguments or assignment)."""
        self.gang = gang
        for key in (RESULTS, STOP, NODES, METRICS):
            self.store.delete(self.run_id, key)
        for key in self.log_keys():
            data = self.store.get(self.run_id, key)
            if data is not None:
                self.store.put(self.run_id, f"{LOGS}/gang-{gang}/{key.rsplit('/', 1)[-1]}", data)
            self.store.delete(self.run_id, key)

    def reset_nodes(self) -> None:
        """The node documents and the stop go (new machines are about to announce themselves)."""
        for key in (STOP, NODES):
            self.store.delete(self.run_id, key)

    def delete_control_files(self) -> None:
        """Everything but logs and checkpoints: payload, results, node documents, stop, heartbeat."""
        for key in CONTROL:
            self.store.delete(self.run_id, key)
