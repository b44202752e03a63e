"""Files of `Record` rows: JSONL and parquet readers and writers, bad-row handling.

JSONL files hold one `Record.to_row()` row per line (`read_jsonl` / `write_jsonl`); parquet
files hold the rows as columns (`read_parquet` / `write_parquet`, `extra_info` a struct);
`read_records` picks the reader by suffix. Read errors are one line naming the file and the line
(JSONL, 1-based) or row (parquet, 0-based); `bad_rows="skip"` drops bad rows (a JSONL line that
is not UTF-8 too) instead and counts them in a `ReadStats`. A `sample_id` may appear only once
per file. Every validation error names the field and the sample id. `read_records`, which
opens a data source, also refuses a file that yields no records. Writers write a temporary
sibling and rename it, so a failure never leaves a half-written file.

A `QuestionLimit` (built by the caller that knows the router: `rl.run.builders.question_limit`)
refuses, under the same `bad_rows` policy, a row whose question cannot fit the router's
context, in two steps: a JSONL line longer than `QuestionLimit.line_bytes` is refused before it
is decoded or parsed (and is never held whole: it is read up to that bound and the rest
discarded), and a parsed row's question is refused if its UTF-8 length is over
`QuestionLimit.question_bytes` (without tokenizing it), else if its token count is over
`QuestionLimit.tokens`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, ClassVar, Literal

from jax_routeweaver.data.records import (
    EXTRA_INFO_KEYS,
    RECORD_ROW_KEYS,
    Record,
    RecordError,
    field_error,
)

__all__ = [
    "BadRows",
    "QuestionLimit",
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

    rows      data rows read (blank JSONL lines are not rows), including skipped ones.
    skipped   rows dropped by `bad_rows="skip"` (invalid rows, repeated sample ids, and
              questions that cannot fit the router's context).
    too_long  of `skipped`, the rows whose question cannot fit the router's context (a
              `QuestionLimit`; a JSONL line over its byte bound included).
    errors    the first `MAX_ERRORS` error messages, each starting `<path>:<line or row N>:`.
    """

    MAX_ERRORS: ClassVar[int] = 5

    rows: int = 0
    skipped: int = 0
    too_long: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def kept(self) -> int:
        return self.rows - self.skipped

    def skip_note(self, source: str | os.PathLike[str]) -> str | None:
        """One line saying what `bad_rows="skip"` dropped from `source` (None if nothing):
        ``<source>: skipped 3 bad rows of 120 (2 with a question too long for the router's
        context); first: <its error>``."""
        if not self.skipped:
            return None
        long = f" ({self.too_long} with a question too long for the router's context)" \
            if self.too_long else ""
        first = f"; first: {self.errors[0]}" if self.errors else ""
        return f"{source}: skipped {self.skipped} bad rows of {self.rows}{long}{first}"


# Line bytes per question byte of a JSONL row, at most, as JSON writers escape it
# (json.dumps, ensure_ascii either way). The question is in a row twice: in the `payload_json`
# string, escaped twice (the worst, a control character: 1 byte -> `\u0001` (6) -> `\\u0001`
# (7)), and in the baked `prompt`, escaped once (6). A row that copies it into more fields
# needs those copies in `QuestionLimit.other_bytes`; a line written with gratuitous `\uXXXX`
# escapes can exceed the bound.
JSON_LINE_EXPANSION = 13


@dataclasses.dataclass(frozen=True)
class QuestionLimit:
    """The most a record's question may hold to fit the router's context, with the bounds
    that let a reader refuse one cheaply (module doc). Plain numbers and a callable: the
    caller that knows the router and its tokenizer builds it (`rl.run.builders.question_limit`).

    tokens       the most tokens a question may have (>= 1): the router's context less the
                 prompt around the question.
    token_bytes  the tokenizer's longest token in UTF-8 bytes (>= 1): a question of more
                 than ``tokens * token_bytes`` bytes has more than `tokens` tokens.
    count        question -> its token count (the exact check, for rows under the bounds).
    why          where `tokens` comes from, shown in errors, e.g.
                 "model.random.max_position_embeddings=8192 less the prompt's 192".
    other_bytes  bytes a JSONL line may hold besides its question (gold, meta, code tests,
                 the other fields), >= 0: the allowance in `line_bytes`.
    """

    tokens: int
    token_bytes: int
    count: Callable[[str], int]
    why: str = ""
    other_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.token_bytes < 1 or self.other_bytes < 0:
            raise ValueError(f"QuestionLimit: tokens ({self.tokens}) and token_bytes "
                             f"({self.token_bytes}) must be >= 1, other_bytes "
                             f"({self.other_bytes}) >= 0")

    @property
    def question_bytes(self) -> int:
        """The most UTF-8 bytes a question of `tokens` tokens can have."""
        return self.tokens * self.token_bytes

    @property
    def line_bytes(self) -> int:
        """The longest JSONL line (bytes, without its newline) a row whose question fits can
        be: the question escaped as JSON in its payload and its prompt
        (`JSON_LINE_EXPANSION` bytes per byte), plus `other_bytes`."""
        return JSON_LINE_EXPANSION * self.question_bytes + self.other_bytes

    def _fits(self) -> str:
        return f"the router's context fits {self.tokens:,}" + (f" ({self.why})" if self.why
                                                                else "")

    def problem(self, question: str) -> str | None:
        """Why `question` cannot fit (``question has N tokens; ...``), or None if it fits.
        Counts tokens only if its UTF-8 length is within `question_bytes`.
        UnicodeEncodeError for a question that is no UTF-8 text (a lone surrogate)."""
        size = len(question.encode("utf-8"))
        if size > self.question_bytes:
            return (f"question has {size:,} bytes, more than {self.tokens:,} tokens of at "
                    f"most {self.token_bytes} bytes can hold; {self._fits()}")
        tokens = self.count(question)
        if tokens > self.tokens:
            return f"question has {tokens:,} tokens; {self._fits()}"
        return None

    def line_problem(self, size: int) -> str:
        """Why a JSONL line of `size` bytes (over `line_bytes`) is refused unparsed."""
        why = f": {self.why}" if self.why else ""
        return (f"question: the line has {size:,} bytes; a row whose question fits the "
                f"router's context ({self.tokens:,} tokens{why}) has at most "
                f"{self.line_bytes:,} ({JSON_LINE_EXPANSION} x {self.question_bytes:,} bytes "
                f"of question, escaped as JSON in its payload and prompt, + "
                f"{self.other_bytes:,} for the other fields); not parsed")


class _Collector:
    """Turns rows into records for one file, applying the `bad_rows` policy and the
    one-row-per-sample-id rule."""

    def __init__(self, path: Path, bad_rows: str, stats: ReadStats | None,
                 limit: QuestionLimit | None = None) -> None:
        if bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
        self.path = path
        self.skip = bad_rows == "skip"
        self.stats = ReadStats() if stats is None else stats
        self.limit = limit
        self.records: list[Record] = []
        self._first_seen: dict[str, str] = {}  # sample_id -> "line 3" / "row 2"

    def reject(self, where: str, problem: str, *, too_long: bool = False) -> None:
        """Count a bad row; raise unless skipping. `where` is `4` (JSONL) or `row 4`;
        `too_long`: the row's question cannot fit the router's context."""
        message = f"{self.path}:{where}: {problem}"
        self.stats.rows += 1
        if not self.skip:
            raise RecordError(message)
        self.stats.skipped += 1
        self.stats.too_long += int(too_long)
        if len(self.stats.errors) < ReadStats.MAX_ERRORS:
            self.stats.errors.append(message)

    def accept(self, where: str, label: str, row: Any) -> None:
        try:
            record = Record.from_row(row)
        except RecordError as exc:
            self.reject(where, str(exc))
            return
        try:
            problem = None if self.limit is None else self.limit.problem(record.question)
        except UnicodeEncodeError as exc:  # "\ud800" is valid JSON; no tokenizer reads it
            self.reject(where, str(field_error(record.sample_id, "question",
                                               f"not valid Unicode ({exc.reason} at "
                                               f"character {exc.start})")))
            return
        if problem is not None:
            self.reject(where, problem, too_long=True)
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
                 stats: ReadStats | None = None,
                 limit: QuestionLimit | None = None) -> list[Record]:
    """Records from a `.jsonl` / `.json` (JSON Lines) or `.parquet` file, chosen by suffix.

    See `read_jsonl` / `read_parquet` for `bad_rows`, `stats` and `limit`. Raises
    `RecordError` naming the file for any other suffix, and for a file that yields no records
    (no rows, or every row skipped as bad).
    """
    path = Path(path)
    readers = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise RecordError(f"{path}: unknown record file type {path.suffix!r}; "
                          f"expected one of {sorted(readers)}")
    stats = ReadStats() if stats is None else stats
    rows_before = stats.rows
    records = reader(path, bad_rows=bad_rows, stats=stats, limit=limit)
    if not records:
        rows = stats.rows - rows_before
        raise RecordError(f"{path}: no records: " + (
            f"every one of its {rows} rows was skipped as bad" if rows else "the file has no rows"))
    return records


# ---------------------------------------------------------------------- JSONL
def read_jsonl(path: str | os.PathLike[str], *, bad_rows: BadRows = "error",
               stats: ReadStats | None = None,
               limit: QuestionLimit | None = None) -> list[Record]:
    """Records from a JSONL file of rows (one `to_row()` object per line).

    Whitespace-only lines are allowed (e.g. a trailing newline). With `bad_rows="error"`
    anything else that is not a valid row (not UTF-8, not JSON, not the schema), or repeats an
    earlier line's `sample_id`, or has a question that cannot fit `limit` (if given), raises
    `RecordError` starting with `<path>:<line>:`; with `"skip"` such lines are dropped and
    counted in `stats` (if given). Lines end at b"\n". With a `limit`, a line longer than
    `limit.line_bytes` is refused without being decoded or parsed, and only its first
    `line_bytes + 1` bytes are ever held in memory.
    """
    path = Path(path)
    collector = _Collector(path, bad_rows, stats, limit)
    max_bytes = None if limit is None else limit.line_bytes
    with path.open("rb") as handle:  # decoded per line, so one bad byte costs one row
        for lineno, (raw, size) in enumerate(_lines(handle, max_bytes), start=1):
            if raw is None:
                assert limit is not None
                collector.reject(str(lineno), limit.line_problem(size), too_long=True)
                continue
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


_DISCARD_CHUNK = 1 << 20  # bytes read at a time from the rest of an oversized line


def _lines(handle: IO[bytes], max_bytes: int | None) -> Iterator[tuple[bytes | None, int]]:
    """(line, its size in bytes without the newline) per line of `handle`; a line longer than
    `max_bytes` comes as (None, size): only its first `max_bytes + 1` bytes are read at once,
    the rest in chunks that are dropped."""
    if max_bytes is None:
        for raw in handle:
            yield raw, len(raw) - raw.endswith(b"\n")
        return
    while raw := handle.readline(max_bytes + 1):
        if raw.endswith(b"\n") or len(raw) <= max_bytes:
            yield raw, len(raw) - raw.endswith(b"\n")
            continue
        size = len(raw)
        del raw
        while chunk := handle.readline(_DISCARD_CHUNK):
            size += len(chunk)
            if chunk.endswith(b"\n"):
                size -= 1
                break
        yield None, size


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
                 stats: ReadStats | None = None,
                 limit: QuestionLimit | None = None) -> list[Record]:
    """Records from a parquet file in the original row layout (`data.records`), read in order.

    Rows go through `Record.from_row` as JSONL lines do, with the same `bad_rows` / `stats` /
    `limit` handling (a parquet row has no line to bound: its question is checked once
    parsed); errors start with `<path>:row <N>:` (N counts from 0, as pandas/pyarrow do). A
    file that is not parquet, or has no `extra_info` column, raises `RecordError` whatever
    `bad_rows` says, as does one whose data cannot be decoded (naming the first row not read).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    collector = _Collector(path, bad_rows, stats, limit)
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
    """Write records as rows of the original layout to a parquet file; returns the number written.

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
