"""Every gang of a job meets under a rendezvous id of its own (issue 49, part B).

After a relaunch, a kept node 0 hosts the next gang's rendezvous on the same address and port;
an agent of the lost gang that comes back late must not join it. The id is derived from the job
key and the gang number the agent finds in ``SGPU_GANG`` (the driver puts it in the launch
environment of every gang after the first)."""

from __future__ import annotations

import pytest

from prefect_sgpu.launch.node_agent import rendezvous_run_id
from prefect_sgpu.launch.rendezvous import rendezvous_id
from prefect_sgpu.protocol.jobfolder import GANG_ENV, new_key


def test_each_gang_of_a_job_joins_a_rendezvous_of_its_own() -> None:
    key = new_key()
    first = rendezvous_run_id({"SGPU_PAYLOAD_KEY": key})
    gang1 = rendezvous_run_id({"SGPU_PAYLOAD_KEY": key, GANG_ENV: "1"})
    gang2 = rendezvous_run_id({"SGPU_PAYLOAD_KEY": key, GANG_ENV: "2"})
    # a late agent of gang 1 looks for gang 1's state, never gang 2's
    assert len({first, gang1, gang2}) == 3
    # every node of one gang agrees, and the first gang is gang 0 whether or not the variable is set
    assert gang2 == rendezvous_run_id({"SGPU_PAYLOAD_KEY": key, GANG_ENV: "2"}) == rendezvous_id(key, 2)
    assert first == rendezvous_run_id({"SGPU_PAYLOAD_KEY": key, GANG_ENV: "0"}) == rendezvous_id(key, 0)
    # another job's gang 2 meets elsewhere; the id names neither key nor gang
    assert rendezvous_run_id({"SGPU_PAYLOAD_KEY": new_key(), GANG_ENV: "2"}) != gang2
    assert key not in gang2 and len(gang2) == 64


@pytest.mark.parametrize("bad", ["x", "-1", "1.5"])
def test_a_bad_gang_number_is_refused_naming_the_variable(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"{GANG_ENV}='{bad}'"):
        rendezvous_run_id({"SGPU_PAYLOAD_KEY": new_key(), GANG_ENV: bad})
