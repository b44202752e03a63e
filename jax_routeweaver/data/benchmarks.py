"""The public benchmarks: one converter per source from its public column layout to `Record`s.

Each `Source` in `SOURCES` maps its dataset's public column layout (`Source.layout`) to
records: the domain, the `scorer_dataset` that grades it, gold answers in the form that scorer
expects and, for code, `meta.tests` (+ `test_type`, `func_name`) as the code scorers read them.
`sample_id` is `<source>[-<split>]-<id>`, the id being the dataset's own id column where it has
one, else the row's 0-based position across the source's files.

A converter raises `MalformedRow` for a row that does not fit the layout (missing column, wrong
type, broken JSON) and `UnusableRow` for a well-formed row the benchmark definition excludes;
`data.sources.load_source` reads the files and applies them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import math
import pickle
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jax_routeweaver.data.dataset_files import MalformedRow
from jax_routeweaver.data.records import Domain, Record

__all__ = [
    "DATA_SOURCE",
    "SOURCES",
    "Source",
    "UnusableRow",
    "last_boxed",
]

DATA_SOURCE = "routeweaver"  # verl data-source tag of every RouteWeaver row
_SPLIT_NAMES = frozenset({"train", "test", "validation", "valid", "dev", "eval"})
# Generic shard file names, which say nothing about the task a file holds.
_SHARD = re.compile(r"^(?:data|train|test|validation|valid|dev|eval)"
                    r"(?:[-_]\d+(?:[-_]of[-_]\d+)?)?$")


class UnusableRow(ValueError):
    """A well-formed row the benchmark excludes; the message is the reason (counted)."""


# ============================================================================ field helpers
def _get(row: Mapping[str, Any], field: str) -> Any:
    if field not in row:
        raise MalformedRow(field, f"missing (columns: {sorted(row)[:12]})")
    return row[field]


def _text(row: Mapping[str, Any], field: str) -> str:
    value = _get(row, field)
    if not isinstance(value, str) or not value.strip():
        raise MalformedRow(field, f"expected a non-empty string, got {value!r:.60}")
    return value


def _optional_text(row: Mapping[str, Any], field: str) -> str:
    value = row.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise MalformedRow(field, f"expected a string, got {type(value).__name__}")
    return value


def _first_text(row: Mapping[str, Any], fields: Sequence[str]) -> str:
    for field in fields:
        if row.get(field) not in (None, ""):
            return _scalar_text(row, field)
    raise MalformedRow("|".join(fields), f"none of these columns is present "
                                         f"(columns: {sorted(row)[:12]})")


def _scalar_text(row: Mapping[str, Any], field: str) -> str:
    """A string or a number column as text (AIME answers are ints in some copies)."""
    value = _get(row, field)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise MalformedRow(field, f"expected a string or number, got {value!r:.60}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedRow(field, f"{value!r} is not a finite number")
        value = int(value) if value.is_integer() else value
    text = str(value).strip()
    if not text:
        raise MalformedRow(field, "is empty")
    return text


def _json_value(row: Mapping[str, Any], field: str) -> Any:
    """A column holding JSON text (decoded) or an already-decoded value (kept)."""
    value = _get(row, field)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise MalformedRow(field, f"invalid JSON: {exc}") from None
    return value


def _str_list(value: Any, field: str, *, allow_empty: bool = False) -> list[str]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise MalformedRow(field, f"expected a list of strings, got {value!r:.60}")
    if not allow_empty and not value:
        raise MalformedRow(field, "is an empty list")
    return list(value)


def _bool(row: Mapping[str, Any], field: str) -> bool:
    value = _get(row, field)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"  # CSV copies
    raise MalformedRow(field, f"expected true/false, got {value!r:.60}")


def _row_id(row: Mapping[str, Any], field: str) -> str | None:
    value = row.get(field)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise MalformedRow(field, f"expected a string or integer id, got {value!r:.60}")
    return str(value).strip() or None


def _plain_meta(**values: Any) -> dict[str, Any]:
    """Meta without None values; anything not JSON-native (timestamps) becomes its text."""
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            value = str(value)
        out[key] = value
    return out


def _dedupe(values: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(v.strip() for v in values if v.strip()))


_LETTERS = "ABCDEFGHIJ"


def _mc_question(question: str, options: Sequence[str]) -> str:
    lines = [f"{_LETTERS[k]}) {option.strip()}" for k, option in enumerate(options)]
    return question.strip() + "\n\n" + "\n".join(lines)


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` / `\fbox{...}` (braces matched), or of a
    `\boxed 5` without braces; None if there is none or its braces never close."""
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if boxed < 0 and fbox < 0:
        return None
    rest = text[boxed + len("\\boxed"):] if boxed > fbox else text[fbox + len("\\fbox"):]
    if rest.startswith(" "):
        match = re.match(r"\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return rest[1:i].strip()
    return None


# ============================================================================ sources
@dataclasses.dataclass(frozen=True)
class RowContext:
    """Where a row came from; `record(...)` fills the source-wide fields."""

    source: Source
    path: Path
    index: int
    split: str | None

    def sample_id(self, own_id: str | None = None) -> str:
        split = f"-{self.split}" if self.split else ""
        return f"{self.source.name}{split}-{self.index if own_id is None else own_id}"

    def record(self, *, own_id: str | None = None, question: str, gold: Sequence[str],
               meta: dict[str, Any], scorer: str | None = None,
               data_source: str = DATA_SOURCE, extras: dict[str, Any] | None = None) -> Record:
        return Record(sample_id=self.sample_id(own_id), domain=self.source.domain,
                      dataset=self.source.dataset,
                      scorer_dataset=scorer or self.source.scorer, question=question,
                      gold=tuple(gold), meta=meta, data_source=data_source,
                      extras=extras or {})


Converter = Callable[[Mapping[str, Any], RowContext], Record]


@dataclasses.dataclass(frozen=True)
class Source:
    """A public dataset. `name` is its key (CLI, sample ids); `dataset` the benchmark name
    records carry (`rfm_dataset`); `scorer` the default `scorer_dataset`; `layout` the public
    copy and the columns read."""

    name: str
    dataset: str
    domain: Domain
    scorer: str
    layout: str
    convert: Converter
    group: Callable[[Record], str] | None = None  # strata for draws (BBH: its task)


def _omni_math(row: Mapping[str, Any], ctx: RowContext) -> Record:
    return ctx.record(question=_text(row, "problem"), gold=[_scalar_text(row, "answer")],
                      meta=_plain_meta(difficulty=row.get("difficulty"),
                                       domain=row.get("domain"), source=row.get("source")))


_LEVEL = re.compile(r"^Level (\d)$")


def _math(row: Mapping[str, Any], ctx: RowContext) -> Record:
    problem = _text(row, "problem")
    level = _get(row, "level")
    if isinstance(level, int) and not isinstance(level, bool):
        number = level  # MATH-500 style copies store the number
    elif isinstance(level, str):
        match = _LEVEL.match(level.strip())
        if not match:
            raise UnusableRow(f"level {level.strip()!r} is not 'Level 1'..'Level 5'")
        number = int(match.group(1))
    else:
        raise MalformedRow("level", f"expected 'Level N' or an integer, got {level!r:.60}")
    if not 2 <= number <= 5:
        raise UnusableRow(f"level {number} (MATH L2-5 keeps levels 2-5)")
    # An `answer` column where the copy has one (MATH-500), else the solution's last \boxed{}.
    answer = _scalar_text(row, "answer") if row.get("answer") not in (None, "") \
        else last_boxed(_text(row, "solution"))
    if not answer:
        raise UnusableRow("no \\boxed{} answer in the solution")
    return ctx.record(own_id=_row_id(row, "unique_id"), question=problem, gold=[answer],
                      meta=_plain_meta(level=number, type=row.get("type", row.get("subject"))))


def _aime(row: Mapping[str, Any], ctx: RowContext) -> Record:
    own = next((_row_id(row, f) for f in ("id", "ID", "url") if row.get(f) not in (None, "")),
               None)
    return ctx.record(own_id=own,
                      question=_first_text(row, ("problem", "Problem", "question", "Question")),
                      gold=[_first_text(row, ("answer", "Answer"))],
                      meta=_plain_meta(year=row.get("Year", row.get("year"))))


_NUMBERED = re.compile(r"^\s*\d+[.)]\s")


def _satbench(row: Mapping[str, Any], ctx: RowContext) -> Record:
    scenario, question = _text(row, "scenario"), _text(row, "question")
    conditions = _str_list(_json_value(row, "conditions"), "conditions")
    # Number the conditions unless the copy already does.
    lines = conditions if all(_NUMBERED.match(c) for c in conditions) \
        else [f"{k}. {c}" for k, c in enumerate(conditions, start=1)]
    text = f"{scenario.strip()}\n\n" + "\n".join(c.strip() for c in lines) + \
        f"\n\n{question.strip()}"
    return ctx.record(question=text, gold=["SAT" if _bool(row, "satisfiable") else "UNSAT"],
                      meta=_plain_meta(num_vars=row.get("num_vars"),
                                       num_clauses=row.get("num_clauses")))


def _supergpqa(row: Mapping[str, Any], ctx: RowContext) -> Record:
    options = _str_list(_json_value(row, "options"), "options")
    if len(options) > len(_LETTERS):
        raise MalformedRow("options", f"{len(options)} options; the letter scorer reads A-J")
    letter = _text(row, "answer_letter").strip().upper()
    if len(letter) != 1 or _LETTERS.find(letter) not in range(len(options)):
        raise MalformedRow("answer_letter", f"{letter!r} is not one of "
                                            f"A-{_LETTERS[len(options) - 1]}")
    return ctx.record(own_id=_row_id(row, "uuid"),
                      question=_mc_question(_text(row, "question"), options), gold=[letter],
                      meta=_plain_meta(discipline=row.get("discipline"),
                                       field=row.get("field"), subfield=row.get("subfield"),
                                       difficulty=row.get("difficulty")))


def _gpqa_diamond(row: Mapping[str, Any], ctx: RowContext) -> Record:
    correct = _text(row, "Correct Answer").strip()
    options = [correct, *(_text(row, f"Incorrect Answer {k}").strip() for k in (1, 2, 3))]
    own = _row_id(row, "Record ID")
    # GPQA lists the correct answer first; shuffle by a hash of the row's id so the letter
    # is the same on every run and machine.
    key = own if own is not None else str(ctx.index)
    order = sorted(range(4), key=lambda k: hashlib.sha256(
        f"gpqa_diamond:{key}:{k}".encode()).digest())
    shuffled = [options[k] for k in order]
    return ctx.record(own_id=own, question=_mc_question(_text(row, "Question"), shuffled),
                      gold=[_LETTERS[order.index(0)]],
                      meta=_plain_meta(subdomain=row.get("Subdomain"),
                                       domain=row.get("High-level domain")))


def bbh_task(path: Path) -> str:
    """The BBH task a file holds: its name (`boolean_expressions.json`), or for a generic
    shard name (`test-00000-of-00001.parquet`, `data-00000-of-00001.arrow`) the nearest
    folder that is not a split name (`boolean_expressions/test/...`)."""
    stem = path.name.split(".", 1)[0]
    if not _SHARD.match(stem):
        return stem
    for parent in path.parents:
        if parent.name and parent.name not in _SPLIT_NAMES:
            return parent.name
    return stem


def _bbh(row: Mapping[str, Any], ctx: RowContext) -> Record:
    target = _scalar_text(row, "target")
    gold = [target]
    choice = re.fullmatch(r"\(([A-R])\)", target)
    if choice:  # multiple-choice tasks: "(B)"; a bare "B" is the same answer
        gold.append(choice.group(1))
    task = bbh_task(ctx.path)
    return ctx.record(own_id=f"{task}-{ctx.index}", question=_text(row, "input"), gold=gold,
                      meta={"task": task})


def _io_tests(row: Mapping[str, Any], field: str = "input_output") -> tuple[list[dict], str]:
    """APPS/TACO `input_output` -> ([{input, output}], fn_name or "")."""
    if row.get(field) in (None, ""):
        raise UnusableRow("no tests (empty input_output)")
    io_spec = _json_value(row, field)
    if not isinstance(io_spec, Mapping):
        raise MalformedRow(field, f"expected a JSON object with inputs/outputs, got "
                                  f"{type(io_spec).__name__}")
    inputs, outputs = io_spec.get("inputs"), io_spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise MalformedRow(field, "'inputs' and 'outputs' must be lists")
    if len(inputs) != len(outputs):
        raise MalformedRow(field, f"{len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise UnusableRow("no tests (empty inputs)")
    fn_name = io_spec.get("fn_name") or ""
    if fn_name and (not isinstance(fn_name, str) or not fn_name.isidentifier()):
        raise MalformedRow(f"{field}.fn_name", f"{fn_name!r} is not a function name")
    return [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)], fn_name


def _code_question(question: str, starter: str, call_based: bool) -> str:
    # APPS's own prompt convention: starter code, then which I/O format the solution uses.
    text = question.strip()
    if starter.strip():
        text += f"\n\n{starter.rstrip()}"
    return text + ("\n\nUse Call-Based format" if call_based else "\n\nUse Standard Input format")


def _apps(row: Mapping[str, Any], ctx: RowContext) -> Record:
    question = _text(row, "question")
    tests, fn_name = _io_tests(row)
    starter = _optional_text(row, "starter_code")
    meta = _plain_meta(tests=tests, difficulty=row.get("difficulty"), url=row.get("url"))
    if fn_name:
        meta.update(test_type="functional", func_name=fn_name)
    else:
        meta["test_type"] = "stdin"
    return ctx.record(own_id=_row_id(row, "problem_id"),
                      question=_code_question(question, starter, bool(fn_name)), gold=[],
                      meta=meta, scorer="apps_functional" if fn_name else "stdin")


def _taco(row: Mapping[str, Any], ctx: RowContext) -> Record:
    question = _text(row, "question")
    tests, fn_name = _io_tests(row)
    starter = _optional_text(row, "starter_code")
    meta = _plain_meta(tests=tests, difficulty=row.get("difficulty"), source=row.get("source"),
                       url=row.get("url"))
    if fn_name:
        # Call-based TACO problems (Codewars) define a module-level function and wrap each
        # expected value in a list: the APPS call-based rules grade them; the LCB functional
        # path would call `Solution().<fn>` and compare unwrapped values.
        meta.update(test_type="functional", func_name=fn_name)
    else:
        meta["test_type"] = "stdin"
    return ctx.record(question=_code_question(question, starter, bool(fn_name)), gold=[],
                      meta=meta, scorer="apps_functional" if fn_name else "taco_mm")


class _TextOnly(pickle.Unpickler):
    """LiveCodeBench pickles a JSON string; refuse anything that needs a class (code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _lcb_cases(row: Mapping[str, Any], field: str) -> list[Any]:
    value = _get(row, field)
    if value in (None, ""):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            # code_generation_lite: base64(zlib(pickle(json text))).
            try:
                raw = _TextOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
                value = json.loads(raw)
            except (ValueError, zlib.error, pickle.UnpicklingError, EOFError, TypeError) as exc:
                raise MalformedRow(field, f"neither JSON nor LiveCodeBench's compressed form "
                                          f"({exc})") from None
    if not isinstance(value, list):
        raise MalformedRow(field, f"expected a list of test cases, got {type(value).__name__}")
    return value


def _livecodebench(row: Mapping[str, Any], ctx: RowContext) -> Record:
    content = _text(row, "question_content")
    cases = _lcb_cases(row, "public_test_cases") + _lcb_cases(row, "private_test_cases")
    if not cases:
        raise UnusableRow("no tests")
    tests, kinds = [], set()
    for k, case in enumerate(cases):
        if not isinstance(case, Mapping) or not {"input", "output"} <= set(case):
            raise MalformedRow("test_cases", f"case {k} is not an {{input, output}} object")
        kinds.add(case.get("testtype", "stdin"))
        tests.append({"input": case["input"], "output": case["output"]})
    if len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
        raise MalformedRow("test_cases", f"testtype must be all 'stdin' or all 'functional', "
                                         f"got {sorted(map(str, kinds))}")
    test_type = kinds.pop()
    meta = _plain_meta(tests=tests, test_type=test_type, platform=row.get("platform"),
                       difficulty=row.get("difficulty"), contest_date=row.get("contest_date"))
    starter = _optional_text(row, "starter_code")
    if test_type == "functional":
        info = _json_value(row, "metadata") if row.get("metadata") not in (None, "") else {}
        name = info.get("func_name") if isinstance(info, Mapping) else None
        if not isinstance(name, str) or not name.isidentifier():
            raise MalformedRow("metadata", f"functional tests need metadata.func_name, got "
                                           f"{name!r}")
        meta["func_name"] = name
        note = ("You will use the following starter code to write the solution to the problem "
                "and enclose your code within delimiters.")
        question = f"{content.strip()}\n\n{note}\n```python\n{starter.rstrip()}\n```"
    else:
        question = (f"{content.strip()}\n\nRead the inputs from stdin, solve the problem and "
                    "write the answer to stdout.")
    return ctx.record(own_id=_row_id(row, "question_id"), question=question, gold=[], meta=meta)


def _popqa(row: Mapping[str, Any], ctx: RowContext) -> Record:
    answers = _dedupe(_str_list(_json_value(row, "possible_answers"), "possible_answers"))
    if not answers:
        raise MalformedRow("possible_answers", "has no non-empty answer")
    return ctx.record(own_id=_row_id(row, "id"), question=_text(row, "question"), gold=answers,
                      meta=_plain_meta(prop=row.get("prop"), s_pop=row.get("s_pop")))


def _triviaqa(row: Mapping[str, Any], ctx: RowContext) -> Record:
    answer = _json_value(row, "answer")
    if not isinstance(answer, Mapping):
        raise MalformedRow("answer", f"expected an object with value/aliases, got "
                                     f"{type(answer).__name__}")
    aliases = _str_list(answer.get("aliases") or [], "answer.aliases", allow_empty=True)
    value = answer.get("value")
    gold = _dedupe([value if isinstance(value, str) and value != "<unk>" else "", *aliases])
    if not gold:
        raise UnusableRow("no answer (TriviaQA's test split carries none)")
    return ctx.record(own_id=_row_id(row, "question_id"), question=_text(row, "question"),
                      gold=gold, meta=_plain_meta(answer_type=answer.get("type")))


def _simpleqa_verified(row: Mapping[str, Any], ctx: RowContext) -> Record:
    return ctx.record(own_id=_row_id(row, "original_index"), question=_text(row, "problem"),
                      gold=[_scalar_text(row, "answer")],
                      meta=_plain_meta(topic=row.get("topic"),
                                       answer_type=row.get("answer_type")))


def _flashrag(row: Mapping[str, Any], ctx: RowContext) -> Record:
    """Router-R1's NQ / HotpotQA rows (FlashRAG layout), in its upstream row shape: data_source
    = the dataset, `ability` and `extra_info.index` kept beside ours."""
    answers = _dedupe(_str_list(_json_value(row, "golden_answers"), "golden_answers"))
    if not answers:
        raise MalformedRow("golden_answers", "has no non-empty answer")
    extras: dict[str, Any] = {"ability": "fact-reasoning", "extra_info.index": ctx.index}
    if ctx.split:
        extras["extra_info.split"] = ctx.split
    return ctx.record(own_id=_row_id(row, "id"), question=_text(row, "question"), gold=answers,
                      meta={}, data_source=ctx.source.dataset, extras=extras)


_M, _C, _K, _R, _Q = Domain.MATH, Domain.CODE, Domain.KNOWLEDGE, Domain.REASON, Domain.RECALL
SOURCES: Mapping[str, Source] = {s.name: s for s in (
    Source("omni_math", "omni_math", _M, "omni_math", "KbsdJames/Omni-MATH: problem, answer, "
           "solution, difficulty, domain, source", _omni_math),
    Source("math", "math_l2-5", _M, "math", "hendrycks MATH (competition_math, "
           "EleutherAI/hendrycks_math): problem, solution (\\boxed answer), level, type; "
           "or MATH-500: problem, answer, level (int), subject, unique_id; levels 2-5 kept",
           _math),
    Source("aime", "aime", _M, "math", "AIME copies: problem|Problem|question|Question, "
           "answer|Answer, optional id|ID|url, Year", _aime),
    Source("satbench", "satbench", _R, "satbench", "LLM4Code/SATBench: scenario, conditions, "
           "question, satisfiable", _satbench),
    Source("bbh", "bbh", _R, "bbeh_mini", "BIG-Bench-Hard (lukaemon/bbh or the task JSON "
           "files): input, target; the task is the file or folder name", _bbh,
           group=lambda record: record.meta["task"]),
    Source("supergpqa", "supergpqa", _K, "supergpqa", "m-a-p/SuperGPQA: uuid, question, "
           "options, answer_letter, discipline, field, subfield, difficulty", _supergpqa),
    Source("gpqa_diamond", "gpqa_diamond", _K, "mc_letter", "Idavidrein/gpqa gpqa_diamond: "
           "Question, Correct Answer, Incorrect Answer 1-3, Record ID", _gpqa_diamond),
    Source("apps", "apps", _C, "stdin", "codeparrot/apps: problem_id, question, input_output "
           "(JSON inputs/outputs[/fn_name]), starter_code, difficulty", _apps),
    Source("livecodebench", "livecodebench", _C, "livecodebench", "livecodebench/"
           "code_generation_lite: question_id, question_content, starter_code, "
           "public_test_cases, private_test_cases, metadata (func_name), platform", _livecodebench),
    Source("taco", "taco_mm", _C, "taco_mm", "BAAI/TACO: question, input_output (JSON "
           "inputs/outputs[/fn_name]), starter_code, difficulty, source", _taco),
    Source("popqa", "popqa", _Q, "qa_subem", "akariasai/PopQA: id, question, possible_answers "
           "(JSON list)", _popqa),
    Source("triviaqa", "triviaqa", _Q, "triviaqa", "mandarjoshi/trivia_qa: question_id, "
           "question, answer {value, aliases}", _triviaqa),
    Source("simpleqa_verified", "simpleqa_verified", _Q, "simpleqa_verified",
           "google/simpleqa-verified: original_index, problem, answer, topic, answer_type",
           _simpleqa_verified),
    Source("nq", "nq", _Q, "triviaqa", "RUC-NLPIR/FlashRAG_datasets nq: id, question, "
           "golden_answers", _flashrag),
    Source("hotpotqa", "hotpotqa", _Q, "triviaqa", "RUC-NLPIR/FlashRAG_datasets hotpotqa: id, "
           "question, golden_answers", _flashrag),
)}
# nq / hotpotqa use the `triviaqa` scorer: SQuAD-normalised equality with any gold answer is
# exactly Router-R1's EM.
