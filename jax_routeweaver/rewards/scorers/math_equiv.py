"""Math scorer: symbolic equivalence plus the original's own rules (its `scorer.score`).

Verdict for a non-empty prediction against the gold list, first rule that fires:

1. Symbolic. Candidates = [content of the last brace-matched `\\boxed{}` (if any), the whole
   answer] plus a percent variant of each (`50\\%` -> `1/2`). For every gold (and its percent
   variant), every candidate: `math_verify` equivalence ("math_verify"); else SQuAD-normalised
   strings equal and non-empty ("string") — but SQuAD normalisation drops the minus sign, so a
   string match is re-checked with `normalize_math`, which keeps it, and rejected when no gold
   agrees (`6` != `-6`). The first string match ends this step either way.
2. Exact rational equality ("rational"): `a/b`, `\\frac{a}{b}` / `\\dfrac`, integers,
   decimals, or a pure arithmetic expression evaluated exactly by sympy.
3. Order-insensitive list equality ("set"): top-level comma lists or a single `\\pm` /
   `±` expansion, at least two items, same count, each item equivalent by 1 or 2.

Reported beside the verdict: EM on `normalize_math` and token F1 (`math_f1`).

`math_verify` and sympy can run for minutes on inputs such as `2^{2^{2^{2^{2^{2}}}}}`, and
`math_verify`'s own timeouts use `signal.alarm`, which only works in a main thread. So the
whole verdict runs in a small, reused `spawn` process pool (no inherited JAX threads) with its
own timeouts disabled; the parent waits at most `MATH_TIMEOUT_S`. A timeout counts as
not-equal, and the pool is killed and replaced so a stuck worker never blocks later calls.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import multiprocessing
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, TypeVar

from jax_routeweaver.rewards.scorers.registry import ScoreResult, gold_list, register
from jax_routeweaver.rewards.scorers.text import normalize_answer, token_f1
from jax_routeweaver.routing.protocol.answers import last_boxed

__all__ = [
    "BACKEND",
    "MATH_TIMEOUT_S",
    "POOL_WORKERS",
    "expand_pm",
    "math_f1",
    "math_verdict",
    "normalize_math",
    "percent_variant",
    "rational_value",
    "score_math",
    "shutdown_pool",
    "split_top_level",
]

BACKEND = "math_verify"
# Seconds the parent waits for one verdict (all candidates x golds, set matching included).
MATH_TIMEOUT_S = 10.0
# Seconds a fresh pool may take to spawn its workers and import math_verify.
POOL_START_TIMEOUT_S = 120.0
POOL_WORKERS = max(1, min(4, os.cpu_count() or 1))
# A call whose pool was killed under it (another call's timeout) is retried this many times.
_POOL_ATTEMPTS = 3

T = TypeVar("T")

# ------------------------------------------------------------ sign-preserving normaliser

# LaTeX that never changes a value. The minus sign is deliberately not here.
_TRIVIA = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\\\(|\\\)|\\\[|\\\]|\$|\s+")
_WRAPPERS = tuple(re.compile(p, re.S) for p in (
    r"^\\boxed\{(.*)\}$", r"^\\text\{(.*)\}$", r"^\((.*)\)$", r"^\{(.*)\}$"))
# A comma between digits followed by exactly three digits: "362,880" but not the pair "1,2".
_THOUSANDS = re.compile(r"(?<=\d),(?=\d\d\d(?!\d))")
# One trailing "= result" step (the "=" within the first 81 characters, none after it).
_TRAILING_EQ = re.compile(r"^[^=]{1,80}=\s*(.+)$", re.S)
_PM_PREFIX = re.compile(r"^\\?pm\s*(.+)$", re.S)


def normalize_math(text: str | None) -> str:
    """The original's sign-preserving normalisation (EM and the string-match guard).

    Unwrap `\\boxed{}`, `\\text{}`, outer `()` / `{}` (up to 3 rounds); `\\%` -> `%`; strip
    `\\left \\right \\! \\, \\; \\  \\( \\) \\[ \\] $` and whitespace; drop trailing `.`;
    drop thousands commas between digits; keep the right side of a single `=`;
    `\\pm x` -> `x,-x`; lowercase.
    """
    s = ("" if text is None else str(text)).strip()
    for _ in range(3):
        before = s
        for wrapper in _WRAPPERS:
            s = wrapper.sub(r"\1", s.strip())
        if s == before:
            break
    s = _TRIVIA.sub("", s.replace("\\%", "%"))
    s = _THOUSANDS.sub("", s.rstrip(".").strip())
    eq = _TRAILING_EQ.match(s)
    if eq and "=" not in eq.group(1):
        s = eq.group(1).strip()
    pm = _PM_PREFIX.match(s)
    if pm:
        body = pm.group(1).strip()
        s = f"{body},-{body}"
    return s.lower()


_F1_SPLIT = re.compile(r"[^0-9a-z]+")


def _f1_tokens(text: str) -> list[str]:
    return [t for t in _F1_SPLIT.split(text.lower()) if t]


def math_f1(prediction: str, gold: str) -> float:
    """Token F1 over lowercase ASCII-alphanumeric runs of the raw strings; empty vs empty = 1."""
    pred, truth = _f1_tokens(prediction), _f1_tokens(gold)
    if not pred or not truth:
        return float(pred == truth)
    return token_f1(pred, truth)


# ------------------------------------------------------------------ exact numeric values

_PERCENT_LITERAL = re.compile(r"^(-?[\d.,]+)\s*\\?%$")
_GROUPED = re.compile(r"^-?\d{1,3}(?:,\d{3})+$")


def percent_variant(text: str) -> str | None:
    """`50\\%` / `50 %` -> "1/2": the percentage as an exact fraction "p/q", else None.

    Commas must be thousands separators of the part before the decimal point; as in the
    original code, that part is read with the `%` still attached when there is no point, so
    `1,000%` gets no variant.
    """
    match = _PERCENT_LITERAL.match(text.strip())
    if match is None:
        return None
    raw = match.group(1) + "%"
    if "," in raw:
        if not _GROUPED.match(raw.split(".")[0]):
            return None
        raw = raw.replace(",", "")
    try:
        value = Fraction(Decimal(raw[:-1])) / 100
    except (InvalidOperation, ValueError, ArithmeticError):
        return None
    return f"{value.numerator}/{value.denominator}"


_SIMPLE_FRAC = re.compile(r"^\s*([+-]?\d+)\s*/\s*([+-]?\d+)\s*$")
_LATEX_FRAC = re.compile(r"^\s*([+-]?)\\d?frac\{([+-]?\d+)\}\{([+-]?\d+)\}\s*$")
_SIMPLE_DEC = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)\s*$")


def rational_value(text: str) -> Fraction | None:
    """Exact value of a normalised `a/b`, `\\frac{a}{b}` / `\\dfrac{a}{b}`, integer or
    decimal; None for anything else (a zero denominator included)."""
    s = normalize_math(text)
    frac = _SIMPLE_FRAC.match(s)
    if frac and int(frac.group(2)) != 0:
        return Fraction(int(frac.group(1)), int(frac.group(2)))
    latex = _LATEX_FRAC.match(s)
    if latex and int(latex.group(3)) != 0:
        value = Fraction(int(latex.group(2)), int(latex.group(3)))
        return -value if latex.group(1) == "-" else value
    if _SIMPLE_DEC.match(s):
        try:
            return Fraction(s.strip())
        except (ValueError, ZeroDivisionError):
            return None
    return None


_ARITH = re.compile(r"^[0-9+\-*/^().\s]+$")
_ARITH_OP = re.compile(r"[+\-*/]")


def _arith_value(text: str) -> Fraction | None:
    """Exact rational value of a bare arithmetic expression ("-1 + (-1)", "3*(4+1)/2"),
    evaluated by sympy; None if it is not one or is not rational. Can be slow (`9^9^9`):
    only call it inside the pool."""
    s = normalize_math(text).replace("^", "**")
    if not _ARITH.match(s) or not _ARITH_OP.search(s):
        return None
    try:
        import sympy

        value = sympy.nsimplify(sympy.sympify(s, rational=True))
        return Fraction(int(value.p), int(value.q)) if value.is_Rational else None
    except Exception:  # sympy raises many types on malformed input; any of them means "no value"
        return None


def _value(text: str) -> Fraction | None:
    value = rational_value(text)
    return value if value is not None else _arith_value(text)


# ----------------------------------------------------------------------- list matching

_BRACKETED = re.compile(r"^[(\[{].*[)\]}]$", re.S)


def _outer_pair_spans_all(s: str) -> bool:
    """True if the bracket opened at s[0] first closes at the last character."""
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and i < len(s) - 1:
            return False
    return True


def split_top_level(text: str) -> list[str]:
    """Split on commas outside () [] {}; a list wrapped in one bracket pair — an ordered
    tuple "(1,2)" or an interval — stays one item. Empty pieces are dropped."""
    s = str(text).strip()
    if not s:
        return []
    if _BRACKETED.match(s) and _outer_pair_spans_all(s):
        return [s]
    parts, depth, current = [], 0, []
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def expand_pm(text: str) -> list[str] | None:
    """One `\\pm` / `±`: "\\pm 3i" -> ["3i", "-3i"], "2 \\pm \\sqrt{3}" -> ["2+\\sqrt{3}",
    "2-\\sqrt{3}"]; None without exactly one, or with nothing after it."""
    s = str(text).strip().replace("±", "\\pm")
    if s.count("\\pm") != 1:
        return None
    left, right = (part.strip() for part in s.split("\\pm"))
    if not right:
        return None
    if not left:
        return [right, f"-{right}"]
    return [f"{left}+{right}", f"{left}-{right}"]


# ------------------------------------------------------------------ the verdict (in pool)

_ANSWER_TAG = re.compile(r"<answer\s*>(.*?)</answer\s*>", re.S | re.I)
_DELIMITED = re.compile(r"\$|\\\(|\\\[")


def _answer_body(prediction: str) -> str:
    """What the original scores: the last `<answer>` body of `<answer>{prediction}</answer>`."""
    return _ANSWER_TAG.findall(f"<answer>{prediction}</answer>")[-1].strip()


def _candidates(prediction: str) -> list[str]:
    answer = _answer_body(prediction)
    candidates = [answer.strip()]
    boxed = last_boxed(answer)
    if boxed is not None:
        candidates.insert(0, boxed.strip())
    for candidate in list(candidates):
        variant = percent_variant(candidate)
        if variant:
            candidates.append(variant)
    return candidates


def _parse(text: str) -> list[Any]:
    """math_verify parse, its timeout off. Bare text is read as one `$...$` formula first: its
    plain-expression reader takes "1, 2" for the decimal 1.2 and cannot read "\\frac12"."""
    from math_verify import parse

    if not _DELIMITED.search(text):
        parsed = parse(f"${text}$", parsing_timeout=None)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=None)


def _symbolic_equal(candidate: str, gold: str) -> bool:
    """math_verify equivalence of one candidate with one gold form; any failure is False."""
    from math_verify import verify

    try:
        gold_parsed, candidate_parsed = _parse(gold), _parse(candidate)
        return bool(gold_parsed and candidate_parsed
                     and verify(gold_parsed, candidate_parsed, timeout_seconds=None))
    except Exception:  # a parser / sympy failure means "not shown equal", as in the original
        return False


def _equivalent(prediction: str, golds: Sequence[str]) -> tuple[bool, str]:
    """Rule 1 of the module docstring (the original's `scorer.equivalent` + `score_math`)."""
    candidates = _candidates(prediction)
    for gold in golds:
        variant = percent_variant(gold)
        forms = [gold, variant] if variant else [gold]
        for candidate in candidates:
            for form in forms:
                if _symbolic_equal(candidate, form):
                    return True, BACKEND
                squad = normalize_answer(candidate)
                if squad and squad == normalize_answer(form):
                    # SQuAD normalisation drops "-": confirm with the sign-preserving one.
                    signed = normalize_math(candidate)
                    if any(signed == normalize_math(g) for g in golds):
                        return True, "string"
                    return False, "string match rejected by sign guard"
    return False, f"unmatched ({BACKEND})"


def _item_equivalent(prediction: str, gold: str) -> bool:
    if _equivalent(prediction, [gold])[0]:
        return True
    a, b = _value(prediction), _value(gold)
    return a is not None and b is not None and a == b


def _set_equivalent(prediction: str, gold: str) -> bool:
    """Rule 3: same number (>= 2) of items, matched one-to-one in any order."""
    pred_items = expand_pm(prediction) or split_top_level(prediction)
    gold_items = expand_pm(gold) or split_top_level(gold)
    if len(pred_items) < 2 or len(pred_items) != len(gold_items):
        return False
    unused = list(gold_items)
    for item in pred_items:
        hit = next((g for g in unused if _item_equivalent(item, g)), None)
        if hit is None:
            return False
        unused.remove(hit)
    return True


def _verdict(prediction: str, golds: Sequence[str]) -> tuple[bool, str]:
    """(equivalent, how) for a non-empty prediction. Runs inside a pool worker."""
    equal, detail = _equivalent(prediction, golds)
    if equal:
        return True, detail
    pred_value = _value(prediction)
    for gold in golds:
        if pred_value is not None and pred_value == _value(gold):
            return True, "rational"
        if _set_equivalent(prediction, gold):
            return True, "set"
    return False, detail


# ------------------------------------------------------------------------ process pool

class _Timeout(Exception):
    pass


class _Crashed(Exception):
    pass


_pool_lock = threading.Lock()
_pool: cf.ProcessPoolExecutor | None = None
_atexit_registered = False
# At most one task per worker in flight, so a call's timeout measures its own work, never
# time spent queued behind another call.
_slots = threading.BoundedSemaphore(POOL_WORKERS)


def _reset_after_fork() -> None:
    # A forked child must not use (or wait on locks of) the parent's pool and threads.
    global _pool, _pool_lock, _slots
    _pool, _pool_lock = None, threading.Lock()
    _slots = threading.BoundedSemaphore(POOL_WORKERS)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _worker_init() -> None:
    # Timeouts are disabled on purpose; silence math_verify's warning about it.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (pay the import at start-up, not inside a timed call)


def _warm() -> int:
    _symbolic_equal("1/2", "0.5")
    return os.getpid()


def _kill(pool: cf.ProcessPoolExecutor) -> None:
    """Kill the pool's workers now (a stuck one never finishes by itself) and shut it down."""
    kill_workers = getattr(pool, "kill_workers", None)  # Python >= 3.14
    if kill_workers is not None:
        kill_workers()
    else:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _get_pool() -> cf.ProcessPoolExecutor:
    """The shared pool, started (all workers warm) on first use."""
    global _pool, _atexit_registered
    with _pool_lock:
        if _pool is None:
            pool = cf.ProcessPoolExecutor(
                max_workers=POOL_WORKERS, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init)
            try:
                for future in [pool.submit(_warm) for _ in range(POOL_WORKERS)]:
                    future.result(timeout=POOL_START_TIMEOUT_S)
            except BaseException as exc:
                _kill(pool)
                raise RuntimeError(f"math scorer: worker pool failed to start: {exc!r}") from exc
            _pool = pool
            if not _atexit_registered:
                # Stop the workers before interpreter teardown, when the executor's own
                # callbacks can no longer run cleanly.
                atexit.register(shutdown_pool)
                _atexit_registered = True
        return _pool


def _discard(pool: cf.ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    _kill(pool)


def shutdown_pool() -> None:
    """Stop the worker pool (a later call starts a fresh one)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _call(fn: Callable[..., T], *args: Any, timeout: float) -> T:
    """Run `fn(*args)` in the pool; `_Timeout` after `timeout` s (the pool is then replaced),
    `_Crashed` if the pool broke on every attempt."""
    error: BaseException | None = None
    with _slots:
        for _ in range(_POOL_ATTEMPTS):
            pool = _get_pool()
            try:
                future = pool.submit(fn, *args)
            except (cf.BrokenExecutor, RuntimeError) as exc:  # killed or shut down meanwhile
                error = exc
                _discard(pool)
                continue
            try:
                return future.result(timeout=timeout)
            except TimeoutError:
                if future.done():  # the task itself raised TimeoutError: not ours to hide
                    raise
                _discard(pool)
                raise _Timeout from None
            except cf.BrokenExecutor as exc:
                error = exc
                _discard(pool)
    raise _Crashed(repr(error))


def math_verdict(prediction: str, golds: Sequence[str],
                 timeout_s: float | None = None) -> tuple[bool, str]:
    """(equivalent, detail) under a time bound (default `MATH_TIMEOUT_S`); a timeout or a
    worker that crashes on every attempt is not-equal, never an exception."""
    timeout = MATH_TIMEOUT_S if timeout_s is None else timeout_s
    if not timeout > 0:
        raise ValueError(f"math scorer: the timeout must be > 0 seconds, got {timeout!r}")
    try:
        return _call(_verdict, str(prediction), [str(g) for g in golds], timeout=timeout)
    except _Timeout:
        return False, f"timeout after {timeout:g}s"
    except _Crashed as exc:
        return False, f"math worker crashed: {exc}"


# ------------------------------------------------------------------------------ scorer

@register("math", "omni_math", "omni_math_d36x")
def score_math(prediction: str, gold: Sequence[str],
               meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """MATH / Omni-MATH: correct = the verdict of the module docstring; em on `normalize_math`,
    f1 = best `math_f1`. An empty prediction is wrong without running anything."""
    golds = gold_list(gold, "math scorer")
    pred = "" if prediction is None else str(prediction)
    if not pred.strip():
        return ScoreResult(False, 0.0, 0.0, "no answer")
    norm = normalize_math(pred)
    em = float(any(norm == normalize_math(g) for g in golds))
    f1 = max(math_f1(pred, g) for g in golds)
    correct, detail = math_verdict(pred, golds)
    return ScoreResult(correct, em, f1, detail)
