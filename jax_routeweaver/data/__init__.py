"""Data: the record schema (records.py); later the grain pipeline and benchmark preparation.

Never imports `models/` or `rl/`.
"""

from jax_routeweaver.data.records import (
    CODE_SCORER_DATASETS,
    FORCED_MODES,
    Domain,
    Record,
    RecordError,
    read_jsonl,
    write_jsonl,
)

__all__ = [
    "CODE_SCORER_DATASETS",
    "FORCED_MODES",
    "Domain",
    "Record",
    "RecordError",
    "read_jsonl",
    "write_jsonl",
]
