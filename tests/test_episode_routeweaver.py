"""RouteWeaver episodes through the runner: scripted policies for every mode, simulated workers,
and a random-init router acting validly under grammar constraints."""

import pytest
from flax import nnx
from scripted import ScriptedSampler

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.rewards.feedback import execution_feedback
from jax_routeweaver.routing.episodes.episode import run_episodes
from jax_routeweaver.routing.episodes.routeweaver_env import EnvConfig, routeweaver_envs
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import GrammarConstraints
from jax_routeweaver.sampling.jax_sampler import JaxSampler

IM_END = 151645


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tasks():
    return synthetic_tasks(5, seed=0)


def spans(traj, tok):
    """(text, mask) runs of the response."""
    out, cur, mask = [], [], None
    for i, m in zip(traj.response_ids, traj.policy_mask, strict=True):
        if m != mask and cur:
            out.append((tok.decode(cur), mask))
            cur = []
        cur.append(i)
        mask = m
    out.append((tok.decode(cur), mask))
    return out


class TurnScript:
    """Policy turns by episode progress: selector, then actions in order (per trajectory,
    keyed by the question)."""

    def __init__(self, turns):
        self.turns = turns
        self.seen: dict[str, int] = {}

    def __call__(self, context, params):
        key = context.split("<|im_start|>assistant\n")[0]
        k = self.seen.get(key, 0)
        self.seen[key] = k + 1
        return self.turns[min(k, len(self.turns) - 1)]


def run(tok, tasks, turns, *, repeats=1, config=None, pool=None):
    pool = pool or SimulatedWorkerPool(tasks, seed=3)
    sampler = ScriptedSampler(tok, TurnScript(turns))
    envs = routeweaver_envs(tok, pool, config or EnvConfig())
    return run_episodes(tasks, sampler, pool, envs, repeats=repeats), sampler


@pytest.mark.slow
def test_single_mode_episode(tok, tasks):
    trajs, sampler = run(tok, tasks[:1], [
        "<mode>single</mode>", '<route model="worker_3">Solve the question.</route>',
        "<answer>7</answer>"])
    (t,) = trajs
    assert (t.mode, t.answer, t.finish, t.violation, t.turns) == ("single", "7", "answer",
                                                                   None, 3)
    assert [c.worker for c in t.calls] == ["worker_3"] and t.calls[0].node == "n1"
    assert t.final_turn == "<answer>7</answer>"
    assert t.record.question in t.calls[0].prompt
    runs = spans(t, tok)
    assert [m for _, m in runs] == [1, 0, 1, 0, 1]
    assert runs[0][0] == "<mode>single</mode>"
    assert runs[1][0].startswith("<|im_end|>\n<|im_start|>user\nYour mode is single.")
    assert runs[3][0].startswith("\n\n<observation>") and runs[3][0].endswith(
        "</observation>\n\n")
    mode_ids = tok.encode("<mode>single</mode>", add_special_tokens=False)
    assert t.mode_span_end == len(mode_ids) == 7
    # Selector turn sampled with its own stops and 64-token cap; action turns with theirs.
    selector_params, action_params = sampler.calls[0][1], sampler.calls[1][1]
    assert selector_params.stop_strings == g.SELECTOR_STOPS
    assert selector_params.max_new_tokens == 64
    assert action_params.stop_strings == g.SINGLE_MULTI_STOPS


def test_multi_mode_needs_two_calls(tok, tasks):
    (t,), _ = run(tok, tasks[:1], [
        "<mode>multi</mode>", '<route model="worker_1">Part one.</route>',
        "<answer>early</answer>"])
    assert t.violation == "answer_premature" and t.finish == "violation"
    assert len(t.calls) == 1
    (t,), _ = run(tok, tasks[:1], [
        "<mode>multi</mode>", '<route model="worker_1">Part one.</route>',
        '<route model="worker_2">Part two.</route>', "<answer>done</answer>"])
    assert t.answer == "done" and [c.worker for c in t.calls] == ["worker_1", "worker_2"]


def test_agentic_layer_runs_in_parallel_with_headers(tok, tasks):
    (t,), _ = run(tok, tasks[:1], [
        "<mode>agentic</mode>",
        '<route model="worker_3" role="executor" refs="">Solve it.</route>\n'
        '<route model="worker_6" role="executor" refs="">Solve it again.</route><|im_end|>',
        '<route model="worker_5" role="summarizer" refs="n1,n2">Reconcile.</route><|im_end|>',
        "<answer>x</answer>"])
    assert t.finish == "answer" and t.answer == "x"
    assert [(c.worker, c.role, c.node) for c in t.calls] == [
        ("worker_3", "executor", "n1"), ("worker_6", "executor", "n2"),
        ("worker_5", "summarizer", "n3")]
    assert "[n1] (from executor)" in t.calls[2].prompt  # refs spliced into the payload
    assert t.summarizer_answer is not None
    text = tok.decode(t.response_ids)
    assert text.count("Routing state:") == 3
    assert "Completed node IDs: n1, n2" in text
    assert '<observation id="n1" role="executor">' in text


def test_forced_arm(tok, tasks):
    forced = [r.replace(forced_mode="multi") for r in tasks[:1]]
    (t,), sampler = run(tok, forced, [
        '<route model="worker_1">a</route>', '<route model="worker_2">b</route>',
        "<answer>z</answer>"])
    assert t.forced and t.mode == "multi" and t.answer == "z"
    runs = spans(t, tok)
    assert runs[0] == ("<|im_end|>\n<|im_start|>user\n<mode>multi</mode><|im_end|>\n"
                       "<|im_start|>assistant\n" + runs[0][0].split("<|im_start|>assistant\n",
                                                                   1)[1], 0)
    forced_ids = tok.encode(g.forced_declaration_text(g.Mode.MULTI, g.ProtocolConfig()),
                            add_special_tokens=False)
    assert t.mode_span_end == len(forced_ids)
    assert sampler.calls[0][1].stop_strings == g.SINGLE_MULTI_STOPS  # no selector turn


def test_violations_end_the_episode_and_turn_limit(tok, tasks):
    (t,), _ = run(tok, tasks[:1], ["I pick <mode>solo</mode>"])
    assert t.violation == "selector_mode_invalid" and t.finish == "violation" and t.turns == 1
    (t,), _ = run(tok, tasks[:1], ["<mode>single</mode>", '<route model="worker_9">x</route>'])
    assert t.violation == "unknown_model" and t.calls == []
    # Recovery on: the cue is injected and the policy retries; 10 action turns at most.
    config = EnvConfig(protocol=g.ProtocolConfig(recovery=True))
    (t,), _ = run(tok, tasks[:1], ["<mode>single</mode>", "no action here"], config=config)
    assert t.finish == "turn_limit" and t.turns == 11 and t.violation is None
    assert t.notices == [] and "Invalid action (route_missing)" in tok.decode(t.response_ids)


def test_infra_failure_is_flagged(tok, tasks):
    pool = SimulatedWorkerPool(tasks, seed=0, failure_rate=1.0)
    (t,), _ = run(tok, tasks[:1], ["<mode>single</mode>", '<route model="worker_1">a</route>',
                                   "<answer>q</answer>"], pool=pool)
    assert t.infra_failed and t.answer == "q"
    assert "<observation></observation>" in tok.decode(t.response_ids)


def test_observation_budget_truncates(tok, tasks):
    config = EnvConfig(protocol=g.ProtocolConfig(observation_cap=40))
    (t,), _ = run(tok, tasks[:1], ["<mode>single</mode>", '<route model="worker_3">a</route>',
                                   "<answer>q</answer>"], config=config)
    obs = [text for text, m in spans(t, tok) if m == 0 and text.startswith("\n\n<observation>")]
    assert len(obs) == 1 and "... [observation truncated] ..." in obs[0]
    assert len(tok.encode(obs[0], add_special_tokens=False)) <= 40


@pytest.mark.slow
def test_random_router_acts_validly_under_grammar(tok, tasks):
    """A random-init tiny router with grammar constraints: never a violation, all modes."""
    cfg = ModelConfig(vocab_size=151_936, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    # The dense engine: these few calls compile fewer programs on it (the engines' equality
    # under grammars is tests/test_paged_sampler.py's).
    sampler = JaxSampler(model, kv_cache="dense", decode=tok.decode, pad_id=151643,
                         constraints=GrammarConstraints(tok, cfg.vocab_size))
    pool = SimulatedWorkerPool(tasks, seed=0)
    config = EnvConfig(sampling=SamplingParams(temperature=1.0, max_new_tokens=96, seed=5),
                       constrained=True)
    trajs = run_episodes(tasks, sampler, pool, routeweaver_envs(tok, pool, config), repeats=3)
    assert all(t.violation is None for t in trajs), [
        (t.violation, tok.decode(t.response_ids)[-300:]) for t in trajs if t.violation]
    assert {t.mode for t in trajs} <= {"single", "multi", "agentic"}
    assert len({t.mode for t in trajs}) >= 2
    for t in trajs:
        assert t.finish in ("answer", "turn_limit", "length_limit"), t.finish
        assert len(t.response_ids) == len(t.policy_mask) == len(t.logprobs)
        if t.mode != "agentic":
            assert t.finish == "answer" and len(t.calls) >= 1
        # Tokens the grammar forced are not actions: in "<mode>single</mode>" only the mode
        # word's first token is (the selector is a choice over canonical tokenizations).
        assert [tok.decode([i]) for i in t.response_ids[:3]] == ["<", "mode", ">"]
        assert t.policy_mask[:4] == [0, 0, 0, 1]
        closing = 5 if t.mode == "agentic" else 4  # ag + entic: entic is forced too
        assert t.policy_mask[4:closing + 3] == [0] * (closing - 1)
        assert t.token_source[:4] == [2, 2, 2, 1]  # forced, forced, forced, a choice
    from jax_routeweaver.rl.reports.episode_metrics import mask_metrics

    assert mask_metrics(trajs) == {"mask/violations": 0.0, "mask/policy_span_min": 1.0,
                                   "mask/env_span_max": 0.0, "mask/mode_span_min": 1.0}


class CountingPool:
    """Wraps a pool; records the most calls in flight at once."""

    def __init__(self, pool):
        self.pool, self.in_flight, self.peak = pool, 0, 0

    def worker_ids(self):
        return self.pool.worker_ids()

    def description(self, worker):
        return self.pool.description(worker)

    async def call(self, worker, prompt, *, max_tokens=None):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await self.pool.call(worker, prompt, max_tokens=max_tokens)
        finally:
            self.in_flight -= 1


def test_calls_run_concurrently_across_layers_and_trajectories_and_are_costed(tok, tasks):
    from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES, trajectory_cost

    pool = CountingPool(SimulatedWorkerPool(tasks, seed=3, latency_s=0.05))
    layer = ('<route model="worker_3" role="executor" refs="">Solve it.</route>\n'
             '<route model="worker_6" role="executor" refs="">Again.</route><|im_end|>')
    sampler = ScriptedSampler(tok, TurnScript(["<mode>agentic</mode>", layer,
                                               '<route model="worker_5" role="summarizer" '
                                               'refs="n1,n2">Reconcile.</route><|im_end|>',
                                               "<answer>x</answer>"]))
    trajs = run_episodes(tasks[:3], sampler, pool, routeweaver_envs(tok, pool), repeats=1,
                         prices=REFERENCE_PRICES)
    # Round 2: three trajectories x two layer members, all in flight together.
    assert pool.peak == 6
    for t in trajs:
        assert t.cost == trajectory_cost(t.calls, REFERENCE_PRICES)
        assert t.cost.complete and t.cost.cost_usd > 0


AGENTIC_CODE = ["<mode>agentic</mode>",
                '<route model="worker_3" role="executor" refs="">Write the function.</route>'
                "<|im_end|>",
                '<route model="worker_5" role="summarizer" refs="n1">Give the final program.'
                "</route><|im_end|>", "<answer>done</answer>"]


@pytest.fixture(scope="module")
def code_tasks():
    from jax_routeweaver.data.records import Domain

    return synthetic_tasks(2, seed=4, domains=(Domain.CODE,))


def test_execution_feedback_prepends_the_sandbox_verdict(tok, code_tasks):
    trajs, _ = run(tok, code_tasks, AGENTIC_CODE, config=EnvConfig(feedback=execution_feedback()))
    for t in trajs:
        text = tok.decode(t.response_ids)
        observation = text.rsplit('<observation id="n1" role="executor">', 1)[1]
        assert observation.startswith("[execution] ")
        assert "hidden tests" in observation.split("\n", 1)[0]
        # ... and the verdict travels with the node output into the summarizer's refs.
        assert "[n1] (from executor)\n[execution] " in t.calls[1].prompt
    (off,), _ = run(tok, code_tasks[:1], AGENTIC_CODE)  # no port bound: no feedback
    assert "[execution]" not in tok.decode(off.response_ids)


def test_sandbox_harness_failure_is_recorded_as_infra_notice(tok, code_tasks):
    class BrokenSandbox:
        async def arun_function(self, *args, **kwargs):
            raise RuntimeError("harness down")

        async def arun_tests(self, *args, **kwargs):
            raise RuntimeError("harness down")

        async def arun(self, *args, **kwargs):
            raise RuntimeError("harness down")

    (t,), _ = run(tok, code_tasks[:1], AGENTIC_CODE,
                  config=EnvConfig(feedback=execution_feedback(BrokenSandbox())))
    assert any(n.startswith("exec_sandbox_error") for n in t.notices), t.notices
    assert "[execution]" not in tok.decode(t.response_ids)


@pytest.mark.slow
def test_compact_rulebook_and_fixed_task_make_each_route_one_decision(tok, tasks):
    """With `task_text` a route is a canonical choice: in single/multi the worker's digit is
    the only free token of a route turn (everything else is forced, so not trained on), and
    `rulebook="compact"` frames the mode in a few lines."""
    cfg = ModelConfig(vocab_size=151_936, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    sampler = JaxSampler(Qwen3(cfg, rngs=nnx.Rngs(1)), kv_cache="dense", decode=tok.decode,
                         pad_id=151643, constraints=GrammarConstraints(tok, cfg.vocab_size))
    pool = SimulatedWorkerPool(tasks, seed=0)
    config = EnvConfig(sampling=SamplingParams(temperature=1.0, max_new_tokens=96, seed=2),
                       constrained=True, answer_choices=True, task_text="Solve the question.",
                       rulebook="compact")
    trajs = run_episodes(tasks, sampler, pool, routeweaver_envs(tok, pool, config), repeats=3)
    assert all(t.violation is None and t.finish == "answer" for t in trajs)
    assert {"single", "multi"} & {t.mode for t in trajs}
    for t in trajs:
        text = tok.decode(t.response_ids)
        assert f"Your mode is {t.mode}. Workers: worker_1, worker_2" in text
        assert "## Allowed model IDs" not in text  # not the reference rulebook
        assert all(c.prompt.count("Solve the question.") == 1 for c in t.calls)
        if t.mode == "agentic":
            continue
        free = [tok.decode([i]) for i, m in zip(t.response_ids[t.mode_span_end:],
                                                t.policy_mask[t.mode_span_end:], strict=True)
                if m]
        # one digit per call, in order; the only other decisions are route-vs-answer (multi,
        # once an answer is allowed) and which candidate answer
        rest = iter(free)
        assert all(c.worker[-1] in rest for c in t.calls), (free, t.calls)
        assert len(free) <= 2 * len(t.calls) + 1, free


@pytest.mark.parametrize("turn, code", [
    ('<route model="worker_3">Solve the question.</route>', "worker_not_offered"),
    ('<route model="worker_9">Solve the question.</route>', "unknown_model"),
])
def test_a_run_offering_part_of_the_pool(tok, tasks, turn, code):
    """docs/protocol.md, "Single/multi action turn", checks 5-6: with `offered` a subset, a
    registered worker outside it is `worker_not_offered` and an id the pool does not know
    `unknown_model`; the catalog the router reads lists only the offered workers."""
    config = EnvConfig(offered=("worker_1", "worker_2"))
    trajs, _ = run(tok, tasks[:1], ["<mode>single</mode>", turn], config=config)
    (t,) = trajs
    assert (t.violation, t.finish, t.calls) == (code, "violation", [])
    rulebook = tok.decode(t.response_ids)
    assert "worker_1:" in rulebook and "worker_2:" in rulebook
    assert "worker_3:" not in rulebook and "worker_6:" not in rulebook
    with pytest.raises(ValueError, match=r"workers.offered: \['worker_7'\] not in the worker"):
        routeweaver_envs(tok, SimulatedWorkerPool(tasks, seed=3),
                         EnvConfig(offered=("worker_1", "worker_7")))


# ------------------------------------------------------------------ wrapper path
# (docs/protocol.md, "How an episode ends" and "What a worker receives")
SINGLE = ["<mode>single</mode>", '<route model="worker_3">Solve the question.</route>']


def gold_script(tasks, turns_of=lambda q: SINGLE):
    """Per question: its turns, then an answer with its gold (stateless: read off the
    response so far, so both repeats of a question act alike)."""
    def script(context, params):
        response = context.split("<|im_start|>assistant\n", 1)[1]
        task = next(t for t in tasks if t.question in context)
        turns = turns_of(task.question)
        done = sum(turn in response for turn in turns)
        return turns[done] if done < len(turns) else f"<answer>{task.gold[0]}</answer>"
    return script


@pytest.mark.slow
def test_an_env_that_raises_ends_its_episode_only_as_an_infra_row(tok, tasks):
    """docs/protocol.md, "How an episode ends": a turn handler that raises ends that trajectory
    (`loop_error:<Type>`, infra, what it had kept); the batch goes on, the others are scored,
    and the broken row stays out of the group statistics (it is not clean: zero advantage, the
    group's survivor alone)."""
    import numpy as np

    from jax_routeweaver.rewards.reward import score_batch
    from jax_routeweaver.rl.core.advantages import grpo_gated
    from jax_routeweaver.rl.reports.metrics import rollout_metrics

    two = [tasks[0], tasks[2]]  # MATH, KNOWLEDGE (the CODE task has no gold answer)
    pool = SimulatedWorkerPool(tasks, seed=3)
    factory = routeweaver_envs(tok, pool)

    def make(record, repeat):
        prompt, env = factory(record, repeat)
        if record is two[1] and repeat == 0:
            def broken(traj, calls):
                raise KeyError("node")
            env.observe = broken
        return prompt, env

    trajs = run_episodes(two, ScriptedSampler(tok, gold_script(tasks)), pool, make,
                         repeats=2)
    bad = trajs[2]
    assert bad.finish == "loop_error:KeyError" and bad.infra_failed
    assert bad.error == "KeyError: 'node'"
    assert [c.worker for c in bad.calls] == ["worker_3"] and bad.turns == 2  # kept
    assert all(t.finish == "answer" and not t.infra_failed for i, t in enumerate(trajs)
               if i != 2)
    rewards = score_batch(trajs)
    assert [r.r_task for r in rewards] == [1.0, 1.0, 0.0, 1.0]
    assert rewards[2].infra and not rewards[2].clean
    assert rewards[2].failure_kind == "wrapper_error"
    assert all(r.clean and r.failure_kind == "correct" for i, r in enumerate(rewards) if i != 2)
    adv = grpo_gated(np.array([r.r_task for r in rewards], np.float32),
                     np.array([0, 0, 1, 1]), np.array([r.clean for r in rewards]),
                     np.ones((4, 3), np.float32), num_groups=2)
    # Group 1 keeps one survivor (mean 0, std 1): its advantage is its raw reward.
    assert np.asarray(adv.a_grpo) == pytest.approx([0.0, 0.0, 0.0, 1.0], abs=1e-5)
    m = rollout_metrics(trajs, rewards, group_size=2)
    assert m["finish/loop_error:KeyError"] == 0.25 and m["infra/loop_error_rate"] == 0.25
    assert m["reward/mean_clean"] == 1.0 and m["failure_kind/wrapper_error"] == 0.25


def test_fatal_env_errors_end_the_run(tok, tasks):
    """A broken install (ImportError) or an env's declared fatal error (its execution
    feedback's: a host that cannot isolate programs) is no row failure."""
    from jax_routeweaver.rewards.sandbox import IsolationUnavailable

    pool = SimulatedWorkerPool(tasks, seed=3)
    factory = routeweaver_envs(tok, pool, EnvConfig(feedback=execution_feedback()))
    for error in (ImportError("no module"), IsolationUnavailable("no bwrap")):
        def make(record, repeat, error=error):
            prompt, env = factory(record, repeat)

            def broken(traj, completion):
                raise error
            env.step = broken
            return prompt, env

        with pytest.raises(type(error)):
            run_episodes(tasks[:1], ScriptedSampler(tok, gold_script(tasks)), pool, make)


def test_payload_hygiene_failure_is_a_wrapper_error(tok, tasks, monkeypatch):
    """docs/protocol.md, "What a worker receives": a payload whose wrapper text holds a brevity
    phrase ends that episode as `wrapper_error` (infra) without calling the worker; the batch
    goes on. The shipped wrappers are clean, so the executor's role brief is patched to provoke
    it."""
    from jax_routeweaver.rewards.reward import score_batch
    from jax_routeweaver.routing.protocol import prompts

    brief = dict(prompts.ROLE_BRIEF)
    brief[g.Role.EXECUTOR] += " Be brief."
    monkeypatch.setattr(prompts, "ROLE_BRIEF", brief)
    agentic = ["<mode>agentic</mode>",
               '<route model="worker_3" role="executor" refs="">Solve it.</route><|im_end|>']
    pool = CountingPool(SimulatedWorkerPool(tasks, seed=3))
    script = gold_script(tasks, lambda q: agentic if q == tasks[0].question else SINGLE)
    trajs = run_episodes([tasks[0], tasks[2]], ScriptedSampler(tok, script), pool,
                         routeweaver_envs(tok, pool))
    bad, ok = trajs
    assert bad.finish == "wrapper_error" and bad.infra_failed and bad.calls == []
    assert "brevity phrases ['be brief']" in bad.error and bad.routes == []
    assert bad.mode == "agentic" and bad.turns == 2
    assert ok.finish == "answer" and [c.worker for c in ok.calls] == ["worker_3"]
    assert pool.peak == 1  # only the clean episode called a worker
    bad_r, ok_r = score_batch(trajs)
    assert bad_r.infra and not bad_r.clean and bad_r.failure_kind == "wrapper_error"
    assert bad_r.r_task == 0.0
    assert ok_r.clean and ok_r.failure_kind == "correct" and ok_r.r_task == 1.0


def test_episode_diagnostics_are_recorded(tok, tasks):
    """The fields the metrics of docs/metrics.md read: provenance per token, the declaring
    turn's logprob, routes and layer width, observation blocks, violations before the first
    call."""
    (t,), _ = run(tok, tasks[:1], [
        "<mode>agentic</mode>",
        '<route model="worker_3" role="executor" refs="">Solve it.</route>\n'
        '<route model="worker_6" role="executor" refs="">Solve it again.</route><|im_end|>',
        '<route model="worker_5" role="summarizer" refs="n1,n2">Reconcile.</route><|im_end|>',
        "<answer>x</answer>"])
    assert len(t.token_source) == len(t.response_ids)
    assert [s == 0 for s in t.token_source] == [m == 0 for m in t.policy_mask]
    assert t.mode_logprob == pytest.approx(-0.25 * t.mode_span_end)
    assert t.routes == [("worker_3", "Solve it."), ("worker_6", "Solve it again."),
                        ("worker_5", "Reconcile.")]
    assert t.max_layer_width == 2 and (t.obs_blocks, t.obs_truncated) == (3, 0)
    assert t.first_call_violations == 0 and t.violations == [] and t.selector_retries == 0
    config = EnvConfig(protocol=g.ProtocolConfig(recovery=True, observation_cap=40))
    (t,), _ = run(tok, tasks[:1], ["<mode>solo</mode>", "<mode>single</mode>", "no action",
                                   '<route model="worker_3">a</route>', "<answer>q</answer>"],
                  config=config)
    assert t.selector_retries == 1 and t.violations == ["selector_mode_invalid",
                                                        "route_missing"]
    assert t.first_call_violations == 2 and (t.obs_blocks, t.obs_truncated) == (1, 1)
    assert t.mode_logprob == pytest.approx(-0.25 * 7)  # the declaring turn only
