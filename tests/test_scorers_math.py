"""Math scorer: math_verify in a process pool plus the reference's own rules."""

import concurrent.futures
import os
import time
from fractions import Fraction
from pathlib import Path

import pytest

from jax_routeweaver.rewards.scorers import math_equiv
from jax_routeweaver.rewards.scorers.math_equiv import (
    expand_pm,
    math_f1,
    normalize_math,
    percent_variant,
    rational_value,
    score_math,
    split_top_level,
)
from jax_routeweaver.rewards.scorers.registry import score

# Runs for minutes in sympy (checked by hand): the timeout path's input.
PATHOLOGICAL = "2^{2^{2^{2^{2^{2}}}}}"

# ------------------------------------------------------------------- the scorer, end to end

MATH_CASES = [
    # (prediction, gold, correct, detail)
    ("", ["5"], False, "no answer"),                                       # empty prediction
    ("  \n ", ["5"], False, "no answer"),
    ("4.5", ["\\frac{9}{2}"], True, "math_verify"),
    ("9/84", ["3/28"], True, "math_verify"),                               # unreduced fraction
    ("\\boxed{28}", ["28"], True, "math_verify"),
    ("so it is \\boxed{\\frac{\\sqrt{3}}{2}}", ["\\frac{\\sqrt3}{2}"], True, "math_verify"),
    ("\\boxed{3} then \\boxed{4}", ["4"], True, "math_verify"),            # LAST boxed
    ("\\boxed{3} then \\boxed{4}", ["3"], False, "unmatched (math_verify)"),
    ("50\\%", ["\\frac{1}{2}"], True, "math_verify"),                      # percent variant
    ("0.25", ["25\\%"], True, "math_verify"),                              # gold percent variant
    ("\\(\\frac{1}{2}\\)", ["1/2"], True, "math_verify"),
    ("362,880", ["362880"], True, "math_verify"),
    ("-1 + (-1) = -2", ["-2"], True, "math_verify"),
    ("\\pm 3i", ["3i, -3i"], True, "math_verify"),
    ("x^2+2x+1", ["(x+1)^2"], True, "math_verify"),
    ("7", ["5", "7"], True, "math_verify"),                                # any gold
    ("yes", ["Yes."], True, "string"),                                     # string fallback
    ("6", ["-6"], False, "string match rejected by sign guard"),           # sign guard
    ("-6", ["6"], False, "string match rejected by sign guard"),
    ("\\boxed{-6}", ["6"], False, "string match rejected by sign guard"),
    ("-6", ["-6"], True, "math_verify"),
    ("[0,1)", ["(0,1]"], False, "string match rejected by sign guard"),    # brackets matter
    ("1,5", ["1.5"], False, "string match rejected by sign guard"),        # ambiguous comma
    ("1 000 000", ["1000000"], True, "rational"),                          # rule 2: rational
    ("2^3^2", ["512"], True, "rational"),                                  # sympy: 2^(3^2)
    ("north, south", ["south, north"], True, "set"),                       # rule 3: set
    ("2^3^2, 1", ["1, 512"], True, "set"),                                 # items by value
    ("north, south", ["north, south, east"], False, "unmatched (math_verify)"),
    ("(1,2)", ["(2,1)"], False, "unmatched (math_verify)"),                # ordered tuple
    ("5", ["6"], False, "unmatched (math_verify)"),
    ("1e3", ["1000"], False, "unmatched (math_verify)"),
]


@pytest.mark.parametrize(("prediction", "gold", "correct", "detail"), MATH_CASES)
def test_math_scorer(prediction, gold, correct, detail):
    result = score_math(prediction, gold)
    assert (result.correct, result.detail) == (correct, detail)


@pytest.mark.parametrize("name", ["math", "omni_math", "omni_math_d36x"])
def test_math_names_share_the_scorer(name):
    assert score(name, "0.5", ["\\frac{1}{2}"]).correct
    assert not score(name, "6", ["-6"]).correct


@pytest.mark.parametrize(("prediction", "gold", "em", "f1"), [
    ("\\boxed{\\text{(A)}}", ["A"], 1.0, 0.5),     # F1 reads the raw text: boxed, text, a
    ("362,880.", ["362880"], 1.0, 0.0),
    ("9/84 = 3/28", ["3/28"], 1.0, 2 / 3),
    ("x = 5", ["5"], 1.0, 2 / 3),
    ("4.5", ["\\frac{9}{2}"], 0.0, 0.0),
    ("6", ["-6"], 0.0, 1.0),          # F1 tokens drop the sign; EM keeps it
    ("\\pm 2", ["2,-2"], 1.0, 0.5),
    ("1, 2", ["3", "1,2"], 1.0, 1.0),
])
def test_math_em_and_f1(prediction, gold, em, f1):
    result = score_math(prediction, gold)
    assert result.em == em
    assert result.f1 == pytest.approx(f1)


def test_math_gold_forms_and_errors():
    assert score_math("0.5", "1/2").correct                    # a bare string is one answer
    for prediction in ("5", ""):
        with pytest.raises(ValueError, match="gold is empty"):
            score_math(prediction, [])
    assert not score_math(None, ["5"]).correct


# ------------------------------------------------------------- rules, in-process (no pool)

@pytest.mark.parametrize(("text", "expected"), [
    ("\\boxed{5}", "5"),
    ("\\boxed{\\text{(A)}}", "a"),
    ("((7))", "7"),
    ("(((((7)))))", "((7))"),                 # unwrapping stops after 3 rounds
    ("{1,2}", "1,2"),
    ("80 \\%", "80%"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),
    ("\\(x\\)", "x"),
    ("\\[ x \\]", "x"),
    ("a\\,b\\;c\\!d\\ e", "abcde"),
    ("42.", "42"),
    ("362,880", "362880"),
    ("1,234,567", "1234567"),
    ("1,2", "1,2"),                           # a pair, not a thousands separator
    ("1,2345", "1,2345"),
    ("9/84 = 3/28", "3/28"),
    ("x=1,y=2", "x=1,y=2"),                   # more than one "="
    ("a = b = c", "a=b=c"),
    ("x" * 81 + "=1", "x" * 81 + "=1"),       # "=" too far right
    ("\\pm 3i", "3i,-3i"),
    ("-6", "-6"),                             # the sign survives
    ("Yes", "yes"),
    (None, ""),
])
def test_normalize_math(text, expected):
    assert normalize_math(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("50\\%", "1/2"),
    ("50%", "1/2"),
    ("50 %", "1/2"),
    ("-12.5\\%", "-1/8"),
    ("0%", "0/1"),
    ("1,000.5%", "2001/200"),
    ("1,000\\%", None),                       # reference quirk: "1,000%" is not a grouped int
    ("1,00.5%", None),
    (".%", None),
    ("abc%", None),
    ("50", None),
])
def test_percent_variant(text, expected):
    assert percent_variant(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("3/6", Fraction(1, 2)),
    ("\\dfrac{3}{6}", Fraction(1, 2)),
    ("-\\frac{1}{2}", Fraction(-1, 2)),
    ("\\frac{-1}{2}", Fraction(-1, 2)),
    ("0.125", Fraction(1, 8)),
    (".5", Fraction(1, 2)),
    ("(7)", Fraction(7)),
    ("1,000", Fraction(1000)),
    ("1/0", None),
    ("x", None),
    ("1e3", None),
])
def test_rational_value(text, expected):
    assert rational_value(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("-1 + (-1)", Fraction(-2)),
    ("3*(4+1)/2", Fraction(15, 2)),
    ("2^3^2", Fraction(512)),
    ("4^(1/2)", Fraction(2)),
    ("2^(1/2)", None),                        # irrational
    ("1/0", None),
    ("5", None),                              # no operator: not an expression
    ("x+1", None),
])
def test_arith_value(text, expected):
    assert math_equiv._arith_value(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("1, 2", ["1", "2"]),
    ("(1,2)", ["(1,2)"]),
    ("[0,1)", ["[0,1)"]),
    ("(1,2),(3,4)", ["(1,2)", "(3,4)"]),
    ("f(1,2), 3", ["f(1,2)", "3"]),
    ("1,,2", ["1", "2"]),
    ("", []),
])
def test_split_top_level(text, expected):
    assert split_top_level(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("\\pm 3i", ["3i", "-3i"]),
    ("2 \\pm \\sqrt{3}", ["2+\\sqrt{3}", "2-\\sqrt{3}"]),
    ("±2", ["2", "-2"]),
    ("1 \\pm 2 \\pm 3", None),
    ("x \\pm", None),
    ("5", None),
])
def test_expand_pm(text, expected):
    assert expand_pm(text) == expected


@pytest.mark.parametrize(("prediction", "gold", "expected"), [
    ("north, south", "south, north", True),
    ("\\pm 2", "-2, 2", True),
    ("1, 2", "1, 2, 3", False),               # same count needed
    ("1, 1", "1, 2", False),                  # matched one-to-one
    ("north", "north", False),                # one item is not a list
    ("(1,2)", "(2,1)", False),                # a bracketed tuple is one item
])
def test_set_equivalent(prediction, gold, expected):
    assert math_equiv._set_equivalent(prediction, gold) is expected


@pytest.mark.parametrize(("prediction", "expected"), [
    ("\\boxed{50\\%}", ["50\\%", "\\boxed{50\\%}", "1/2"]),
    ("x \\boxed{ 7 } y", ["7", "x \\boxed{ 7 } y"]),
    ("  12.5%  ", ["12.5%", "1/8"]),
    # The reference wraps the prediction in <answer></answer> and takes the first (non-greedy)
    # block of that, so a prediction still carrying tags keeps its opening one.
    ("<answer> 3 </answer>", ["<answer> 3"]),
])
def test_candidates(prediction, expected):
    assert math_equiv._candidates(prediction) == expected


@pytest.mark.parametrize(("candidate", "gold", "expected"), [
    ("12%", "0.12", True),
    ("1, 2", "2, 1", True),                   # bare text is read as one $...$ formula, a set
    ("\\frac12", "0.5", True),
    ("$\\frac{1}{2}$", "1/2", True),         # already delimited: parsed as given
    ("6", "-6", False),
    ("", "0", False),                          # nothing parsed: not equal
])
def test_symbolic_equal(candidate, gold, expected):
    assert math_equiv._symbolic_equal(candidate, gold) is expected


def test_math_f1():
    assert math_f1("x = 5", "5") == pytest.approx(2 / 3)
    assert math_f1("", "") == 1.0
    assert math_f1("+", "5") == 0.0


# ------------------------------------------------------------------------ the process pool

def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_pool_is_reused():
    score_math("1", ["1"])
    pool = math_equiv._get_pool()
    pids = {math_equiv._call(os.getpid, timeout=30) for _ in range(12)}
    for _ in range(5):
        assert score_math("0.5", ["1/2"]).correct
    assert math_equiv._get_pool() is pool
    assert os.getpid() not in pids
    assert 1 <= len(pids) <= math_equiv.POOL_WORKERS


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_timeout_is_not_equal_and_replaces_the_pool(monkeypatch):
    monkeypatch.setattr(math_equiv, "MATH_TIMEOUT_S", 1.0)
    old_pool = math_equiv._get_pool()
    old_pids = {math_equiv._call(os.getpid, timeout=30) for _ in range(8)}
    start = time.monotonic()
    result = score_math(PATHOLOGICAL, ["3"])
    assert time.monotonic() - start < 10
    assert (result.correct, result.detail) == (False, "timeout after 1s")
    assert result.em == 0.0
    # The stuck worker was killed, and the next call runs on a fresh pool.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in old_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in old_pids)
    assert score_math("0.5", ["1/2"]).correct
    assert math_equiv._get_pool() is not old_pool


def test_concurrent_calls_survive_another_calls_timeout(monkeypatch):
    monkeypatch.setattr(math_equiv, "MATH_TIMEOUT_S", 1.5)
    jobs = [("0.5", ["\\frac{1}{2}"]), ("6", ["-6"]), (PATHOLOGICAL, ["3"])] + [
        (f"{k}/2", [str(k / 2)]) for k in range(1, 25)]
    with concurrent.futures.ThreadPoolExecutor(6) as threads:
        results = list(threads.map(lambda job: score_math(*job), jobs))
    assert results[0].correct and not results[1].correct
    assert results[2].detail == "timeout after 1.5s"
    assert all(r.correct for r in results[3:]), [r for r in results[3:] if not r.correct]


@pytest.mark.slow
def test_a_crashing_worker_is_reported_not_raised():
    with pytest.raises(math_equiv._Crashed):
        math_equiv._call(os._exit, 3, timeout=30)
    assert score_math("2", ["2"]).correct            # the pool recovers


def test_shutdown_then_restart():
    math_equiv.shutdown_pool()
    assert math_equiv._pool is None
    assert score_math("1/4", ["0.25"]).correct


@pytest.mark.slow
def test_a_call_whose_pool_is_killed_under_it_is_retried():
    math_equiv._get_pool()
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        pending = thread.submit(math_equiv._call, time.sleep, 1.0, timeout=30)
        time.sleep(0.3)                       # the sleep is now running in a worker
        math_equiv._discard(math_equiv._get_pool())
        assert pending.result(timeout=30) is None


FORK_CHECK = """
import os
from jax_routeweaver.rewards.scorers import math_equiv
from jax_routeweaver.rewards.scorers.math_equiv import score_math
parent_pool = math_equiv._get_pool()
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # child: must not touch the parent's pool
    ok = math_equiv._pool is None and score_math("3/4", ["0.75"]).correct
    math_equiv.shutdown_pool()
    os.write(write, b"1" if ok else b"0")
    os._exit(0)
os.close(write)
assert os.read(read, 1) == b"1", "child reused the parent's pool"
os.waitpid(pid, 0)
assert math_equiv._get_pool() is parent_pool
math_equiv.shutdown_pool()
print("fork-ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_pool():
    """Run in a fresh interpreter: forking this (JAX-threaded) test process could deadlock."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORK_CHECK], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "fork-ok" in out.stdout, out.stderr[-2000:]


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        math_equiv.math_verdict("1", ["1"], timeout_s=0)
