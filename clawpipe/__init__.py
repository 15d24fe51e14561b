"""clawpipe: reinforcement learning for LLM agents through the harnesses they run in.

The package is split into rooms that meet only at schemas and tables (see docs/ARCHITECTURE.md):
``sandbox`` runs harnesses, ``proxy`` captures model calls, ``serving`` serves the policy,
``lake`` lands captures in Parquet, ``trees`` rebuilds prefix trees, ``train`` updates the policy.
Importing ``clawpipe`` stays cheap: no torch, transformers, prefect or mlflow here.
"""

__version__ = "0.1.0"
