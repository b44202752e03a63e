"""The one record schema for real and synthetic questions, and its row form.

A `Record` is one question with everything the pipeline, the episode runner and the scorers
need. The original code stores questions as verl parquet rows; `Record.to_row()` and
`Record.from_row(row)` convert to and from exactly that shape:

```
{"data_source": str,
 "prompt": [{"role": "user", "content": <turn-1 selector prompt>}]   (None if not built yet),
 "extra_info": {"payload_json": '{"raw_question": ..., "gold": [...], "meta": {...}}',
                "scorer_dataset": str, "sample_id": str, "batch_index": int | None,
                "domain": "MATH" | "CODE" | "KNOWLEDGE" | "REASON" | "RECALL",
                "pool": str, "dataset": str, "forced_mode": "single"|"multi"|"agentic"|None}}
```

`payload_json` is a JSON *string* (as in the original parquets). Keys this module does not
know are kept, uninterpreted, in `Record.extras` under a location-qualified name (`ability`
for a top-level column, `extra_info.index`, `payload_json.source`) and written back by
`to_row()`, so a real row survives a round trip unchanged.

Every validation error names the field and the sample id. Reading and writing files of rows
(JSONL, parquet) is `data.record_files`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import operator
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CODE_SCORER_DATASETS",
    "FORCED_MODES",
    "UNSCORED",
    "Domain",
    "Record",
    "RecordError",
]


class Domain(enum.StrEnum):
    """The five task domains of the paper (batch quota 7/7/7/6/5 in this order)."""

    MATH = "MATH"
    CODE = "CODE"
    KNOWLEDGE = "KNOWLEDGE"
    REASON = "REASON"
    RECALL = "RECALL"


FORCED_MODES = ("single", "multi", "agentic")
# Scorers that execute a program against `meta.tests` (the original's code scorers); their rows
# need tests.
CODE_SCORER_DATASETS = frozenset({"stdin", "apps_functional", "livecodebench", "taco_mm"})
# The scorer name of a question nobody grades (a request to the serving endpoint, `serving`):
# it needs no gold answer and may have no domain.
UNSCORED = "unscored"

RECORD_ROW_KEYS = ("data_source", "prompt", "extra_info")
EXTRA_INFO_KEYS = ("payload_json", "scorer_dataset", "sample_id", "batch_index", "domain",
                    "pool", "dataset", "forced_mode")
_PAYLOAD_KEYS = ("raw_question", "gold", "meta")
_EXTRA_PREFIXES = ("extra_info.", "payload_json.")
_SCORER_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class RecordError(ValueError):
    """A record, row or JSONL line that does not fit the schema."""


def field_error(sample_id: object, field: str, problem: str) -> RecordError:
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

    Fields (row location in the original layout in brackets):
      sample_id       [extra_info.sample_id] unique id of the question.
      domain          [extra_info.domain] a `Domain` (strings are converted, any case); None
                      only for an `UNSCORED` question (a served request's is unknown).
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
    domain: Domain | None
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
            raise field_error(sid, "sample_id", "must be a non-empty string")
        # Normalise the forgiving input forms once, so a Record is always canonical.
        domain = self.domain
        if isinstance(domain, str) and not isinstance(domain, Domain):
            try:
                domain = Domain(domain.strip().upper())
            except ValueError:
                raise field_error(sid, "domain", f"{self.domain!r} is not one of "
                                  f"{[d.value for d in Domain]}") from None
            object.__setattr__(self, "domain", domain)
        elif domain is None and self.scorer_dataset == UNSCORED:
            pass
        elif not isinstance(domain, Domain):
            raise field_error(sid, "domain",
                              f"expected a Domain or string, got {type(domain).__name__}")
        gold = self.gold
        if isinstance(gold, (str, bytes)) or not isinstance(gold, Iterable):
            raise field_error(sid, "gold", f"expected a list of strings, got {type(gold).__name__}")
        items = []
        for k, item in enumerate(_plain(gold) if hasattr(gold, "tolist") else gold):
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise field_error(sid, f"gold[{k}]",
                                  f"expected a string, got {type(item).__name__}")
            if isinstance(item, float) and not math.isfinite(item):
                raise field_error(sid, f"gold[{k}]", f"{item!r} is not a finite number")
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
                raise field_error(sid, name, "must be a non-empty string")
        if not isinstance(self.scorer_dataset, str) or not _SCORER_NAME.match(self.scorer_dataset):
            raise field_error(sid, "scorer_dataset",
                              f"must be a scorer name like 'math' or 'apps_functional', "
                              f"got {self.scorer_dataset!r}")
        for name in ("pool", "data_source"):
            if not isinstance(getattr(self, name), str):
                raise field_error(sid, name, f"must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.meta, dict) or not all(isinstance(k, str) for k in self.meta):
            raise field_error(sid, "meta", "must be a dict with string keys")
        if not _json_ok(self.meta):
            raise field_error(sid, "meta", "must be JSON-serialisable (no NaN, no custom objects)")
        is_code = self.scorer_dataset in CODE_SCORER_DATASETS
        if not is_code and self.scorer_dataset != UNSCORED \
                and not any(g.strip() for g in self.gold):
            raise field_error(sid, "gold", f"needs at least one non-empty answer for scorer "
                              f"{self.scorer_dataset!r}")
        if is_code:
            self._validate_code_meta()
        bi = self.batch_index
        if bi is not None and (isinstance(bi, bool) or not isinstance(bi, int) or bi < 0):
            raise field_error(sid, "batch_index",
                              f"must be a non-negative integer or None, got {bi!r}")
        if self.forced_mode is not None and self.forced_mode not in FORCED_MODES:
            raise field_error(sid, "forced_mode",
                              f"must be one of {FORCED_MODES} or None, got {self.forced_mode!r}")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise field_error(sid, "prompt", "must be a non-empty string or None")
        if not isinstance(self.extras, dict) or not _json_ok(self.extras):
            raise field_error(sid, "extras", "must be a JSON-serialisable dict")
        for key in self.extras:
            bare = key.split(".", 1)[1] if key.startswith(_EXTRA_PREFIXES) else key
            known = {"extra_info.": EXTRA_INFO_KEYS, "payload_json.": _PAYLOAD_KEYS}
            prefix = key[: len(key) - len(bare)]
            if not bare or bare in known.get(prefix, RECORD_ROW_KEYS):
                raise field_error(sid, f"extras[{key!r}]",
                                  "names a schema field; set the field itself instead")

    def _validate_code_meta(self) -> None:
        sid = self.sample_id
        tests = self.meta.get("tests")
        if not isinstance(tests, list) or not tests:
            raise field_error(sid, "meta.tests",
                              f"scorer {self.scorer_dataset!r} runs code and needs "
                              "a non-empty list of {input, output} tests")
        for k, test in enumerate(tests):
            if not isinstance(test, dict) or "input" not in test or "output" not in test:
                raise field_error(sid, f"meta.tests[{k}]",
                                  "must be an object with 'input' and 'output'")
        if self.scorer_dataset == "apps_functional":
            name = self.meta.get("func_name")
            if not isinstance(name, str) or not name.isidentifier():
                raise field_error(sid, "meta.func_name",
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
        """The row in the original parquet layout (module doc); `payload_json` is a JSON string."""
        payload: dict[str, Any] = {"raw_question": self.question, "gold": list(self.gold),
                                   "meta": self.meta}
        info: dict[str, Any] = {
            "payload_json": None,  # filled below, after payload extras
            "scorer_dataset": self.scorer_dataset,
            "sample_id": self.sample_id,
            "batch_index": self.batch_index,
            "domain": None if self.domain is None else self.domain.value,
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
        """Parse a row in the original layout (a dict from parquet/pyarrow/pandas, or a JSONL line).

        Raises `RecordError` naming the missing/invalid field (`extra_info.payload_json.gold`,
        ...) and the sample id.
        """
        if not isinstance(row, Mapping):
            raise RecordError(f"row: expected an object/dict, got {type(row).__name__}")
        info = _plain(row.get("extra_info"))
        if not isinstance(info, Mapping):
            raise field_error("<unknown>", "extra_info", "missing or not an object")
        sid = info.get("sample_id", "<unknown>")

        def need(mapping: Mapping[str, Any], key: str, where: str) -> Any:
            if key not in mapping or mapping[key] is None:
                raise field_error(sid, f"{where}{key}", "missing")
            return _plain(mapping[key])

        raw_payload = need(info, "payload_json", "extra_info.")
        if isinstance(raw_payload, (str, bytes)):
            try:
                payload = json.loads(raw_payload)
            except json.JSONDecodeError as exc:
                raise field_error(sid, "extra_info.payload_json", f"invalid JSON: {exc}") from None
        else:
            payload = raw_payload
        if not isinstance(payload, Mapping):
            raise field_error(sid, "extra_info.payload_json", "must be a JSON object")
        question = need(payload, "raw_question", "extra_info.payload_json.")
        gold = need(payload, "gold", "extra_info.payload_json.")
        if not isinstance(gold, list):
            raise field_error(sid, "extra_info.payload_json.gold",
                              f"expected a list, got {type(gold).__name__}")
        meta = payload.get("meta")
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise field_error(sid, "extra_info.payload_json.meta",
                              f"expected an object, got {type(meta).__name__}")
        extras: dict[str, Any] = {}
        for key, value in row.items():
            if key not in RECORD_ROW_KEYS:
                extras[key] = _plain(value)
        for key, value in info.items():
            if key not in EXTRA_INFO_KEYS:
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
        raise field_error(sid, "prompt", "expected a list with exactly one "
                          "{'role': 'user', 'content': str} message")
    return value[0]["content"]
