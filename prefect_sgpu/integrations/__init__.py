"""Connections between prefect-sgpu's runtime and the trainers people use.

- :mod:`prefect_sgpu.integrations.hf`: a callback for Hugging Face ``transformers.Trainer``;
- :mod:`prefect_sgpu.integrations.lightning`: a callback for Lightning's ``Trainer``.

Each imports its trainer's library when imported itself; ``prefect_sgpu`` never imports them.
"""
