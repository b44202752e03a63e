"""Per-step metrics (rl/reports/metrics.py, docs/metrics.md): exact values on a hand-built
batch (forced and free groups, an invalid mode, a violation, dirty rows, two domains), the
advantage metrics on hand-made advantages and on a real COMET-GRPO output, window means, and
one batch of real episodes (scripted router, simulated workers, real scorers)."""

import math

import numpy as np
import pytest
from scripted import ScriptedSampler

from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.reward import FAILURE_KINDS, Rewards, score_batch
from jax_routeweaver.rl.core import advantages as A
from jax_routeweaver.rl.reports.metrics import (
    advantage_metrics,
    rollout_metrics,
    summarize_steps,
    window_mean,
)
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.protocol.calls import WorkerCall

M1 = Record("m1", "MATH", "gsm8k", "math", "1+1?", ("2",))
M2 = Record("m2", "MATH", "gsm8k", "math", "2+2?", ("4",))
R1 = Record("r1", "RECALL", "nq", "triviaqa", "Capital of France?", ("Paris",))


def call(ok=True):
    return WorkerCall("worker_1", "p", "reply" if ok else "", ok)


def row(record, *, mode, r, r_eff=0.0, correct=False, kind=None, forced=False, calls=(),
        violation=None, turns=3, policy=5, env=5, span=4, finish="answer", cost=0.0,
        infra=False):
    """One (Trajectory, Rewards) pair; `clean` and `failed_calls` follow reward.reward()."""
    failed = sum(not c.success for c in calls)
    traj = Trajectory(record, 0, [1, 2], response_ids=list(range(policy + env)),
                      policy_mask=[1] * policy + [0] * env, mode=mode, mode_span_end=span,
                      forced=forced, calls=list(calls), violation=violation, turns=turns,
                      infra_failed=failed > 0, finish=finish)
    kind = kind or ("correct" if correct else "genuine_incorrect")
    rewards = Rewards(r, r_eff, infra, -1.0, cost, True, kind, correct=correct,
                      violation=violation, clean=not infra and failed == 0, failed_calls=failed)
    return traj, rewards


# Group 0 (MATH, free): three modes, rewards 1 / 0 / −1 (a selector violation).
# Group 1 (RECALL, free): all single; the middle row is dirty (one failed call).
# Group 2 (MATH, forced agentic): the last row is an infra failure (all calls failed).
BATCH = [
    row(M1, mode="single", r=1.0, r_eff=0.5, correct=True, calls=[call()], turns=3,
        policy=6, env=4, span=4, cost=0.01),
    row(M1, mode="multi", r=0.0, calls=[call(), call()], turns=4, policy=7, env=5, span=5,
        cost=0.02),
    row(M1, mode=None, r=-1.0, r_eff=-1.0, kind="parser_error",
        violation="selector_mode_missing", turns=1, policy=3, env=0, span=3,
        finish="violation"),
    row(R1, mode="single", r=1.0, r_eff=0.5, correct=True, calls=[call()], policy=5, env=3,
        cost=0.01),
    row(R1, mode="single", r=0.0, calls=[call(), call(False)], policy=5, env=4, cost=0.03),
    row(R1, mode="single", r=1.0, r_eff=0.5, correct=True, calls=[call()], policy=5, env=3,
        cost=0.01),
    row(M2, mode="agentic", r=1.0, r_eff=0.25, correct=True, forced=True, calls=[call()] * 3,
        turns=5, policy=8, env=12, span=6, cost=0.05),
    row(M2, mode="agentic", r=0.0, forced=True, calls=[call()] * 3, turns=5, policy=8, env=12,
        span=6, cost=0.04),
    row(M2, mode="agentic", r=0.0, kind="provider_error", forced=True,
        calls=[call(False)] * 2, turns=5, policy=4, env=6, span=6, infra=True),
]


@pytest.fixture(scope="module")
def batch_metrics():
    trajs, rewards = zip(*BATCH, strict=True)
    return rollout_metrics(list(trajs), list(rewards), group_size=3)


def test_rewards_and_accuracy(batch_metrics):
    m = batch_metrics
    assert m["reward/mean"] == pytest.approx(3 / 9)
    assert m["reward/mean_clean"] == pytest.approx(3 / 7)  # rows 4 and 8 are dirty
    assert m["reward/eff_mean"] == pytest.approx(0.75 / 9)
    assert {k: m[k] for k in m if k.startswith("reward/by_mode/")} == pytest.approx({
        "reward/by_mode/single": 0.75, "reward/by_mode/multi": 0.0,
        "reward/by_mode/invalid": -1.0, "reward/by_mode/agentic": 1 / 3})
    assert m["reward/by_domain/MATH"] == pytest.approx(1 / 6)
    assert m["reward/by_domain/RECALL"] == pytest.approx(2 / 3)
    assert {k: m[k] for k in m if k.startswith("reward/by_domain_mode/")} == pytest.approx({
        "reward/by_domain_mode/MATH/single": 1.0, "reward/by_domain_mode/MATH/multi": 0.0,
        "reward/by_domain_mode/MATH/invalid": -1.0,
        "reward/by_domain_mode/MATH/agentic": 1 / 3,
        "reward/by_domain_mode/RECALL/single": 2 / 3})
    assert {k: m[k] for k in m if k.startswith("reward/eff_by_domain_mode/")} == pytest.approx({
        "reward/eff_by_domain_mode/MATH/single": 0.5, "reward/eff_by_domain_mode/MATH/multi": 0.0,
        "reward/eff_by_domain_mode/MATH/invalid": -1.0,
        "reward/eff_by_domain_mode/MATH/agentic": 0.25 / 3,
        "reward/eff_by_domain_mode/RECALL/single": 1 / 3})
    assert m["rows/by_domain_mode/MATH/agentic"] == 3.0
    assert m["rows/by_domain_mode/RECALL/single"] == 3.0
    assert m["rows/by_domain_mode/MATH/multi"] == 1.0
    assert m["accuracy/mean"] == pytest.approx(4 / 9)
    assert m["accuracy/by_domain/MATH"] == pytest.approx(1 / 3)
    assert m["accuracy/by_domain/RECALL"] == pytest.approx(2 / 3)


def test_mode_shares_and_curriculum(batch_metrics):
    m = batch_metrics
    assert [m[f"mode/share/{k}"] for k in ("single", "multi", "agentic", "invalid")] == \
        pytest.approx([4 / 9, 1 / 9, 3 / 9, 1 / 9])
    # Free rows are 0..5: forced agentic rows never count as the policy's choice.
    assert [m[f"mode/share_free/{k}"] for k in ("single", "multi", "agentic", "invalid")] == \
        pytest.approx([4 / 6, 1 / 6, 0, 1 / 6])
    p = [2 / 3, 1 / 6, 1 / 6]
    assert m["mode/entropy"] == pytest.approx(-sum(x * math.log(x) for x in p))
    assert m["mode/selector_valid_rate"] == pytest.approx(5 / 6)
    assert [m[f"mode/share_by_domain/MATH/{k}"] for k in ("single", "multi", "agentic",
                                                          "invalid")] == \
        pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    assert m["mode/share_by_domain/RECALL/single"] == 1.0
    assert m["mode/share_by_domain/RECALL/agentic"] == 0.0
    assert m["curriculum/forced_share"] == pytest.approx(1 / 3)
    assert (m["rows/by_domain/MATH"], m["rows/by_domain/RECALL"]) == (6.0, 3.0)


def test_group_statistics(batch_metrics):
    m = batch_metrics
    # Clean rewards per group: [1, 0, −1] (std 1), [1, 1] (flat), [1, 0] (std √½).
    assert m["groups/zero_variance_ratio"] == pytest.approx(1 / 3)
    assert m["groups/reward_std_mean"] == pytest.approx((1 + 0 + math.sqrt(0.5)) / 3)
    # Free groups: 0 has three modes (single, multi, invalid), 1 is all single.
    assert m["groups/unique_modes_mean"] == 2.0
    assert m["groups/all_same_mode_ratio"] == 0.5
    assert m["groups/mixing_forced_free"] == 0.0
    assert m["routing/mode_selection_signal"] == 0.5


def test_violations_failures_infra(batch_metrics):
    m = batch_metrics
    assert m["violation/selector_mode_missing"] == pytest.approx(1 / 9)
    assert m["violation/rate"] == pytest.approx(1 / 9)
    assert [k for k in m if k.startswith("violation/")] == [
        "violation/selector_mode_missing", "violation/rate"]
    kinds = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("failure_kind/")}
    assert set(kinds) == set(FAILURE_KINDS)  # every known kind, zeros included
    assert kinds == pytest.approx({**dict.fromkeys(FAILURE_KINDS, 0.0), "correct": 4 / 9,
                                   "genuine_incorrect": 3 / 9, "parser_error": 1 / 9,
                                   "provider_error": 1 / 9})
    assert m["infra/failed_rate"] == pytest.approx(2 / 9)  # row 4 (a failed call), row 8
    assert m["infra/dirty_rate"] == pytest.approx(2 / 9)


def test_episode_shape_finish_cost(batch_metrics):
    m = batch_metrics
    assert m["episode/worker_calls_mean"] == pytest.approx(15 / 9)
    assert m["episode/failed_worker_calls_mean"] == pytest.approx(3 / 9)
    assert m["episode/turns_mean"] == pytest.approx(32 / 9)
    assert m["episode/policy_tokens_mean"] == pytest.approx(51 / 9)
    assert m["episode/env_tokens_mean"] == pytest.approx(49 / 9)
    assert m["episode/response_tokens_max"] == 20.0
    # Free rows with a mode: 0, 1, 3, 4, 5 (the invalid row and forced rows are left out).
    assert m["episode/mode_span_tokens_mean"] == pytest.approx(21 / 5)
    assert m["finish/answer"] == pytest.approx(8 / 9)
    assert m["finish/violation"] == pytest.approx(1 / 9)
    assert m["cost/usd_mean"] == pytest.approx(0.17 / 9)
    assert m["cost/usd_by_mode/single"] == pytest.approx(0.015)
    assert m["cost/usd_by_mode/agentic"] == pytest.approx(0.03)
    assert m["cost/usd_by_mode/invalid"] == 0.0
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_worker_shares_overall_and_by_domain():
    """Calls per worker: 3 of 5 to worker_1 overall; MATH's rows called worker_2 twice and
    worker_1 once, RECALL's only worker_1 (worker_2 at 0 there); both MATH rows called
    worker_2 first; no calls, no keys."""
    w = lambda name: WorkerCall(name, "p", "reply", True)
    rows = [row(M1, mode="multi", r=1.0, calls=[w("worker_2"), w("worker_1")]),
            row(M1, mode="single", r=0.0, calls=[w("worker_2")]),
            row(R1, mode="single", r=1.0, calls=[w("worker_1")]),
            row(R1, mode="single", r=0.0, calls=[w("worker_1")])]
    trajs, rewards = zip(*rows, strict=True)
    m = rollout_metrics(list(trajs), list(rewards), group_size=2)
    assert {k: v for k, v in m.items() if k.startswith("workers/")} == {
        "workers/share/worker_1": 0.6, "workers/share/worker_2": 0.4,
        "workers/share_by_domain/MATH/worker_1": pytest.approx(1 / 3),
        "workers/share_by_domain/MATH/worker_2": pytest.approx(2 / 3),
        "workers/share_by_domain/RECALL/worker_1": 1.0,
        "workers/share_by_domain/RECALL/worker_2": 0.0,
        "workers/first_by_domain/MATH/worker_1": 0.0,
        "workers/first_by_domain/MATH/worker_2": 1.0,
        "workers/first_by_domain/RECALL/worker_1": 1.0,
        "workers/first_by_domain/RECALL/worker_2": 0.0}
    no_calls = [row(M1, mode="single", r=1.0), row(M1, mode="single", r=0.0)]
    trajs, rewards = zip(*no_calls, strict=True)
    assert not any(k.startswith("workers/") for k in rollout_metrics(
        list(trajs), list(rewards), group_size=2))


def test_mixed_group_all_forced_and_all_dirty():
    batch = [row(M1, mode="single", r=1.0, forced=True, calls=[call(False)]),
             row(M1, mode="single", r=0.0, calls=[call(False)]),
             row(M2, mode="multi", r=0.0, forced=True, calls=[call(False)]),
             row(M2, mode="multi", r=1.0, forced=True, calls=[call(False)])]
    trajs, rewards = zip(*batch, strict=True)
    m = rollout_metrics(list(trajs), list(rewards), group_size=2)
    assert m["groups/mixing_forced_free"] == 1.0
    assert m["groups/zero_variance_ratio"] == 1.0  # no clean member anywhere
    assert m["infra/dirty_rate"] == 1.0
    # Empty denominators leave keys out rather than logging 0 or NaN.
    for key in ("reward/mean_clean", "groups/reward_std_mean", "groups/unique_modes_mean",
                "routing/mode_selection_signal"):
        assert key not in m
    assert m["mode/share_free/single"] == 1.0  # the one free row
    m = rollout_metrics(list(trajs[2:]), list(rewards[2:]), group_size=2)
    assert not any(k.startswith("mode/share_free/") for k in m)
    assert "mode/entropy" not in m and "episode/mode_span_tokens_mean" not in m
    assert m["mode/share/multi"] == 1.0 and m["mode/share/invalid"] == 0.0
    assert m["curriculum/forced_share"] == 1.0


def test_rollout_metrics_rejects_bad_shapes():
    trajs, rewards = zip(*BATCH, strict=True)
    with pytest.raises(ValueError, match="groups of 4"):
        rollout_metrics(list(trajs), list(rewards), group_size=4)
    with pytest.raises(ValueError, match="rewards"):
        rollout_metrics(list(trajs), list(rewards[:-1]), group_size=3)
    assert rollout_metrics([], [], group_size=8) == {}


def test_advantage_metrics_by_hand():
    adv = A.Advantages(token_advantages=None,
                       a_mode=np.array([0.5, -0.5, 0.3, 0.0]),
                       a_inner=np.array([0.5, 1e-8, 9.0, 1.0]),
                       a_grpo=np.array([1.0, -0.4, 0.0, 1.0]))
    forced = np.array([False, False, False, True])
    clean = np.array([True, True, False, True])  # row 2 is dirty: its broken identity is ignored
    resp = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    mode = np.zeros_like(resp)
    mode[0, :2] = mode[1, :2] = mode[2, :1] = 1
    m = advantage_metrics(adv, forced=forced, clean=clean, response_mask=resp,
                          mode_token_mask=mode)
    assert m == pytest.approx({
        "adv/mode_abs_mean": 0.5, "adv/inner_abs_mean": 0.25, "adv/grpo_abs_mean": 2.4 / 3,
        "adv/mode_nonzero_rate": 1.0, "adv/inner_nonzero_rate": 0.5,
        "adv/identity_error": 0.1, "tokens/mode": 5.0, "tokens/inner": 9.0,
        "tokens/mode_frac": 5 / 14})
    none = advantage_metrics(adv, forced=np.ones(4, bool), clean=clean,
                             response_mask=np.zeros_like(resp), mode_token_mask=mode * 0)
    assert none["adv/mode_abs_mean"] == none["adv/identity_error"] == 0.0
    assert none["tokens/mode_frac"] == 0.0


def test_advantage_metrics_on_comet_grpo():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], np.float32)
    groups = np.array([0, 0, 0, 1, 1, 1])
    clean = np.array([True, True, True, True, True, False])
    forced = np.array([False, False, False, True, True, True])
    mode_ids = np.array([0, 0, 1, 2, 2, 2])
    span = np.array([3, 3, 4, 5, 5, 5])
    resp = np.ones((6, 8), np.float32)
    adv = A.comet_grpo(rewards, groups, clean, forced, mode_ids, span, resp, num_groups=2)
    mask = A.mode_token_mask(forced, span, resp)
    m = advantage_metrics(adv, forced=forced, clean=clean, response_mask=resp,
                          mode_token_mask=mask)
    assert m["adv/identity_error"] == pytest.approx(float(A.identity_error(adv, forced, clean)),
                                                    abs=1e-7)
    assert m["tokens/mode"] == 10.0 and m["tokens/inner"] == 38.0
    assert m["adv/mode_nonzero_rate"] == 1.0  # single (μ_m ½) vs multi (0) around μ ⅓
    assert m["adv/inner_nonzero_rate"] == pytest.approx(2 / 3)  # the lone multi row gets 0


def test_window_mean_and_summary():
    nan = float("nan")
    records = [{"step": 1, "a": 1.0}, {"step": 2, "a": nan}, {"step": 3},
               {"step": 4, "a": 3.0, "b": 2.0}, {"step": 5, "a": None}]
    assert window_mean(records, "a", first=2) == 1.0
    assert window_mean(records, "a", last=2) == 3.0
    assert window_mean(records, "a") == 2.0
    assert math.isnan(window_mean(records, "a", first=0))
    assert math.isnan(window_mean(records, "b", first=3))
    assert math.isnan(window_mean([], "a", last=10))
    with pytest.raises(ValueError):
        window_mean(records, "a", first=1, last=1)
    s = summarize_steps(records, first=1, last=2)
    assert (s["a/first"], s["a/last"], s["a/delta"]) == (1.0, 3.0, 2.0)
    assert math.isnan(s["b/first"]) and s["b/last"] == 2.0
    assert not any(k.startswith("step/") for k in s)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.mark.slow
def test_real_episodes(tok):
    """Scripted router on simulated workers: one question answered in single mode, one whose
    selector turn is invalid; scored by the real scorers."""
    from jax_routeweaver.routing.episodes.episode import run_episodes
    from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs
    from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
    from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

    tasks = synthetic_tasks(2, seed=0, domains=("RECALL", "KNOWLEDGE"))
    bad = tasks[1].question  # this one gets an invalid selector turn
    route = '<route model="worker_3">Solve it.</route>'

    def script(context, params):
        """Stateless, so both repeats of a question act alike: the turn is read off the
        response so far (everything after the prompt's assistant header)."""
        response = context.split("<|im_start|>assistant\n", 1)[1]
        if bad in context:
            return "I pick <mode>solo</mode>"
        if not response:
            return "<mode>single</mode>"
        return "<answer>x</answer>" if route in response else route

    pool = SimulatedWorkerPool(tasks, seed=3)
    trajs = run_episodes(tasks, ScriptedSampler(tok, script), pool,
                         routeweaver_envs(tok, pool), repeats=2)
    rewards = score_batch(trajs)
    m = rollout_metrics(trajs, rewards, group_size=2)
    assert m["mode/share/single"] == m["mode/share/invalid"] == 0.5
    assert m["violation/selector_mode_invalid"] == 0.5
    assert m["reward/by_mode/invalid"] == -1.0
    assert m["rows/by_domain/RECALL"] == m["rows/by_domain/KNOWLEDGE"] == 2.0
    assert m["episode/mode_span_tokens_mean"] == 7.0  # `<mode>single</mode>`
    assert m["episode/policy_tokens_mean"] == pytest.approx(
        np.mean([sum(t.policy_mask) for t in trajs]))
    assert m["reward/mean"] == pytest.approx(np.mean([r.r_task for r in rewards]))
    assert m["groups/all_same_mode_ratio"] == 1.0 and m["groups/mixing_forced_free"] == 0.0
    assert m["finish/answer"] == m["finish/violation"] == 0.5


# ----------------------------------------------------------- episode diagnostics (docs/metrics.md)
def drow(record, *, r, sources=None, mask=None, correct=False, infra=False, s_cost=-1.0,
         forced_mode=None, **fields):
    """A (Trajectory, Rewards) pair with the diagnostic fields set by hand. `sources` /
    `mask`: the response's token provenance and policy mask (no provenance when None)."""
    if forced_mode is not None:
        record = record.replace(forced_mode=forced_mode)
        fields.setdefault("forced", True)
        fields.setdefault("mode", forced_mode)
    sources = sources or []
    mask = mask if mask is not None else [int(s == 1) for s in sources]
    traj = Trajectory(record, 0, [1], response_ids=list(range(len(mask))), policy_mask=mask,
                      token_source=list(sources), **fields)
    cost = traj.cost
    rewards = Rewards(r, 0.0, infra, s_cost, 0.0 if cost is None else cost.cost_usd,
                      cost is not None and cost.complete,
                      "correct" if correct else "genuine_incorrect", correct=correct,
                      clean=not infra and not traj.infra_failed)
    return traj, rewards


def wcall(worker):
    return WorkerCall(worker, "p", "reply", True)


def summary(usd, *reasons):
    from jax_routeweaver.routing.pools.pricing import CostSummary

    return CostSummary(usd, not reasons, tuple(reasons))


# Group 0 (free, MATH): two single rows, one ended by a loop error. Group 1 (free, RECALL): a
# multi row with an env token at mask 1, and an invalid selector. Group 2 (forced agentic,
# MATH): in-loop execution, a repeated route, a policy token at mask 0, a sandbox-error row.
# Group 3 (forced single, RECALL): a recovered violation after the first call, and a
# premature answer before any call; neither costed nor with token provenance.
DIAG = [
    drow(M1, r=1.0, correct=True, mode="single", mode_span_end=2, finish="answer",
         sources=[1, 1, 0, 0, 1], mode_logprob=math.log(0.5), routes=[("w1", "t")],
         calls=[wcall("w1")], obs_blocks=1, obs_truncated=1, cost=summary(0.01), s_cost=0.6),
    drow(M1, r=0.0, infra=True, mode="single", mode_span_end=2, infra_failed=True,
         finish="loop_error:KeyError", sources=[1, 1, 2, 0, 1], mask=[1, 1, 0, 0, 1],
         mode_logprob=math.log(0.25), selector_retries=1, routes=[("w1", "t")],
         calls=[wcall("w1")], obs_blocks=1, cost=summary(0.02, "usage_unknown")),
    drow(R1, r=1.0, correct=True, mode="multi", mode_span_end=1, finish="answer",
         sources=[1, 0, 1], mask=[1, 1, 1], mode_logprob=math.log(0.8),
         routes=[("w1", "a"), ("w2", "b")], calls=[wcall("w1"), wcall("w2")], obs_blocks=2,
         obs_truncated=1, cost=summary(0.03), s_cost=0.4),
    drow(R1, r=-1.0, violation="selector_mode_missing", violations=["selector_mode_missing"],
         finish="violation", sources=[1, 1], cost=summary(0.0), s_cost=1.0),
    drow(M2, r=1.0, correct=True, forced_mode="agentic", mode_span_end=2, finish="answer",
         sources=[0, 0, 1, 0], routes=[("w3", "x"), ("w3", "x"), ("w5", "s")],
         calls=[wcall("w3"), wcall("w3"), wcall("w9")], max_layer_width=2, turns=4,
         first_call_violations=0, obs_blocks=3, exec_runs=3, exec_graded=2, exec_passed_all=1,
         cost=summary(0.05, "unpriced")),
    drow(M2, r=0.0, infra=True, forced_mode="agentic", mode_span_end=2, finish="violation",
         violation="ref_unknown", violations=["ref_unknown"], sources=[0, 0, 1, 1],
         mask=[0, 0, 1, 0], routes=[("w3", "y")], calls=[wcall("w3")], max_layer_width=1,
         turns=3, first_call_violations=0, obs_blocks=1, obs_truncated=1, exec_runs=1,
         exec_sandbox_errors=1, cost=summary(0.01), s_cost=0.5),
    drow(R1, r=0.0, forced_mode="single", finish="answer", violations=["route_missing"],
         first_call_violations=0, routes=[("w1", "q")], calls=[wcall("w1")], turns=3),
    drow(R1, r=-1.0, forced_mode="single", finish="violation", violation="answer_premature",
         violations=["answer_premature"], turns=1),
]
PRICES = dict.fromkeys(("w1", "w2", "w3", "w5"), None)


@pytest.fixture(scope="module")
def diag():
    trajs, rewards = zip(*DIAG, strict=True)
    return rollout_metrics(list(trajs), list(rewards), group_size=2, prices=PRICES)


def test_observation_truncation(diag):
    """Blocks 1, 1, 2, 0, 3, 1, 0, 0; cut 1, 0, 1, 0, 0, 1."""
    assert {k: v for k, v in diag.items() if k.startswith("obs/")} == pytest.approx({
        "obs/blocks_mean": 1.0, "obs/truncation_rate": 3 / 8, "obs/row_truncation_rate": 3 / 5,
        "obs/truncation_rate_by_mode/single": 0.5, "obs/truncation_rate_by_mode/multi": 0.5,
        "obs/truncation_rate_by_mode/agentic": 0.25,  # invalid: no block, no key
        "obs/truncation_rate_by_domain/MATH": 1 / 3,
        "obs/truncation_rate_by_domain/RECALL": 0.5})


def test_execution_feedback_and_mask_provenance(diag):
    assert {k: v for k, v in diag.items() if k.startswith("exec/")} == {
        "exec/runs": 4.0, "exec/sandbox_errors": 1.0, "exec/rows_with_exec": 2.0,
        "exec/pass_all_rate": 0.5}
    # Rows 2 (env token at 1) and 5 (a choice token at 0); rows 6, 7 have no provenance.
    assert {k: v for k, v in diag.items() if k.startswith("mask/")} == {
        "mask/violations": 2.0, "mask/policy_span_min": 0.0, "mask/env_span_max": 1.0,
        "mask/mode_span_min": 1.0}


def test_episode_shape_and_wrapper_failures(diag):
    assert diag["episode/route_count_mean"] == pytest.approx(9 / 8)
    assert diag["episode/selector_retries_mean"] == 0.25  # over the four free rows
    assert diag["episode/max_layer_width_mean"] == 1.5  # agentic rows 4 and 5
    assert diag["infra/loop_error_rate"] == 1 / 8 and diag["infra/wrapper_error_rate"] == 0.0


def test_forced_mode_family(diag):
    m1 = {k: v for k, v in diag.items() if k.startswith("m1/")}
    assert m1 == pytest.approx({
        "m1/agentic/rows": 2.0, "m1/agentic/reward_mean": 0.5,
        "m1/agentic/task_accuracy": 0.5, "m1/agentic/first_pass_valid": 1.0,
        "m1/agentic/eventual_valid": 0.5, "m1/agentic/terminal_invalid_rate": 0.5,
        "m1/agentic/infra_rate": 0.5, "m1/agentic/forced_mode_honoured": 1.0,
        "m1/agentic/unique_route_ratio": 0.75, "m1/agentic/worker_calls_mean": 2.0,
        "m1/agentic/turns_mean": 3.5, "m1/agentic/groups": 1.0,
        "m1/agentic/zero_variance_group_ratio": 1.0,  # one clean member
        "m1/single/rows": 2.0, "m1/single/reward_mean": -0.5,
        "m1/single/task_accuracy": 0.0, "m1/single/first_pass_valid": 0.5,
        "m1/single/eventual_valid": 0.5, "m1/single/terminal_invalid_rate": 0.5,
        "m1/single/infra_rate": 0.0, "m1/single/forced_mode_honoured": 1.0,
        "m1/single/unique_route_ratio": 1.0, "m1/single/worker_calls_mean": 0.5,
        "m1/single/turns_mean": 2.0, "m1/single/groups": 1.0,
        "m1/single/zero_variance_group_ratio": 0.0})


def test_arms_question_routing_cost_and_mode_probability(diag):
    assert {k: v for k, v in diag.items() if k.startswith("stage2/")} == pytest.approx({
        "stage2/free_ratio": 0.5, "stage2/forced_ratio": 0.5,
        "stage2/free/reward_mean": 0.25, "stage2/forced/reward_mean": 0.0,
        "stage2/free/mode_share/single": 0.5, "stage2/free/mode_share/multi": 0.25,
        "stage2/free/mode_share/agentic": 0.0, "stage2/free/mode_share/invalid": 0.25,
        "stage2/forced/mode_share/single": 0.5, "stage2/forced/mode_share/multi": 0.0,
        "stage2/forced/mode_share/agentic": 0.5, "stage2/forced/mode_share/invalid": 0.0})
    assert diag["routing/question_mode_entropy_mean"] == pytest.approx(math.log(2) / 2)
    assert diag["routing/unanimous_group_ratio"] == 0.5
    # Costed rows 0..5: row 1 misses usage, row 4 calls an unpriced worker (w9).
    assert {k: v for k, v in diag.items() if k.startswith("cost/") and
            k != "cost/usd_mean" and not k.startswith("cost/usd_by_mode")} == pytest.approx({
        "cost/calls": 7 / 6, "cost/usage_unknown_rate": 1 / 6, "cost/unpriced_rate": 1 / 6,
        "cost/complete_rate": 4 / 6, "cost/s_cost_mean": 2.5 / 4})
    assert {k: v for k, v in diag.items() if k.startswith("mode/pi")} == pytest.approx({
        "mode/pi_chosen_mean": 1.55 / 3, "mode/pi_chosen/single": 0.375,
        "mode/pi_chosen/multi": 0.8})


def test_diagnostics_without_modes_provenance_or_cost(batch_metrics):
    """Router-R1 rows: no mode family; rows built without provenance or cost: no mask or
    cost key; a batch without costing leaves cost/calls out."""
    assert not [k for k in batch_metrics if k.startswith(("mask/", "cost/calls"))]
    assert batch_metrics["episode/route_count_mean"] == 0.0
    trajs, rewards = zip(*DIAG, strict=True)
    m = rollout_metrics(list(trajs[6:]), list(rewards[6:]), group_size=2)
    assert m["mask/violations"] == 0.0  # empty responses: nothing to contradict
    assert not [k for k in m if k.startswith(("mask/policy", "mask/env", "mask/mode",
                                              "cost/calls", "cost/complete", "mode/pi",
                                              "stage2/free/"))]
    assert m["stage2/forced_ratio"] == 1.0 and "routing/unanimous_group_ratio" not in m
    from jax_routeweaver.rl.reports.episode_metrics import episode_diagnostics

    r1 = episode_diagnostics(list(trajs), list(rewards), group_size=2, with_modes=False)
    assert not [k for k in r1 if k.startswith(("m1/", "stage2/", "routing/", "mode/",
                                               "exec/", "obs/truncation_rate_by_mode",
                                               "mask/mode_span", "episode/selector",
                                               "episode/max_layer"))]
    assert r1["obs/truncation_rate"] == 3 / 8 and r1["mask/violations"] == 2.0
    assert "cost/calls" not in r1 and r1["cost/complete_rate"] == 4 / 6
