"""What a rank sends back loads as plain data in the driver: a hostile ``__reduce__`` never runs there."""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import os
import pathlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from prefect_sgpu import ResultRefused, SGPUConfigError, spec
from prefect_sgpu.driver import results
from prefect_sgpu.errors import GangCheckFailed, RankFailedError
from prefect_sgpu.protocol import payload

BASE = {"rank": 3, "node": 1, "local_rank": 1, "host": "node-1"}


class RunsACommand:
    """A return value whose unpickling runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@dataclass
class Scores:
    """A user-defined class: loaded only where the job trusts its ranks."""

    loss: float
    names: list[str]


class ModelDiverged(Exception):
    """A user exception class the driver itself imported (this module)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        Path(os.environ["SGPU_TEST_INIT_MARKER"]).touch()  # must not run in the driver


class CarriesACommand(Exception):
    """An exception whose unpickling runs a shell command."""

    def __init__(self, marker: Path) -> None:
        super().__init__("carries a command")
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _through_the_store(env: payload.Envelope) -> payload.Envelope:
    return payload.load_envelope(payload.dump_envelope(env), env.rank)


def test_a_result_whose_reduce_runs_a_command_is_refused_naming_rank_global_and_opt_in(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    env = _through_the_store(payload.success_envelope(dict(BASE), RunsACommand(marker)))
    with pytest.raises(ResultRefused) as info:
        env.value()
    text = str(info.value)
    assert "rank 3" in text and f"{os.system.__module__}.system" in text and "trusted_results=True" in text
    assert info.value.rank == 3 and info.value.global_name == f"{os.system.__module__}.system"
    assert not marker.exists(), "the command never runs in the driver"


def test_a_user_class_is_refused_by_default_and_returns_with_the_opt_in() -> None:
    env = _through_the_store(payload.success_envelope(dict(BASE), Scores(0.5, ["a"])))
    with pytest.raises(ResultRefused, match=r"rank 3 refers to .*Scores"):
        env.value()
    assert env.value(trusted=True) == Scores(0.5, ["a"])


def test_an_envelope_carrying_a_command_is_refused_before_anything_runs(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    env = payload.success_envelope(dict(BASE), 1)
    env.gang_check = {"report": RunsACommand(marker)}  # any rank holds the key that seals an envelope
    with pytest.raises(ResultRefused, match=r"envelope of rank 3 refers to .*system"):
        payload.load_envelope(payload.dump_envelope(env), 3)
    assert not marker.exists()


def test_plain_data_tensors_arrays_and_containers_round_trip_by_default() -> None:
    value = {
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3), "half": torch.ones(2, dtype=torch.bfloat16),
        "state": collections.OrderedDict(w=torch.zeros(3)), "array": np.arange(4.0), "i4": np.int32(7),
        "objects": np.array([1, "a"], dtype=object), "when": datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc),
        "took": datetime.timedelta(seconds=3), "day": datetime.date(2026, 1, 2), "price": decimal.Decimal("1.25"),
        "third": fractions.Fraction(1, 3), "id": uuid.UUID(int=5), "path": pathlib.PurePosixPath("/data/x"),
        "nested": [(1, 2.5, 3j, None, True), {"set": {1, 2}, "frozen": frozenset({"a"}), "bytes": b"x"}],
        "counts": collections.Counter("aab"), "lists": collections.defaultdict(list, {"k": [1]}),
        "queue": collections.deque([1, 2]), "range": range(3), "slice": slice(1, 4), "raw": bytearray(b"y"),
    }
    back = _through_the_store(payload.success_envelope(dict(BASE), value)).value()
    assert torch.equal(back["tensor"], value["tensor"]) and back["half"].dtype == torch.bfloat16
    assert torch.equal(back["state"]["w"], torch.zeros(3)) and isinstance(back["state"], collections.OrderedDict)
    assert np.array_equal(back["array"], value["array"]) and back["i4"] == np.int32(7)
    assert list(back["objects"]) == [1, "a"]
    for key in ("when", "took", "day", "price", "third", "id", "path", "nested", "counts", "lists", "queue",
                "range", "slice", "raw"):
        assert back[key] == value[key], key
    assert back["lists"].default_factory is list


def _failure_of(env: payload.Envelope, trusted: bool = False) -> BaseException:
    job = SimpleNamespace(envelopes=lambda: {env.rank: env}, run_id="job-1",
                          spec=spec.merge(spec.layer("call", trusted_results=trusted)))
    return results.failure(job, {1: 1}, {}, {})


def _failure_envelope(exc: BaseException) -> payload.Envelope:
    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001
        env = payload.failure_envelope(dict(BASE), raised, f"Traceback (most recent call last):\n  raise {exc!r}", 1)
    return _through_the_store(env)


def test_a_builtin_or_project_exception_is_rebuilt_as_itself() -> None:
    err = _failure_of(_failure_envelope(KeyError("missing column")))
    assert isinstance(err, KeyError) and err.args == ("missing column",)
    assert err.sgpu_failure.rank == 3  # type: ignore[attr-defined]
    gang = _failure_envelope(GangCheckFailed("job-1", {1: {"node": 0, "error": "gloo timed out"}}))
    assert isinstance(gang.exception(), GangCheckFailed) and gang.exception().failed[1]["error"] == "gloo timed out"


def test_a_user_exception_is_rebuilt_from_type_message_and_traceback_without_its_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGPU_TEST_INIT_MARKER", str(tmp_path / "rank-init"))
    env = _failure_envelope(ModelDiverged("loss is nan at step 7"))
    (tmp_path / "rank-init").unlink()  # the rank ran __init__; the driver must not
    err = _failure_of(env)
    assert type(err) is ModelDiverged and str(err) == "loss is nan at step 7"
    assert not (tmp_path / "rank-init").exists(), "the class's own code never runs in the driver"
    failure = err.sgpu_failure  # type: ignore[attr-defined]
    assert failure.rank == 3 and "raise ModelDiverged" in failure.remote_traceback
    assert "raise ModelDiverged" in "\n".join(err.__notes__)


def test_an_exception_carrying_a_command_becomes_a_rank_failure_naming_type_message_and_traceback(
        tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"

    class Local(Exception):
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    env = _failure_envelope(Local("hostile"))
    err = _failure_of(env)
    assert isinstance(err, RankFailedError) and err.rank == 3
    assert "Local: hostile" in str(err) and ".system" in str(err) and "trusted_results=True" in str(err)
    assert "raise Local" in (err.remote_traceback or "")
    assert not marker.exists()
    assert env.exception() is None


def test_with_the_opt_in_the_ranks_own_exception_returns_with_its_attributes() -> None:
    class WithStep(Exception):
        def __init__(self, step: int) -> None:
            super().__init__(f"diverged at {step}")
            self.step = step

    env = _failure_envelope(WithStep(7))
    assert isinstance(_failure_of(env), RankFailedError)
    err = _failure_of(env, trusted=True)
    assert type(err).__name__ == "WithStep" and err.step == 7  # type: ignore[attr-defined]


def test_trusted_results_is_validated() -> None:
    assert spec.merge(spec.layer("call", trusted_results=True)).trusted_results is True
    assert spec.merge(spec.layer("call")).trusted_results is False
    assert spec.merge(spec.environment_layer({"PREFECT_SGPU_TRUSTED_RESULTS": "true"})).trusted_results is True
    with pytest.raises(SGPUConfigError, match=r"trusted_results='yes' is not allowed: True .* or False"):
        spec.layer("call", trusted_results="yes")
    with pytest.raises(SGPUConfigError, match="PREFECT_SGPU_TRUSTED_RESULTS"):
        spec.environment_layer({"PREFECT_SGPU_TRUSTED_RESULTS": "maybe"})


def test_a_class_registered_with_torchs_safe_globals_loads_by_default() -> None:
    env = _through_the_store(payload.success_envelope(dict(BASE), Scores(1.0, [])))
    with torch.serialization.safe_globals([Scores]):
        assert env.value() == Scores(1.0, [])
    with pytest.raises(ResultRefused):
        env.value()
