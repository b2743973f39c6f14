"""Training pipeline building blocks used by the flows in ``flows/``.

- :mod:`.mds` — a Prefect task converting source data to Mosaic Streaming (MDS) shards.
- :mod:`.streaming` — inside a rank: a StreamingDataset/DataLoader for this rank.
- :mod:`.strategies` — wrap a model and optimizer for DDP, FSDP2 or DeepSpeed ZeRO.
- :mod:`.checkpoint` — periodic, complete-or-absent checkpoints and automatic resume.
- :mod:`.registry` — MLflow logging, model versions and the ``candidate``/``champion`` aliases.

Importing this package imports nothing heavy; each module loads torch, Prefect or
MLflow only where it needs them (ranks never import Prefect).
"""
