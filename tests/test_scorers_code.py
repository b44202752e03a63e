"""Code scorers: program extraction, the LCB and APPS comparison rules, table-driven
end to end through the registry, and the simulated CODE tasks (reference program passes, buggy
one fails)."""

import pytest

from jax_routeweaver.data.records import Domain
from jax_routeweaver.rewards.sandbox import CallResult
from jax_routeweaver.rewards.scorers import code
from jax_routeweaver.rewards.scorers.code import (
    CodeReport,
    TestOutcome,
    apps_value_matches,
    evaluate_code,
    extract_program,
    fenced_blocks,
    lcb_value_matches,
    stdout_matches,
)
from jax_routeweaver.rewards.scorers.registry import get_scorer, known_scorers, score
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

pytestmark = pytest.mark.integration

DOUBLE = "n = int(input())\nprint(n * 2)\n"


def fence(body: str, tag: str = "python") -> str:
    return f"```{tag}\n{body}```"


# ------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text, program", [
    (f"Here:\n{fence('print(1)')}\nDone.", "print(1)"),
    (f"{fence('print(1)')}\nthen\n{fence('print(2)', 'py')}", "print(2)"),  # the last block
    (f"{fence('print(2)', 'python3')}\n{fence('int main(){}', 'cpp')}", "print(2)"),
    (f"{fence('print(3)', '')}", "print(3)"),
    ("```PYTHON\nprint(4)\n```", "print(4)"),
    ("text\n```python\nprint(5)\nprint(6)", "print(5)\nprint(6)"),  # unclosed fence
    (f"{fence('print(1)')}\nand an unclosed\n```python\nprint(7)", "print(1)"),
    ("<answer>\ndef f(x):\n    return x\n</answer>", "def f(x):\n    return x"),
    ("import sys\nprint(sys.version)", "import sys\nprint(sys.version)"),
    ("The answer is 42.", ""),
    ("", ""),
    ("  print(1) is indented prose", ""),
])
def test_extract_program(text, program):
    assert extract_program(text) == program


def test_fenced_blocks_pairing():
    blocks = fenced_blocks("a\n```cpp\nx\n```\nb\n```python\ny\n```\n```\nz")
    assert [(b.tag, b.body, b.closed) for b in blocks] == [
        ("cpp", "x\n", True), ("python", "y\n", True), ("", "z", False)]


# ------------------------------------------------------------------------------ comparison rules
@pytest.mark.parametrize("got, expected, ok", [
    ("6\n", "6", True),
    ("6   \n\n\n", "6", True),  # trailing spaces / blank lines
    ("\n\n6", "6", True),  # leading blank lines (strip of the whole text)
    ("1 2  \n3\n", "1 2\n3", True),
    ("1  2\n3", "1 2\n3", False),  # inner spaces count
    ("6\n\n7", "6\n7", False),  # an inner blank line counts
    ("3\r\n7\r\n", "3\n7", True),
    ("YES", "yes", False),
    ("  6", "6", True),  # strip() of the whole text
    ("a\n  b", "a\nb", False),  # but lines are only rstripped
])
def test_stdout_matches(got, expected, ok):
    assert stdout_matches(got, expected) is ok


@pytest.mark.parametrize("got, expected, ok", [
    ([1, 2], [1, 2], True),
    ((1, 2), [1, 2], True),
    (0.30000000000000004, 0.3, True),
    ([0.1234564, 2], [0.1234560, 2], True),
    (0.1234, 0.1235, False),
    ({"a": [1.0000001]}, {"a": [1]}, True),
    ([1, 2], [2, 1], False),
    ("1", 1, False),
])
def test_lcb_value_matches(got, expected, ok):
    assert lcb_value_matches(got, expected) is ok


def _call(value, encoding="json"):
    return CallResult(0, "ok", value, encoding)


@pytest.mark.parametrize("call, expected, ok", [
    (_call(6), 6, True),
    (_call(6), [6], True),  # expected wraps the result
    (_call([6]), 6, True),  # the result wraps the expected
    (_call([1, 2]), [[1, 2]], True),
    (_call([1, 2], "list"), [1, 2], True),  # a set/iterable compared as list(g) == list(e)
    (_call([2, 1], "list"), [1, 2], False),
    (_call({"1": 2}), {"1": 2}, True),  # int keys became strings in the round trip
    (_call(6), "6", True),  # a JSON-text expected output is decoded for a non-string result
    (_call("6"), "6", True),
    (_call("6"), 6, False),
    (_call("ab"), ["a", "b"], True),  # list(g) == list(e), as the reference
    (_call(True), 1, True),  # Python equality
    (_call(None, "repr"), None, False),
    (_call(7), 6, False),
])
def test_apps_value_matches(call, expected, ok):
    assert apps_value_matches(call, expected) is ok


# ------------------------------------------------------------------------------ end to end
@pytest.fixture()
def fast(monkeypatch):
    monkeypatch.setattr(code, "PER_TEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(code, "LCB_TOTAL_TIMEOUT_S", 3.0)
    monkeypatch.setattr(code, "APPS_TOTAL_TIMEOUT_S", 3.0)


def stdin_meta(*pairs, **extra):
    return {"tests": [{"input": i, "output": o} for i, o in pairs], **extra}


LCB_SOLUTION = ("class Solution:\n    def twoSum(self, nums: List[int], target: int):\n"
                "        seen = {}\n        for i, x in enumerate(nums):\n"
                "            if target - x in seen:\n                return [seen[target - x], i]\n"
                "            seen[x] = i\n")
LCB_META = {"test_type": "functional", "func_name": "twoSum",
            "tests": [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]"},
                      {"input": "[3, 2, 4]\n6", "output": "[1, 2]"}]}

CASES = [
    # (id, scorer, prediction, meta, correct, detail fragment)
    ("stdin_pass", "stdin", fence(DOUBLE), stdin_meta(("3", "6"), ("10\n", "20\n")), True,
     "passed 2/2"),
    ("stdin_line_lists", "stdin",
     fence("import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n"
           "    print(a + b)\n"),
     stdin_meta((["1 2", "3 4"], ["3", "7"])), True, "passed 1/1"),
    ("stdin_whitespace_tolerance", "stdin", fence("print(int(input()) * 2, '  ')\nprint()\n"),
     stdin_meta(("3", "6")), True, "passed 1/1"),
    ("stdin_wrong_answer", "stdin", fence("print(int(input()) + 2)"),
     stdin_meta(("2", "4"), ("3", "6"), ("4", "8")), False,
     "passed 1/3 tests; first failure at test 1: wrong answer"),
    ("stdin_runtime_error_after_output", "stdin", fence("print(6)\nraise ValueError('late')"),
     stdin_meta(("3", "6")), False, "ValueError: late"),
    ("stdin_system_exit_is_clean", "stdin", fence("import sys\nprint(6)\nsys.exit(1)"),
     stdin_meta(("3", "6")), True, "passed 1/1"),
    ("stdin_exit_builtin", "stdin", fence("print(6)\nexit()"), stdin_meta(("3", "6")), True,
     "passed 1/1"),
    ("stdin_no_code", "stdin", "I think the answer is to double it.", stdin_meta(("3", "6")),
     False, "no runnable code"),
    ("stdin_unclosed_fence", "stdin", "```python\n" + DOUBLE, stdin_meta(("3", "6")), True,
     "passed 1/1"),
    ("stdin_bare_code", "stdin", DOUBLE, stdin_meta(("3", "6")), True, "passed 1/1"),
    ("stdin_answer_tag", "stdin", f"<answer>\n{DOUBLE}</answer>", stdin_meta(("3", "6")), True,
     "passed 1/1"),
    ("stdin_last_block_wins", "stdin",
     fence("print('wrong')") + "\nfixed:\n" + fence(DOUBLE) + "\n" + fence("int x;", "cpp"),
     stdin_meta(("3", "6")), True, "passed 1/1"),
    ("stdin_buffer_io", "stdin",
     fence("import sys\nn = int(sys.stdin.buffer.readline())\n"
           "sys.stdout.buffer.write(str(2 * n).encode())\n"),
     stdin_meta(("21", "42")), True, "passed 1/1"),
    ("stdin_case_sensitive", "stdin", fence("print('YES')"), stdin_meta(("", "yes")), False,
     "wrong answer"),
    ("stdin_timeout", "stdin", fence("while True:\n    pass"), stdin_meta(("", "1")), False,
     "timed out"),
    ("stdin_syntax_error", "stdin", fence("print(1"), stdin_meta(("", "1")), False,
     "SyntaxError"),
    ("livecodebench_stdin", "livecodebench", fence(DOUBLE), stdin_meta(("3", "6")), True,
     "passed 1/1"),
    ("taco_mm_stdin", "taco_mm", fence(DOUBLE), stdin_meta(("3", "6"), ("4", "9")), False,
     "first failure at test 1"),
    ("lcb_functional_pass", "livecodebench", fence(LCB_SOLUTION), LCB_META, True, "passed 2/2"),
    ("lcb_functional_module_function_fails", "livecodebench",
     fence("def twoSum(nums, target):\n    return [0, 1]\n"), LCB_META, False,
     "Solution is not defined"),
    ("lcb_functional_float_rounding", "livecodebench",
     fence("class Solution:\n    def f(self, a, b):\n        return a + b\n"),
     {"test_type": "functional", "func_name": "f",
      "tests": [{"input": "0.1\n0.2", "output": "0.3"}]}, True, "passed 1/1"),
    ("lcb_functional_tuple_is_list", "livecodebench",
     fence("class Solution:\n    def f(self, a):\n        return (a, a)\n"),
     {"test_type": "functional", "func_name": "f",
      "tests": [{"input": "1", "output": "[1, 1]"}]}, True, "passed 1/1"),
    ("apps_module_function", "apps_functional", fence("def add(a, b):\n    return a + b\n"),
     {"func_name": "add", "tests": [{"input": [1, 2], "output": 3},
                                    {"input": ["a", "b"], "output": "ab"}]}, True, "passed 2/2"),
    ("apps_solution_method", "apps_functional",
     fence("class Solution:\n    def add(self, a, b):\n        return a + b\n"),
     {"func_name": "add", "tests": [{"input": [1, 2], "output": [3]}]}, True, "passed 1/1"),
    ("apps_json_string_input", "apps_functional", fence("def add(a, b):\n    return [a + b]\n"),
     {"func_name": "add", "tests": [{"input": "[1, 2]", "output": 3}]}, True, "passed 1/1"),
    ("apps_set_result", "apps_functional", fence("def uniq(xs):\n    return set(xs)\n"),
     {"func_name": "uniq", "tests": [{"input": [[1, 1, 2]], "output": [1, 2]}]}, True,
     "passed 1/1"),
    ("apps_stdout_ignored", "apps_functional",
     fence("def add(a, b):\n    print('debug', a, b)\n    return a + b\n"),
     {"func_name": "add", "tests": [{"input": [1, 2], "output": 3}]}, True, "passed 1/1"),
    ("apps_runs_every_test", "apps_functional",
     fence("def inv(x):\n    return 1 / x\n"),
     {"func_name": "inv", "tests": [{"input": [1], "output": 1.0}, {"input": [0], "output": 0},
                                    {"input": [2], "output": 0.5}]}, False,
     "passed 2/3 tests; first failure at test 1: ZeroDivisionError"),
    ("apps_wrong", "apps_functional", fence("def add(a, b):\n    return a - b\n"),
     {"func_name": "add", "tests": [{"input": [1, 2], "output": 3}]}, False, "wrong answer"),
    ("apps_missing_function", "apps_functional", fence("def plus(a, b):\n    return a + b\n"),
     {"func_name": "add", "tests": [{"input": [1, 2], "output": 3}]}, False,
     "'add' is not defined"),
    ("apps_timeout", "apps_functional", fence("def f(x):\n    while True:\n        pass\n"),
     {"func_name": "f", "tests": [{"input": [1], "output": 1}]}, False, "timed out"),
]


@pytest.mark.parametrize("scorer, prediction, meta, correct, detail",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_code_scorers_table(fast, scorer, prediction, meta, correct, detail):
    result = score(scorer, prediction, ["(hidden tests)"], meta)
    assert result.correct is correct, result.detail
    assert result.em == result.f1 == float(correct)
    assert detail in result.detail


def test_lcb_stops_at_the_first_failure(fast):
    meta = stdin_meta(("1", "2"), ("2", "5"), ("3", "6"))
    report = evaluate_code("stdin", fence(DOUBLE), meta)
    assert [(o.index, o.status) for o in report.outcomes] == [(0, "ok"), (1, "wrong")]
    assert report.passed == 1 and report.total == 3 and report.first_failure.index == 1


def test_total_budget_counts_as_a_timeout(monkeypatch):
    monkeypatch.setattr(code, "LCB_TOTAL_TIMEOUT_S", 0.8)
    report = evaluate_code("stdin", fence("import time\ntime.sleep(0.5)\nprint(1)"),
                           stdin_meta(*[("", "1")] * 4))
    assert not report.all_passed and report.first_failure.status == "timeout"
    assert report.passed < 4


def test_report_properties():
    r = CodeReport("p", 3, (TestOutcome(0, True, "ok"), TestOutcome(1, True, "ok")))
    assert not r.all_passed and r.first_failure.index == 2 and r.first_failure.error == "not run"
    assert CodeReport("p", 0).first_failure.error == "no tests"
    assert not CodeReport("p", 0).all_passed
    assert CodeReport("", 2).no_code and CodeReport("", 2).detail() == "no runnable code found"


@pytest.mark.parametrize("scorer, meta, match", [
    ("stdin", {}, "meta.tests"),
    ("stdin", {"tests": "not json"}, "meta.tests"),
    ("stdin", {"tests": [{"input": "1"}]}, r"meta.tests\[0\]"),
    ("apps_functional", {"tests": [{"input": [1], "output": 1}]}, "func_name"),
    ("apps_functional", {"func_name": "f", "tests": [{"input": "[1,", "output": 1}]},
     r"meta.tests\[0\].input"),
    ("livecodebench", {"test_type": "functional", "func_name": "f",
                       "tests": [{"input": "1\n{bad", "output": "1"}]}, "line 1"),
])
def test_malformed_meta_raises(scorer, meta, match):
    with pytest.raises(ValueError, match=match):
        score(scorer, fence("print(1)"), [], meta)


def test_registered_names():
    assert {"stdin", "apps_functional", "livecodebench", "taco_mm"} <= set(known_scorers())
    assert get_scorer("stdin") is get_scorer("livecodebench") is get_scorer("taco_mm") \
        is code.score_lcb
    assert get_scorer("apps_functional") is code.score_apps_functional


# ------------------------------------------------------------------------------ simulated tasks
@pytest.fixture(scope="module")
def sim_code_tasks():
    tasks = synthetic_tasks(12, seed=7, domains=(Domain.CODE,))
    assert {t.meta["difficulty"] for t in tasks} == {"easy", "medium", "hard"}
    return tasks


def test_simulated_reference_solutions_pass(sim_code_tasks):
    for task in sim_code_tasks:
        reply = f"<answer>\n```python\n{task.meta['sim']['solution']}```\n</answer>"
        result = score(task.scorer_dataset, reply, list(task.gold), task.meta)
        assert task.scorer_dataset == "apps_functional"
        assert result.correct, (task.meta["func_name"], result.detail)


def test_simulated_buggy_solutions_fail(sim_code_tasks):
    for task in sim_code_tasks:
        reply = f"```python\n{task.meta['sim']['buggy_solution']}```"
        result = score(task.scorer_dataset, reply, list(task.gold), task.meta)
        assert not result.correct, task.meta["func_name"]
        assert "wrong answer" in result.detail or "Error" in result.detail
