"""Files of `Record` rows: JSONL and parquet readers and writers, bad-row handling.

JSONL files hold one `Record.to_row()` row per line (`read_jsonl` / `write_jsonl`); parquet
files hold the rows as columns (`read_parquet` / `write_parquet`, `extra_info` a struct);
`read_records` picks the reader by suffix. Read errors are one line naming the file and the line
(JSONL, 1-based) or row (parquet, 0-based); `bad_rows="skip"` drops bad rows (a JSONL line that
is not UTF-8 too) instead and counts them in a `ReadStats`. A `sample_id` may appear only once
per file. Every validation error names the field and the sample id. `read_records`, which
opens a data source, also refuses a file that yields no records. Writers write a temporary
sibling and rename it, so a failure never leaves a half-written file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from jax_routeweaver.data.records import (
    EXTRA_INFO_KEYS,
    RECORD_ROW_KEYS,
    Record,
    RecordError,
    field_error,
)

__all__ = [
    "BadRows",
    "ReadStats",
    "read_jsonl",
    "read_parquet",
    "read_records",
    "write_jsonl",
    "write_parquet",
]


# ---------------------------------------------------------------------- reading files
BadRows = Literal["error", "skip"]


@dataclasses.dataclass
class ReadStats:
    """What a reader saw. Counts are added to, so one `ReadStats` can total several files.

    rows     data rows read (blank JSONL lines are not rows), including skipped ones.
    skipped  rows dropped by `bad_rows="skip"` (invalid rows and repeated sample ids).
    errors   the first `MAX_ERRORS` error messages, each starting `<path>:<line or row N>:`.
    """

    MAX_ERRORS: ClassVar[int] = 5

    rows: int = 0
    skipped: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def kept(self) -> int:
        return self.rows - self.skipped


class _Collector:
    """Turns rows into records for one file, applying the `bad_rows` policy and the
    one-row-per-sample-id rule."""

    def __init__(self, path: Path, bad_rows: str, stats: ReadStats | None) -> None:
        if bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
        self.path = path
        self.skip = bad_rows == "skip"
        self.stats = ReadStats() if stats is None else stats
        self.records: list[Record] = []
        self._first_seen: dict[str, str] = {}  # sample_id -> "line 3" / "row 2"

    def reject(self, where: str, problem: str) -> None:
        """Count a bad row; raise unless skipping. `where` is `4` (JSONL) or `row 4`."""
        message = f"{self.path}:{where}: {problem}"
        self.stats.rows += 1
        if not self.skip:
            raise RecordError(message)
        self.stats.skipped += 1
        if len(self.stats.errors) < ReadStats.MAX_ERRORS:
            self.stats.errors.append(message)

    def accept(self, where: str, label: str, row: Any) -> None:
        try:
            record = Record.from_row(row)
        except RecordError as exc:
            self.reject(where, str(exc))
            return
        first = self._first_seen.get(record.sample_id)
        if first is not None:
            self.reject(where, f"record {record.sample_id!r}: field 'sample_id': "
                               f"duplicate of {first}")
            return
        self._first_seen[record.sample_id] = label
        self.stats.rows += 1
        self.records.append(record)


@contextlib.contextmanager
def _atomic_target(path: Path) -> Iterator[Path]:
    """A temporary sibling of `path` to write; renamed over `path` only if the block succeeds,
    so a failure never leaves a half-written file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_records(path: str | os.PathLike[str], *, bad_rows: BadRows = "error",
                 stats: ReadStats | None = None) -> list[Record]:
    """Records from a `.jsonl` / `.json` (JSON Lines) or `.parquet` file, chosen by suffix.

    See `read_jsonl` / `read_parquet` for `bad_rows` and `stats`. Raises `RecordError` naming
    the file for any other suffix, and for a file that yields no records (no rows, or every
    row skipped as bad).
    """
    path = Path(path)
    readers = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise RecordError(f"{path}: unknown record file type {path.suffix!r}; "
                          f"expected one of {sorted(readers)}")
    stats = ReadStats() if stats is None else stats
    rows_before = stats.rows
    records = reader(path, bad_rows=bad_rows, stats=stats)
    if not records:
        rows = stats.rows - rows_before
        raise RecordError(f"{path}: no records: " + (
            f"every one of its {rows} rows was skipped as bad" if rows else "the file has no rows"))
    return records


# ---------------------------------------------------------------------- JSONL
def read_jsonl(path: str | os.PathLike[str], *, bad_rows: BadRows = "error",
               stats: ReadStats | None = None) -> list[Record]:
    """Records from a JSONL file of rows (one `to_row()` object per line).

    Whitespace-only lines are allowed (e.g. a trailing newline). With `bad_rows="error"`
    anything else that is not a valid row (not UTF-8, not JSON, not the schema), or repeats an
    earlier line's `sample_id`, raises `RecordError` starting with `<path>:<line>:`; with
    `"skip"` such lines are dropped and counted in `stats` (if given). Lines end at b"\n".
    """
    path = Path(path)
    collector = _Collector(path, bad_rows, stats)
    with path.open("rb") as handle:  # decoded per line, so one bad byte costs one row
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                collector.reject(str(lineno), f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} "
                                              f"at column {exc.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                collector.reject(str(lineno), f"invalid JSON: {exc}")
                continue
            collector.accept(str(lineno), f"line {lineno}", row)
    return collector.records


def write_jsonl(path: str | os.PathLike[str], records: Iterable[Record]) -> int:
    """Write records as rows, one per line (UTF-8); returns the number written.

    The file is written to a temporary sibling and renamed, so a failure never leaves a
    half-written file behind.
    """
    path = Path(path)
    count = 0
    with _atomic_target(path) as tmp, tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            if not isinstance(record, Record):
                raise RecordError(f"{path}: item {count} is a {type(record).__name__}, "
                                  "not a Record")
            handle.write(json.dumps(record.to_row(), ensure_ascii=False))
            handle.write("\n")
            count += 1
    return count


# ---------------------------------------------------------------------- parquet
# pyarrow is imported inside the parquet functions: it is slow to import and most users of
# this module (scorers, episode code) never touch a parquet file.
_INFO_INT_KEYS = frozenset({"batch_index"})


def _parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    """A pyarrow row -> the `from_row` shape.

    `extra_info` may be a struct (dict) or a JSON string. Parquet cannot tell a missing struct
    field or column from a null one (every row has every column), so null *unknown* keys are
    dropped instead of becoming `extras` the row never had.
    """
    info = row.get("extra_info")
    if isinstance(info, (str, bytes)):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as exc:
            raise field_error("<unknown>", "extra_info", f"invalid JSON: {exc}") from None
    if isinstance(info, dict):
        info = {k: v for k, v in info.items() if v is not None or k in EXTRA_INFO_KEYS}
    out = {k: v for k, v in row.items() if v is not None or k in RECORD_ROW_KEYS}
    out["extra_info"] = info
    return out


def read_parquet(path: str | os.PathLike[str], *, bad_rows: BadRows = "error",
                 stats: ReadStats | None = None) -> list[Record]:
    """Records from a parquet file in the reference row layout (`data.records`), read in order.

    Rows go through `Record.from_row` as JSONL lines do, with the same `bad_rows` / `stats`
    handling; errors start with `<path>:row <N>:` (N counts from 0, as pandas/pyarrow do). A
    file that is not parquet, or has no `extra_info` column, raises `RecordError` whatever
    `bad_rows` says, as does one whose data cannot be decoded (naming the first row not read).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    collector = _Collector(path, bad_rows, stats)
    try:
        parquet = pq.ParquetFile(path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as exc:
        raise RecordError(f"{path}: not a readable parquet file: {_one_line(exc)}") from None
    with parquet:
        if "extra_info" not in parquet.schema_arrow.names:
            raise RecordError(f"{path}: no 'extra_info' column (columns: "
                              f"{parquet.schema_arrow.names})")
        index = 0
        try:
            for batch in parquet.iter_batches():
                for row in batch.to_pylist():
                    where = f"row {index}"
                    try:
                        parsed = _parquet_row(row)
                    except RecordError as exc:
                        collector.reject(where, str(exc))
                    else:
                        collector.accept(where, where, parsed)
                    index += 1
        except (pa.ArrowException, OSError) as exc:  # a corrupt page or column chunk
            raise RecordError(f"{path}:row {index}: cannot read the parquet data: "
                              f"{_one_line(exc)}") from None
    return collector.records


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _arrow_column(values: list[Any], name: str, arrow_type: Any, path: Path) -> Any:
    import pyarrow as pa

    try:
        return pa.array(values, type=arrow_type)
    except (pa.ArrowException, OverflowError, TypeError) as exc:
        raise RecordError(f"{path}: column {name!r}: its values do not share one parquet "
                          f"type: {exc}") from None


def write_parquet(path: str | os.PathLike[str], records: Iterable[Record]) -> int:
    """Write records as reference rows to a parquet file; returns the number written.

    `extra_info` is a struct whose `payload_json` is the JSON string of `to_row()`, so
    question, gold and meta (code tests included) round-trip exactly through `read_parquet`.
    Each `extras` key becomes a column (top level or in `extra_info`) whose values must share
    one parquet type (else `RecordError`); records lacking it get null there, which reads back
    as absent, so `extras` whose value is None, or dicts with differing keys, do not round
    trip. Written to a temporary sibling and renamed, like `write_jsonl`.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    rows = []
    for count, record in enumerate(records):
        if not isinstance(record, Record):
            raise RecordError(f"{path}: item {count} is a {type(record).__name__}, "
                              "not a Record")
        rows.append(record.to_row())
    infos = [row["extra_info"] for row in rows]
    info_keys = dict.fromkeys([*EXTRA_INFO_KEYS, *(k for info in infos for k in info)])
    info_arrays = [
        _arrow_column([info.get(key) for info in infos], f"extra_info.{key}",
                      pa.int64() if key in _INFO_INT_KEYS
                      else pa.string() if key in EXTRA_INFO_KEYS else None, path)
        for key in info_keys
    ]
    columns: dict[str, Any] = {
        "data_source": _arrow_column([row["data_source"] for row in rows], "data_source",
                                     pa.string(), path),
        "prompt": _arrow_column([row["prompt"] for row in rows], "prompt",
                                pa.list_(pa.struct([("role", pa.string()),
                                                    ("content", pa.string())])), path),
        "extra_info": pa.StructArray.from_arrays(info_arrays, names=list(info_keys)),
    }
    for key in dict.fromkeys(k for row in rows for k in row if k not in RECORD_ROW_KEYS):
        columns[key] = _arrow_column([row.get(key) for row in rows], key, None, path)
    table = pa.table(columns)
    with _atomic_target(path) as tmp:
        pq.write_table(table, tmp)
    return len(rows)
