"""Loading checkpoint files without running code from them.

A checkpoint location is writable by more than the job (an S3 prefix, a shared folder), so
every file a restore reads is treated as untrusted: torch.distributed.checkpoint's pickled
``.metadata`` passes a restricted unpickler first, its non-tensor entries load weights-only,
and DeepSpeed's loads go through torch's weights-only unpickler. A refusal raises
:class:`~prefect_sgpu.errors.CheckpointRefused` before anything from the file runs.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from prefect_sgpu.errors import CheckpointRefused

#: harmless builtins a checkpoint's pickled metadata may name (no callables that reach further)
_SAFE_BUILTINS = frozenset({"set", "frozenset", "slice", "complex", "bytearray", "tuple", "list", "dict", "int",
                            "float", "bool", "str", "bytes", "object"})
_SAFE_GLOBALS = frozenset({("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
                           ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                           ("pathlib", "PureWindowsPath"), ("copyreg", "_reconstructor"),
                           ("torch.distributed.checkpoint.filesystem", "_StorageInfo")})


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's ``.metadata``: its own classes, torch sizes and dtypes,
    paths and plain containers; any other global (``os.system``, ``builtins.eval``, ...) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # some Pythons (3.11.0 to 3.11.2) pickle enum members as getattr(cls, name)
        allowed = ((module == "torch.distributed.checkpoint.metadata" and name[:1].isupper())
                   or (module == "torch.distributed.checkpoint.metadata" and name == "_MEM_FORMAT_ENCODING")
                   or (module, name) in _SAFE_GLOBALS
                   or (module == "builtins" and name in _SAFE_BUILTINS)
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise CheckpointRefused(f"{module}.{name}")
        return super().find_class(module, name)


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr`` as a checkpoint's metadata may call it: only a member of an enum the unpickler
    allowed, by its name."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise CheckpointRefused(f"builtins.getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r})")


def check_dcp_metadata(path: Path) -> None:
    """Refuse a DCP ``.metadata`` that names anything but DCP's own types (it is unpickled by DCP)."""
    try:
        with open(path, "rb") as fh:
            _MetadataUnpickler(fh).load()
    except CheckpointRefused as exc:
        raise CheckpointRefused(f"checkpoint metadata {path} names {exc}, which DCP's loader would call: "
                                "refused") from None


def weights_only_load_planner() -> Any:
    """DCP's default load planner, except that non-tensor entries (optimizer settings, steps) load
    with ``weights_only=True``: DCP's own planner unpickles them with ``weights_only=False``, so a
    planted entry in a shard file would run code in every rank that restores it."""
    import io

    import torch
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise CheckpointRefused(f"checkpoint entry {fqn!r} is not plain data (tensors, numbers, strings, "
                                        f"containers): refused before it ran ({exc})") from None
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes places it
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return WeightsOnlyLoadPlanner()


def load_dcp(state: dict[str, Any], folder: Path) -> None:
    """``dcp.load`` into ``state`` without running anything from the files: the ``.metadata`` passes a
    restricted unpickler first and non-tensor entries load weights-only; a refusal (which DCP wraps
    in its own exception) is raised as ``CheckpointRefused``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_dcp_metadata(folder / ".metadata")
    try:
        dcp.load(state, checkpoint_id=str(folder), planner=weights_only_load_planner())
    except CheckpointException as exc:
        refused = [str(f) for f in getattr(exc, "failures", {}).values() if "CheckpointRefused" in repr(f)]
        if refused or "CheckpointRefused" in str(exc):
            detail = refused[0] if refused else str(exc).split("CheckpointRefused:", 1)[-1].strip()
            raise CheckpointRefused(f"{folder}: {detail[:1000]}") from None
        raise


def _deepspeed_safe_globals() -> list[Any]:
    """The classes DeepSpeed's ZeRO optimizer files name besides tensors and plain values (checked on 0.19 for
    stages 0-3): its loss scalers, the stage enum and the fragment addresses of its flat buffers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


class WeightsOnlyLoads:
    """A DeepSpeed checkpoint engine whose loads go through torch's weights-only unpickler.

    DeepSpeed's own engines call ``torch.load(weights_only=False)``; every file its
    ``load_checkpoint`` reads (model states, ZeRO optimizer shards) goes through ``load``, so
    swapping the engine for the length of a restore refuses a planted pickle at the one place
    it would be read, with no window between a check and the load.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        import torch

        try:
            with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointRefused(
                f"checkpoint file {path} names more than tensors, plain values and DeepSpeed's own checkpoint "
                f"classes, so loading it could run code: refused ({str(exc).splitlines()[0]})") from None
