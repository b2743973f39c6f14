"""The IAM policy documents prefect-sgpu ships (rendered by prefect_sgpu.compute.ec2.roles)."""
