"""Periodic checkpoints that are complete or ignored, and automatic resume.

Each checkpoint goes to its own step folder (``step-00000040/``). Every rank writes its
part — the whole model and optimizer from rank 0 for DDP, one shard per rank for FSDP2
(``torch.distributed.checkpoint``) and DeepSpeed ZeRO (``engine.save_checkpoint``) —
plus its own extra state (step, data-loader position, RNG). Then all ranks meet at a
barrier and rank 0 writes the ``COMPLETE`` marker, atomically (write to a temporary
name, then rename). The marker carries a manifest of every file of the step (name, size,
sha256), sealed with the location's key (:mod:`prefect_sgpu.checkpoints.manifest`): the
key is derived per location from a secret the driver holds, so a Prefect retry of the task
verifies what earlier attempts wrote, and whoever can only write the location cannot.
Resume picks the newest folder whose marker is sealed and whose files match it, so a job
killed while writing never resumes from half a checkpoint, and a forged marker or a
changed file is refused (logged) and the next older verified step is restored instead
(or none: a fresh start). Only the last ``keep`` complete checkpoints stay.

The location defaults to ``runtime.checkpoint_uri()``: the job store's checkpoint
folder, which ``gpu_task`` keys by flow run, task and inputs so a Prefect retry (or a
relaunch after a lost node) finds the checkpoints of the failed attempt. A local path
is used in place; on an ``s3://`` location each node writes into a node-local stage,
uploads its own files, and rank 0 uploads the marker only after every node has
(:mod:`prefect_sgpu.checkpoints`), so a checkpoint on S3 is complete or absent too, and
a gang on different nodes than the writers restores it by downloading it first.

When the node is about to be reclaimed (a spot interruption notice, see
``runtime.preemption_requested()``), ``due`` says so on every rank at the same step,
so the loop saves at once instead of losing the work since the last regular save. The
driver's ask for a final checkpoint before it stops a job (its cost cap,
``runtime.final_checkpoint_requested()``) is answered the same way.
A rebalance recommendation (``runtime.rebalance_recommendation()``) is only a warning that the
node may be reclaimed later, or never: ``on_rebalance=True`` makes it one early save too (once),
by default it changes nothing.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect_sgpu import runtime
from prefect_sgpu.checkpoints.manifest import FileEntry, check_name, warn_once
from prefect_sgpu.checkpoints import MARKER, Location, step_dir_name
from prefect_sgpu.errors import CheckpointRefused, SGPUConfigError
from prefect_sgpu.pipeline import async_save as async_save_mod
from prefect_sgpu.pipeline.collectives import barrier, dist_ready, flag_group, from_rank_zero
from prefect_sgpu.pipeline.safe_load import WeightsOnlyLoads, load_dcp
from prefect_sgpu.pipeline.world_change import WorldChange, check_restorable, reseed, saved_world_size

if TYPE_CHECKING:
    from prefect_sgpu.pipeline.strategies import Wrapped

__all__ = ["MARKER", "Checkpointer", "SealedSteps", "complete_steps", "latest_complete_step", "load_model", "save_model",
           "step_dir_name"]

logger = logging.getLogger("prefect_sgpu.checkpoints")

#: the file of a model saved with :func:`save_model`, in its own folder at the checkpoint location
MODEL_FILE = "model.pt"


def complete_steps(folder: str | Path) -> list[int]:
    """Steps with a complete checkpoint at ``folder`` (a path or an ``s3://`` URI), oldest first: their
    marker is sealed with the location's key (the files are checked when a step is restored)."""
    return Location(folder).complete_steps()


def latest_complete_step(folder: str | Path) -> int | None:
    steps = complete_steps(folder)
    return steps[-1] if steps else None


def _rng_state() -> dict[str, Any]:
    """Every RNG's state in types ``torch.load(weights_only=True)`` accepts (tensors, numbers, tuples)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, key, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (str(kind), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    except ImportError:
        pass
    if runtime.uses_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and runtime.uses_gpu():
        torch.cuda.set_rng_state(state["cuda"])


def save_model(state_dict: dict[str, Any] | None, name: str = "final") -> str:
    """Rank 0: ``state_dict`` as one weights-only file in folder ``name`` of the job's checkpoint
    location (uploaded, marker last, when it is on S3); every rank returns its URI.

    Tasks pass this URI instead of the weights: a Prefect result stays a few bytes, and the
    model sits beside the checkpoints it came from (kept across retries of the task).
    """
    location = Location()
    if runtime.is_rank_zero():
        if state_dict is None:
            raise SGPUConfigError("state_dict", None, "rank 0's full state dict (Wrapped.full_state_dict())")
        if "/" in check_name(name, f"{location.uri}/{name}"):
            raise SGPUConfigError("name", name, "one folder name (no '/')")
        folder = location.ensure_local() / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        _atomic_torch_save(state_dict, folder / MODEL_FILE)
        files = location.upload(name)  # rank 0 wrote the folder whole: its manifest is this node's
        location.put_marker(name, {"written_at": time.time()}, files)  # last: complete
    barrier()
    return f"{location.uri.rstrip('/')}/{name}/{MODEL_FILE}"


def load_model(uri: str) -> dict[str, Any]:
    """A state dict saved by :func:`save_model`: its folder's sealed manifest checked (the files fetched
    first when on S3), then loaded with ``weights_only=True``."""
    import torch

    folder_uri, _, file_name = uri.rstrip("/").rpartition("/")
    location_uri, _, name = folder_uri.rpartition("/")
    location = Location(location_uri)
    path = location.fetch(name) / check_name(file_name, uri)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(f"model file {uri} holds more than tensors and plain values: refused "
                                f"({str(exc).splitlines()[0]})") from None


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class SealedSteps:
    """Step folders at one checkpoint location, each sealed once every rank's part is stored, and the
    newest verified one found again: what :class:`Checkpointer` and the trainer callbacks
    (:mod:`prefect_sgpu.integrations`) share. Collective where a method says so."""

    def __init__(self, folder: str | Path | None = None, *, keep: int = 2, on_rebalance: bool = False) -> None:
        if keep < 1:
            raise SGPUConfigError("keep", keep, "an integer >= 1 (complete checkpoints to keep)")
        #: save once, early, when any rank's node gets a rebalance recommendation (not only on a reclaim notice)
        self.on_rebalance = bool(on_rebalance)
        self.rebalanced_at: int | None = None
        self.location = Location(folder)
        #: where this rank reads and writes: the location itself, or this node's (private) stage of it
        self.folder = self.location.ensure_local()
        self.keep = keep
        self.preempted_at: int | None = None
        self._flags = flag_group()

    def reclaim_due(self, step: int) -> bool:
        """True once, at the first ``step`` where any rank's node has a reclaim notice or the driver's ask
        for a final checkpoint (collective:
        every rank calls it at every step, so all of them save at the same step); with
        ``on_rebalance``, also once at the first step where any rank's node has a rebalance
        recommendation."""
        # one collective for both: 2 where a node has a reclaim notice, 1 where the driver asked for a
        # final checkpoint before it stops the job (its cost cap), 0 where neither
        asked = 0 if self.preempted_at is not None else self._max_rank(
            2 if runtime.preemption_requested() else 1 if runtime.final_checkpoint_requested() is not None else 0)
        if asked == 2:
            self.preempted_at = step
            print(f"[sgpu] reclaim notice: saving a checkpoint at step {step} "
                  f"({runtime.preemption_notice() or 'on another node'})", flush=True)
            return True
        if asked == 1:
            self.preempted_at = step  # the driver stops the job next: saved (and awaited) as on a reclaim
            print(f"[sgpu] the driver asked for a final checkpoint: saving at step {step} "
                  f"({runtime.final_checkpoint_requested() or 'on another node'})", flush=True)
            return True
        if (self.on_rebalance and self.rebalanced_at is None and self.preempted_at is None
                and self._any_rank(runtime.rebalance_recommendation() is not None)):
            self.rebalanced_at = step
            print(f"[sgpu] rebalance recommendation: saving a checkpoint at step {step} "
                  f"({runtime.rebalance_recommendation() or 'on another node'}); the job goes on", flush=True)
            return True
        return False

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` on any rank, over a CPU (gloo) group: no device sync in the training loop."""
        return bool(self._max_rank(1 if flag else 0))

    def _max_rank(self, value: int) -> int:
        """The largest ``value`` of any rank, over a CPU (gloo) group (collective)."""
        if not dist_ready():
            return value
        import torch
        import torch.distributed as dist

        box = torch.tensor([value])
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self._flags)
        return int(box.item())

    def clears(self) -> bool:
        """Does this rank clear and arrange step folders? One per folder: rank 0 for a shared folder,
        each node's first rank for its stage."""
        return runtime.local_rank() == 0 if self.location.remote else runtime.is_rank_zero()

    def fresh_step_folder(self, name: str) -> Path:
        """The step's folder, emptied of what an attempt that died left (collective)."""
        target = self.folder / name
        if self.clears() and target.exists():
            shutil.rmtree(target)
        barrier()
        target.mkdir(parents=True, exist_ok=True)
        return target

    def _marker_info(self, step: int) -> dict[str, Any]:
        return {"step": step, "world_size": runtime.world_size(), "written_at": time.time()}

    def seal(self, step: int, name: str, group: Any) -> None:
        """Once every rank has written its part: each node sends its part (remote), then rank 0 seals
        what they all sent (a local folder: rank 0 hashes what all wrote) and prunes; collective over
        ``group`` (None: the job's group, and the flags group for the gather)."""
        barrier(group)  # every rank's part is on its node's disk
        files = None
        if self.location.remote:
            files = self._gather(self.location.upload(name) if runtime.local_rank() == 0 else {}, group)
        else:
            barrier(group)
        if runtime.is_rank_zero():
            self.location.put_marker(name, self._marker_info(step), files)
            self._prune(step)
        if self.location.remote and runtime.local_rank() == 0:
            self.location.prune_stage(keep=name)
        barrier(group)

    def _gather(self, files: dict[str, FileEntry], group: Any = None) -> dict[str, FileEntry]:
        """Every node's uploaded files, on every rank (collective; also the barrier before the marker)."""
        if not dist_ready():
            return files
        import torch.distributed as dist

        group = group if group is not None else self._flags
        parts: list[Any] = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(parts, {k: (v.size, v.sha256) for k, v in files.items()}, group=group)
        merged: dict[str, FileEntry] = {}
        for part in parts:
            for rel, (size, sha256) in part.items():
                entry = FileEntry(size=size, sha256=sha256)
                if merged.setdefault(rel, entry) != entry:
                    raise CheckpointRefused(f"checkpoint file {rel} was written differently by two nodes: "
                                            "the step is not sealed")
        return merged

    def _prune(self, newest: int) -> None:
        """Keep the last ``keep`` complete checkpoints; drop older ones and stale partial folders.

        A step whose marker this key cannot verify (sealed under another key: a retry on a host with
        another checkpoint secret, a run with another key for the same folder; or forged) is never
        deleted: it is left as it is, with one warning naming the folder. Only verified steps and
        folders without a marker (a save that died) are removed."""
        complete = self.location.complete_steps()
        kept = set(complete[-self.keep:])
        marked = set(self.location.marker_steps())
        unverified = sorted(marked - set(complete))
        if unverified:
            warn_once(self.location.uri, "prune", CheckpointRefused(
                f"checkpoint folder {self.location.uri}: step(s) {', '.join(map(str, unverified))} carry a "
                "marker this job's key cannot verify (another checkpoint secret or key, or forged): left in "
                "place, never deleted; remove them yourself once they are not needed"))
        for step in self.location.step_dirs():
            if step in kept or step in unverified:
                continue
            if step < newest or step in complete:
                self.location.delete(step_dir_name(step))

    # --- restoring ---------------------------------------------------------------

    def latest(self) -> int | None:
        """The newest step whose marker is sealed, as rank 0 sees it (the same answer on every rank)."""
        steps = self._candidates()
        return steps[0] if steps else None

    def _candidates(self) -> list[int]:
        """Steps with a sealed marker, newest first, as rank 0 sees them (the same list on every rank)."""
        steps = list(reversed(self.location.complete_steps())) if runtime.is_rank_zero() else None
        return list(from_rank_zero(steps))

    def _checked(self, step: int) -> bool:
        """Collective: the step's files are here and match its sealed manifest on every node (fetched
        into each node's stage when remote; checked in place by rank 0 when local)."""
        problem: CheckpointRefused | None = None
        if self.clears():
            try:
                self.location.fetch(step_dir_name(step))
            except CheckpointRefused as exc:
                problem = exc
        if problem is not None:
            logger.warning("%s; restoring an older checkpoint instead (or starting fresh)", problem)
        return not self._any_rank(problem is not None)

    def newest_verified(self) -> int | None:
        """Collective: the newest step that is sealed and whose files check out on every node (each
        node's stage holds it then), or None."""
        for step in self._candidates():
            if self._checked(step):
                return step
        return None


class Checkpointer(SealedSteps):
    """Saves ``wrapped`` every ``every`` steps into ``folder``; restores the newest complete one.

    Use it the same way on every rank::

        ckpt = Checkpointer(wrapped, every=10, keep=2)
        start, extra = ckpt.restore()              # (0, {}) on a fresh start
        for step in range(start, total):
            ...
            if ckpt.due(step + 1):
                ckpt.save(step + 1, {"loader": loader.state_dict()})

    ``save``/``maybe_save``/``restore`` are collective: every rank must call them.

    ``async_save=True``: ``save`` copies the state to CPU memory (FSDP2: torch DCP's
    ``async_save`` stages it) and returns; writing, uploading and sealing the checkpoint go on
    in a background thread (:mod:`prefect_sgpu.pipeline.async_save`). The next ``save`` (and
    ``restore``) first waits for the one before; call ``wait()`` after the last step, so the
    final checkpoint is complete before the function returns. A background save that failed
    raises in the call that waits for it. DeepSpeed saves inline whatever the setting (its
    engine writes its own files).

    ``on_rebalance=True``: a rebalance recommendation (a warning that a node may be reclaimed later,
    or never) makes ``due`` true once, as a reclaim notice does; the job goes on after that save.
    """

    def __init__(self, wrapped: "Wrapped", folder: str | Path | None = None, *, every: int = 10,
                 keep: int = 2, async_save: bool = False, on_rebalance: bool = False) -> None:
        if every < 1:
            raise SGPUConfigError("every", every, "an integer >= 1 (steps between checkpoints)")
        super().__init__(folder, keep=keep, on_rebalance=on_rebalance)
        self.wrapped = wrapped
        self.every = every
        #: saves in the background (DeepSpeed: always inline)
        self.async_save = bool(async_save) and wrapped.strategy != "deepspeed"
        self._save_group = async_save_mod.save_group() if self.async_save else None
        self._pending: async_save_mod.BackgroundSave | None = None
        #: the last restore's step and world sizes (saved by, restored in); None before a restore found one
        self.restored: WorldChange | None = None

    # --- saving ------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every``, or, once, when a node is about to be reclaimed.

        Also reports progress to the hang watchdog. With a process group this is collective
        (every rank must call it at every step): the ranks agree on a reclaim notice that
        only one node received, so all of them save at the same step.
        """
        runtime.progress(step)
        if self.reclaim_due(step):
            return step > 0
        return step > 0 and step % self.every == 0

    def maybe_save(self, step: int, extra: dict[str, Any] | None = None) -> Path | None:
        """Save when ``step`` is due; returns the folder written, if any."""
        return self.save(step, extra) if self.due(step) else None

    def wait(self) -> None:
        """Wait until the background save under way (if any) is complete; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint of ``step`` and mark it complete once every rank's part is stored
        (with ``async_save``: start doing so in the background, after the previous save ended)."""
        if self.async_save:
            target = self._save_in_background(step, extra)
            if step == self.preempted_at or runtime.preemption_requested():  # the node is going away: awaited
                self.wait()
            return target
        name = step_dir_name(step)
        target = self.fresh_step_folder(name)
        self._save_training_state(target)
        state = {"step": step, "extra": extra or {}, "rng": _rng_state()}
        _atomic_torch_save(state, target / f"extra-rank-{runtime.rank():05d}.pt")
        self.seal(step, name, None)
        runtime.progress(step)
        return target

    def _save_in_background(self, step: int, extra: dict[str, Any] | None) -> Path:
        """The loop's part of an asynchronous save: wait for the previous one, clear the step's folder,
        copy the state to CPU memory; writing and sealing run in a thread (``work`` below)."""
        self.wait()
        name = step_dir_name(step)
        target = self.fresh_step_folder(name)
        state = {"step": step, "extra": async_save_mod.cpu_copy(extra or {}), "rng": _rng_state()}
        w = self.wrapped
        written: Any = None  # what finishes the training state in the background
        if w.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(w.module, w.optimizer)
            written = dcp.async_save({"model": model_state, "optimizer": optim_state},
                                     checkpoint_id=str(target / "dcp"), process_group=self._save_group)
        elif runtime.is_rank_zero():
            written = async_save_mod.cpu_copy({"model": w.module.state_dict(), "optimizer": w.optimizer.state_dict()})
        runtime.progress(step)

        def work() -> None:
            if w.strategy == "fsdp":
                written.result()
            elif written is not None:
                _atomic_torch_save(written, target / "model.pt")
            _atomic_torch_save(state, target / f"extra-rank-{runtime.rank():05d}.pt")
            self.seal(step, name, self._save_group)

        self._pending = async_save_mod.BackgroundSave(step, work)
        return target

    def _marker_info(self, step: int) -> dict[str, Any]:
        return {**super()._marker_info(step), "strategy": self.wrapped.strategy}

    def _save_training_state(self, target: Path) -> None:
        w = self.wrapped
        if w.strategy == "deepspeed":
            w.engine.save_checkpoint(str(self.folder), tag=target.name, save_latest=False)
        elif w.strategy == "fsdp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(w.module, w.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(target / "dcp"))
        elif runtime.is_rank_zero():  # DDP: every replica is the same, rank 0 writes it whole
            _atomic_torch_save({"model": w.module.state_dict(), "optimizer": w.optimizer.state_dict()},
                               target / "model.pt")

    def restore(self) -> tuple[int, dict[str, Any]]:
        """Load the newest complete, verified checkpoint into the model and optimizer.

        Returns ``(step, extra)``: the step it was saved at and the extra state given to
        ``save``, or ``(0, {})`` when there is none. RNG states are restored too. A step whose
        marker is not sealed with the location's key, or whose files differ from its sealed
        manifest, is skipped with a warning, and the next older one is tried.

        A checkpoint written by a world of another size (an elastic job that grew or shrank) is
        restored as :mod:`prefect_sgpu.pipeline.world_change` says: FSDP2 resharded, DDP from rank 0's
        copy, DeepSpeed at ZeRO stage 0 (or from a universal checkpoint), any other DeepSpeed state
        refused with an ``SGPUConfigError`` naming both world sizes. Every rank then gets rank 0's
        ``extra``, its generators are seeded from the step and its new rank, and ``restored`` says so.
        """
        self.wait()
        step = self.newest_verified()
        return (0, {}) if step is None else self._restore_step(step)

    def _restore_step(self, step: int) -> tuple[int, dict[str, Any]]:
        source = self.folder / step_dir_name(step)
        change = self._world_change(step)
        w = self.wrapped
        universal = w.engine is not None and bool(w.engine.load_universal_checkpoint())
        check_restorable(w.strategy, change, zero_stage=w.zero_stage, universal=universal)
        self._load_training_state(source)
        own = source / f"extra-rank-{runtime.rank():05d}.pt"
        if change.changed:  # per-rank streams and positions do not map onto another world's ranks
            state = self._load(source / "extra-rank-00000.pt")
            reseed(step, runtime.rank())
            if runtime.is_rank_zero():
                print(f"[sgpu] restored step {step} written by {change.saved} ranks into {change.now} ranks "
                      f"({w.strategy}): rank 0's extra on every rank, RNG seeded per rank", flush=True)
        else:
            state = self._load(own if own.exists() else source / "extra-rank-00000.pt")
            _set_rng_state(state["rng"])
        barrier()
        self.restored = change
        return int(state["step"]), dict(state["extra"])

    def _world_change(self, step: int) -> WorldChange:
        """The world size the step's sealed marker names, as rank 0 read it, beside this world's."""
        info = None
        if runtime.is_rank_zero():
            manifest = self.location.manifest(step_dir_name(step))
            info = dict(manifest.info) if manifest is not None else {}
        return WorldChange(step, saved_world_size(from_rank_zero(info)), runtime.world_size())

    def saved_extras(self) -> list[dict[str, Any]]:
        """Every saving rank's ``extra`` of the step the last ``restore`` loaded, in rank order: what code
        merges that keeps per-rank state (data-loader positions) across a change of world size."""
        if self.restored is None:
            return []
        source = self.folder / step_dir_name(self.restored.step)
        return [dict(self._load(path)["extra"]) for path in sorted(source.glob("extra-rank-*.pt"))]

    def _load(self, path: Path) -> Any:
        """A file this class wrote: tensors, numbers, strings and containers only (``weights_only``)."""
        import torch

        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointRefused(
                f"checkpoint file {path} holds more than tensors and plain values, so loading it could run "
                f"code: refused ({str(exc).splitlines()[0]}). Keep `extra` to tensors, numbers, strings, "
                "lists, tuples and dicts.") from None

    def _load_training_state(self, source: Path) -> None:
        w = self.wrapped
        if w.strategy == "deepspeed":
            engine = w.engine
            own = engine.checkpoint_engine
            engine.checkpoint_engine = WeightsOnlyLoads(own)
            try:
                path, _ = engine.load_checkpoint(str(self.folder), tag=source.name)
            finally:
                engine.checkpoint_engine = own
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {source}")
        elif w.strategy == "fsdp":
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(w.module, w.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            load_dcp(state, source / "dcp")
            set_state_dict(w.module, w.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        else:
            state = self._load(source / "model.pt")
            w.module.load_state_dict(state["model"])
            w.optimizer.load_state_dict(state["optimizer"])
