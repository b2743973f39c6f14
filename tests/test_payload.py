"""Payload checks happen before anything starts and name the culprit."""

from __future__ import annotations

import threading

import pytest

from prefect_sgpu import PayloadError, distributed
from prefect_sgpu.protocol import payload
from prefect_sgpu.store import LocalStore

LOCK = threading.Lock()


def _uses_global_lock() -> bool:
    return LOCK.locked()


def test_unpicklable_argument_is_named(tmp_path) -> None:
    store = LocalStore(tmp_path)

    @distributed(gpus=2, mlflow=False, store=store)
    def train(config: dict, lock: object) -> None: ...

    with pytest.raises(PayloadError, match=r"argument 'lock' of .*train cannot be pickled"):
        train.distributed({"lr": 0.1}, threading.Lock())
    assert not any(tmp_path.iterdir()), "nothing may be written before the payload is valid"


def test_unpicklable_captured_variable_is_named(tmp_path) -> None:
    lock = threading.Lock()

    @distributed(gpus=2, mlflow=False, store=LocalStore(tmp_path))
    def train() -> bool:
        return lock.locked()

    with pytest.raises(PayloadError, match=r"variable 'lock' captured by .*train"):
        train.distributed()


def test_unpicklable_global_is_named() -> None:
    with pytest.raises(PayloadError, match=r"global 'LOCK' used by _uses_global_lock"):
        payload.build(payload.FunctionCall(_uses_global_lock))


def test_too_large_payload_says_to_load_data_inside(tmp_path) -> None:
    big = b"x" * (3 * 1024 * 1024)

    @distributed(gpus=2, mlflow=False, store=LocalStore(tmp_path))
    def train(data: bytes) -> int:
        return len(data)

    with pytest.raises(PayloadError) as info:
        payload.build(payload.FunctionCall(train.func, (big,)), limit=1024 * 1024)
    text = str(info.value)
    assert "over the 1 MiB limit" in text
    assert "load data inside the function" in text
    assert "argument 'data'" in text or "argument 0" in text


def test_envelope_keeps_traceback_when_exception_cannot_be_unpickled() -> None:
    class Local(Exception):
        pass

    try:
        raise Local("boom")
    except Local as exc:
        env = payload.failure_envelope({"rank": 1, "node": 0, "local_rank": 1, "host": "h"},
                                       exc, "Traceback: boom", 1)
    env.exception_blob = b"not a pickle"
    back = payload.load_envelope(payload.dump_envelope(env))
    assert back.exception() is None
    assert back.traceback == "Traceback: boom" and back.exc_message == "boom"
