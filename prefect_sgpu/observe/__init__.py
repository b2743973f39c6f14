"""What a running job shows: rank logs, live progress, stragglers, the gang check's report, MLflow tracking and its relay from the ranks."""
