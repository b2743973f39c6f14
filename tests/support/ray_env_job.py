"""One job on each Ray path with ``environment=`` (run by the image Python of ``ray_image.py``).

``python ray_env_job.py PROJECT WHEELS KIND [SIBLING]``: KIND ``compute`` runs a two-worker RayCompute job (a Ray
Train run, then a warm worker group) on a two-node cluster on loopback, then one with no ``environment=`` whose
function imports a package of a project folder SIBLING beside it; ``launch`` a one-node ``@ray_launch`` job whose driver runs a Ray task.
Either way the code on Ray's workers imports ``features`` (a module of PROJECT, the working_dir)
and ``sgpu_tiny`` (a wheel in WHEELS, the one extra requirement). The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import sys


def probe() -> dict:
    """What a Ray worker sees: the project's module and the extra requirement."""
    import features  # noqa: I001 - in the working_dir only
    import sgpu_tiny  # installed by Ray's pip only

    return {"tag": features.TAG, "value": sgpu_tiny.VALUE,
            "python": sys.executable}


def launched() -> dict:
    import ray

    ray.init()  # RAY_ADDRESS and the job's runtime_env come from the node
    return ray.get(ray.remote(num_cpus=1)(probe).remote())


def sibling_train(folder: str):
    """``train`` of a project run from its own folder, whose module imports a package beside it at its top
    (neither is on the cluster's path): found on the driver's ``sys.path`` only."""
    from pathlib import Path

    root = Path(folder)
    (root / "sgpu_ray_sib_lib").mkdir(parents=True, exist_ok=True)
    (root / "sgpu_ray_sib_lib" / "__init__.py").write_text("def triple(x):\n    return 3 * x\n")
    (root / "sgpu_ray_sib_train.py").write_text(
        "import sgpu_ray_sib_lib\n\n\ndef train():\n"
        "    return {'auto': sgpu_ray_sib_lib.triple(14), 'lib': sgpu_ray_sib_lib.__file__}\n")
    sys.path.insert(0, folder)
    import importlib

    return importlib.import_module("sgpu_ray_sib_train").train


def main() -> None:
    project, wheels, kind = sys.argv[1:4]
    os.environ["PIP_NO_INDEX"] = "1"  # the cluster's own pip settings: offline, the wheel from find_links
    environment = {"working_dir": project, "requirements": ["sgpu-tiny==1.0"], "find_links": [wheels]}
    if kind == "compute":
        from support.ray_cluster import ray_cluster

        from prefect_sgpu import distributed
        from prefect_sgpu.ray import RayCompute

        with ray_cluster() as address:
            cold = RayCompute(address=address, environment=environment)
            warm = RayCompute(address=address, environment=environment, keep_warm=30)
            bare = RayCompute(address=address)  # no environment=: the driver's own modules travel
            try:
                values = distributed(gpus=2, compute=cold, mlflow=False)(probe).distributed()
                # a warm worker group's actors (their fork servers and the rank processes forked from them)
                values += distributed(gpus=2, compute=warm, mlflow=False)(probe).distributed()
                values += distributed(gpus=2, compute=bare, mlflow=False)(sibling_train(sys.argv[4])).distributed()
            finally:
                bare.close()
                warm.close()
                cold.close()
    else:
        from prefect_sgpu.ray import ray_launch

        values = [ray_launch(gpus=1, mlflow=False, environment=environment)(launched).distributed()]
    print(json.dumps(values))


if __name__ == "__main__":
    main()
