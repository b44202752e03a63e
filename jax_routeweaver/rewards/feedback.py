"""In-loop execution feedback for agentic executors (docs/protocol.md, "What a worker receives").

The episode runner calls `aexecution_verdict` on every successful executor reply and, when it
returns a text, prepends it to the observation body and to the node output. The environment
reaches it through its port (`routing.episodes.routeweaver_env.ExecutionFeedback`), which
`execution_feedback` binds to a sandbox; the run and the server bind it when
`rollout.execution_feedback` is on. Texts, exactly as the original code writes them:

CODE rows (`scorer_dataset` in stdin / apps_functional / livecodebench / taco_mm, with
`meta.tests`): the reply is graded by the row's code scorer against the same hidden tests as
the final reward --
    no program     "[execution] no runnable code block found in this output; nothing was
                    executed."
    all pass       "[execution] all N hidden tests PASSED."
    otherwise      "[execution] p/N hidden tests passed; first failure at test index k;
                    error: <at most 300 chars>."
The error names the failure kind (wrong answer, timeout, the exception's last line); it never
shows the expected output of a hidden test.

MATH rows (`scorer_dataset == "math"` only): the reply's last fenced block tagged python / py
or untagged is run (10 s) and, with no comparison to the gold answer --
    "[calc] the program printed:\\n<stdout, at most 600 chars>"
    "[calc] the program errored: <last stderr line, at most 300 chars>"
    "[calc] the program ran but printed nothing."
    "[calc] the program timed out after 10 s."   (the original's wording is not recorded)
A reply without such a block gets no text.

Other roles, other datasets and CODE rows without tests get None. A failure of the sandbox
itself raises (SandboxError, or ValueError for malformed tests): the runner records it as an
`exec_sandbox_error` and the row is then classified as infra.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

from jax_routeweaver.rewards.sandbox import (
    IsolationUnavailable,
    RunResult,
    Sandbox,
    default_sandbox,
)
from jax_routeweaver.rewards.scorers.code import (
    CODE_SCORERS,
    CodeReport,
    aevaluate_code,
    fenced_blocks,
)
from jax_routeweaver.routing.episodes.routeweaver_env import ExecutionFeedback

__all__ = [
    "CALC_STDOUT_CHARS",
    "ERROR_CHARS",
    "EXECUTOR_ROLE",
    "MATH_EXEC_SCORERS",
    "MATH_TIMEOUT_S",
    "NO_CODE",
    "aexecution_verdict",
    "applies",
    "calc_verdict",
    "code_verdict",
    "execution_verdict",
    "math_program",
    "runs_programs",
]

EXECUTOR_ROLE = "executor"
MATH_EXEC_SCORERS = frozenset({"math"})
MATH_TIMEOUT_S = 10.0
ERROR_CHARS = 300
CALC_STDOUT_CHARS = 600
NO_CODE = "[execution] no runnable code block found in this output; nothing was executed."
_MATH_TAGS = frozenset({"", "python", "py"})


def code_verdict(report: CodeReport) -> str:
    """The "[execution] ..." text of a graded reply."""
    if report.no_code:
        return NO_CODE
    if report.all_passed:
        return f"[execution] all {report.total} hidden tests PASSED."
    failure = report.first_failure
    index = failure.index if failure is not None else 0
    error = (failure.error or failure.status) if failure is not None else "unknown"
    return (f"[execution] {report.passed}/{report.total} hidden tests passed; first failure at "
            f"test index {index}; error: {error[:ERROR_CHARS]}.")


def calc_verdict(result: RunResult, timeout_s: float = MATH_TIMEOUT_S) -> str:
    """The "[calc] ..." text of a MATH executor's program run."""
    if result.status == "timeout":
        return f"[calc] the program timed out after {timeout_s:g} s."
    if not result.ok:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit code {result.returncode}"
        return f"[calc] the program errored: {last[:ERROR_CHARS]}"
    out = result.stdout.strip()
    if not out:
        return "[calc] the program ran but printed nothing."
    return f"[calc] the program printed:\n{out[:CALC_STDOUT_CHARS]}"


def math_program(reply: str) -> str | None:
    """The last complete fenced block tagged python / py or untagged, None if there is none."""
    blocks = [b for b in fenced_blocks(reply or "") if b.closed and b.tag in _MATH_TAGS]
    if not blocks or not blocks[-1].body.strip():
        return None
    return blocks[-1].body


def applies(role: str | None, scorer_dataset: str, meta: Mapping[str, Any] | None) -> bool:
    """True if execution feedback is computed for this call (executor on a CODE row with tests, or
    on a MATH row)."""
    if role != EXECUTOR_ROLE:
        return False
    if scorer_dataset in CODE_SCORERS:
        return bool(meta) and meta.get("tests") is not None
    return scorer_dataset in MATH_EXEC_SCORERS


async def aexecution_verdict(reply: str, *, role: str | None, scorer_dataset: str,
                             meta: Mapping[str, Any] | None,
                             sandbox: Sandbox | None = None) -> str | None:
    """The verdict text to prepend to an executor's observation, or None (see module doc)."""
    if not applies(role, scorer_dataset, meta):
        return None
    sandbox = sandbox or default_sandbox()
    if scorer_dataset in CODE_SCORERS:
        report = await aevaluate_code(scorer_dataset, reply, meta or {}, sandbox=sandbox)
        return code_verdict(report)
    program = math_program(reply)
    if program is None:
        return None
    result = await sandbox.arun(program, timeout_s=MATH_TIMEOUT_S)
    return calc_verdict(result, MATH_TIMEOUT_S)


def execution_feedback(sandbox: Sandbox | None = None) -> ExecutionFeedback:
    """The environment's execution-feedback port bound to `sandbox` (None: the default
    sandbox, as configured when a verdict runs); a host that cannot give the sandbox's
    isolation (`IsolationUnavailable`) ends the run."""
    return ExecutionFeedback(functools.partial(aexecution_verdict, sandbox=sandbox),
                             fatal=(IsolationUnavailable,))


def execution_verdict(reply: str, *, role: str | None, scorer_dataset: str,
                      meta: Mapping[str, Any] | None,
                      sandbox: Sandbox | None = None) -> str | None:
    """`aexecution_verdict` for synchronous callers (not from inside a running event loop)."""
    return asyncio.run(aexecution_verdict(reply, role=role, scorer_dataset=scorer_dataset,
                                          meta=meta, sandbox=sandbox))


def runs_programs(scorer_dataset: str, execution_feedback: bool) -> bool:
    """True if a row graded by `scorer_dataset` runs programs in the sandbox: its scorer runs
    the answer against tests (CODE), or, with `execution_feedback`, its executors' python is
    run (MATH)."""
    return scorer_dataset in CODE_SCORERS or (
        execution_feedback and scorer_dataset in MATH_EXEC_SCORERS)
