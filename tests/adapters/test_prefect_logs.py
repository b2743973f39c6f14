"""Inside a Prefect run, rank lines go to the run's logger and are stored on the server."""

from __future__ import annotations

import time

import pytest

from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


@distributed(gpus=2, mlflow=False)
def chatty() -> int:
    print(f"checkpoint saved by rank {runtime.rank()}")
    return runtime.rank()


def test_rank_lines_are_flow_run_logs_on_the_server(prefect_server: None) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    @flow
    def uses_ranks() -> list[int]:
        return chatty.distributed()

    state = uses_ranks(return_state=True)
    assert state.result() == [0, 1]
    wanted = {"[rank 0 node 0] checkpoint saved by rank 0", "[rank 1 node 0] checkpoint saved by rank 1"}
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    deadline = time.monotonic() + 30  # logs are shipped to the server in batches
    with get_client(sync_client=True) as client:
        while True:
            messages = {log.message for log in client.read_logs(log_filter, limit=200, offset=0)}
            if wanted <= messages or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert wanted <= messages
