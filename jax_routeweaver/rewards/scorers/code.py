"""Code scorers (the original's matching rules): programs run against `meta.tests` in the
sandbox.

    stdin, livecodebench, taco_mm   LCB rules. stdin tests (the default): each test runs the
        program in a fresh child with the test's input on stdin (a list of lines is joined by
        "\\n", for input and output alike); SystemExit is a clean exit; the output matches if
        `[l.rstrip() for l in out.strip().split("\\n")]` is equal for both texts.
        `meta.test_type == "functional"`: `Solution().<func_name>(*args)` after the LCB prelude
        (collections, heapq, itertools, math, functools, bisect, re, string, `from collections
        import *`, `from typing import *`), args = one `json.loads` per input line, the expected
        output JSON-decoded; equal once tuples are lists and floats are rounded to 6 places.
        Per test 6 s, whole program 90 s; stops at the first failure.
    apps_functional   APPS call-based: args = the test input (JSON-decoded if a string),
        `Solution().<func_name>` if that exists else the module-level function; stdout
        discarded; a match is equality after a JSON round trip, or one side being a 1-element
        list holding the other, or `list(got) == list(expected)`. Per test 6 s, program 30 s;
        every test runs.

Correct iff there is at least one test and every test passed. The program is
`extract_program(text)`: the last fenced block (``` with no tag or a python / py / python3
tag), else the text after the last unclosed opening fence, else the last `<answer>` body if it
looks like code, else the text itself if it looks like code (a line starting with def, class,
import, from or print( ), else nothing (no code: wrong, nothing runs). The `<answer>` step is
not in the original's rules; it only matters for texts without a fence (the reward tries the
answer body as a separate candidate anyway; docs/algorithm.md, "The verdict").

Expected outputs never enter the sandbox: the child reports outputs, the comparison happens
here, so a program cannot forge a pass. Malformed `meta` (no tests, undecodable inputs, a
missing `func_name`) raises ValueError, which the reward turns into `sandbox_error`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.rewards.sandbox import (
    CallResult,
    FunctionRunResult,
    RunResult,
    Sandbox,
    default_sandbox,
)
from jax_routeweaver.rewards.scorers.registry import ScoreResult, register

__all__ = [
    "APPS_TOTAL_TIMEOUT_S",
    "CODE_SCORERS",
    "LCB_PRELUDE",
    "LCB_TOTAL_TIMEOUT_S",
    "PER_TEST_TIMEOUT_S",
    "CodeReport",
    "Fence",
    "TestOutcome",
    "aevaluate_code",
    "apps_value_matches",
    "evaluate_code",
    "extract_program",
    "fenced_blocks",
    "lcb_value_matches",
    "score_apps_functional",
    "score_lcb",
    "stdout_matches",
]

CODE_SCORERS = frozenset({"stdin", "apps_functional", "livecodebench", "taco_mm"})
PER_TEST_TIMEOUT_S = 6.0
LCB_TOTAL_TIMEOUT_S = 90.0
APPS_TOTAL_TIMEOUT_S = 30.0
MEMORY_MB = 4096  # per job, as the original; concurrent jobs share the sandbox memory budget
RECURSION_LIMIT = 100_000
LCB_PRELUDE = ("import collections\nimport heapq\nimport itertools\nimport math\n"
               "import functools\nimport bisect\nimport re\nimport string\n"
               "from collections import *\nfrom typing import *\n")
PYTHON_TAGS = frozenset({"", "python", "py", "python3"})

_MARKER = re.compile(r"```([^\n`]*)")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_CODE_LINE = re.compile(r"^(?:(?:def|class|import|from)\b|print\()", re.MULTILINE)


# ------------------------------------------------------------------------- extraction
@dataclasses.dataclass(frozen=True)
class Fence:
    """A fenced block: `tag` (first word after the backticks, lower case), `body`, and whether
    a closing fence was found (an unclosed block runs to the end of the text)."""

    tag: str
    body: str
    closed: bool


def fenced_blocks(text: str) -> list[Fence]:
    """Fences in order; ``` markers pair up as opening / closing."""
    markers = list(_MARKER.finditer(text))
    blocks = []
    for k in range(0, len(markers), 2):
        opening = markers[k]
        words = opening.group(1).split()
        tag = words[0].lower() if words else ""
        start = opening.end() + (text[opening.end():opening.end() + 1] == "\n")
        if k + 1 < len(markers):
            blocks.append(Fence(tag, text[start:markers[k + 1].start()], True))
        else:
            blocks.append(Fence(tag, text[start:], False))
    return blocks


def looks_like_code(text: str) -> bool:
    """A line starts with def / class / import / from / print( (the original's test)."""
    return _CODE_LINE.search(text) is not None


def extract_program(text: str) -> str:
    """The program in `text` (see the module doc), "" if there is none."""
    if not text or not text.strip():
        return ""
    blocks = [b for b in fenced_blocks(text) if b.tag in PYTHON_TAGS]
    closed = [b for b in blocks if b.closed]
    if closed:
        return closed[-1].body.strip("\n")
    if blocks and not blocks[-1].closed:
        return blocks[-1].body.strip("\n")
    bodies = _ANSWER.findall(text)
    if bodies and looks_like_code(bodies[-1].strip()):
        return bodies[-1].strip()
    return text.strip("\n") if looks_like_code(text) else ""


# ------------------------------------------------------------------------- comparison
def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().split("\n")]


def stdout_matches(got: str, expected: str) -> bool:
    """LCB stdin rule: equal line by line after `strip()` of the text, `rstrip()` per line."""
    return _lines(got) == _lines(expected)


def _lcb_norm(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, (list, tuple)):
        return [_lcb_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _lcb_norm(v) for k, v in value.items()}
    return value


def lcb_value_matches(got: Any, expected: Any) -> bool:
    """LCB functional rule: equal once tuples are lists and floats are rounded to 6 places."""
    return _lcb_norm(got) == _lcb_norm(expected)


def _safe_list(value: Any) -> list | None:
    if isinstance(value, (int, float, bool)) or value is None:
        return None
    try:
        return list(value)
    except TypeError:
        return None


def apps_value_matches(call: CallResult, expected: Any) -> bool:
    """APPS call-based rule on a successful call (`call.value` already went through JSON).
    A string `expected` is also tried JSON-decoded when the result is not a string."""
    forms = [expected]
    if isinstance(expected, str) and not isinstance(call.value, str):
        with contextlib.suppress(ValueError):
            forms.append(json.loads(expected))
    got = call.value
    for e in forms:
        if call.encoding == "json":
            if got == e:
                return True
            if isinstance(e, list) and len(e) == 1 and got == e[0]:
                return True
            if isinstance(got, list) and len(got) == 1 and got[0] == e:
                return True
        if call.encoding in ("json", "list"):
            g, ee = _safe_list(got), _safe_list(e)
            if g is not None and ee is not None and g == ee:
                return True
    return False


# ------------------------------------------------------------------------- reports
@dataclasses.dataclass(frozen=True)
class TestOutcome:
    """One test. `status`: ok (passed) | wrong | timeout | memory | error | killed."""

    __test__ = False  # not a pytest class

    index: int
    passed: bool
    status: str
    error: str = ""


@dataclasses.dataclass(frozen=True)
class CodeReport:
    """What running one text's program against the tests found. `outcomes` holds the tests
    that ran (LCB stops at the first failure; APPS runs them all)."""

    program: str
    total: int
    outcomes: tuple[TestOutcome, ...] = ()

    @property
    def no_code(self) -> bool:
        return not self.program

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def first_failure(self) -> TestOutcome | None:
        """The first failing test (a test that never ran counts), None if all passed."""
        for o in self.outcomes:
            if not o.passed:
                return o
        if self.total > len(self.outcomes) or self.total == 0:
            return TestOutcome(len(self.outcomes), False, "error",
                               "no tests" if self.total == 0 else "not run")
        return None

    def detail(self) -> str:
        if self.no_code:
            return "no runnable code found"
        text = f"passed {self.passed}/{self.total} tests"
        failure = self.first_failure
        if failure is not None:
            text += f"; first failure at test {failure.index}: {failure.error or failure.status}"
        return text


# ------------------------------------------------------------------------- tests from meta
@dataclasses.dataclass(frozen=True)
class _Plan:
    kind: str  # "stdin" | "lcb" | "apps"
    program: str
    inputs: list
    expected: list
    func_name: str = ""


def _tests(meta: Mapping[str, Any]) -> list[tuple[Any, Any]]:
    tests = meta.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ValueError(f"meta.tests: not valid JSON ({exc})") from None
    if not isinstance(tests, list):
        raise ValueError(f"meta.tests: expected a list of {{input, output}} objects, "
                         f"got {type(tests).__name__}")
    out = []
    for k, test in enumerate(tests):
        if not isinstance(test, Mapping) or "input" not in test or "output" not in test:
            raise ValueError(f"meta.tests[{k}]: expected an object with 'input' and 'output'")
        out.append((test["input"], test["output"]))
    return out


def _func_name(meta: Mapping[str, Any], scorer: str) -> str:
    name = meta.get("func_name") or meta.get("fn_name")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{scorer}: meta.func_name must name the function to call, "
                         f"got {name!r}")
    return name


def _as_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return value if isinstance(value, str) else str(value)


def _apps_args(value: Any, k: int) -> list:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"meta.tests[{k}].input: not valid JSON ({exc})") from None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _lcb_args(value: Any, k: int) -> list:
    if not isinstance(value, str):
        return list(value) if isinstance(value, (list, tuple)) else [value]
    args = []
    for j, line in enumerate(value.split("\n")):
        if line.strip():
            try:
                args.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"meta.tests[{k}].input line {j}: not valid JSON "
                                 f"({exc})") from None
    return args


def _decoded(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _is_functional(meta: Mapping[str, Any]) -> bool:
    if meta.get("test_type") is not None:
        return meta.get("test_type") == "functional"
    tests = meta.get("tests")
    return isinstance(tests, list) and bool(tests) and all(
        isinstance(t, Mapping) and t.get("testtype") == "functional" for t in tests)


def _plan(scorer: str, text: str, meta: Mapping[str, Any]) -> _Plan:
    if scorer not in CODE_SCORERS:
        raise ValueError(f"not a code scorer: {scorer!r} (known: {sorted(CODE_SCORERS)})")
    meta = meta or {}
    tests = _tests(meta)
    program = extract_program(text)
    if scorer == "apps_functional":
        return _Plan("apps", program, [_apps_args(i, k) for k, (i, _) in enumerate(tests)],
                     [o for _, o in tests], _func_name(meta, scorer))
    if _is_functional(meta):
        return _Plan("lcb", program, [_lcb_args(i, k) for k, (i, _) in enumerate(tests)],
                     [_decoded(o) for _, o in tests], _func_name(meta, scorer))
    return _Plan("stdin", program, [_as_text(i) for i, _ in tests],
                 [_as_text(o) for _, o in tests])


# ------------------------------------------------------------------------- running
def _run_error(result: RunResult) -> str:
    if result.status == "timeout":
        return f"timed out after {PER_TEST_TIMEOUT_S:g} s"
    last = [line for line in result.stderr.strip().splitlines() if line.strip()]
    if result.status == "memory":
        return "MemoryError (memory limit exceeded)"
    return last[-1].strip() if last else f"exit code {result.returncode}"


def _stdin_check(plan: _Plan):
    def check(i: int, result: RunResult) -> bool:
        return result.ok and stdout_matches(result.stdout, plan.expected[i])
    return check


def _stdin_report(plan: _Plan, results: list[RunResult]) -> CodeReport:
    outcomes = []
    for i, r in enumerate(results):
        if r.ok:
            ok = stdout_matches(r.stdout, plan.expected[i])
            outcomes.append(TestOutcome(i, ok, "ok" if ok else "wrong",
                                        "" if ok else "wrong answer"))
        else:
            outcomes.append(TestOutcome(i, False, r.status, _run_error(r)))
    if len(outcomes) < len(plan.inputs) and (not outcomes or outcomes[-1].passed):
        outcomes.append(TestOutcome(len(outcomes), False, "timeout",
                                    f"total time limit of {LCB_TOTAL_TIMEOUT_S:g} s exceeded"))
    return CodeReport(plan.program, len(plan.inputs), tuple(outcomes))


def _call_check(plan: _Plan):
    def check(i: int, call: CallResult) -> bool:
        return call.status == "ok" and lcb_value_matches(call.value, plan.expected[i])
    return check


def _function_report(plan: _Plan, result: FunctionRunResult) -> CodeReport:
    if result.load_error is not None:
        return CodeReport(plan.program, len(plan.inputs),
                          (TestOutcome(0, False, "error", result.load_error),))
    outcomes = []
    for call in result.calls:
        if call.status != "ok":
            outcomes.append(TestOutcome(call.index, False, call.status, call.error))
            continue
        expected = plan.expected[call.index]
        if plan.kind == "lcb":
            ok = call.encoding != "repr" and lcb_value_matches(call.value, expected)
        else:
            ok = apps_value_matches(call, expected)
        error = "" if ok else (call.error if call.encoding == "repr" else "wrong answer")
        outcomes.append(TestOutcome(call.index, ok, "ok" if ok else "wrong", error))
    return CodeReport(plan.program, len(plan.inputs), tuple(outcomes))


def _function_kwargs(plan: _Plan) -> dict[str, Any]:
    common = {"per_test_timeout_s": PER_TEST_TIMEOUT_S, "memory_mb": MEMORY_MB,
              "recursion_limit": RECURSION_LIMIT}
    if plan.kind == "lcb":
        return {**common, "style": "lcb", "prelude": LCB_PRELUDE,
                "total_timeout_s": LCB_TOTAL_TIMEOUT_S, "stop_on_error": True,
                "check": _call_check(plan)}
    return {**common, "style": "apps", "total_timeout_s": APPS_TOTAL_TIMEOUT_S}


def _stdin_kwargs(plan: _Plan) -> dict[str, Any]:
    return {"per_test_timeout_s": PER_TEST_TIMEOUT_S, "total_timeout_s": LCB_TOTAL_TIMEOUT_S,
            "memory_mb": MEMORY_MB, "recursion_limit": RECURSION_LIMIT, "swallow_exit": True,
            "check": _stdin_check(plan)}


def evaluate_code(scorer: str, text: str, meta: Mapping[str, Any], *,
                  sandbox: Sandbox | None = None) -> CodeReport:
    """Extract the program of `text` and run it against `meta.tests` under `scorer`'s rules."""
    plan = _plan(scorer, text, meta)
    if not plan.program:
        return CodeReport("", len(plan.inputs))
    sandbox = sandbox or default_sandbox()
    if plan.kind == "stdin":
        return _stdin_report(plan, sandbox.run_tests(plan.program, plan.inputs,
                                                     **_stdin_kwargs(plan)))
    return _function_report(plan, sandbox.run_function(plan.program, plan.func_name,
                                                       plan.inputs, **_function_kwargs(plan)))


async def aevaluate_code(scorer: str, text: str, meta: Mapping[str, Any], *,
                         sandbox: Sandbox | None = None) -> CodeReport:
    """`evaluate_code` for asyncio callers (the episode runner)."""
    plan = _plan(scorer, text, meta)
    if not plan.program:
        return CodeReport("", len(plan.inputs))
    sandbox = sandbox or default_sandbox()
    if plan.kind == "stdin":
        return _stdin_report(plan, await sandbox.arun_tests(plan.program, plan.inputs,
                                                            **_stdin_kwargs(plan)))
    return _function_report(plan, await sandbox.arun_function(
        plan.program, plan.func_name, plan.inputs, **_function_kwargs(plan)))


def _result(report: CodeReport) -> ScoreResult:
    ok = report.all_passed
    return ScoreResult(correct=ok, em=float(ok), f1=float(ok), detail=report.detail())


# ------------------------------------------------------------------------- registered scorers
@register("stdin", "livecodebench", "taco_mm")
def score_lcb(prediction: str, gold: Sequence[str], meta: Mapping[str, Any]) -> ScoreResult:
    """APPS stdin / LiveCodeBench / TACO: LCB rules (`gold` is unused: the tests are)."""
    return _result(evaluate_code("livecodebench", prediction, meta))


@register("apps_functional")
def score_apps_functional(prediction: str, gold: Sequence[str],
                          meta: Mapping[str, Any]) -> ScoreResult:
    """APPS call-based: APPS rules (`gold` is unused: the tests are)."""
    return _result(evaluate_code("apps_functional", prediction, meta))
