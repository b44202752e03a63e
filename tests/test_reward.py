"""RouteWeaver reward composition (docs/algorithm.md, "Rewards"): failure classification,
task and efficiency rewards, the recovery branch, code candidates in reference order. Every
trajectory is built by hand and graded by a fake scorer that records what it was asked."""

import dataclasses

import pytest

from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.reward import (
    FAILURE_KINDS,
    INFRA_KINDS,
    RewardConfig,
    candidate_programs,
    code_candidates,
    judge,
    reward,
    score_batch,
)
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.pools.pricing import C_REF_USD, CostSummary
from jax_routeweaver.routing.protocol.calls import WorkerCall


@dataclasses.dataclass(frozen=True)
class FakeResult:
    correct: bool
    em: float = 0.0
    f1: float = 0.0
    detail: str = ""


class FakeScorer:
    """Correct iff the prediction is in `right`; raises for predictions in `boom` and for
    unknown scorer names (as the registry does); records every (name, prediction)."""

    def __init__(self, right=("Paris",), boom=(), names=("triviaqa", "stdin")):
        self.right, self.boom, self.names = set(right), set(boom), set(names)
        self.asked: list[tuple[str, str]] = []
        self.seen_gold_meta: list[tuple[list, dict]] = []

    def __call__(self, name, prediction, gold, meta=None):
        self.asked.append((name, prediction))
        self.seen_gold_meta.append((gold, meta))
        if name not in self.names:
            raise KeyError(name)
        if prediction in self.boom:
            raise RuntimeError("sandbox died")
        ok = prediction in self.right
        return FakeResult(ok, em=float(ok), f1=1.0 if ok else 0.25, detail=f"graded {prediction}")

    @property
    def predictions(self) -> list[str]:
        return [p for _, p in self.asked]


QA = Record("q1", "RECALL", "triviaqa", "triviaqa", "Capital of France?", ("Paris", "paris"),
            meta={"k": 1})
CODE = Record("c1", "CODE", "apps", "stdin", "Print 3.", (),
              meta={"tests": [{"input": "", "output": "3"}]})
COMPLETE = CostSummary(C_REF_USD, True)  # S_cost = 0.5


def ok(worker="worker_1", text="some reply", role=None):
    return WorkerCall(worker, "payload", text, True, role=role)


def failed(error="HTTP 402 payment required", worker="worker_2"):
    return WorkerCall(worker, "payload", "", False, error=error)


def traj(record=QA, *, calls=(), violation=None, notices=(), answer=None, summarizer=None,
         finish="answer", cost=COMPLETE):
    return Trajectory(record, 0, [1, 2], calls=list(calls), violation=violation,
                      notices=list(notices), answer=answer, summarizer_answer=summarizer,
                      finish=finish, cost=cost, infra_failed=any(not c.success for c in calls))


# -------------------------------------------------------------- classification table
# (id, trajectory, scorer, failure_kind, r_task, r_eff)
CASES = [
    ("wrapper_finish", traj(answer="Paris", finish="loop_error:KeyError"), FakeScorer(),
     "wrapper_error", 0.0, 0.0),
    ("wrapper_notice", traj(answer="Paris", notices=["wrapper_error:banned phrase"]),
     FakeScorer(), "wrapper_error", 0.0, 0.0),
    ("wrapper_beats_selector", traj(violation="selector_mode_missing", finish="loop_error"),
     FakeScorer(), "wrapper_error", 0.0, 0.0),
    # RouteWeaverEnv's payload-hygiene finish (docs/protocol.md, "What a worker receives"), even
    # on a correct answer.
    ("wrapper_payload_finish", traj(answer="Paris", calls=[ok()], finish="wrapper_error"),
     FakeScorer(), "wrapper_error", 0.0, 0.0),
    ("selector_invalid", traj(violation="selector_mode_missing", finish="violation"),
     FakeScorer(), "parser_error", -1.0, -1.0),
    ("selector_beats_failed_calls", traj(violation="answer_in_selector", calls=[failed()]),
     FakeScorer(), "parser_error", -1.0, -1.0),
    ("all_failed_timeout", traj(answer="Paris", calls=[failed("ReadTimeout after 180 s"),
                                                       failed()]),
     FakeScorer(), "execution_timeout", 0.0, 0.0),
    ("all_failed_timed_out", traj(calls=[failed("request timed out")], finish="turn_limit"),
     FakeScorer(), "execution_timeout", 0.0, 0.0),
    ("all_failed_provider", traj(answer="Paris", calls=[failed(), failed("HTTP 503")]),
     FakeScorer(), "provider_error", 0.0, 0.0),
    ("all_failed_beats_sandbox", traj(answer="Paris", calls=[failed()]),
     FakeScorer(boom={"Paris"}), "provider_error", 0.0, 0.0),
    ("sandbox_scorer_raises", traj(answer="Paris", calls=[ok()]), FakeScorer(boom={"Paris"}),
     "sandbox_error", 0.0, 0.0),
    ("sandbox_unknown_scorer", traj(record=QA.replace(scorer_dataset="nope"), answer="Paris"),
     FakeScorer(), "sandbox_error", 0.0, 0.0),
    ("sandbox_in_loop", traj(answer="Paris", notices=["exec_sandbox_error:OSError"]),
     FakeScorer(), "sandbox_error", 0.0, 0.0),
    ("sandbox_beats_violation", traj(answer=None, summarizer="Paris",
                                     violation="already_finished"),
     FakeScorer(boom={"Paris"}), "sandbox_error", 0.0, 0.0),
    ("correct_router", traj(answer="Paris", calls=[ok()]), FakeScorer(), "correct", 1.0, 0.5),
    ("correct_summarizer", traj(answer="London", summarizer="Paris"), FakeScorer(),
     "correct", 1.0, 0.5),
    ("violation_even_if_correct", traj(summarizer="Paris", violation="already_finished",
                                       finish="violation"),
     FakeScorer(), "correct", -1.0, -1.0),
    ("grammar_error_no_answer", traj(violation="answer_premature", finish="violation"),
     FakeScorer(), "parser_error", -1.0, -1.0),
    ("grammar_error_wrong_summarizer", traj(summarizer="Lyon", violation="must_summarize_now"),
     FakeScorer(), "parser_error", -1.0, -1.0),
    ("recovered_grammar_error_no_answer", traj(notices=["route_missing"], finish="turn_limit"),
     FakeScorer(), "parser_error", 0.0, 0.0),  # not terminal: no −1 without recovery
    ("genuine_incorrect", traj(answer="London"), FakeScorer(), "genuine_incorrect", 0.0, 0.0),
    ("turn_limit_no_answer", traj(finish="turn_limit", calls=[ok()]), FakeScorer(),
     "genuine_incorrect", 0.0, 0.0),
    ("some_calls_failed_correct", traj(answer="Paris", calls=[ok(), failed()]), FakeScorer(),
     "correct", 1.0, 0.5),
]


@pytest.mark.parametrize("t, scorer, kind, r_task, r_eff",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classification_and_rewards(t, scorer, kind, r_task, r_eff):
    verdict = judge(t, scorer=scorer)
    assert verdict.failure_kind == kind
    r = reward(t, verdict, RewardConfig())
    assert (r.r_task, r.r_eff, r.failure_kind) == (r_task, r_eff, kind)
    assert r.infra is (kind in INFRA_KINDS) is verdict.infra
    assert r.clean is (not r.infra and all(c.success for c in t.calls))
    assert r.violation == t.violation


def test_every_failure_kind_is_covered():
    kinds = {c[3] for c in CASES}
    assert kinds == set(FAILURE_KINDS)
    assert sorted(INFRA_KINDS) == ["execution_timeout", "provider_error", "sandbox_error",
                                   "wrapper_error"]


def test_verdict_fields_for_answers():
    scorer = FakeScorer()
    v = judge(traj(answer="London", summarizer="Paris"), scorer=scorer)
    assert v.correct and not v.router_answer_correct and v.summarizer_answer_correct
    assert (v.em, v.f1, v.source) == (1.0, 1.0, "summarizer")
    assert scorer.asked == [("triviaqa", "London"), ("triviaqa", "Paris")]
    assert scorer.seen_gold_meta[0] == (["Paris", "paris"], {"k": 1})
    assert "summarizer: graded Paris" in v.detail
    # Empty answers are not scored.
    scorer = FakeScorer()
    v = judge(traj(answer="  ", summarizer=None), scorer=scorer)
    assert scorer.asked == [] and not v.correct and (v.em, v.f1) == (0.0, 0.0)
    # A scorer exception stops grading and names the exception.
    scorer = FakeScorer(boom={"London"})
    v = judge(traj(answer="London", summarizer="Paris"), scorer=scorer)
    assert v.failure_kind == "sandbox_error" and "RuntimeError: sandbox died" in v.detail
    assert scorer.predictions == ["London"]


def test_import_error_is_not_a_sandbox_error():
    def broken(name, prediction, gold, meta=None):
        raise ModuleNotFoundError("No module named 'scorer_backend'")

    with pytest.raises(ImportError):
        judge(traj(answer="Paris"), scorer=broken)


# ------------------------------------------------------------------ efficiency reward
@pytest.mark.parametrize("cost, answer, config, s_cost, r_eff, complete", [
    (CostSummary(0.003, True), "Paris", RewardConfig(c_ref=0.001), 0.25, 0.25, True),
    (CostSummary(0.0, True), "Paris", RewardConfig(), 1.0, 1.0, True),
    (COMPLETE, "Paris", RewardConfig(), 0.5, 0.5, True),
    (CostSummary(0.002, False, ("usage_unknown",)), "Paris", RewardConfig(), -1.0, 0.0, False),
    (None, "Paris", RewardConfig(), -1.0, 0.0, False),
    (CostSummary(0.003, True), "London", RewardConfig(c_ref=0.001), 0.25, 0.0, True),
])
def test_efficiency_reward(cost, answer, config, s_cost, r_eff, complete):
    t = traj(answer=answer, cost=cost)
    r = reward(t, judge(t, scorer=FakeScorer()), config)
    assert r.s_cost == pytest.approx(s_cost) and r.r_eff == pytest.approx(r_eff)
    assert r.cost_complete is complete
    assert r.cost_usd == (0.0 if cost is None else cost.cost_usd)
    assert r.cost_reasons == (("not_costed",) if cost is None else cost.reasons)
    assert r.r_task == (1.0 if answer == "Paris" else 0.0)  # cost never changes the task reward


def test_default_config_uses_the_paper_c_ref():
    assert RewardConfig().c_ref == C_REF_USD == 0.007071665299999997
    assert RewardConfig() == RewardConfig(0.0, C_REF_USD, False, "union")
    for bad in (dict(alpha=1.5), dict(c_ref=0.0), dict(c_ref=float("nan")),
                dict(code_scorer="all")):
        with pytest.raises(ValueError):
            RewardConfig(**bad)
    with pytest.raises(ValueError):
        judge(traj(answer="Paris"), scorer=FakeScorer(), code_scorer="all")


# -------------------------------------------------------------------- recovery branch
@pytest.mark.parametrize("t, r_task", [
    (traj(answer="Paris", notices=["answer_premature"]), 1.0),  # recovered, then correct
    (traj(summarizer="Paris", violation="already_finished"), 1.0),  # correct wins
    (traj(violation="selector_mode_invalid", finish="violation"), -1.0),
    (traj(notices=["route_missing"], finish="turn_limit"), -1.0),  # grammar error, no answer
    (traj(answer="London", notices=["route_missing"]), 0.0),  # answered: not −1
    (traj(finish="turn_limit"), 0.0),  # no grammar error
    (traj(notices=["rules_budget_exhausted"], finish="turn_limit"), 0.0),  # notices only
    (traj(answer="Paris", calls=[failed()]), 0.0),  # infra
])
def test_recovery_branch(t, r_task):
    r = reward(t, judge(t, scorer=FakeScorer()), RewardConfig(recovery=True))
    assert r.r_task == r_task
    assert r.r_eff == (-1.0 if r_task == -1.0 else 0.5 if r_task == 1.0 else 0.0)


@pytest.mark.parametrize("recovery", [False, True])
def test_the_run_rewards_with_its_protocols_recovery_branch(recovery):
    """Training, `eval run` and `eval favourites` take their RewardConfig from
    `rl.run.routeweaver_run.reward_config`: a recovery-mode run scores a violation that
    recovered and answered wrongly 0, not the no-recovery -1."""
    from pathlib import Path

    from jax_routeweaver.rl.run.routeweaver_run import reward_config
    from jax_routeweaver.rl.run.train_config import load_train_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    cfg = load_train_config(quickstart, [f"rollout.protocol.recovery={str(recovery).lower()}",
                                         "reward.c_ref=0.001"])
    config = reward_config(cfg)
    assert (config.recovery, config.c_ref, config.alpha) == (recovery, 0.001, 0.0)
    t = traj(answer="London", violation="answer_premature")
    assert reward(t, judge(t, scorer=FakeScorer()), config).r_task == (0.0 if recovery else -1.0)
    # Recovered from a violation (the env lists it in `violations`, the episode goes on) but
    # never answered: the recovery branch's -1; the no-recovery branch has no terminal code.
    t = traj(answer=None)
    t.violations.append("route_missing")
    assert reward(t, judge(t, scorer=FakeScorer()), config).r_task == (-1.0 if recovery else 0.0)


# -------------------------------------------------------------------- code candidates
FENCE2 = "```python\nprint(2)\n```"
FENCE3 = "```python\nprint(3)\n```"


def code_traj(**kw):
    calls = [ok("worker_1", "Plan: read nothing, print 3.", role="planner"),
             ok("worker_2", f"Here is a program:\n{FENCE2}\nDone.", role="executor"),
             failed(),
             ok("worker_4", f"Final <answer>{FENCE3}</answer>", role="summarizer"),
             ok("worker_5", FENCE2, role="verifier")]
    return traj(CODE, calls=calls, answer=kw.pop("answer", "print(1)"), **kw)


def test_union_candidates_in_reference_order():
    scorer = FakeScorer(right=())
    v = judge(code_traj(), scorer=scorer)
    # router answer, summarizer reply, fenced worker replies (each program once, failed and
    # fence-less replies skipped)
    assert scorer.asked == [("stdin", "print(1)"), ("stdin", FENCE3), ("stdin", FENCE2)]
    assert v.failure_kind == "genuine_incorrect" and not v.correct
    assert [s for s, _ in candidate_programs(code_traj())] == ["router", "summarizer",
                                                                "worker:1"]


def test_final_code_scorer_skips_worker_replies():
    scorer = FakeScorer(right=())
    judge(code_traj(), scorer=scorer, code_scorer="final")
    assert scorer.predictions == ["print(1)", FENCE3]
    scorer = FakeScorer(right=())
    score_batch([code_traj()], RewardConfig(code_scorer="final"), scorer=scorer)
    assert scorer.predictions == ["print(1)", FENCE3]


def test_score_batch_scores_each_distinct_call_once():
    """A group's rollouts that end on the same answer are scored once; the rewards are those
    of scoring each alone; a call that raised is asked again."""
    trajs = [code_traj(), code_traj(), code_traj()]
    alone = [reward(t, judge(t, scorer=FakeScorer(right={FENCE2}))) for t in trajs]
    scorer = FakeScorer(right={FENCE2})
    assert score_batch(trajs, scorer=scorer) == alone
    assert sorted(scorer.predictions) == sorted(["print(1)", FENCE3, FENCE2])
    boom = FakeScorer(right={FENCE2}, boom={FENCE3})
    batch = score_batch(trajs[:2], scorer=boom)
    assert [r.failure_kind for r in batch] == ["sandbox_error"] * 2
    assert boom.predictions == ["print(1)", FENCE3, FENCE3]


@pytest.mark.parametrize("right, source, asked, router_ok, summarizer_ok", [
    ({"print(1)"}, "router", 1, True, False),
    ({FENCE3}, "summarizer", 2, False, True),
    ({FENCE2}, "worker:1", 3, False, False),
])
def test_first_passing_candidate_wins(right, source, asked, router_ok, summarizer_ok):
    scorer = FakeScorer(right=right)
    t = code_traj()
    v = judge(t, scorer=scorer)
    assert v.correct and v.failure_kind == "correct" and v.source == source
    assert (v.router_answer_correct, v.summarizer_answer_correct) == (router_ok, summarizer_ok)
    assert len(scorer.asked) == asked
    assert reward(t, v).r_task == 1.0


def test_code_scorer_exception_is_sandbox_error():
    scorer = FakeScorer(right={FENCE2}, boom={FENCE3})
    t = code_traj()
    v = judge(t, scorer=scorer)
    assert v.failure_kind == "sandbox_error" and v.infra and not v.correct
    assert scorer.predictions == ["print(1)", FENCE3]  # stops at the exception
    r = reward(t, v)
    assert (r.r_task, r.r_eff, r.infra, r.clean) == (0.0, 0.0, True, False)


def test_code_candidates_per_text():
    assert code_candidates(None) == [] and code_candidates("  ") == []
    assert code_candidates("print(1)") == ["print(1)"]  # neither tag nor fence: the text
    assert code_candidates(f"x\n{FENCE2}\ny") == [FENCE2]
    assert code_candidates(f"<ANSWER> {FENCE3} </ANSWER>") == [FENCE3]
    assert code_candidates(f"{FENCE2}\n<answer>print(9)</answer>") == ["print(9)", FENCE2]
    assert code_candidates("<answer>a</answer> then <answer>b</answer>") == ["b"]


def test_summarizer_reply_is_the_full_reply_for_code():
    long_reply = "<answer>print(3)</answer>" + "#" * 30_000
    t = traj(CODE, calls=[ok("worker_4", long_reply, role="summarizer")], answer=None,
             summarizer="stale candidate")
    scorer = FakeScorer(right=())
    judge(t, scorer=scorer, code_scorer="final")
    assert scorer.predictions == ["print(3)"]


# ---------------------------------------------------------------------------- batch
def test_score_batch_in_order_and_rows():
    trajs = [traj(answer="Paris"), traj(answer="London"),
             traj(violation="answer_premature"), traj(answer="Paris", calls=[failed()])] * 3
    scorer = FakeScorer()
    serial = score_batch(trajs, RewardConfig(), scorer=scorer)
    threaded = score_batch(trajs, RewardConfig(), scorer=FakeScorer(), workers=4)
    assert serial == threaded
    assert [r.r_task for r in serial[:4]] == [1.0, 0.0, -1.0, 0.0]
    assert [r.failure_kind for r in serial[:4]] == ["correct", "genuine_incorrect",
                                                    "parser_error", "provider_error"]
    row = serial[3].as_row()
    assert (row["infra_failed"], row["cost_complete"], row["cost_usd"]) == (1, 1, C_REF_USD)
    assert row["failure_kind"] == "provider_error" and row["failed_worker_calls"] == 1
    with pytest.raises(ValueError):
        score_batch(trajs, workers=0, scorer=scorer)


def test_router_final_turn_fence_is_a_code_candidate():
    """A program the router fenced outside its <answer> in the answering turn is graded."""
    from jax_routeweaver.rewards.reward import candidate_programs

    traj = _code_traj_for_final_turn()
    programs = [p for source, p in candidate_programs(traj) if source == "router"]
    assert programs == ["see above", "```python\ndef f(x):\n    return x + 1\n```"]


def _code_traj_for_final_turn():
    import dataclasses

    from jax_routeweaver.data.records import Record
    from jax_routeweaver.routing.episodes.episode import Trajectory

    record = Record(sample_id="c1", domain="CODE", dataset="apps", scorer_dataset="apps_functional",
                    question="Write f.", gold=(), meta={"func_name": "f", "tests": [
                        {"input": [1], "output": 2}]})
    traj = Trajectory(record, 0, [1, 2, 3])
    return dataclasses.replace(traj, answer="see above", final_turn=(
        "```python\ndef f(x):\n    return x + 1\n```\n<answer>see above</answer>"))
