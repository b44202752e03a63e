"""Router-R1 as a configuration of `train()`: a tiny constrained run, exact resume with the
cost window in the saved state, and the config rules of ``rollout.dialect: router_r1``."""

import io
import math
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from jax_routeweaver.config import ConfigError
from jax_routeweaver.rewards.router_r1_reward import CostWindow
from jax_routeweaver.rl.run.checkpoint import STATE_ITEM, StateCheckpointer
from jax_routeweaver.rl.run.loop import train
from jax_routeweaver.rl.run.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "router_r1_quickstart.yaml"
PAPER = ROOT / "configs" / "router_r1.yaml"
BATCH, K = 2, 2
# 2 queries (MATH, RECALL) x 2 rollouts, one routed turn then the answer turn, the prompt's
# last 128 tokens, 128 tokens per turn (room for the longest free action, 109), full state
# every step; one micro-batch (a micro-batch must split over the 8 fake devices).
TINY = [f"data.batch_size={BATCH}", f"data.group_size={K}", "data.quotas={MATH: 1, RECALL: 1}",
        "data.synthetic_queries=60", "rollout.max_new_tokens=128",
        "rollout.router_r1.max_turns=1", "rollout.router_r1.start_max_tokens=128",
        "rollout.router_r1.trajectory_max_tokens=768", "checkpoint.full_every=1",
        "checkpoint.keep_full=3",
        "algo.loss.micro_batch_size=0", "logging.progress=false", "logging.tensorboard=false",
        "logging.plots=false"]


def run(out: Path, steps: int, extra: tuple[str, ...] | list[str] = ()) -> list[dict]:
    cfg = load_train_config(QUICKSTART, [*TINY, f"out_dir={out}", f"steps={steps}", *extra])
    return train(cfg, console=Console(file=io.StringIO())).metrics


def comparable(records: list[dict]) -> list[dict]:
    """Per-step metrics without wall-clock times."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def saved_loop(out: Path, step: int) -> dict:
    with StateCheckpointer(out / "checkpoints" / "state", keep=None) as ckpt:
        return ckpt.read_loop(step)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An uninterrupted 3-step run (shared by the tests below)."""
    out = tmp_path_factory.mktemp("r1") / "whole"
    return out, run(out, 3)


@pytest.mark.slow
def test_tiny_run_logs_router_r1_metrics_and_only_valid_episodes(whole):
    _, records = whole
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("r1/em", "r1/f1", "r1/format_score", "r1/format_ok_rate", "r1/cost_raw",
                    "r1/cost_score", "r1/routes", "r1/calls", "r1/answered_rate",
                    "reward/mean", "accuracy/mean", "violation/rate", "adv/grpo_abs_mean"):
            assert math.isfinite(r[key]), key
        # A random-init router under the grammar: every episode valid and answered.
        assert r["violation/rate"] == 0.0 and r["r1/format_ok_rate"] == 1.0
        assert r["r1/format_score"] == 0.0 and r["r1/unrouted_turns"] == 0.0
        assert r["r1/answered_rate"] == 1.0 and r["finish/answer"] == 1.0
        assert r["infra/dirty_rate"] == 0.0
        assert r["r1/calls"] <= 1.0  # max_turns=1: at most one routed turn
        # No mode, curriculum or mode-segment metric for mode-less rows.
        assert not [k for k in r if k.startswith(("mode/", "adv/mode", "adv/inner",
                                                  "tokens/mode", "reward/by_mode",
                                                  "curriculum/rho", "groups/unique_modes"))]
    assert sum(r["r1/calls"] for r in records) > 0  # the grammar lets it route, too


@pytest.mark.slow
def test_resume_continues_with_the_saved_cost_window(whole, tmp_path):
    whole_dir, expected = whole
    # A run killed while saving step 3's full state: its files, without that state. A fresh
    # process resumes from step 2's state (the cost window included) and redoes step 3.
    part = tmp_path / "part"
    shutil.copytree(whole_dir, part)
    shutil.rmtree(part / "checkpoints" / "state" / "3")
    resumed = run(part, 3)
    assert comparable(resumed) == comparable(expected)

    # The window is in the saved loop state: one sqrt-cost per trajectory, in batch order,
    # step 3's window continuing step 2's; the same in both runs.
    rows = BATCH * K
    windows = {s: saved_loop(part, s)["cost_window"] for s in (1, 2, 3)}
    assert windows[3] == saved_loop(whole_dir, 3)["cost_window"]
    for s, window in windows.items():
        assert window["size"] == 1000 and len(window["values"]) == rows * s
        if s > 1:
            assert window["values"][:-rows] == windows[s - 1]["values"]
        step_x = window["values"][-rows:]  # x = sqrt(raw cost) of this step's rows
        assert sum(x * x for x in step_x) / rows == pytest.approx(
            expected[s - 1]["r1/cost_raw"], rel=1e-9, abs=1e-9)

    # Step 3's cost scores need the restored window: replaying its costs on step 2's
    # window gives the logged mean; on a fresh window it would not.
    def replay(window: CostWindow) -> float:
        return sum(window.update(x * x) for x in windows[3]["values"][-rows:]) / rows

    assert replay(CostWindow.from_state_dict(windows[2])) == pytest.approx(
        expected[2]["r1/cost_score"], abs=1e-9)
    assert replay(CostWindow()) != pytest.approx(expected[2]["r1/cost_score"], abs=1e-6)


# ------------------------------------------------------------------------------ PPO + critic
PPO = ["algo.estimator=ppo_gae", "data.group_size=1", "algo.loss.kl_coef=0",
       "algo.critic.lr=0.001", "algo.loss.ppo_mini_batches=2", "data.batch_size=4",
       "data.quotas={MATH: 2, RECALL: 2}"]


@pytest.fixture(scope="module")
def ppo_whole(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("r1ppo") / "whole"
    return out, run(out, 3, PPO)


@pytest.mark.slow
def test_ppo_run_trains_its_critic_and_resumes_exactly(ppo_whole, tmp_path):
    whole_dir, expected = ppo_whole
    for r in expected:
        for key in ("critic/vf_loss", "critic/grad_norm", "ppo_gae/returns_mean",
                    "ppo_gae/kl_mean", "adv/gae_abs_mean", "loss/pg"):
            assert math.isfinite(r[key]), key
        assert "adv/grpo_abs_mean" not in r  # no group advantage with a critic
    # The critic's state is in the full checkpoint next to the policy's.
    with StateCheckpointer(whole_dir / "checkpoints" / "state", keep=None) as ckpt:
        leaves = ckpt._manager.item_metadata(3)[STATE_ITEM]
    names = list(getattr(leaves, "tree", leaves))
    assert any("critic" in n for n in names) and any("policy" in n for n in names)
    # Killed while saving step 3: the resumed run restores policy, critic and cost window
    # from step 2 and repeats step 3 exactly (the critic's values feed the advantages).
    part = tmp_path / "part"
    shutil.copytree(whole_dir, part)
    shutil.rmtree(part / "checkpoints" / "state" / "3")
    assert comparable(run(part, 3, PPO)) == comparable(expected)


def test_ppo_gae_is_router_r1_only_and_its_sections_need_it():
    with pytest.raises(ConfigError, match=r"algo\.estimator.*router_r1"):
        load_train_config(ROOT / "configs" / "quickstart.yaml", ["algo.estimator=ppo_gae"])
    with pytest.raises(ConfigError, match=r"algo\.critic"):
        load_train_config(QUICKSTART, ["algo.critic.lr=0.1"])
    with pytest.raises(ConfigError, match=r"algo\.gae"):
        load_train_config(QUICKSTART, ["algo.gae.lam=0.9"])
    with pytest.raises(ConfigError, match=r"algo\.gae\.gamma"):
        load_train_config(PAPER, ["algo.gae.gamma=1.5"])


@pytest.mark.parametrize("override, key", [
    ("algo.estimator=comet_grpo", "algo.estimator"),
    ("algo.estimator=comet_gdpo", "algo.estimator"),
    ("algo.support=true", "algo.support"),
    ("algo.loss.reduction=segment", "algo.loss.reduction"),
    ("algo.exploration.forced_start_batch=3", "algo.exploration.forced_start_batch"),
    ("reward.alpha=0.5", "reward.alpha"),
    ("reward.router_r1.cost_coe=1.5", "reward.router_r1.cost_coe"),
    ("rollout.max_new_tokens=64", "rollout.max_new_tokens"),
    ("rollout.router_r1.max_turns=0", "rollout.router_r1"),
    ("rollout.router_r1.models={GPT-9: worker_1}", "rollout.router_r1.models"),
    ("rollout.router_r1.models={Granite-3.0-8B-Instruct: worker_1}",
     "rollout.router_r1.models"),
])
def test_router_r1_rejects_mode_options_and_bad_values(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_train_config(QUICKSTART, [override])


def test_dialect_and_router_r1_sections_are_checked():
    with pytest.raises(ConfigError, match=r"rollout\.dialect.*router_r1"):
        load_train_config(QUICKSTART, ["rollout.dialect=router-r1"])
    # Router-R1 settings in a RouteWeaver run are an error, not silently ignored.
    with pytest.raises(ConfigError, match=r"reward\.router_r1"):
        load_train_config(ROOT / "configs" / "quickstart.yaml", ["reward.router_r1.cost_coe=0.5"])
    with pytest.raises(ConfigError, match=r"model\.path"):
        load_train_config(PAPER, ["model.path="])


def test_paper_config_maps_the_reference_hyper_parameters():
    cfg = load_train_config(PAPER)
    assert cfg.rollout.dialect == "router_r1" and cfg.model.init == "hf"
    assert cfg.model.path == cfg.model.tokenizer  # one placeholder for both
    assert (cfg.optim.lr, cfg.algo.loss.clip_low, cfg.algo.loss.clip_high) == (1e-6, 0.2, 0.2)
    # PPO with a critic: γ = λ = 1, whitened GAE, KL 0.001 in the reward and no KL loss,
    # critic lr 1e-5 and value clip 0.5, one rollout per prompt, two mini-batches.
    assert cfg.algo.estimator == "ppo_gae" and cfg.data.group_size == 1
    g, c = cfg.algo.gae, cfg.algo.critic
    assert (g.gamma, g.lam, g.whiten, g.reward_kl_coef) == (1.0, 1.0, True, 0.001)
    assert (c.lr, c.value_clip, c.grad_clip) == (1e-5, 0.5, 1.0)
    assert (cfg.algo.loss.kl_coef, cfg.algo.loss.entropy_coef) == (0.0, 0.001)
    assert cfg.algo.loss.ppo_mini_batches == 2
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == (
        1.0, 0.95, 1024)
    r = cfg.rollout.router_r1
    assert (r.max_turns, r.start_max_tokens, r.context_max_tokens, r.obs_max_tokens) == (
        4, 2048, 4096, 600)
    assert cfg.data.batch_size == 64 and cfg.reward.router_r1.metric == "em"


# ------------------------------------------------------------------------------ grammar
def random_action(constraints, grammar, rng) -> list[int]:
    """Token ids of a uniformly random walk through `grammar` until it completes."""
    import numpy as np

    matcher = constraints.matcher(grammar)
    row = np.empty((1, constraints.words), np.int32)
    ids: list[int] = []
    while not matcher.is_terminated():
        constraints.fill([matcher], row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:constraints.vocab_size]
        token = int(rng.choice(np.flatnonzero(bits)))
        assert matcher.accept_token(token)
        ids.append(token)
        assert len(ids) <= 400, "the grammar did not complete"
    return ids


@pytest.mark.slow
def test_every_constrained_episode_passes_router_r1_format_check():
    """Random walks through the per-turn grammars (what a random-init router does), stitched
    into episodes with real observations: every action parses as intended, fits the bound
    the turn cap is checked against, and the whole response passes Router-R1's format check."""
    import numpy as np

    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.routing.episodes.router_r1_env import (
        max_action_bytes,
        router_r1_grammar,
        valid_queries,
    )
    from jax_routeweaver.routing.protocol import router_r1 as r1
    from jax_routeweaver.sampling.constraints import GrammarConstraints

    tok = build_qwen3_tokenizer()  # the cache the training runs above use
    constraints = GrammarConstraints(tok, len(tok))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    cfg = r1.RouterR1Config(max_turns=2)
    models = [m.name for m in r1.PROMPT_MODELS]
    question = "Which river flows through the city of Zendorselheim?"
    queries = valid_queries([question, "a: b"], models)
    assert queries == (question,)
    rng = np.random.default_rng(0)
    routed = 0
    for episode in range(12):
        answers = ("Kawynen River", "7") if episode % 2 else ()
        response, state = "", r1.EpisodeState()
        while True:
            grammar = router_r1_grammar(state, cfg, models, queries=queries if episode % 3
                                        else (), answers=answers)
            ids = random_action(constraints, grammar, rng)
            assert len(ids) <= max_action_bytes(models, queries, answers)
            text = decode(ids)
            assert r1.cut_turn_text(text) == text  # ends at its closing tag
            action = r1.parse_action(text)
            response += text
            decision = r1.decide_turn(state, action, cfg)
            if isinstance(decision, r1.EndEpisode):
                assert isinstance(action, r1.AnswerAction) and decision.reason == "answer"
                if answers and r1.is_final_turn(state, cfg):
                    assert action.answer in answers
                break
            assert isinstance(decision, r1.CallWorker), decision
            response += r1.render_observation("Step 1: recall it. So the answer is 7.")
            state = r1.advance(state, decision)
            routed += 1
        assert r1.format_violations(response) == (), response
    assert routed >= 3


# ------------------------------------------------------------------------------ metrics
def test_rollout_metrics_of_router_r1_rows():
    """No mode keys (a mode-less row would read as an "invalid" mode), violations are the
    format violations (a row may have several), and the r1/* means."""
    from jax_routeweaver.rewards.router_r1_reward import router_r1_reward
    from jax_routeweaver.rl.reports.metrics import rollout_metrics
    from jax_routeweaver.rl.run.router_r1_run import as_rewards
    from jax_routeweaver.routing.episodes.episode import Trajectory
    from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall
    from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

    record = synthetic_tasks(1, seed=0)[0]  # MATH, gold "158"
    ok = "<think> a </think>\n<answer> 158 </answer>"
    routed = ("<think> a </think>\n<search> Qwen2.5-7B-Instruct: q </search>\n\n<information>x"
              "</information>\n\n<answer> 7 </answer>")
    bad = "<answer> 158 </answer><answer> 158 </answer>"  # no think, two answers
    call = WorkerCall("worker_1", "p", "x", True, Usage(10, 100))
    window = CostWindow()
    rows = []
    for response, calls in ((ok, []), (routed, [call]), (bad, []), (ok, [])):
        traj = Trajectory(record, 0, [1], calls=list(calls), finish="answer", turns=1)
        cost = 100 * 0.30 if calls else 0.0
        rows.append((traj, router_r1_reward(response, record.gold, cost, window)))
    trajs = [t for t, _ in rows]
    details = [d for _, d in rows]
    m = rollout_metrics(trajs, [as_rewards(t, d) for t, d in rows], group_size=2,
                        router_r1=details)
    assert not [k for k in m if k.startswith(("mode/", "reward/by_mode", "cost/usd_by_mode",
                                              "routing/", "curriculum/", "groups/unique"))]
    assert m["violation/rate"] == 0.25
    assert m["violation/answer_count"] == m["violation/no_think"] == 0.25
    assert m["r1/format_ok_rate"] == 0.75 and m["r1/format_score"] == -0.25
    # Accuracy is EM whatever the format (as upstream reports it); the reward gates on format.
    assert m["r1/em"] == m["accuracy/mean"] == 0.75
    assert m["r1/calls"] == m["r1/routes"] == 0.25
    assert m["r1/cost_raw"] == pytest.approx(30.0 / 4)
    # No row with a known raw cost: the key is left out (a None would break the run log).
    import dataclasses

    from jax_routeweaver.rl.reports.metrics import router_r1_metrics
    unknown = [dataclasses.replace(d, raw_cost=None) for d in details]
    assert "r1/cost_raw" not in router_r1_metrics(trajs, unknown)
    assert m["reward/mean"] == pytest.approx(sum(d.reward for d in details) / 4)
    assert m["failure_kind/parser_error"] == 0.25
