"""A machine launched alone to replace a lost node offers no environment pack (issue 49, part B).

The driver records the packs node 0 offers only after a gang's launch (``take_offers`` in acquire); a
lone replacement of node 0 used to be asked to offer too, and so built, packed and uploaded an archive
of several GiB that no record ever named. Now neither the user-data of a replacement asks for an offer,
nor does the environment stage make one when its bootstrap names the node it replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect_sgpu.compute.ec2.compute import EC2InstanceCompute
from prefect_sgpu.environment import capture
from prefect_sgpu.launch.node_env import offers_pack
from support.aws_fixtures import MotoAWS


class _Launched:
    """What the stage asks its transport here: the machine's launch index (0 for a machine launched alone)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def launch_index(self) -> int:
        return self.index


def test_the_stage_of_a_replacement_never_offers_a_pack() -> None:
    gang = ["--run-id=r", "--gang=1"]
    assert offers_pack(True, gang, _Launched(0))  # node 0 of a gang's launch
    assert not offers_pack(True, gang, _Launched(1))
    assert not offers_pack(False, gang, _Launched(0))
    # a machine launched alone for node 0 has launch index 0 too: its --node-index says it replaces one
    assert not offers_pack(True, [*gang, "--node-index=0"], _Launched(0))
    assert not offers_pack(True, [*gang, "--node-index=1"], _Launched(0))


def test_a_replacements_user_data_asks_for_no_pack_offer(tmp_path: Path, aws_env: MotoAWS, aws_faults: Any) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("def train():\n    return 1\n")
    env = capture(working_dir=project)
    bucket = f"sgpu-offers-{tmp_path.name[-8:].lower().replace('_', '-')}"
    aws_env.client("s3").create_bucket(Bucket=bucket)
    compute = EC2InstanceCompute.from_settings({"region": aws_env.region, "endpoint_url": aws_env.endpoint_url,
                                                "store_uri": f"s3://{bucket}/jobs"}, session=aws_env.session())
    first = compute.user_data("run-1", environment=env)
    relaunch = compute.user_data("run-1", environment=env, gang=1)
    lone = compute.user_data("run-1", environment=env, gang=1, node_index=0)
    assert "--offer-pack" in first and "--offer-pack" in relaunch  # recorded after the gang's launch
    assert "--node-index=0" in lone and "--offer-pack" not in lone
