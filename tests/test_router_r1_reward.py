"""Router-R1 reward (docs/router_r1.md): format gate, EM/F1, the sqrt/p5-p95 cost window
on hand-computed numbers, eviction at 1000, save/restore, hierarchical gating and alpha."""

import json
import math
import random

import pytest

from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.router_r1_reward import (
    CostWindow,
    RouterR1RewardConfig,
    combine,
    exact_match,
    f1_score,
    normalize_answer,
    router_r1_raw_cost,
    router_r1_reward,
    score_router_r1_batch,
    trajectory_reward,
    worker_prices,
)
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.pools.pricing import PricingError
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall

ROUTED = ("<think>I need help.</think>\n<search>Qwen2.5-7B-Instruct: who wrote Hamlet?</search>"
          "\n\n<information>Shakespeare wrote it.</information>\n\n<think>ok</think>\n"
          "<answer>William Shakespeare</answer>")
DIRECT = "<think>I know this.</think>\n<answer>William Shakespeare</answer>"


# ------------------------------------------------------------------------- format gate
@pytest.mark.parametrize("response, ok", [
    (DIRECT, True),
    (ROUTED, True),
    ("<answer>William Shakespeare</answer>", False),  # no think
    ("<think>...</think>\n<answer>William Shakespeare</answer>", False),  # empty think
    ("<think>a</think>\n<search>LLM-Name:Your-Query</search>\n<information>x</information>"
     "<answer>William Shakespeare</answer>", False),  # placeholder
    ("<think>a</think>\n<search>GPT-4o: who wrote Hamlet?</search>\n<information>None"
     "</information><answer>William Shakespeare</answer>", False),  # unknown model
    ("<think>a</think>\n<search>Qwen2.5-7B-Instruct: a: b</search>\n<information>x"
     "</information><answer>William Shakespeare</answer>", False),  # two colons
    ("<think>a</think><answer>x</answer><answer>William Shakespeare</answer>", False),
    ("<think>a</think>\n<search>Qwen2.5-7B-Instruct: who wrote Hamlet?</search>\n"
     "<answer>William Shakespeare</answer>", False),  # search without information
])
def test_format_gate(response, ok):
    window = CostWindow()
    r = router_r1_reward(response, ["William Shakespeare"], 0.0, window,
                         RouterR1RewardConfig(alpha=0.0))
    assert (r.format_score == 0.0) is ok and (not r.violations) is ok
    # The answer is right in every case: the format alone decides between +1 and -1.
    assert r.em == 1.0
    assert r.reward == (1.0 if ok else -1.0)
    assert len(window) == 1  # the window sees every trajectory, gated or not


def test_no_answer_gets_the_format_score():
    r = router_r1_reward("<think>hmm</think>", ["x"], 0.0, CostWindow())
    assert r.answer is None and r.em == r.f1 == 0.0 and r.reward == -1.0
    assert "answer_count" in r.violations
    # combine() with a zero format score and no answer: F·(1−α) = 0.
    assert combine(0.0, False, False, 0.0, 1.0, 0.6) == 0.0


def test_golden_combination_alpha_06_cost_07():
    # Golden fixture from Router-R1's reward: α = 0.6, C = 0.7 -> correct 0.82, wrong 0, bad
    # format -1.
    assert combine(0.0, True, True, 1.0, 0.7, 0.6) == pytest.approx(0.4 + 0.42)
    assert combine(0.0, True, False, 0.0, 0.7, 0.6) == 0.0
    assert combine(-1.0, True, True, 1.0, 0.7, 0.6) == -1.0


def test_alpha_mixes_cost_only_for_correct_answers():
    cfg = RouterR1RewardConfig(alpha=0.6)
    window = CostWindow()
    first = router_r1_reward(DIRECT, ["William Shakespeare"], 100.0, window, cfg)
    assert first.cost_score == 0.5 and first.reward == pytest.approx(0.4 + 0.6 * 0.5)
    # Second sample: window x = [10, 0]; lo = 0.5, hi = 9.5; x = 0 -> C = 1.
    second = router_r1_reward(ROUTED, ["William Shakespeare"], 0.0, window, cfg)
    assert second.cost_score == 1.0 and second.reward == pytest.approx(1.0)
    wrong = router_r1_reward(DIRECT, ["Marlowe"], 0.0, window, cfg)
    assert wrong.cost_score == 1.0 and not wrong.correct and wrong.reward == 0.0
    assert (first.routes, second.routes) == (0, 1)
    assert (first.raw_cost, second.raw_cost) == (100.0, 0.0)


def test_f1_metric_reward():
    cfg = RouterR1RewardConfig(alpha=0.5, metric="f1")
    response = "<think>t</think>\n<answer>eiffel tower paris</answer>"
    r = router_r1_reward(response, ["The Eiffel Tower"], 4.0, CostWindow(), cfg)
    # F1 = 2·(2/3)·1 / (2/3 + 1) = 0.8; C = 0.5 (one sample); EM = 0 but F1 > 0 is correct.
    assert r.em == 0.0 and r.f1 == pytest.approx(0.8) and r.correct
    assert r.reward == pytest.approx(0.5 * 0.8 + 0.5 * 0.5)
    em_cfg = RouterR1RewardConfig(alpha=0.5, metric="em")
    assert router_r1_reward(response, ["The Eiffel Tower"], 4.0, CostWindow(),
                            em_cfg).reward == 0.0


# ---------------------------------------------------------------------------- EM / F1
def test_normalisation_and_exact_match():
    assert normalize_answer("  The Eiffel   Tower. ") == "eiffel tower"
    assert normalize_answer("An apple, a day!") == "apple day"
    assert normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert exact_match("the eiffel tower!", "Eiffel Tower") == 1.0  # bare string gold
    assert exact_match("Paris", ["London", "paris."]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0


@pytest.mark.parametrize("pred, gold, expected", [
    ("eiffel tower paris", ["the eiffel tower"], 0.8),
    ("yes", ["yes it is"], 0.0),  # yes/no/noanswer rule, on either side
    ("yes it is", ["yes"], 0.0),
    ("no answer", ["noanswer"], 0.0),
    ("yes", ["Yes."], 1.0),
    ("w b c d", ["x y", "b c d e"], 0.75),  # max over golds: p = r = 3/4
    ("London", ["Paris"], 0.0),
    ("", ["Paris"], 0.0),
])
def test_f1(pred, gold, expected):
    assert f1_score(pred, gold) == pytest.approx(expected)


# ----------------------------------------------------------------------------- window
def test_golden_cost_sequence():
    # Golden sequence for Router-R1's cost window: raw 0, 100, 0, 25, 88, 0 on a fresh window.
    window = CostWindow()
    got = [window.update(c) for c in (0, 100, 0, 25, 88, 0)]
    # 4th: sorted x = [0, 0, 5, 10]; lo = 0, hi = 5 + 5·0.85 = 9.25 -> 1 − 5/9.25.
    # 5th: sorted x = [0, 0, 5, √88, 10]; hi = √88 + (10 − √88)·0.8 -> 1 − √88/hi.
    hi5 = math.sqrt(88) + (10 - math.sqrt(88)) * 0.8
    expected = [0.5, 0.0, 1.0, 1 - 5 / 9.25, 1 - math.sqrt(88) / hi5, 1.0]
    assert got == pytest.approx(expected, abs=1e-12)
    assert [round(g, 4) for g in got] == [0.5, 0.0, 1.0, 0.4595, 0.0502, 1.0]


def test_window_degenerate_and_validation():
    window = CostWindow()
    assert [window.update(9.0) for _ in range(3)] == [0.5, 0.5, 0.5]  # hi − lo < 1e-8
    for bad in (-1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError):
            window.update(bad)
    assert len(window) == 3
    with pytest.raises(ValueError):
        CostWindow(0)


def test_window_evicts_after_1000():
    window = CostWindow()
    window.update(0.0)  # x = 0, evicted by the 1001st push
    scores = [window.update(float(k * k)) for k in range(1, 1001)]  # x = 1 .. 1000
    assert len(window) == 1000 and window.values[0] == 1.0 and window.values[-1] == 1000.0
    # Window 1..1000: P5 at pos 49.95 -> 50.95, P95 at pos 949.05 -> 950.05.
    assert window.bounds() == pytest.approx((50.95, 950.05))
    assert scores[-1] == 0.0
    # The 1000th push (x = 999, window 0..999 of 1000 values): P5 = 49.95, P95 = 949.05.
    assert scores[-2] == 0.0
    # Next push x = 500: window 2..1000, 500; P5 at pos 49.95 of sorted [2..1000 with 500].
    s = window.update(500.0 ** 2)
    ordered = sorted([*range(2, 1001), 500])
    lo = ordered[49] + (ordered[50] - ordered[49]) * 0.95
    hi = ordered[949] + (ordered[950] - ordered[949]) * 0.05
    assert s == pytest.approx(1 - (500 - lo) / (hi - lo))
    assert len(window) == 1000


def test_window_state_round_trip_continues_identically():
    rng = random.Random(0)
    costs = [rng.choice([0.0, rng.uniform(0, 500)]) for _ in range(1100)]
    a = CostWindow()
    for c in costs[:1050]:
        a.update(c)
    state = json.loads(json.dumps(a.state_dict()))
    b = CostWindow.from_state_dict(state)
    assert b.values == a.values and b.size == 1000
    assert [a.update(c) for c in costs[1050:]] == [b.update(c) for c in costs[1050:]]
    assert a.values == b.values


def test_window_rejects_bad_state():
    window = CostWindow(2)
    for bad in ({}, {"size": 2}, {"size": 0, "values": []}, {"size": 1, "values": [1.0, 2.0]},
                {"size": 2, "values": [-1.0]}, {"size": 2, "values": ["x"]}):
        with pytest.raises(ValueError):
            window.load_state_dict(bad)
    window.load_state_dict({"size": 3, "values": [1, 2]})
    assert window.size == 3 and window.values == (1.0, 2.0)


# ---------------------------------------------------------------------------- raw cost
def call(worker, completion, success=True):
    return WorkerCall(worker, "p", "reply" if success else "", success,
                      usage=Usage(1000, completion))


def test_raw_cost_in_micro_dollars():
    prices = worker_prices({"LLaMA-3.1-70B-Instruct": "worker_3",
                            "Qwen2.5-7B-Instruct": "worker_1"})
    assert prices == {"worker_3": 0.88, "worker_1": 0.30}
    calls = [call("worker_3", 100), call("worker_1", 10), call("worker_3", 999, success=False)]
    assert router_r1_raw_cost(calls, prices) == pytest.approx(100 * 0.88 + 10 * 0.30)
    with pytest.raises(PricingError):
        router_r1_raw_cost([call("worker_9", 1)], prices)
    with pytest.raises(PricingError):
        worker_prices({"Granite-3.0-8B-Instruct": "worker_2"})  # no price in the reference
    # a successful call without (plausible) usage: the cost is unknown, never a crash
    assert router_r1_raw_cost([WorkerCall("worker_1", "p", "r", True), call("worker_1", 5)],
                              prices) is None


def test_unknown_cost_leaves_the_window_alone_and_makes_the_row_infra():
    from jax_routeweaver.rl.run.router_r1_run import as_rewards

    window = CostWindow()
    window.update(100.0)
    record = Record("q1", "RECALL", "nq", "triviaqa", "Who wrote Hamlet?",
                    ("William Shakespeare",))
    traj = Trajectory(record, 0, [1], response_ids=[7],
                      calls=[WorkerCall("worker_1", "p", "r", True)])  # usage unknown
    r = trajectory_reward(traj, lambda ids: ROUTED, {"worker_1": 0.30}, window,
                          RouterR1RewardConfig(alpha=0.5))
    assert r.raw_cost is None and r.cost_score == 0.0 and len(window.state_dict()["values"]) == 1
    row = as_rewards(traj, r)
    assert row.infra and not row.clean and not row.cost_complete and row.r_task == 0.0


def test_batch_and_trajectory_helpers():
    cfg = RouterR1RewardConfig(alpha=0.5)
    window = CostWindow()
    out = score_router_r1_batch([DIRECT, ROUTED], [["William Shakespeare"]] * 2, [0.0, 100.0],
                                window, cfg)
    assert [r.cost_score for r in out] == [0.5, 0.0]
    assert [r.reward for r in out] == pytest.approx([0.75, 0.5])
    with pytest.raises(ValueError):
        score_router_r1_batch([DIRECT], [], [0.0], window, cfg)

    record = Record("q1", "RECALL", "nq", "triviaqa", "Who wrote Hamlet?",
                    ("William Shakespeare",))
    traj = Trajectory(record, 0, [1], response_ids=[7, 8, 9],
                      calls=[call("worker_1", 100)])
    seen = []

    def decode(ids):
        seen.append(list(ids))
        return ROUTED

    r = trajectory_reward(traj, decode, {"worker_1": 0.30}, CostWindow(), cfg)
    assert seen == [[7, 8, 9]] and r.raw_cost == pytest.approx(30.0) and r.em == 1.0
    assert r.reward == pytest.approx(0.5 + 0.5 * 0.5)
