"""Loading a public benchmark's local copy as `Record`s: `load_source`, in file or draw order.

Rows come from `dataset_files.read_rows` (local copies only: files, saved `datasets`
directories, Hub snapshots) and go through their source's converter (`data.benchmarks`).

A row that does not fit the layout (missing column, wrong type, broken JSON) is *malformed*:
`load_source` raises `RecordError` starting `<file>:<line>:` (JSON lines, 1-based) or
`<file>:row <N>:` (other formats, 0-based within the file) and naming the field, or with
`bad_rows="skip"` drops and counts it in `SourceStats` (record_files.py's `ReadStats`
convention). A well-formed row the benchmark definition excludes (MATH level 1, an APPS problem
without tests, a TriviaQA test row without answers) is *unusable*: always dropped, counted by
reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import os
from collections import Counter
from collections.abc import Mapping

from jax_routeweaver.data.benchmarks import SOURCES, RowContext, UnusableRow
from jax_routeweaver.data.dataset_files import MalformedRow, read_rows
from jax_routeweaver.data.record_files import BadRows, ReadStats
from jax_routeweaver.data.records import Record, RecordError

__all__ = [
    "MalformedRow",
    "SourceStats",
    "draw_key",
    "load_source",
]


@dataclasses.dataclass
class SourceStats(ReadStats):
    """`ReadStats` plus rows the benchmark excludes: `unusable` of `rows`, by reason."""

    unusable: int = 0
    reasons: Counter = dataclasses.field(default_factory=Counter)

    @property
    def kept(self) -> int:
        return self.rows - self.skipped - self.unusable


def draw_key(seed: int, sample_id: str) -> bytes:
    """Draw order of a row: sha256 of (seed, sample_id). A row's rank depends on nothing
    else, so other rows being added, removed or reordered never changes which of two rows
    comes first."""
    return hashlib.sha256(f"jax_routeweaver.prepare:{seed}:{sample_id}".encode()).digest()


def load_source(name: str, path: str | os.PathLike[str], *, split: str | None = None,
                bad_rows: BadRows = "error", stats: SourceStats | None = None,
                seed: int | None = None, limit: int | None = None) -> list[Record]:
    """The usable records of source `name` (a `SOURCES` key) read from `path`.

    File order if `seed` is None, else the seeded draw order (`draw_key`); `limit` keeps only
    the first `limit` of that order (memory stays bounded on large code datasets). Malformed
    rows raise `RecordError` `<file>:<line>: <name>: field 'x': ...` / `<file>:row N: ...`, or
    are skipped and counted with `bad_rows="skip"`; a repeated sample id is malformed too.
    Unusable rows are counted in `stats` (module doc).
    """
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; known: {sorted(SOURCES)}")
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
    if limit is not None and seed is None:
        raise ValueError("limit needs a seed: it keeps the first rows of the draw order")
    source = SOURCES[name]
    stats = SourceStats() if stats is None else stats
    seen: dict[str, str] = {}
    kept: list[tuple[bytes, int, Record]] = []  # a max-heap on the key when limited
    for raw in read_rows(path, split=split):
        stats.rows += 1
        try:
            if isinstance(raw.row, MalformedRow):
                raise raw.row
            if not isinstance(raw.row, Mapping):
                raise MalformedRow("<row>", f"expected an object, got {type(raw.row).__name__}")
            record = source.convert(raw.row, RowContext(source, raw.path, raw.index, split))
            first = seen.setdefault(record.sample_id, f"{raw.path}:{raw.where}")
            if first != f"{raw.path}:{raw.where}":
                raise MalformedRow("id", f"sample id {record.sample_id!r} repeats {first}")
        except UnusableRow as exc:
            stats.unusable += 1
            stats.reasons[str(exc)] += 1
            continue
        except (MalformedRow, RecordError) as exc:
            message = f"{raw.path}:{raw.where}: {name}: {exc}"
            if bad_rows == "error":
                raise RecordError(message) from None
            stats.skipped += 1
            if len(stats.errors) < ReadStats.MAX_ERRORS:
                stats.errors.append(message)
            continue
        if seed is None:
            kept.append((b"", raw.index, record))
            continue
        item = (_inverted(draw_key(seed, record.sample_id)), raw.index, record)
        if limit is None or len(kept) < limit:
            heapq.heappush(kept, item)
        elif item[0] > kept[0][0]:  # its key is smaller than the largest kept
            heapq.heapreplace(kept, item)
    if seed is None:
        return [record for _, _, record in kept]
    return [record for _, _, record in sorted(kept, key=lambda item: item[0], reverse=True)]


def _inverted(key: bytes) -> bytes:
    # heapq is a min-heap; inverting the key bytes keeps the `limit` smallest keys at hand.
    return bytes(255 - b for b in key)
