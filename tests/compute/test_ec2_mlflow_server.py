"""MLflow as a server: EC2 ranks log straight to ``mlflow server`` over HTTP (no relay), its
artifacts land in S3 (the moto server), a model registered from the job's run keeps its files
there, and the task's MLflow reference is a link that opens."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from typing import Any

import pytest

from support.conformance_ec2 import EC2Env
from support.mlflow_server import mlflow_server
from prefect_sgpu import distributed, runtime

pytestmark = pytest.mark.e2e


def _log_to_the_server() -> tuple[str, str]:
    import mlflow

    run = mlflow.start_run()  # the job's run, from MLFLOW_RUN_ID
    rank = runtime.rank()
    for step in range(3):
        mlflow.log_metric(f"loss_rank{rank}", 1.0 / (step + 1), step=step)
    mlflow.log_param(f"seen_by_rank{rank}", "yes")
    mlflow.log_text(f"written by rank {rank}\n", f"ranks/rank-{rank}.txt")
    return run.info.run_id, mlflow.get_tracking_uri()


def _keys(ec2: EC2Env, bucket: str) -> list[str]:
    s3 = ec2.aws.client("s3")
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])]


def test_ec2_ranks_log_straight_to_an_mlflow_server_whose_artifacts_and_models_are_in_s3(
        ec2: EC2Env, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from mlflow.tracking import MlflowClient

    from prefect_sgpu.adapters.reports import mlflow_reference
    from prefect_sgpu.pipeline.registry import register_model

    bucket = f"sgpu-mlflow-{uuid.uuid4().hex[:12]}"
    ec2.aws.client("s3").create_bucket(Bucket=bucket)
    with mlflow_server(f"s3://{bucket}/mlflow", ec2.aws.env, ec2.aws.endpoint_url) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        job = distributed(gpus=2, gpu_type="A10", remote=True, compute=ec2.compute(),
                          timeout=300)(_log_to_the_server).job()
        result = job.run()
        assert [v for v in result.values] == [(result.mlflow_run_id, url)] * 2, \
            "every rank logged into the job's run, on the server itself (no relay)"
        assert not [k for k in ec2.objects(job.run_id) if "/metrics/" in k], "nothing went through the relay"

        client = MlflowClient(url)
        run = client.get_run(result.mlflow_run_id)
        assert run.info.status == "FINISHED"
        for rank in (0, 1):
            history = client.get_metric_history(result.mlflow_run_id, f"loss_rank{rank}")
            assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, 1 / 3)], rank
            assert run.data.params[f"seen_by_rank{rank}"] == "yes"
        # the ranks' artifacts went through the server into the bucket, under the run
        keys = _keys(ec2, bucket)
        for rank in (0, 1):
            assert any(k.startswith("mlflow/") and k.endswith(f"{result.mlflow_run_id}/artifacts/ranks/rank-{rank}.txt")
                       for k in keys), keys

        # a model registered from the job's run: its files are in the bucket, and it loads back
        model = torch.nn.Linear(3, 2)
        version = register_model(model, name=f"server-{uuid.uuid4().hex[:8]}", metric_name="loss",
                                 metric_value=0.25, tracking_uri=url, run_id=result.mlflow_run_id)
        registered = client.get_model_version(version.name, str(version.version))
        assert registered.run_id == result.mlflow_run_id and registered.status == "READY"
        model_files = [k for k in _keys(ec2, bucket) if k.startswith("mlflow/") and k not in keys]
        assert any(k.endswith("/MLmodel") for k in model_files), model_files
        assert any(k.endswith(".pth") or "/data/" in k for k in model_files), model_files
        import mlflow.pytorch

        loaded = mlflow.pytorch.load_model(version.model_uri)  # through the server, from the bucket
        probe = torch.ones(1, 3)
        assert torch.equal(loaded(probe), model(probe))

        # the reference a task's artifact shows is a link to the run's page on the server, and it opens
        reference = mlflow_reference(url, run.info.experiment_id, result.mlflow_run_id)
        link = re.search(r"\]\((http[^)]+)\)", reference).group(1)
        assert link.startswith(url) and link.endswith(f"#/experiments/{run.info.experiment_id}/runs/"
                                                      f"{result.mlflow_run_id}"), link
        with urllib.request.urlopen(link, timeout=30) as page:
            assert page.status == 200 and b"<html" in page.read().lower()
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={result.mlflow_run_id}",
                                    timeout=30) as answer:
            got: dict[str, Any] = json.loads(answer.read())
        assert got["run"]["info"]["status"] == "FINISHED"
    assert ec2.leftovers(job.run_id) == []
