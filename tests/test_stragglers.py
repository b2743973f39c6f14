"""The straggler detector, fed (rank, step, time) observations by hand; its settings on the job spec;
the driver's reading of progress files."""

from __future__ import annotations

import os

import pytest

from prefect_sgpu import SGPUConfigError, distributed
from prefect_sgpu import spec as spec_mod
from prefect_sgpu.observe.progress_watch import StragglerWatch, describe, parse_progress
from prefect_sgpu.protocol.jobfolder import new_key
from prefect_sgpu.protocol.rank_progress import file_bytes, progress_key
from prefect_sgpu.store import LocalStore
from prefect_sgpu.observe.stragglers import Straggler, StragglerDetector


def _feed(detector: StragglerDetector, periods: dict[int, float], until: float,
          start: dict[int, int] | None = None, t0: float = 1000.0) -> list[Straggler]:
    """Each rank reports every step; rank r takes ``periods[r]`` seconds a step; observations in time order."""
    steps = dict(start or {r: 0 for r in periods})
    events = []
    for rank, period in periods.items():
        t = t0
        step = steps[rank]
        while t + period <= t0 + until:
            t += period
            step += 1
            events.append((t, rank, step))
    named = []
    for t, rank, step in sorted(events):
        named.extend(detector.observe(rank, step, t))
    return named


def _last_steps(detector: StragglerDetector) -> dict[int, int]:
    return {rank: state.window[-1][0] for rank, state in detector._ranks.items()}


def test_even_ranks_name_none() -> None:
    detector = StragglerDetector(factor=2.0, steps=5)
    named = _feed(detector, {0: 0.10, 1: 0.11, 2: 0.09, 3: 0.12}, until=30)
    assert named == []
    rates = detector.rates()
    assert sorted(rates) == [0, 1, 2, 3] and all(7 < r < 12 for r in rates.values()), rates


def test_one_slow_rank_is_named_once_with_its_rate_and_the_median() -> None:
    detector = StragglerDetector(factor=2.0, steps=5)
    named = _feed(detector, {0: 0.1, 1: 0.1, 2: 0.5, 3: 0.1}, until=60)
    assert len(named) == 1, named
    found = named[0]
    assert found.rank == 2
    assert found.rate == pytest.approx(2.0)
    assert found.median_rate == pytest.approx(10.0)
    # slow from its first rate on: named after 5 slow steps counted from the step before it
    assert found.step == 6 and found.at == pytest.approx(1003.0)
    assert detector.named == named


def test_a_rank_that_recovers_and_slows_again_is_named_again() -> None:
    detector = StragglerDetector(factor=2.0, steps=3, window_steps=3)
    first = _feed(detector, {0: 0.1, 1: 0.1, 2: 0.5}, until=10)
    assert [s.rank for s in first] == [2]
    # rank 2 catches up to the others' pace: no new name, the episode ends
    again = _feed(detector, {0: 0.1, 1: 0.1, 2: 0.1}, until=10, start=_last_steps(detector), t0=1010.0)
    assert again == []
    assert detector._ranks[2].slow_from is None
    # and falls behind again: named a second time
    third = _feed(detector, {0: 0.1, 1: 0.1, 2: 0.5}, until=10, start=_last_steps(detector), t0=1020.0)
    assert [s.rank for s in third] == [2]
    # its window still holds a step of the fast phase
    assert third[0].rate == pytest.approx(2.0, rel=0.1) and third[0].median_rate == pytest.approx(10.0)
    assert [s.rank for s in detector.named] == [2, 2]


def test_a_rank_slow_for_fewer_steps_than_set_is_not_named() -> None:
    detector = StragglerDetector(factor=2.0, steps=50)
    assert _feed(detector, {0: 0.1, 1: 0.1, 2: 0.5}, until=20) == []  # 40 slow steps of rank 2
    assert detector.rates()[2] == pytest.approx(2.0)


def test_a_rank_that_starts_over_gets_a_new_history() -> None:
    detector = StragglerDetector(factor=2.0, steps=1)
    detector.observe(0, 100, 10.0)
    detector.observe(0, 110, 11.0)
    assert detector.rates() == {0: pytest.approx(10.0)}
    assert detector.observe(0, 3, 12.0) == []  # a restarted rank: its old rate is gone
    assert detector.rates() == {}
    assert detector.observe(0, 3, 12.5) == [] and detector.observe(0, 2, 13.0) == []


@pytest.mark.parametrize(("factor", "steps"), [(1.0, 5), (0.5, 5), (2.0, 0)])
def test_the_detector_refuses_settings_that_could_never_name_a_rank(factor: float, steps: int) -> None:
    with pytest.raises(ValueError):
        StragglerDetector(factor=factor, steps=steps)


def _noop() -> None:
    return None


@pytest.mark.parametrize(("kwargs", "field", "needle"), [
    ({"straggler_factor": 1.0}, "straggler_factor", "greater than 1"),
    ({"straggler_factor": 0.5}, "straggler_factor", "greater than 1"),
    ({"straggler_factor": -2}, "straggler_factor", "None to turn straggler naming off"),
    ({"straggler_steps": 0}, "straggler_steps", "at least 1"),
    ({"straggler_steps": -3}, "straggler_steps", "at least 1"),
])
def test_bad_straggler_settings_fail_at_decoration_naming_field_value_and_what_is_allowed(
        kwargs: dict, field: str, needle: str) -> None:
    with pytest.raises(SGPUConfigError) as info:
        distributed(**kwargs)(_noop)
    err = info.value
    assert err.field == field and err.value == next(iter(kwargs.values()))
    assert f"{field}={err.value!r} is not allowed" in str(err) and needle in str(err), str(err)


def test_straggler_settings_have_defaults_layers_and_environment_variables() -> None:
    spec = spec_mod.build(environ={})
    assert (spec.straggler_factor, spec.straggler_steps) == (2.0, 5)
    env = {"PREFECT_SGPU_STRAGGLER_FACTOR": "3.5", "PREFECT_SGPU_STRAGGLER_STEPS": "8"}
    assert spec_mod.build(environ=env).straggler_factor == 3.5
    assert spec_mod.build(environ=env).straggler_steps == 8
    assert spec_mod.build(spec_mod.layer("task", straggler_steps=2), environ=env).straggler_steps == 2
    assert spec_mod.build(environ={"PREFECT_SGPU_STRAGGLER_FACTOR": "off"}).straggler_factor is None
    with pytest.raises(SGPUConfigError) as info:
        spec_mod.build(environ={"PREFECT_SGPU_STRAGGLER_FACTOR": "1"})
    assert info.value.field == "PREFECT_SGPU_STRAGGLER_FACTOR" and "greater than 1" in str(info.value)
    with pytest.raises(SGPUConfigError) as info:
        spec_mod.build(environ={"PREFECT_SGPU_STRAGGLER_STEPS": "0"})
    assert info.value.field == "PREFECT_SGPU_STRAGGLER_STEPS"


def test_a_progress_file_gives_the_ranks_step_and_time() -> None:
    assert parse_progress(b"123 7 100 1700000000.250\n", 5.0) == (7, 1700000000.25)
    assert parse_progress(b"123 7\n", 5.0) == (7, 5.0)  # an older rank: the driver's clock
    assert parse_progress(b"123\n", 5.0) is None
    assert parse_progress(None, 5.0) is None
    assert parse_progress(b"123 seven", 5.0) is None


def test_the_watch_reads_every_ranks_progress_file_and_places_the_straggler(tmp_path: os.PathLike) -> None:
    store = LocalStore(tmp_path)
    key = new_key()
    watch = StragglerWatch(store, "job-1", 3, 2.0, 2, key=key, interval=0.0,
                           where=lambda rank: {"node": rank // 2, "host": f"host-{rank // 2}", "instance_id": None})
    named: list[Straggler] = []
    for tick in range(1, 12):
        for rank, per_tick in ((0, 10), (1, 10), (2, 1)):
            store.put("job-1", f"progress/rank-{rank}", file_bytes(f"99 {tick * per_tick} 0 {1000 + tick}.0",
                                                                   progress_key(key), "job-1", rank))
        named.extend(watch.poll(now=float(tick)))
    assert [(s.rank, s.node, s.host) for s in named] == [(2, 1, "host-1")]
    assert named[0].rate == pytest.approx(1.0) and named[0].median_rate == pytest.approx(10.0)
    line = describe("train", named[0], 2.0, 2)
    assert "rank 2 (node 1, host host-1) is a straggler: 1 steps/s against a median of 10 steps/s" in line


def test_straggler_settings_are_job_variables_of_the_sgpu_pool_checked_and_handed_to_the_flow_run() -> None:
    from prefect_sgpu.adapters import pool_variables as pv
    from prefect_sgpu.adapters.worker import SGPUWorker

    properties = SGPUWorker.get_default_base_job_template()["variables"]["properties"]
    assert {"exclusiveMinimum": 1, "type": "number"} in properties["straggler_factor"]["anyOf"]
    assert {"minimum": 1, "type": "integer"} in properties["straggler_steps"]["anyOf"]
    defaults = pv.gpu_defaults({"straggler_factor": 3, "straggler_steps": 4})
    env = pv.gpu_defaults_env(defaults)
    assert env == {"PREFECT_SGPU_STRAGGLER_FACTOR": "3.0", "PREFECT_SGPU_STRAGGLER_STEPS": "4"}
    spec = spec_mod.build(environ=env)
    assert (spec.straggler_factor, spec.straggler_steps) == (3.0, 4)
    with pytest.raises(SGPUConfigError) as info:
        pv.gpu_defaults({"straggler_factor": 0.9})
    assert info.value.field == "job variable straggler_factor" and "greater than 1" in str(info.value)
