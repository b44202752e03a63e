"""In-loop execution verdicts for agentic executors (docs/protocol.md, "What a worker receives"):
the exact texts, when they apply, and end to end on CODE rows (simulated tasks, hidden tests) and
MATH rows (python blocks run)."""

import asyncio

import pytest

from jax_routeweaver.data.records import Domain
from jax_routeweaver.rewards.feedback import (
    NO_CODE,
    aexecution_verdict,
    applies,
    calc_verdict,
    code_verdict,
    execution_verdict,
    math_program,
)
from jax_routeweaver.rewards.sandbox import RunResult
from jax_routeweaver.rewards.scorers.code import CodeReport, TestOutcome
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks


def run_result(status="ok", stdout="", stderr="", returncode=0):
    return RunResult(status, stdout, stderr, returncode, 0.1)


# ------------------------------------------------------------------------------ texts
def test_code_verdict_texts():
    assert code_verdict(CodeReport("", 5)) == NO_CODE == (
        "[execution] no runnable code block found in this output; nothing was executed.")
    passed = CodeReport("p", 3, tuple(TestOutcome(i, True, "ok") for i in range(3)))
    assert code_verdict(passed) == "[execution] all 3 hidden tests PASSED."
    failed = CodeReport("p", 4, (TestOutcome(0, True, "ok"), TestOutcome(1, True, "ok"),
                                 TestOutcome(2, False, "wrong", "wrong answer")))
    assert code_verdict(failed) == ("[execution] 2/4 hidden tests passed; first failure at test "
                                    "index 2; error: wrong answer.")
    crashed = CodeReport("p", 2, (TestOutcome(0, False, "error", "E" * 500),))
    assert code_verdict(crashed) == ("[execution] 0/2 hidden tests passed; first failure at test "
                                     f"index 0; error: {'E' * 300}.")
    apps = CodeReport("p", 3, (TestOutcome(0, True, "ok"), TestOutcome(1, False, "timeout",
                                                                       "timed out after 6 s"),
                               TestOutcome(2, True, "ok")))
    assert code_verdict(apps) == ("[execution] 2/3 hidden tests passed; first failure at test "
                                  "index 1; error: timed out after 6 s.")


def test_calc_verdict_texts():
    assert calc_verdict(run_result(stdout="1024\n")) == "[calc] the program printed:\n1024"
    assert calc_verdict(run_result(stdout="7" * 1000)) == \
        "[calc] the program printed:\n" + "7" * 600
    assert calc_verdict(run_result(stdout=" \n")) == "[calc] the program ran but printed nothing."
    err = run_result("error", stderr="Traceback ...\n  line 1\nNameError: name 'x' is not "
                                     "defined\n", returncode=1)
    assert calc_verdict(err) == "[calc] the program errored: NameError: name 'x' is not defined"
    long = run_result("error", stderr="ValueError: " + "v" * 400, returncode=1)
    assert calc_verdict(long) == "[calc] the program errored: " + ("ValueError: " + "v" * 400)[:300]
    assert calc_verdict(run_result("error", returncode=3)) == \
        "[calc] the program errored: exit code 3"
    assert calc_verdict(run_result("timeout", returncode=-9)) == \
        "[calc] the program timed out after 10 s."


@pytest.mark.parametrize("reply, program", [
    ("```python\nprint(1)\n```", "print(1)\n"),
    ("```py\nprint(1)\n```\nand\n```\nprint(2)\n```", "print(2)\n"),
    ("```python\nprint(1)\n```\n```text\nout\n```", "print(1)\n"),
    ("```python3\nprint(1)\n```", None),  # only python / py / untagged, as the reference
    ("```python\nprint(1)", None),  # unclosed
    ("no code, the answer is 4", None),
    ("```python\n\n```", None),
])
def test_math_program(reply, program):
    assert math_program(reply) == program


@pytest.mark.parametrize("role, dataset, meta, expected", [
    ("executor", "apps_functional", {"tests": []}, True),
    ("executor", "stdin", {"tests": [{"input": "", "output": ""}]}, True),
    ("executor", "livecodebench", {}, False),  # no tests
    ("executor", "taco_mm", None, False),
    ("executor", "math", {}, True),
    ("executor", "omni_math", {}, False),  # math only
    ("executor", "triviaqa", {}, False),
    ("verifier", "math", {}, False),
    ("summarizer", "stdin", {"tests": []}, False),
    (None, "math", {}, False),  # single / multi workers have no role
])
def test_applies(role, dataset, meta, expected):
    assert applies(role, dataset, meta) is expected


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def code_task():
    return synthetic_tasks(3, seed=11, domains=(Domain.CODE,))[0]


def _verdict(reply, dataset, meta, role="executor"):
    return execution_verdict(reply, role=role, scorer_dataset=dataset, meta=meta)


@pytest.mark.integration
def test_code_row_verdicts(code_task):
    meta, n = code_task.meta, len(code_task.meta["tests"])
    good = f"Steps...\n<answer>\n```python\n{meta['sim']['solution']}```\n</answer>"
    assert _verdict(good, "apps_functional", meta) == f"[execution] all {n} hidden tests PASSED."
    bad = _verdict(f"```python\n{meta['sim']['buggy_solution']}```", "apps_functional", meta)
    assert bad.startswith("[execution] ") and bad.endswith("; error: wrong answer.")
    assert f"/{n} hidden tests passed; first failure at test index " in bad
    assert _verdict("I would loop over the list.", "apps_functional", meta) == NO_CODE
    crash = _verdict(f"```python\ndef {meta['func_name']}(*a):\n    raise KeyError('k')\n```",
                     "apps_functional", meta)
    assert crash == (f"[execution] 0/{n} hidden tests passed; first failure at test index 0; "
                     "error: KeyError: 'k'.")
    assert _verdict(good, "apps_functional", meta, role="verifier") is None


@pytest.mark.integration
def test_stdin_row_verdict():
    meta = {"tests": [{"input": "2", "output": "4"}, {"input": "3", "output": "9"}]}
    text = _verdict("```python\nn = int(input())\nprint(n + n)\n```", "stdin", meta)
    assert text == ("[execution] 1/2 hidden tests passed; first failure at test index 1; "
                    "error: wrong answer.")


@pytest.mark.integration
def test_math_row_verdicts():
    assert _verdict("Compute:\n```python\nprint(sum(range(101)))\n```", "math", {}) == \
        "[calc] the program printed:\n5050"
    assert _verdict("```python\nx = 1\n```", "math", {}) == \
        "[calc] the program ran but printed nothing."
    assert _verdict("```python\nprint(1/0)\n```", "math", {}) == \
        "[calc] the program errored: ZeroDivisionError: division by zero"
    assert _verdict("The answer is 5050.", "math", {}) is None
    assert _verdict("```python\nprint(1)\n```", "omni_math", {}) is None


@pytest.mark.integration
def test_async_verdicts_run_concurrently_with_the_loop(code_task):
    meta = code_task.meta

    async def main():
        return await asyncio.gather(
            aexecution_verdict(f"```python\n{meta['sim']['solution']}```", role="executor",
                               scorer_dataset="apps_functional", meta=meta),
            aexecution_verdict("```python\nprint(6 * 7)\n```", role="executor",
                               scorer_dataset="math", meta={}))

    code_text, calc_text = asyncio.run(main())
    assert code_text.endswith("hidden tests PASSED.") and calc_text.endswith("\n42")


@pytest.mark.integration
def test_malformed_tests_raise_for_the_runner_to_count():
    with pytest.raises(ValueError, match="meta.tests"):
        _verdict("```python\nprint(1)\n```", "stdin", {"tests": "{not json"})
