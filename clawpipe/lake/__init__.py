"""The trajectory lake: landing captures into Parquet, read-only SQL over it, audits and compaction.

- :func:`land` (landing.py): capture segments + rollout results -> model_calls / rollouts / rejects.
- :func:`run_sql`, :func:`run_saved`, :func:`run_audits` (query.py): read-only DuckDB over the views.
- :func:`compact` (compaction.py): merge small part files per partition, atomically.
"""

from __future__ import annotations

from clawpipe.lake.compaction import CompactionReport, compact
from clawpipe.lake.landing import LandingReport, land
from clawpipe.lake.query import run_audits, run_saved, run_sql, saved_names

__all__ = [
    "CompactionReport",
    "LandingReport",
    "compact",
    "land",
    "run_audits",
    "run_saved",
    "run_sql",
    "saved_names",
]
