"""RouteWeaver's verdict, failure classification, task reward and efficiency reward.

As the original's TaskRewardManager and CostRewardManager (docs/algorithm.md, "Rewards").

Verdict (`judge`): non-code rows score the router's answer and the agentic summarizer's answer
(each when non-empty) and are correct if either is. Code rows try candidate programs in order,
router turn -> summarizer reply -> (with `code_scorer="union"`, the paper setting) every
successful worker reply containing a fence; the first that passes wins. Any scorer exception
(an unknown scorer included) marks the verdict `sandbox_error`.

Failure kind, first match wins (docs/algorithm.md, "Failure kinds"):
    wrapper_error      the loop or wrapper raised                                   [infra]
    parser_error       the selector turn was invalid
    execution_timeout  every worker call failed and an error mentions a timeout     [infra]
    provider_error     every worker call failed otherwise                           [infra]
    sandbox_error      grading (or an in-loop execution) raised                     [infra]
    correct
    parser_error       grammar errors and no router answer
    genuine_incorrect

Task reward (docs/algorithm.md, "Task reward"), no-recovery branch (the paper setting):
    r_task = 0 if infra;  −1 if a policy violation ended the episode (even if correct);
             +1 if correct;  0 otherwise.
Recovery branch: 0 if infra; +1 if correct; −1 if grammar errors and no router answer; else 0.

Efficiency reward (docs/algorithm.md, "Efficiency reward"), for α > 0 and cost evaluation:
    r_eff = 0 if infra;  −1 if r_task = −1;  S_cost = 1/(1 + C/C_ref) if correct and the cost
            is complete;  0 otherwise.
The α-mix of the two happens in the advantage code (after per-component normalisation).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from jax_routeweaver.data.records import CODE_SCORER_DATASETS
from jax_routeweaver.rewards.sandbox import IsolationUnavailable
from jax_routeweaver.rewards.scorers.registry import ScoreResult, score
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.pools.pricing import C_REF_USD, cost_score
from jax_routeweaver.routing.protocol.violations import SELECTOR_VIOLATIONS, Violation

Scorer = Callable[[str, str, Sequence[str], Mapping[str, Any] | None], ScoreResult]
CodeScorerMode = Literal["union", "final"]

WRAPPER_ERROR = "wrapper_error"
PARSER_ERROR = "parser_error"
PROVIDER_ERROR = "provider_error"
EXECUTION_TIMEOUT = "execution_timeout"
SANDBOX_ERROR = "sandbox_error"
CORRECT = "correct"
GENUINE_INCORRECT = "genuine_incorrect"
FAILURE_KINDS: tuple[str, ...] = (WRAPPER_ERROR, PARSER_ERROR, EXECUTION_TIMEOUT, PROVIDER_ERROR,
                                  SANDBOX_ERROR, CORRECT, GENUINE_INCORRECT)
INFRA_KINDS = frozenset({WRAPPER_ERROR, EXECUTION_TIMEOUT, PROVIDER_ERROR, SANDBOX_ERROR})

# How the runner marks what the classification needs beyond the Trajectory's own fields: a
# `finish` or notice equal to one of these, or starting with it plus ":" (e.g.
# "loop_error:KeyError"), is a wrapper error / an in-loop sandbox failure.
WRAPPER_MARKERS: tuple[str, ...] = ("loop_error", "wrapper_error")
IN_LOOP_SANDBOX_MARKERS: tuple[str, ...] = ("exec_sandbox_error",)
SUMMARIZER_ROLE = "summarizer"
SUMMARIZER_OUTPUT_CHARS = 24_000  # the original keeps the first 24000 chars of the reply
S_COST_UNAVAILABLE = -1.0

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_FENCE = "```"
_FENCED_BLOCK = re.compile(r"```[^\n`]*\n.*?```", re.DOTALL)
_TIMEOUT = re.compile(r"time[d\s_-]*out", re.IGNORECASE)
_VIOLATION_CODES = frozenset(str(v) for v in Violation)
_SELECTOR_CODES = frozenset(str(v) for v in SELECTOR_VIOLATIONS)


# ------------------------------------------------------------------------------ verdict
@dataclasses.dataclass(frozen=True)
class Verdict:
    """How a trajectory was judged. `em` / `f1`: max over the answers scored. `source`: which
    candidate made it correct ("router", "summarizer", "worker:<i>" = index in `traj.calls`).
    `detail`: the scorer's detail, or the exception that made it a sandbox error."""

    correct: bool
    router_answer_correct: bool
    summarizer_answer_correct: bool
    em: float
    f1: float
    failure_kind: str
    detail: str = ""
    source: str | None = None

    @property
    def infra(self) -> bool:
        return self.failure_kind in INFRA_KINDS


@dataclasses.dataclass(frozen=True)
class _Graded:
    """What grading found, before classification."""

    correct: bool = False
    router: bool = False
    summarizer: bool = False
    em: float = 0.0
    f1: float = 0.0
    detail: str = ""
    source: str | None = None
    sandbox_error: bool = False


def has_marker(traj: Trajectory, markers: Sequence[str]) -> bool:
    """True if `traj.finish` or a notice is one of `markers` (or `marker:...`)."""
    texts = [traj.finish or "", *traj.notices]
    return any(t == m or t.startswith(m + ":") for t in texts for m in markers)


def grammar_errors(traj: Trajectory) -> tuple[str, ...]:
    """The policy-violation codes of a trajectory, each once: its terminal `violation`, the
    violations the env recorded as the episode went (`Trajectory.violations`: with recovery
    on, the ones it recovered from), and notices that are violation codes."""
    codes = [traj.violation] if traj.violation is not None else []
    codes += [*traj.violations, *(n for n in traj.notices if n in _VIOLATION_CODES)]
    return tuple(dict.fromkeys(codes))


def all_calls_failed(traj: Trajectory) -> bool:
    """True if the trajectory made worker calls and every one of them failed."""
    return bool(traj.calls) and not any(c.success for c in traj.calls)


def mentions_timeout(traj: Trajectory) -> bool:
    """True if any failed call's error text mentions a timeout ("timeout", "timed out")."""
    return any(_TIMEOUT.search(c.error or "") for c in traj.calls if not c.success)


def classify(traj: Trajectory, graded_correct: bool, sandbox_error: bool) -> str:
    """The failure kind (first match wins); see the module doc."""
    if has_marker(traj, WRAPPER_MARKERS):
        return WRAPPER_ERROR
    if traj.violation is not None and traj.violation in _SELECTOR_CODES:
        return PARSER_ERROR
    if all_calls_failed(traj):
        return EXECUTION_TIMEOUT if mentions_timeout(traj) else PROVIDER_ERROR
    if sandbox_error or has_marker(traj, IN_LOOP_SANDBOX_MARKERS):
        return SANDBOX_ERROR
    if graded_correct:
        return CORRECT
    if grammar_errors(traj) and traj.answer is None:
        return PARSER_ERROR
    return GENUINE_INCORRECT


def summarizer_reply(traj: Trajectory) -> str | None:
    """The last successful summarizer call's reply (first 24000 chars), or None."""
    for call in reversed(traj.calls):
        if call.role == SUMMARIZER_ROLE and call.success:
            return call.text[:SUMMARIZER_OUTPUT_CHARS]
    return None


def last_fenced_block(text: str) -> str | None:
    """The last complete ``` fenced block of `text`, fences included, or None."""
    blocks = _FENCED_BLOCK.findall(text)
    return blocks[-1] if blocks else None


def code_candidates(text: str | None) -> list[str]:
    """Programs to try from one text (docs/algorithm.md, "The verdict"): the last `<answer>`
    body, then the last fenced block (unless the body already holds it); the text itself when
    it has neither."""
    if not text or not text.strip():
        return []
    found: list[str] = []
    bodies = _ANSWER.findall(text)
    body = bodies[-1].strip() if bodies else ""
    if body:
        found.append(body)
    block = last_fenced_block(text)
    if block is not None and block not in body:
        found.append(block)
    return found or [text]


def candidate_programs(traj: Trajectory, code_scorer: CodeScorerMode = "union"
                       ) -> list[tuple[str, str]]:
    """(source, program) pairs in the original's order, each program once: the router's final turn
    (its last `<answer>` body, then its last fenced block; the bare answer when the turn text
    is not kept), then the summarizer reply, then (union) every successful worker reply that
    contains a fence."""
    router = traj.final_turn if traj.final_turn is not None else traj.answer
    sources: list[tuple[str, str | None]] = [("router", router),
                                             ("summarizer", summarizer_reply(traj))]
    if code_scorer == "union":
        sources += [(f"worker:{i}", c.text) for i, c in enumerate(traj.calls)
                    if c.success and _FENCE in c.text]
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for source, text in sources:
        for program in code_candidates(text):
            if program not in seen:
                seen.add(program)
                out.append((source, program))
    return out


def _call_scorer(scorer: Scorer, traj: Trajectory, text: str
                 ) -> tuple[ScoreResult | None, str]:
    """(result, "") or (None, error description) when the scorer raised.

    Every exception is a sandbox error (infra, never "wrong"), an unknown scorer's KeyError
    included, except ImportError and IsolationUnavailable: a broken install or a host without
    the sandbox's isolation would otherwise silently drop every code row as infra."""
    record = traj.record
    try:
        return scorer(record.scorer_dataset, text, list(record.gold), record.meta), ""
    except (ImportError, IsolationUnavailable):
        raise
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def grade_code(traj: Trajectory, scorer: Scorer, code_scorer: CodeScorerMode) -> _Graded:
    """Try the candidate programs in order; the first pass wins, the first exception stops."""
    em = f1 = 0.0
    detail = ""
    for source, program in candidate_programs(traj, code_scorer):
        result, error = _call_scorer(scorer, traj, program)
        if result is None:
            return _Graded(em=em, f1=f1, detail=error, sandbox_error=True)
        em, f1, detail = max(em, result.em), max(f1, result.f1), result.detail
        if result.correct:
            return _Graded(True, source == "router", source == "summarizer", em, f1,
                           result.detail, source)
    return _Graded(em=em, f1=f1, detail=detail)


def grade_answers(traj: Trajectory, scorer: Scorer) -> _Graded:
    """Score the router answer and the summarizer answer (each when non-empty); correct if
    either is; the first exception stops."""
    flags = {"router": False, "summarizer": False}
    em = f1 = 0.0
    details: list[str] = []
    for source, answer in (("router", traj.answer), ("summarizer", traj.summarizer_answer)):
        if answer is None or not answer.strip():
            continue
        result, error = _call_scorer(scorer, traj, answer)
        if result is None:
            return _Graded(em=em, f1=f1, detail=error, sandbox_error=True)
        flags[source] = bool(result.correct)
        em, f1 = max(em, result.em), max(f1, result.f1)
        if result.detail:
            details.append(f"{source}: {result.detail}")
    winner = "router" if flags["router"] else "summarizer" if flags["summarizer"] else None
    return _Graded(winner is not None, flags["router"], flags["summarizer"], em, f1,
                   "; ".join(details), winner)


def judge(traj: Trajectory, *, code_scorer: CodeScorerMode = "union",
          scorer: Scorer = score) -> Verdict:
    """Grade a trajectory and classify its failure (docs/algorithm.md, "The verdict" and
    "Failure kinds"). `scorer(name, prediction, gold, meta) -> ScoreResult` is injectable
    (tests); `code_scorer`: "union" (paper) or "final" (router and summarizer only)."""
    if code_scorer not in ("union", "final"):
        raise ValueError(f"code_scorer={code_scorer!r}: expected 'union' or 'final'")
    if traj.record.scorer_dataset in CODE_SCORER_DATASETS:
        graded = grade_code(traj, scorer, code_scorer)
    else:
        graded = grade_answers(traj, scorer)
    kind = classify(traj, graded.correct, graded.sandbox_error)
    return Verdict(graded.correct, graded.router, graded.summarizer, graded.em, graded.f1,
                   kind, graded.detail, graded.source)


# ------------------------------------------------------------------------------ rewards
@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """`alpha`: cost trade-off, used by the advantage code (0: task reward only); `c_ref`: USD
    at which S_cost = 0.5 (paper: `C_REF_USD`, recalibrate with `routeweaver calibrate-cost`);
    `recovery`: reward of the recovery branch; `code_scorer`: "union" or "final"."""

    # Weight α of the efficiency reward against the task reward, in [0, 1]; mixed in the
    # advantage code (0: task reward only, no cost evaluation).
    alpha: float = 0.0
    # Reference cost C_ref in USD per episode at which S_cost = 0.5; finite and > 0.
    c_ref: float = C_REF_USD
    # Score with the recovery branch of the task reward (module doc) instead of the paper's
    # no-recovery one.
    recovery: bool = False
    # Programs a code row tries: "union" (router, summarizer, then every worker reply with a
    # fence; the paper) or "final" (router and summarizer only).
    code_scorer: CodeScorerMode = "union"

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) \
                or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"RewardConfig.alpha={self.alpha!r} must be in [0, 1]")
        if isinstance(self.c_ref, bool) or not isinstance(self.c_ref, int | float) \
                or not math.isfinite(self.c_ref) or self.c_ref <= 0:
            raise ValueError(f"RewardConfig.c_ref={self.c_ref!r} must be a finite positive "
                             "number of USD")
        if self.code_scorer not in ("union", "final"):
            raise ValueError(f"RewardConfig.code_scorer={self.code_scorer!r}: expected "
                             "'union' or 'final'")


@dataclasses.dataclass(frozen=True)
class Rewards:
    """Both reward components of one trajectory, plus what the trainer and logs need.

    `infra`: system failure (reward 0, dropped from the gradient). `clean`: not infra and no
    failed worker call (the dispatch gate; docs/algorithm.md, "Clean rows"). `s_cost`: S_cost
    when the cost is complete, else −1. `cost_usd`: worker cost (0 if the trajectory was never
    costed: `cost_reasons` then says "not_costed").
    """

    r_task: float
    r_eff: float
    infra: bool
    s_cost: float
    cost_usd: float
    cost_complete: bool
    failure_kind: str
    correct: bool = False
    router_answer_correct: bool = False
    summarizer_answer_correct: bool = False
    em: float = 0.0
    f1: float = 0.0
    violation: str | None = None
    clean: bool = True
    failed_calls: int = 0
    cost_reasons: tuple[str, ...] = ()

    def as_row(self) -> dict[str, Any]:
        """A JSON-able dump row; `cost_usd`, `infra_failed`, `cost_complete` are the fields
        `routeweaver calibrate-cost` reads."""
        return {"r_task": self.r_task, "r_eff": self.r_eff, "infra_failed": int(self.infra),
                "cost_usd": self.cost_usd, "cost_complete": int(self.cost_complete),
                "s_cost": self.s_cost, "failure_kind": self.failure_kind,
                "correct": int(self.correct),
                "router_answer_correct": int(self.router_answer_correct),
                "summarizer_answer_correct": int(self.summarizer_answer_correct),
                "em": self.em, "f1": self.f1, "policy_invalid": self.violation or "",
                "clean": int(self.clean), "failed_worker_calls": self.failed_calls,
                "cost_reasons": list(self.cost_reasons)}


def task_reward(traj: Trajectory, verdict: Verdict, recovery: bool = False) -> float:
    """r_task ∈ {−1, 0, 1}; see the module doc for both branches."""
    if verdict.infra:
        return 0.0
    if recovery:
        if verdict.correct:
            return 1.0
        return -1.0 if grammar_errors(traj) and traj.answer is None else 0.0
    if traj.violation is not None:
        return -1.0
    return 1.0 if verdict.correct else 0.0


def efficiency_reward(r_task: float, verdict: Verdict, cost_complete: bool,
                      s_cost: float) -> float:
    """r_eff ∈ {−1, 0} ∪ (0, 1]: 0 infra, −1 if r_task = −1, S_cost if correct with a
    complete cost, else 0."""
    if verdict.infra:
        return 0.0
    if r_task == -1.0:
        return -1.0
    return s_cost if verdict.correct and cost_complete else 0.0


def reward(traj: Trajectory, verdict: Verdict, config: RewardConfig | None = None) -> Rewards:
    """Both components of one judged trajectory."""
    config = config or RewardConfig()
    if traj.cost is None:
        cost_usd, complete, reasons = 0.0, False, ("not_costed",)
    else:
        cost_usd, complete, reasons = traj.cost.cost_usd, traj.cost.complete, traj.cost.reasons
    s_cost = cost_score(cost_usd, config.c_ref) if complete else S_COST_UNAVAILABLE
    r_task = task_reward(traj, verdict, config.recovery)
    failed = sum(not c.success for c in traj.calls)
    return Rewards(
        r_task=r_task, r_eff=efficiency_reward(r_task, verdict, complete, s_cost),
        infra=verdict.infra, s_cost=s_cost, cost_usd=cost_usd, cost_complete=complete,
        failure_kind=verdict.failure_kind, correct=verdict.correct,
        router_answer_correct=verdict.router_answer_correct,
        summarizer_answer_correct=verdict.summarizer_answer_correct, em=verdict.em,
        f1=verdict.f1, violation=traj.violation,
        clean=not verdict.infra and not traj.infra_failed and failed == 0,
        failed_calls=failed, cost_reasons=tuple(reasons))


def score_batch(trajs: Sequence[Trajectory], config: RewardConfig | None = None, *,
                scorer: Scorer = score, workers: int = 1) -> list[Rewards]:
    """`reward(traj, judge(traj))` for each trajectory, in order. `workers` > 1 judges
    trajectories concurrently in threads (code scorers run programs in child processes).
    Identical scorer calls within the batch run once (`memoized`): a group's rollouts often
    end on the same answer, and a code answer costs a sandbox run per test."""
    config = config or RewardConfig()
    if workers < 1:
        raise ValueError(f"score_batch: workers={workers} must be >= 1")
    scorer = memoized(scorer)

    def one(traj: Trajectory) -> Rewards:
        return reward(traj, judge(traj, code_scorer=config.code_scorer, scorer=scorer), config)

    if workers == 1 or len(trajs) < 2:
        return [one(t) for t in trajs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, trajs))


def memoized(scorer: Scorer) -> Scorer:
    """`scorer` with its results kept by (name, prediction, gold, meta): a scorer is a function
    of those. A call that raises is not kept (the next identical call runs again). Two threads
    may score the same key at once; both get a result."""
    results: dict[tuple[str, str, tuple[str, ...], str], ScoreResult] = {}

    def cached(name: str, prediction: str, gold: Sequence[str],
               meta: Mapping[str, Any] | None = None) -> ScoreResult:
        key = (name, prediction, tuple(gold), json.dumps(meta, sort_keys=True, default=repr))
        if key not in results:
            results[key] = scorer(name, prediction, gold, meta)
        return results[key]

    return cached
