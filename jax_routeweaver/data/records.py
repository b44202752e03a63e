"""The one record schema for real and synthetic questions, and its row / JSONL forms.

A `Record` is one question with everything the pipeline, the episode runner and the scorers
need. The reference stores questions as verl parquet rows; `Record.to_row()` and
`Record.from_row(row)` convert to and from exactly that shape:

```
{"data_source": str,
 "prompt": [{"role": "user", "content": <turn-1 selector prompt>}]   (None if not built yet),
 "extra_info": {"payload_json": '{"raw_question": ..., "gold": [...], "meta": {...}}',
                "scorer_dataset": str, "sample_id": str, "batch_index": int | None,
                "domain": "MATH" | "CODE" | "KNOWLEDGE" | "REASON" | "RECALL",
                "pool": str, "dataset": str, "forced_mode": "single"|"multi"|"agentic"|None}}
```

`payload_json` is a JSON *string* (as in the reference parquets). Keys this module does not
know are kept, uninterpreted, in `Record.extras` under a location-qualified name (`ability`
for a top-level column, `extra_info.index`, `payload_json.source`) and written back by
`to_row()`, so a real row survives a round trip unchanged.

JSONL files hold one such row per line (`read_jsonl` / `write_jsonl`); parquet files hold the
rows as columns (`read_parquet` / `write_parquet`, `extra_info` a struct); `read_records` picks
the reader by suffix. Read errors are one line naming the file and the line (JSONL, 1-based)
or row (parquet, 0-based); `bad_rows="skip"` drops bad rows (a JSONL line that is not UTF-8
too) instead and counts them in a `ReadStats`. A `sample_id` may appear only once per file.
Every validation error names the field and the sample id. `read_records`, which opens a data
source, also refuses a file that yields no records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import operator
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

__all__ = [
    "CODE_SCORER_DATASETS",
    "FORCED_MODES",
    "Domain",
    "ReadStats",
    "Record",
    "RecordError",
    "read_jsonl",
    "read_parquet",
    "read_records",
    "write_jsonl",
    "write_parquet",
]


class Domain(enum.StrEnum):
    """The five task domains of the paper (batch quota 7/7/7/6/5 in this order)."""

    MATH = "MATH"
    CODE = "CODE"
    KNOWLEDGE = "KNOWLEDGE"
    REASON = "REASON"
    RECALL = "RECALL"


FORCED_MODES = ("single", "multi", "agentic")
# Scorers that execute a program against `meta.tests` (the reference's code scorers); their rows
# need tests.
CODE_SCORER_DATASETS = frozenset({"stdin", "apps_functional", "livecodebench", "taco_mm"})

_ROW_KEYS = ("data_source", "prompt", "extra_info")
_EXTRA_INFO_KEYS = ("payload_json", "scorer_dataset", "sample_id", "batch_index", "domain",
                    "pool", "dataset", "forced_mode")
_PAYLOAD_KEYS = ("raw_question", "gold", "meta")
_EXTRA_PREFIXES = ("extra_info.", "payload_json.")
_SCORER_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class RecordError(ValueError):
    """A record, row or JSONL line that does not fit the schema."""


def _fail(sample_id: object, field: str, problem: str) -> RecordError:
    return RecordError(f"record {sample_id!r}: field {field!r}: {problem}")


def _plain(value: Any) -> Any:
    """numpy scalars/arrays (as pandas/pyarrow hand them out) -> Python objects."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    return value


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Record:
    """One question. Immutable; `meta` and `extras` are plain dicts, treat them as read-only.

    Fields (reference row location in brackets):
      sample_id       [extra_info.sample_id] unique id of the question.
      domain          [extra_info.domain] a `Domain` (strings are converted, any case).
      dataset         [extra_info.dataset] benchmark name (logged as `rfm_dataset`).
      scorer_dataset  [extra_info.scorer_dataset] which scorer grades it.
      question        [payload_json.raw_question] the raw question, verbatim.
      gold            [payload_json.gold] accepted answers (ints/floats become strings); at
                      least one non-empty answer unless the scorer runs code.
      meta            [payload_json.meta] scorer inputs (`tests`, `test_type`, `func_name`
                      for code) and anything else, e.g. `difficulty`; JSON-serialisable.
      pool            [extra_info.pool] which pool the row was drawn from.
      batch_index     [extra_info.batch_index] training step - 1 the row belongs to, or None.
      forced_mode     [extra_info.forced_mode] 'single' | 'multi' | 'agentic' | None
                      ("" in a row reads as None).
      data_source     [data_source] the verl data-source tag.
      prompt          [prompt[0].content] the baked turn-1 selector prompt, None if not built.
      extras          unknown row keys, kept for a lossless round trip (see module doc).
    """

    sample_id: str
    domain: Domain
    dataset: str
    scorer_dataset: str
    question: str
    gold: tuple[str, ...]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    pool: str = ""
    batch_index: int | None = None
    forced_mode: str | None = None
    data_source: str = ""
    prompt: str | None = None
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        sid = self.sample_id
        if not isinstance(sid, str) or not sid.strip():
            raise _fail(sid, "sample_id", "must be a non-empty string")
        # Normalise the forgiving input forms once, so a Record is always canonical.
        domain = self.domain
        if isinstance(domain, str) and not isinstance(domain, Domain):
            try:
                domain = Domain(domain.strip().upper())
            except ValueError:
                raise _fail(sid, "domain", f"{self.domain!r} is not one of "
                                           f"{[d.value for d in Domain]}") from None
            object.__setattr__(self, "domain", domain)
        elif not isinstance(domain, Domain):
            raise _fail(sid, "domain", f"expected a Domain or string, got {type(domain).__name__}")
        gold = self.gold
        if isinstance(gold, (str, bytes)) or not isinstance(gold, Iterable):
            raise _fail(sid, "gold", f"expected a list of strings, got {type(gold).__name__}")
        items = []
        for k, item in enumerate(_plain(gold) if hasattr(gold, "tolist") else gold):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise _fail(sid, f"gold[{k}]", f"expected a string, got {type(item).__name__}")
            if isinstance(item, float) and not math.isfinite(item):
                raise _fail(sid, f"gold[{k}]", f"{item!r} is not a finite number")
            items.append(item if isinstance(item, str) else str(item))
        object.__setattr__(self, "gold", tuple(items))
        if self.batch_index is not None and not isinstance(self.batch_index, bool):
            # numpy integers from parquet -> int; floats and strings stay and fail in validate()
            with contextlib.suppress(TypeError):
                object.__setattr__(self, "batch_index", operator.index(self.batch_index))
        if self.forced_mode == "":
            object.__setattr__(self, "forced_mode", None)
        self.validate()

    def validate(self) -> None:
        """Raise `RecordError` (naming the field and sample id) if any field is invalid."""
        sid = self.sample_id
        for name in ("dataset", "question"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise _fail(sid, name, "must be a non-empty string")
        if not isinstance(self.scorer_dataset, str) or not _SCORER_NAME.match(self.scorer_dataset):
            raise _fail(sid, "scorer_dataset",
                        f"must be a scorer name like 'math' or 'apps_functional', "
                        f"got {self.scorer_dataset!r}")
        for name in ("pool", "data_source"):
            if not isinstance(getattr(self, name), str):
                raise _fail(sid, name, f"must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.meta, dict) or not all(isinstance(k, str) for k in self.meta):
            raise _fail(sid, "meta", "must be a dict with string keys")
        if not _json_ok(self.meta):
            raise _fail(sid, "meta", "must be JSON-serialisable (no NaN, no custom objects)")
        is_code = self.scorer_dataset in CODE_SCORER_DATASETS
        if not is_code and not any(g.strip() for g in self.gold):
            raise _fail(sid, "gold", f"needs at least one non-empty answer for scorer "
                                     f"{self.scorer_dataset!r}")
        if is_code:
            self._validate_code_meta()
        bi = self.batch_index
        if bi is not None and (isinstance(bi, bool) or not isinstance(bi, int) or bi < 0):
            raise _fail(sid, "batch_index", f"must be a non-negative integer or None, got {bi!r}")
        if self.forced_mode is not None and self.forced_mode not in FORCED_MODES:
            raise _fail(sid, "forced_mode",
                        f"must be one of {FORCED_MODES} or None, got {self.forced_mode!r}")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise _fail(sid, "prompt", "must be a non-empty string or None")
        if not isinstance(self.extras, dict) or not _json_ok(self.extras):
            raise _fail(sid, "extras", "must be a JSON-serialisable dict")
        for key in self.extras:
            bare = key.split(".", 1)[1] if key.startswith(_EXTRA_PREFIXES) else key
            known = {"extra_info.": _EXTRA_INFO_KEYS, "payload_json.": _PAYLOAD_KEYS}
            prefix = key[: len(key) - len(bare)]
            if not bare or bare in known.get(prefix, _ROW_KEYS):
                raise _fail(sid, f"extras[{key!r}]",
                            "names a schema field; set the field itself instead")

    def _validate_code_meta(self) -> None:
        sid = self.sample_id
        tests = self.meta.get("tests")
        if not isinstance(tests, list) or not tests:
            raise _fail(sid, "meta.tests", f"scorer {self.scorer_dataset!r} runs code and needs "
                                           "a non-empty list of {input, output} tests")
        for k, test in enumerate(tests):
            if not isinstance(test, dict) or "input" not in test or "output" not in test:
                raise _fail(sid, f"meta.tests[{k}]", "must be an object with 'input' and 'output'")
        if self.scorer_dataset == "apps_functional":
            name = self.meta.get("func_name")
            if not isinstance(name, str) or not name.isidentifier():
                raise _fail(sid, "meta.func_name",
                            "apps_functional needs the name of the function to call")

    @property
    def difficulty(self) -> str | None:
        """`meta['difficulty']` if present (synthetic tasks: 'easy' | 'medium' | 'hard')."""
        value = self.meta.get("difficulty")
        return value if isinstance(value, str) else None

    def replace(self, **changes: Any) -> Record:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ row form
    def to_row(self) -> dict[str, Any]:
        """The reference parquet row (see module doc); `payload_json` is a JSON string."""
        payload: dict[str, Any] = {"raw_question": self.question, "gold": list(self.gold),
                                   "meta": self.meta}
        info: dict[str, Any] = {
            "payload_json": None,  # filled below, after payload extras
            "scorer_dataset": self.scorer_dataset,
            "sample_id": self.sample_id,
            "batch_index": self.batch_index,
            "domain": self.domain.value,
            "pool": self.pool,
            "dataset": self.dataset,
            "forced_mode": self.forced_mode,
        }
        row: dict[str, Any] = {
            "data_source": self.data_source,
            "prompt": (None if self.prompt is None
                       else [{"role": "user", "content": self.prompt}]),
            "extra_info": info,
        }
        for key, value in self.extras.items():
            if key.startswith("payload_json."):
                payload[key[len("payload_json."):]] = value
            elif key.startswith("extra_info."):
                info[key[len("extra_info."):]] = value
            else:
                row[key] = value
        info["payload_json"] = json.dumps(payload, ensure_ascii=False)
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Record:
        """Parse a reference row (a dict from parquet/pyarrow/pandas, or a JSONL line).

        Raises `RecordError` naming the missing/invalid field (`extra_info.payload_json.gold`,
        ...) and the sample id.
        """
        if not isinstance(row, Mapping):
            raise RecordError(f"row: expected an object/dict, got {type(row).__name__}")
        info = _plain(row.get("extra_info"))
        if not isinstance(info, Mapping):
            raise _fail("<unknown>", "extra_info", "missing or not an object")
        sid = info.get("sample_id", "<unknown>")

        def need(mapping: Mapping[str, Any], key: str, where: str) -> Any:
            if key not in mapping or mapping[key] is None:
                raise _fail(sid, f"{where}{key}", "missing")
            return _plain(mapping[key])

        raw_payload = need(info, "payload_json", "extra_info.")
        if isinstance(raw_payload, (str, bytes)):
            try:
                payload = json.loads(raw_payload)
            except json.JSONDecodeError as exc:
                raise _fail(sid, "extra_info.payload_json", f"invalid JSON: {exc}") from None
        else:
            payload = raw_payload
        if not isinstance(payload, Mapping):
            raise _fail(sid, "extra_info.payload_json", "must be a JSON object")
        question = need(payload, "raw_question", "extra_info.payload_json.")
        gold = need(payload, "gold", "extra_info.payload_json.")
        if not isinstance(gold, list):
            raise _fail(sid, "extra_info.payload_json.gold",
                        f"expected a list, got {type(gold).__name__}")
        meta = payload.get("meta")
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise _fail(sid, "extra_info.payload_json.meta",
                        f"expected an object, got {type(meta).__name__}")
        extras: dict[str, Any] = {}
        for key, value in row.items():
            if key not in _ROW_KEYS:
                extras[key] = _plain(value)
        for key, value in info.items():
            if key not in _EXTRA_INFO_KEYS:
                extras[f"extra_info.{key}"] = _plain(value)
        for key, value in payload.items():
            if key not in _PAYLOAD_KEYS:
                extras[f"payload_json.{key}"] = value
        return cls(
            sample_id=sid if isinstance(sid, str) else str(sid),
            domain=need(info, "domain", "extra_info."),
            dataset=need(info, "dataset", "extra_info."),
            scorer_dataset=need(info, "scorer_dataset", "extra_info."),
            question=question,
            gold=tuple(gold),
            meta=meta,
            pool=_plain(info.get("pool")) or "",
            batch_index=_plain(info.get("batch_index")),
            forced_mode=_plain(info.get("forced_mode")) or None,
            data_source=_plain(row.get("data_source")) or "",
            prompt=_prompt_from_row(row.get("prompt"), sid),
            extras=extras,
        )


def _prompt_from_row(value: Any, sid: object) -> str | None:
    """`prompt` column -> the one user message's content (docs/protocol.md, "The selector
    prompt"), or None."""
    value = _plain(value)
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], Mapping)
            or value[0].get("role") != "user" or not isinstance(value[0].get("content"), str)):
        raise _fail(sid, "prompt", "expected a list with exactly one "
                                   "{'role': 'user', 'content': str} message")
    return value[0]["content"]


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
            raise _fail("<unknown>", "extra_info", f"invalid JSON: {exc}") from None
    if isinstance(info, dict):
        info = {k: v for k, v in info.items() if v is not None or k in _EXTRA_INFO_KEYS}
    out = {k: v for k, v in row.items() if v is not None or k in _ROW_KEYS}
    out["extra_info"] = info
    return out


def read_parquet(path: str | os.PathLike[str], *, bad_rows: BadRows = "error",
                 stats: ReadStats | None = None) -> list[Record]:
    """Records from a parquet file in the reference row layout (module doc), read in order.

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
    info_keys = dict.fromkeys([*_EXTRA_INFO_KEYS, *(k for info in infos for k in info)])
    info_arrays = [
        _arrow_column([info.get(key) for info in infos], f"extra_info.{key}",
                      pa.int64() if key in _INFO_INT_KEYS
                      else pa.string() if key in _EXTRA_INFO_KEYS else None, path)
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
    for key in dict.fromkeys(k for row in rows for k in row if k not in _ROW_KEYS):
        columns[key] = _arrow_column([row.get(key) for row in rows], key, None, path)
    table = pa.table(columns)
    with _atomic_target(path) as tmp:
        pq.write_table(table, tmp)
    return len(rows)
