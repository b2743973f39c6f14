"""Drop-in ``TorchDistributor`` and ``DeepspeedTorchDistributor`` for Databricks Runtime ML code.

Same constructor arguments, ``run()`` arguments and return values as
``pyspark.ml.torch.distributor.TorchDistributor`` and
``pyspark.ml.deepspeed.deepspeed_distributor.DeepspeedTorchDistributor``, without
Spark: ranks are started by ``@distributed`` / ``run_script`` on the local compute
(or the ``compute=`` given), so notebooks written for Databricks run unchanged in a
Prefect flow. Differences, on purpose:

- a training *script* that fails raises (pyspark returns None for scripts either way);
- ``use_gpu=True`` on a machine without GPUs runs CPU ranks with gloo (with a warning),
  as ``@distributed`` does, instead of failing; ``use_gpu=False`` always runs CPU ranks;
- ``DeepspeedTorchDistributor`` also runs with ``useGpu=False`` (DeepSpeed's CPU
  accelerator), which pyspark refuses.

Every rank's output is shown with ``[rank R node N]`` tags, as with ``@distributed``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

from prefect_sgpu.compute.local import LocalProcessCompute
from prefect_sgpu.adapters.decorator import distributed, run_script
from prefect_sgpu.errors import SGPUConfigError
from prefect_sgpu.store import default_home

#: the JSON file of a DeepspeedTorchDistributor's config, for functions (scripts get --deepspeed_config)
DEEPSPEED_CONFIG_ENV = "SGPU_DEEPSPEED_CONFIG"


class CPULocalCompute(LocalProcessCompute):
    """Local processes that never use a GPU, even on a machine that has some (``use_gpu=False``)."""

    def local_gpus(self) -> int:
        return 0


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SGPUConfigError(field, value, "an integer >= 1")
    return value


class TorchDistributor:
    """``TorchDistributor(num_processes, local_mode, use_gpu).run(fn_or_script, *args)``.

    ``run(fn, *args, **kwargs)`` returns rank 0's return value; ``run("train.py", *args)``
    runs the script on every rank (torchrun's environment) and returns None, raising
    if any rank fails. ``local_mode`` is accepted for compatibility: every rank runs on
    ``compute`` (this machine by default), on one node.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True, *,
                 compute: Any | None = None, mlflow: bool = True, env: dict[str, str] | None = None) -> None:
        self.num_processes = _positive_int("num_processes", num_processes)
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)
        self.compute = compute
        self.mlflow = mlflow
        self.env = dict(env or {})
        self.nodes = 1

    def _compute(self) -> Any:
        if self.compute is not None:
            return self.compute
        return LocalProcessCompute() if self.use_gpu else CPULocalCompute()

    def _script_args(self, args: tuple[Any, ...]) -> list[str]:
        return [str(a) for a in args]

    def _env(self) -> dict[str, str]:
        return dict(self.env)

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any | None:
        """Run on every rank: a function's rank-0 value, or None for a script (raises on failure)."""
        common = {"gpus": self.num_processes, "nodes": self.nodes, "compute": self._compute(),
                  "mlflow": self.mlflow, "env": self._env()}
        if isinstance(train_object, (str, os.PathLike)):
            if kwargs:
                raise SGPUConfigError("kwargs", sorted(kwargs), "none for a script: pass its arguments as strings")
            run_script(train_object, args=self._script_args(args), **common)
            return None
        if not callable(train_object):
            raise SGPUConfigError("train_object", train_object, "a function or the path of a Python script")
        return distributed(**common)(train_object).distributed(*args, **kwargs)[0]


class DeepspeedTorchDistributor(TorchDistributor):
    """``DeepspeedTorchDistributor(numGpus, nnodes, localMode, useGpu, deepspeedConfig).run(...)``.

    ``numGpus`` ranks on each of ``nnodes`` nodes. ``deepspeedConfig`` (a dict or a JSON
    file path) reaches scripts as ``--deepspeed --deepspeed_config PATH`` (as pyspark
    passes it) and functions as the ``SGPU_DEEPSPEED_CONFIG`` environment variable, read
    with :func:`deepspeed_config`.
    """

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True,  # noqa: N803 - pyspark's names
                 useGpu: bool = True, deepspeedConfig: str | dict[str, Any] | None = None, *,
                 compute: Any | None = None, mlflow: bool = True, env: dict[str, str] | None = None) -> None:
        gpus_per_node = _positive_int("numGpus", numGpus)
        self.nnodes = _positive_int("nnodes", nnodes)
        super().__init__(gpus_per_node * self.nnodes, localMode, useGpu, compute=compute, mlflow=mlflow, env=env)
        self.nodes = self.nnodes
        self.deepspeed_config = deepspeedConfig
        self._config_path = self._config_file(deepspeedConfig)

    @staticmethod
    def _config_file(config: str | dict[str, Any] | None) -> str:
        """The config as a JSON file path ("" for DeepSpeed's defaults); a dict is written once."""
        if config is None:
            return ""
        if isinstance(config, dict):
            text = json.dumps(config, sort_keys=True)
            path = default_home() / "deepspeed" / f"config-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return str(path)
        if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
            return str(Path(config).resolve())
        raise SGPUConfigError("deepspeedConfig", config, "a dict, the path of an existing JSON file, or None")

    def _script_args(self, args: tuple[Any, ...]) -> list[str]:
        argv = [*super()._script_args(args), "--deepspeed"]
        return argv + ["--deepspeed_config", self._config_path] if self._config_path else argv

    def _env(self) -> dict[str, str]:
        env = super()._env()
        if self._config_path:
            env[DEEPSPEED_CONFIG_ENV] = self._config_path
        return env


def deepspeed_config() -> dict[str, Any] | None:
    """Inside a rank: the DeepspeedTorchDistributor's config as a dict (None when none was given)."""
    path = os.environ.get(DEEPSPEED_CONFIG_ENV)
    return json.loads(Path(path).read_text()) if path else None
