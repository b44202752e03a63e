"""Router-R1 episodes through the runner: scripted policy, simulated workers."""

import pytest
from scripted import ScriptedSampler

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.rewards.router_r1_reward import CostWindow, trajectory_reward, worker_prices
from jax_routeweaver.rl.run.router_r1_run import as_rewards
from jax_routeweaver.routing.episodes.episode import EpisodeStats, run_episodes
from jax_routeweaver.routing.episodes.router_r1_env import router_r1_envs
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

MODEL_WORKERS = {m.name: f"worker_{i}" for i, m in enumerate(r1.PROMPT_MODELS, 1)}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tasks():
    return synthetic_tasks(4, seed=0)


def question_of(context: str, tasks) -> str:
    return next(t.question for t in tasks if t.question in context)


def after_prompt(context: str, tasks) -> str:
    """What the episode added after the prompt (the prompt itself explains the tags)."""
    return context.rsplit(question_of(context, tasks), 1)[1]


@pytest.mark.slow
def test_search_then_answer(tok, tasks):
    def script(context, params):
        q = question_of(context, tasks)
        if "<information>" not in after_prompt(context, tasks):
            return f"<think>ask</think>\n<search> Qwen2.5-7B-Instruct: {q} </search>"
        return "<think>done</think>\n<answer> 42 </answer><|im_end|>"

    pool = SimulatedWorkerPool(tasks, seed=1)
    sampler = ScriptedSampler(tok, script)
    stats = EpisodeStats()
    trajs = run_episodes(tasks, sampler, pool, router_r1_envs(tok, MODEL_WORKERS), repeats=2,
                         stats=stats)
    assert len(trajs) == 8 and [t.repeat for t in trajs[:2]] == [0, 1]
    assert stats.rounds == 2 and len(sampler.calls) == 2 and sampler.calls[0][0] == 8
    for t in trajs:
        assert t.finish == "answer" and t.answer == "42" and t.turns == 2
        assert [c.worker for c in t.calls] == ["worker_1"] and t.calls[0].success
        assert t.policy_versions == [7, 7] and not t.infra_failed
        # Token-in/token-out: the response is policy turn 1, observation, policy turn 2.
        turn1 = tok.encode(f"<think>ask</think>\n<search> Qwen2.5-7B-Instruct: "
                           f"{t.record.question} </search>", add_special_tokens=False)
        obs = tok.encode(r1.observation_for_call(t.calls[0]), add_special_tokens=False)
        assert t.response_ids[:len(turn1)] == turn1
        assert t.policy_mask == [1] * len(turn1) + [0] * len(obs) + [1] * (
            len(t.response_ids) - len(turn1) - len(obs))
        assert t.response_ids[len(turn1):len(turn1) + len(obs)] == obs
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.policy_mask, strict=True) if not m)
        assert all(lp == -0.25 for lp, m in zip(t.logprobs, t.policy_mask, strict=True) if m)
        # The trailing EOS of the answer turn is dropped (Router-R1 never trains on it).
        assert t.response_ids[-1] != tok.eos_token_id


def test_turn_budget_and_invalid_actions(tok, tasks):
    def script(context, params):
        tail = after_prompt(context, tasks)
        n = tail.count("<information>") + tail.count("bogus")
        if n % 2:
            return "<think>x</think> bogus without an action"
        return f"<search> Gemma-2-27B-Instruct: {question_of(context, tasks)} </search>"

    pool = SimulatedWorkerPool(tasks, seed=1)
    trajs = run_episodes(tasks[:1], ScriptedSampler(tok, script), pool,
                         router_r1_envs(tok, MODEL_WORKERS))
    (t,) = trajs
    # 4 routed turns (calls or invalid actions) then the final, never-routed generation.
    assert t.turns == 5 and t.finish == "final_turn"
    assert len(t.calls) == 2 and {c.worker for c in t.calls} == {"worker_6"}
    assert t.notices == ["no_action", "no_action"]


def test_unknown_and_unserved_models_get_none(tok, tasks):
    def script(context, params):
        if "<information>" in after_prompt(context, tasks):
            return "<answer> a </answer>"
        return "<search> Mixtral-8x22B-Instruct: hello </search>"

    served = {k: v for k, v in MODEL_WORKERS.items() if not k.startswith("Mixtral")}
    (t,) = run_episodes(tasks[:1], ScriptedSampler(tok, script), SimulatedWorkerPool(tasks, seed=0),
                        router_r1_envs(tok, served))
    assert t.calls == [] and t.notices == ["model_not_served"] and t.finish == "answer"
    obs = tok.decode([i for i, m in zip(t.response_ids, t.policy_mask, strict=True) if not m])
    assert obs == r1.render_observation(None)


def test_failed_worker_call_is_observed_as_none_and_scored(tok, tasks):
    """docs/router_r1.md, "A failed call is an observation": a call that failed after the pool's
    retries shows the policy `<information>None</information>`; the row is not infra, costs 0,
    and is scored like any other (right answer: the full reward; wrong answer: 0), not
    dropped."""
    def script(context, params):
        q = question_of(context, tasks)
        if "<information>" in after_prompt(context, tasks):
            answer = tasks[0].gold[0] if q == tasks[0].question else "surely wrong"
            return f"<think> done </think>\n<answer> {answer} </answer>"
        return "<think> ask </think>\n<search> Qwen2.5-7B-Instruct: who knows </search>"

    pool = SimulatedWorkerPool(tasks, seed=0, failure_rate=1.0)
    trajs = run_episodes(tasks[:2], ScriptedSampler(tok, script), pool,
                         router_r1_envs(tok, MODEL_WORKERS))
    window = CostWindow()
    prices = worker_prices(MODEL_WORKERS)
    rows = []
    for t in trajs:
        assert not t.infra_failed and not t.calls[0].success and t.finish == "answer"
        obs = tok.decode([i for i, m in zip(t.response_ids, t.policy_mask, strict=True)
                          if not m])
        assert obs == r1.render_observation(None)
        assert t.routes == [("Qwen2.5-7B-Instruct", "who knows")] and t.obs_blocks == 1
        detail = trajectory_reward(t, tok.decode, prices, window)
        rows.append((detail, as_rewards(t, detail)))
    (right, right_row), (wrong, wrong_row) = rows
    for detail, row in rows:
        assert detail.violations == () and detail.raw_cost == 0.0  # a failed call costs 0
        assert not row.infra and row.clean and row.failed_calls == 1
        assert row.r_task == detail.reward
    assert right.reward == 1.0 and right_row.failure_kind == "correct"
    assert wrong.reward == 0.0 and wrong_row.failure_kind == "genuine_incorrect"


def test_a_loop_error_is_infra_for_router_r1(tok, tasks):
    """An env call that raises ends that episode only, as a wrapper error (infra)."""
    factory = router_r1_envs(tok, MODEL_WORKERS)

    def make(record, repeat):
        prompt, env = factory(record, repeat)
        if record is tasks[1]:
            def broken(traj, completion):
                raise RuntimeError("env bug")
            env.step = broken
        return prompt, env

    def script(context, params):
        return "<think> x </think>\n<answer> 7 </answer>"

    trajs = run_episodes(tasks[:2], ScriptedSampler(tok, script),
                         SimulatedWorkerPool(tasks, seed=0), make)
    ok, bad = trajs
    assert ok.finish == "answer" and not ok.infra_failed
    assert bad.finish == "loop_error:RuntimeError" and bad.infra_failed
    assert bad.error == "RuntimeError: env bug" and bad.turns == 1
    window, prices = CostWindow(), worker_prices(MODEL_WORKERS)
    rows = [as_rewards(t, trajectory_reward(t, tok.decode, prices, window)) for t in trajs]
    assert not rows[0].infra and rows[0].clean
    assert rows[1].infra and not rows[1].clean and rows[1].r_task == 0.0
    assert rows[1].failure_kind == "wrapper_error"


def test_factory_rejects_unknown_model_names(tok):
    with pytest.raises(ValueError, match="unknown Router-R1 models"):
        router_r1_envs(tok, {"GPT-9": "worker_1"})
