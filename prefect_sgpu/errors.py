"""Exception types users can catch.

Every error that can be predicted from the user's input is raised *before* anything
is started or paid for, as an :class:`SGPUConfigError` that names the field, the
value and what is allowed.
"""

from __future__ import annotations

from typing import Any


class SGPUError(Exception):
    """Base class of every error this package raises on purpose."""


class SGPUConfigError(SGPUError, ValueError):
    """A setting is invalid. Raised before any process, VM or run is started."""

    def __init__(self, field: str, value: Any, allowed: str, hint: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.hint = hint
        message = f"{field}={value!r} is not allowed: {allowed}"
        if hint:
            message += f". {hint}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.value, self.allowed, self.hint))


class PayloadError(SGPUError, ValueError):
    """The function or its arguments cannot be shipped to the ranks."""


class PayloadImportError(PayloadError, ModuleNotFoundError):
    """A rank could not import a module the payload refers to, while loading it.

    Raised on the rank with the module's name; the driver, reading it back, names where it imports
    that module from and how to ship it (:func:`prefect_sgpu.environment.modules.explained`).
    """

    def __init__(self, module: str, rank_detail: str = "", driver_source: str | None = None,
                 local: bool = True, explained: bool = False) -> None:
        self.module, self.rank_detail, self.driver_source = module, rank_detail, driver_source
        self.local, self.explained = local, explained
        text = f"a rank could not import the module {module!r} while loading the payload"
        if rank_detail:
            text += f" ({rank_detail})"
        if not explained:  # on the rank: where the driver has it is the driver's to say
            text += ("; the driver names where it imports it from and how to ship it (py_modules, working_dir) "
                     "or install it (docs/environment.md)")
        elif driver_source and local:
            text += (f"; the driver imports it from {driver_source}, which is not installed: it travels with the "
                     "job when environment's auto_modules is on (the default) and the driver imported it before "
                     f"the call, or name it: environment={{'py_modules': [{driver_source!r}]}}, or ship its "
                     "project folder with environment={'working_dir': ...} (docs/environment.md)")
        elif driver_source:
            text += (f"; the driver has it installed ({driver_source}): the nodes need its distribution too "
                     "(environment mode 'driver' installs the driver's distributions; with mode 'image' the "
                     "image must hold it, or add it to environment requirements) (docs/environment.md)")
        else:
            text += ("; the driver cannot import it either: install its distribution on the nodes (environment "
                     "requirements or the image), or ship it with environment={'py_modules': [...]} or "
                     "{'working_dir': ...} (docs/environment.md)")
        ImportError.__init__(self, text, name=module)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.module, self.rank_detail, self.driver_source, self.local, self.explained))


class DocumentRefused(PayloadError):
    """A document in the job folder is not this job's own: unsigned, forged, from another
    job, or moved to another node's or rank's place. It is never acted on."""


class ProvisioningError(SGPUError):
    """Compute could not be acquired (capacity, quota, permissions)."""


class EnvironmentMismatch(SGPUError):
    """A node runs what cannot run the driver's calls (another Python minor version, another
    prefect-sgpu, ...): found once the nodes are up, before any rank starts (:mod:`prefect_sgpu.protocol.versions`)."""

    def __init__(self, run_id: str, node: int, host: str, differences: list[str]) -> None:
        self.run_id, self.node, self.host, self.differences = run_id, node, host, list(differences)
        super().__init__(
            f"job {run_id}: node {node} ({host}) cannot run the driver's calls: " + "; ".join(differences)
            + ". Boot the nodes from an image that matches the driver (docs/environment.md); nothing was run."
        )


class GangCheckFailed(SGPUError):
    """The gang check before the user's function (:mod:`prefect_sgpu.observe.gang_check`) found ranks that
    could not join it, or a collective whose result was wrong: nothing of the user's ran.

    ``failed`` maps each failing rank to where it ran (node, host, instance id) and what it saw.
    """

    def __init__(self, run_id: str, failed: dict[int, dict[str, Any]], summary: str = "") -> None:
        self.run_id, self.failed, self.summary = run_id, {int(k): dict(v) for k, v in failed.items()}, summary
        lines = []
        culprits = [r for r in sorted(self.failed) if not self.failed[r].get("collateral")] or sorted(self.failed)
        for rank in culprits:
            info = self.failed[rank]
            where = ", ".join(f"{k} {info[k]}" for k in ("node", "instance", "host") if info.get(k) not in (None, ""))
            lines.append(f"rank {rank} ({where}): {info.get('error', '?')}")
        others = [r for r in sorted(self.failed) if r not in culprits]
        if others:
            lines.append(f"rank(s) {others} stopped because of that")
        super().__init__(
            f"job {run_id}: the gang check failed before the function ran"
            + (f" ({summary})" if summary else "") + ":\n  " + "\n  ".join(lines)
            + "\nTurn the check off with gang_check=False only to skip it, not to fix this.")

    @property
    def nodes(self) -> list[int]:
        """The nodes of the failing ranks that failed on their own (not because a peer did)."""
        own = [info for info in self.failed.values() if not info.get("collateral")]
        return sorted({int(info["node"]) for info in own or self.failed.values() if info.get("node") is not None})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.failed, self.summary))


class LaunchTimeout(SGPUError, TimeoutError):
    """The job did not finish within its ``timeout``; every rank was stopped."""

    def __init__(self, run_id: str, timeout: float, phase: str = "run") -> None:
        self.run_id = run_id
        self.timeout = timeout
        self.phase = phase
        super().__init__(
            f"job {run_id} exceeded timeout={timeout:g}s during {phase}; every rank was stopped"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.timeout, self.phase))


class JobCancelled(SGPUError):
    """The job was cancelled by the caller (future cancel, Prefect cancel)."""


class RankFailedError(SGPUError):
    """A rank failed and its own exception could not be re-raised as is.

    Also attached as ``__cause__``-like context (``exc.sgpu_failure``) to the original
    exception when that one can be unpickled, so callers always find rank, host,
    exit code and the remote traceback.
    """

    def __init__(
        self,
        rank: int | None,
        host: str | None,
        exit_code: int | None,
        remote_traceback: str | None,
        message: str | None = None,
        node: int | None = None,
    ) -> None:
        self.rank, self.node, self.host = rank, node, host
        self.exit_code, self.message, self.remote_traceback = exit_code, message, remote_traceback
        where = f"rank {rank}" if rank is not None else "a rank"
        if node is not None:
            where += f" (node {node})"
        if host:
            where += f" on {host}"
        text = f"{where} failed with exit code {exit_code}"
        if message:
            text += f": {message}"
        if remote_traceback:
            text += "\n\nRemote traceback:\n" + remote_traceback.rstrip()
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.rank, self.host, self.exit_code, self.remote_traceback, self.message, self.node),
        )


class JobHung(SGPUError):
    """Ranks made no progress for the job's ``hang_timeout``: the job was stopped.

    ``ranks`` maps each silent rank to how long it was silent, its last reported step
    and its Python stack at the time (dumped by the node's watchdog).
    """

    def __init__(self, run_id: str, timeout: float, ranks: dict[int, dict[str, Any]]) -> None:
        self.run_id = run_id
        self.timeout = timeout
        self.ranks = ranks
        names = ", ".join(str(r) for r in sorted(ranks))
        text = (f"job {run_id}: rank(s) {names} made no progress for {timeout:g}s (hang_timeout); "
                "every rank was stopped")
        for rank in sorted(ranks):
            info = ranks[rank]
            step = f", last step {info['step']}" if info.get("step") else ""
            text += f"\n\nrank {rank} (silent {info.get('silent_s', 0):.0f}s{step}):\n"
            text += (info.get("stack") or "(no stack: the rank did not answer the dump signal)").rstrip()
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.timeout, self.ranks))


class InfrastructureLost(RankFailedError):
    """Nodes were lost (spot reclaim, instance gone, node silent) more often than ``max_recoveries``
    allows; ``recoveries`` lists the relaunches already made."""

    def __init__(self, rank: int | None, host: str | None, exit_code: int | None, remote_traceback: str | None,
                 message: str | None = None, node: int | None = None,
                 recoveries: list[dict[str, Any]] | None = None) -> None:
        super().__init__(rank, host, exit_code, remote_traceback, message, node)
        self.recoveries = list(recoveries or [])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.host, self.exit_code, self.remote_traceback, self.message,
                             self.node, self.recoveries))


class HeartbeatExpired(RankFailedError):
    """A node stopped its ranks itself because no new driver heartbeat reached it within its TTL, while
    the driver still ran: the driver's process was too loaded to write the heartbeat, or the node could
    not read the store. Whatever the other ranks raised afterwards (a collective whose peer vanished)
    is collateral and is kept in ``collateral``."""

    def __init__(self, rank: int | None, host: str | None, exit_code: int | None, remote_traceback: str | None,
                 message: str | None = None, node: int | None = None, collateral: str | None = None) -> None:
        super().__init__(rank, host, exit_code, remote_traceback, message, node)
        self.collateral = collateral

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.host, self.exit_code, self.remote_traceback, self.message,
                             self.node, self.collateral))


class CheckpointRefused(SGPUError):
    """A checkpoint file that could run code when loaded (or is not what ``Checkpointer`` writes):
    refused before it is unpickled. Whoever can write the checkpoint location can stop a resume,
    never run code in a rank."""


class StoreUnreachable(SGPUError):
    """The job store failed every call for longer than the nodes' heartbeat TTL: they have stopped."""


class ResultRefused(SGPUError):
    """What a rank sent back names a global outside the allow-list of plain data
    (:mod:`prefect_sgpu.protocol.safe_pickle`); nothing of it was called in the driver."""

    def __init__(self, rank: int | None, global_name: str, what: str = "result") -> None:
        self.rank, self.global_name, self.what = rank, global_name, what
        where = f"rank {rank}" if rank is not None else "a rank"
        super().__init__(
            f"the {what} of {where} refers to {global_name}, which the driver does not load by default "
            "(allowed: builtins' plain types and exceptions, collections, datetime, decimal, fractions, uuid, "
            "pathlib, numpy arrays, torch tensors and prefect_sgpu's errors); return plain data (dicts, lists, "
            "tensors), or pass trusted_results=True (to @distributed, .distributed(), @gpu_task or the job spec) "
            "where every rank's code is as trusted as the driver's: see docs/security.md"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.global_name, self.what))


class CostCapReached(SGPUError):
    """The job's machines would have cost more than its ``max_cost_usd``: the ranks were asked for a
    final checkpoint (as a reclaim notice asks), and every rank was stopped.

    ``spent_usd`` is what the machines had cost when the driver decided, ``projected_usd`` what they
    would have cost by its next check; ``checkpoint_step`` the step of the final checkpoint, or None
    when none was complete within the wait (:mod:`prefect_sgpu.driver.cost_cap`)."""

    def __init__(self, run_id: str, cap_usd: float, spent_usd: float, projected_usd: float,
                 checkpoint_step: int | None = None) -> None:
        self.run_id, self.cap_usd, self.spent_usd = run_id, cap_usd, spent_usd
        self.projected_usd, self.checkpoint_step = projected_usd, checkpoint_step
        saved = (f"a final checkpoint was saved at step {checkpoint_step}" if checkpoint_step is not None
                 else "no final checkpoint was complete in time")
        super().__init__(
            f"job {run_id} reached its cost cap max_cost_usd={cap_usd:g}: it had cost ${spent_usd:.4f} and "
            f"would have cost ${projected_usd:.4f} by the next check; {saved}, and every rank was stopped")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.run_id, self.cap_usd, self.spent_usd, self.projected_usd, self.checkpoint_step))
