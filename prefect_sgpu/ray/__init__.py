"""Ray for prefect-sgpu: a Ray cluster per job (``@ray_launch``) and existing clusters (``RayCompute``).

Importing this package does not import Ray: it loads on the nodes and when a job starts.

- ``@ray_launch(gpus=16, gpu_type="A10", remote=True)``: node 0 of the job hosts a Ray
  head, the other nodes join it, and the function runs once as the Ray driver.
- ``RayCompute(address="auto")``: ``@distributed`` functions and GPU tasks run on an
  existing cluster as Ray Train ``TorchTrainer`` jobs, one worker per rank.
"""

from prefect_sgpu.ray.compute import RayCompute
from prefect_sgpu.ray.launch import RayLaunchFunction, RayLauncher, ray_launch

__all__ = ["RayCompute", "RayLaunchFunction", "RayLauncher", "ray_launch"]
