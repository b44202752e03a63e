"""Local copies of public datasets -> raw rows, with where each row came from.

`read_rows` reads, without any network access,

* a file: `.parquet`, `.arrow` (Arrow IPC, as `datasets.save_to_disk` writes), `.jsonl`,
  `.json` (JSON lines, a JSON array, or an object holding the rows under `examples` / `data`
  / `rows`, as BIG-Bench-Hard's task files), `.csv` or `.tsv`;
* a directory: a `datasets.save_to_disk` Dataset (`state.json` lists its arrow files), a
  saved DatasetDict (`dataset_dict.json`; `split` picks the split), or any folder of such
  files, e.g. a Hub snapshot (read recursively in path order; `split` keeps the files whose
  path has a part named like the split: `test/`, `test.jsonl`, `test-00000-of-00001.parquet`).

The `datasets` package is not needed: its saved files are plain Arrow, read with pyarrow.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jax_routeweaver.data.records import RecordError

__all__ = ["MalformedRow", "SourceRow", "read_rows"]

_DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json", ".csv", ".tsv")
_HF_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "state.json",
                          "dataset_dict.json"})


class MalformedRow(ValueError):
    """A row that does not fit its dataset's layout; `field` names the column."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"field {field!r}: {problem}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class SourceRow:
    """One raw row. `where` is `"3"` (JSON lines: 1-based line) or `"row 3"` (0-based row of
    the file); `index` is the 0-based position across all files of the source."""

    path: Path
    where: str
    index: int
    row: Mapping[str, Any]


def _data_files(directory: Path, split: str | None) -> list[Path]:
    if (directory / "dataset_dict.json").is_file():
        try:
            splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"{directory}/dataset_dict.json: not a DatasetDict index "
                              f"({exc})") from None
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise RecordError(f"{directory}: a DatasetDict with splits {splits}; choose one "
                              f"(got split {split!r})")
        return _data_files(directory / split, None)
    if (directory / "state.json").is_file():
        try:
            state = json.loads((directory / "state.json").read_text())
            names = [entry["filename"] for entry in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"{directory}/state.json: not a saved Dataset ({exc})") from None
        if split is not None:
            raise RecordError(f"{directory}: a saved Dataset has no splits (got split "
                              f"{split!r}); pass the DatasetDict directory instead")
        return [directory / name for name in names]
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix.lower() in _DATA_SUFFIXES
                   and p.name not in _HF_METADATA
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if split is not None:
        files = [p for p in files if _has_split(p.relative_to(directory), split)]
    if not files:
        what = f" for split {split!r}" if split else ""
        raise RecordError(f"{directory}: no data files{what} (looked for "
                          f"{', '.join(_DATA_SUFFIXES)})")
    return files


def _has_split(relative: Path, split: str) -> bool:
    *dirs, name = relative.parts
    stem = name.split(".", 1)[0]
    return split in dirs or stem == split or stem.startswith((f"{split}-", f"{split}_"))


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSON lines in a .json file
    if isinstance(data, dict):
        key = next((k for k in ("examples", "data", "rows") if isinstance(data.get(k), list)),
                   None)
        data = None if key is None else data[key]  # else: a one-line JSON lines file
    if not isinstance(data, list):
        yield from _jsonl_lines(io.StringIO(text))
        return
    for i, row in enumerate(data):
        yield f"row {i}", row


def _jsonl_lines(handle: Any) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            yield str(lineno), json.loads(line)
        except json.JSONDecodeError as exc:
            yield str(lineno), MalformedRow("<line>", f"invalid JSON: {exc}")


def _arrow_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)  # what datasets.save_to_disk writes
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"row {index}", row
                index += 1


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    index = 0
    with pq.ParquetFile(path) as parquet:
        for batch in parquet.iter_batches():
            for row in batch.to_pylist():
                yield f"row {index}", row
                index += 1


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    # Quoted cells may span lines, so rows are numbered, not lines.
    with path.open(encoding="utf-8-sig", newline="") as handle:
        reader = csv.DictReader(handle, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        for i, row in enumerate(reader):
            if None in row:  # DictReader files cells beyond the header under None
                yield f"row {i}", MalformedRow("<row>", f"{len(row[None])} more cells than "
                                                        "the header has columns")
            else:
                yield f"row {i}", row


def _file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            yield from _parquet_rows(path)
        elif suffix == ".arrow":
            yield from _arrow_rows(path)
        elif suffix == ".jsonl":
            with path.open(encoding="utf-8") as handle:
                yield from _jsonl_lines(handle)
        elif suffix == ".json":
            yield from _json_rows(path)
        elif suffix in (".csv", ".tsv"):
            yield from _csv_rows(path)
        else:
            raise RecordError(f"{path}: unknown data file type {suffix!r}; expected one of "
                              f"{', '.join(_DATA_SUFFIXES)}")
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise RecordError(f"{path}: cannot read it as {suffix} ({exc})") from None
    except Exception as exc:  # pyarrow's errors (ArrowInvalid, ...) without importing it here
        if type(exc).__module__.startswith("pyarrow"):
            raise RecordError(f"{path}: cannot read it as {suffix} ({exc})") from None
        raise


def read_rows(path: str | os.PathLike[str], *, split: str | None = None) -> Iterator[SourceRow]:
    """The raw rows of a local dataset copy (module doc: files, directories, `split`).

    A row that is not a JSON object / mapping is passed on as is (the converter rejects it);
    an unparsable JSON line is passed on as a `MalformedRow` instance. Unreadable files raise
    `RecordError` naming the file; a missing path raises FileNotFoundError.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_dir():
        files = _data_files(path, split)
    elif split is not None:
        raise RecordError(f"{path}: a split selects files inside a directory, but this is a "
                          f"file (got split {split!r})")
    else:
        files = [path]
    index = 0
    for file in files:
        for where, row in _file_rows(file):
            yield SourceRow(file, where, index, row)
            index += 1
