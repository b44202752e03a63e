"""Router-R1 as one configuration of `train()` (``rollout.dialect: router_r1``): the
`RouterR1Dialect` the loop and the evaluator hold (`rl.run.dialect`).

What differs from a RouteWeaver run, and nothing else: episodes come from `router_r1_envs`
(model names mapped onto the pool's worker ids), rewards from Router-R1's hierarchical reward
with one `CostWindow` owned by the run (saved in the full train state, so a resumed run keeps
normalising costs against the same window; docs/paper_configs.md, "configs/router_r1.yaml"), and
the rows handed to the estimator, the trainer and the metrics are the same `Rewards` a
RouteWeaver step makes. The advantage is PPO's with a critic (``algo.estimator: ppo_gae``,
`rl.learner.ppo`; the paper's recipe) or GRPO grouped by query (``grpo_gated``), with the global
token-mean (enforced by `check_train_config`); there is no curriculum, no mode token and no
support loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_routeweaver.data.pipeline import QueryBatch
from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards import reward as rw
from jax_routeweaver.rewards.router_r1_reward import (
    CostWindow,
    RouterR1Reward,
    RouterR1RewardConfig,
    trajectory_reward,
    worker_prices,
)
from jax_routeweaver.rl.run.dialect import stop_ids
from jax_routeweaver.rl.run.train_config import RouterR1ScoreConfig, TrainConfig, router_r1_config
from jax_routeweaver.routing.episodes.episode import EnvFactory, Trajectory
from jax_routeweaver.routing.episodes.router_r1_env import (
    Constraints,
    TagFreeReplies,
    answer_text,
    default_model_workers,
    router_r1_envs,
    search_text,
    strip_tags,
    think_text,
)
from jax_routeweaver.routing.pools.pricing import Prices
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.protocol.calls import WorkerPool
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.sampling.base import SamplingParams

WINDOW_KEY = "cost_window"  # the `loop` item's key for the CostWindow state


def router_r1_pool(pool: WorkerPool) -> WorkerPool:
    """The pool a Router-R1 run calls: the simulated pool without its `<answer>` tags (see
    `TagFreeReplies`), any other pool as it is."""
    return TagFreeReplies(pool) if isinstance(pool, SimulatedWorkerPool) else pool


def model_workers(cfg: TrainConfig, pool: WorkerPool) -> dict[str, str]:
    """Router-R1 model name -> worker id: ``rollout.router_r1.models``, or the six prompt
    models onto the pool's first six workers (worker_1..6 of the simulated pool). A worker
    id the pool does not offer is a ValueError naming it."""
    mapping = dict(cfg.rollout.router_r1.models) or default_model_workers(pool.worker_ids())
    offered = set(pool.worker_ids())
    missing = {n: w for n, w in mapping.items() if w not in offered}
    if missing:
        raise ValueError(f"rollout.router_r1.models maps onto workers the pool does not offer: "
                         f"{missing}; offered: {sorted(offered)}")
    return mapping


def env_factory(cfg: TrainConfig, tokenizer: Any, workers: Mapping[str, str],
                stop_token_ids: Sequence[int]) -> EnvFactory:
    """`router_r1_envs` for this run: rollout sampling (no stop strings, as upstream; the
    turn is cut at its first closing tag), and the grammar when ``rollout.constrained``."""
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens,
                              stop_token_ids=tuple(stop_token_ids))
    constraints = Constraints(answer_choices=r.answer_choices,
                              question_query=r.router_r1.question_query) \
        if r.constrained else None
    return router_r1_envs(tokenizer, workers, config=router_r1_config(cfg), sampling=sampling,
                          constraints=constraints)


CORPUS_REPLIES = 200  # queries whose simulated worker replies join the pruning corpus


def routing_corpus(cfg: TrainConfig, records: Sequence[Record], pool: WorkerPool) -> list[str]:
    """The text a Router-R1 run tokenizes (for `prune_tokenizer`): the prompt (once in full,
    then each record's question line), the actions the grammar writes, the observation
    framing, and simulated replies to the first queries."""
    variant = cfg.rollout.router_r1.prompt_variant
    texts = [r1.render_prompt_text(records[0].question, variant=variant)] if records else []
    texts += [f"Question: {r1.normalize_question(r.question)}\n\n" for r in records]
    names = [m.name for m in r1.ALL_MODELS]
    texts += [think_text("t") + search_text(n, "q") + answer_text("a") for n in names]
    texts += [r1.render_observation("x"), r1.render_observation(None)]
    sim = pool.pool if isinstance(pool, TagFreeReplies) else pool
    if isinstance(sim, SimulatedWorkerPool):
        workers = list(model_workers(cfg, sim).values())
        for record in records[:CORPUS_REPLIES]:
            prompt = r1.render_worker_prompt(f" {record.question.strip()} ")
            texts += [strip_tags(sim.respond(w, prompt).text) for w in workers]
    return texts


def as_rewards(traj: Trajectory, r: RouterR1Reward) -> rw.Rewards:
    """The row the estimator, trainer and metrics read. ``r_task`` is Router-R1's reward;
    a failed worker call is part of the episode, as upstream: the policy saw a `None`
    observation, the call costs 0, and the row is scored and trained like any other
    (`RouterR1Env.failed_call_is_infra`); only `traj.infra_failed` (a loop error) makes it
    infra.
    ``correct`` is the outcome (EM = 1, or F1 > 0) whatever the format, as upstream reports
    EM; the format gate is in the reward. Failure kinds map onto RouteWeaver's, first match:
    wrapper_error (a loop error), provider_error (other infra), parser_error (a format
    violation), correct, genuine_incorrect.
    ``cost_usd`` is the raw cost (micro-dollars) in USD; an unknown cost (a worker's usage
    missing or implausible) makes the row infra too: its reward cannot be computed."""
    failed = sum(not c.success for c in traj.calls)
    infra = traj.infra_failed or r.raw_cost is None  # no reward without a cost
    kind = rw.WRAPPER_ERROR if rw.has_marker(traj, rw.WRAPPER_MARKERS) \
        else rw.PROVIDER_ERROR if infra else rw.PARSER_ERROR if r.violations \
        else rw.CORRECT if r.correct else rw.GENUINE_INCORRECT
    return rw.Rewards(
        r_task=0.0 if infra else r.reward, r_eff=0.0, infra=infra, s_cost=r.cost_score,
        cost_usd=(r.raw_cost or 0.0) * 1e-6, cost_complete=r.raw_cost is not None,
        failure_kind=kind,
        correct=r.correct and not infra, router_answer_correct=r.correct and not infra,
        em=r.em, f1=r.f1, violation=r.violations[0] if r.violations else None,
        clean=not infra, failed_calls=failed)


class RouterR1Scorer:
    """Router-R1's reward for a run: one `CostWindow` of ``window_size`` that every scored
    trajectory updates in batch order (so it is part of the train state: `state_dict`)."""

    def __init__(self, section: RouterR1ScoreConfig, workers: Mapping[str, str],
                 decode: Callable[[Sequence[int]], str]):
        self.config = RouterR1RewardConfig(alpha=section.cost_coe, metric=section.metric)
        self.prices = worker_prices(workers)
        self.decode = decode
        self.window = CostWindow(section.window_size)

    def score(self, trajs: Sequence[Trajectory]) -> tuple[list[rw.Rewards], list[RouterR1Reward]]:
        """(rows for the learner, Router-R1 diagnostics), in `trajs` order."""
        details = [trajectory_reward(t, self.decode, self.prices, self.window, self.config)
                   for t in trajs]
        return [as_rewards(t, r) for t, r in zip(trajs, details, strict=True)], details

    def state_dict(self) -> dict[str, Any]:
        return self.window.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the window; a saved size other than this run's is a ValueError (the
        normalisation would silently change)."""
        if state.get("size") != self.window.size:
            raise ValueError(f"saved Router-R1 cost window has size {state.get('size')!r}, "
                             f"reward.router_r1.window_size is {self.window.size}")
        self.window.load_state_dict(state)



class RouterR1Dialect:
    """The Router-R1 `Dialect`: no modes and no curriculum; calls are priced by Router-R1's
    own table inside its reward; one `RouterR1Scorer` (its cost window) for the whole run,
    saved with the full train state under `WINDOW_KEY`."""

    has_modes = False

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.scorer: RouterR1Scorer | None = None
        self.make_env: EnvFactory | None = None

    def worker_pool(self, pool: WorkerPool) -> WorkerPool:
        return router_r1_pool(pool)

    def corpus(self, records: Sequence[Record], pool: WorkerPool) -> list[str]:
        return routing_corpus(self.cfg, records, pool)

    def start(self, tokenizer: Any, pool: WorkerPool, eos_id: int | tuple[int, ...]) -> None:
        workers = model_workers(self.cfg, pool)
        self.make_env = env_factory(self.cfg, tokenizer, workers, stop_ids(eos_id))
        self.scorer = RouterR1Scorer(
            self.cfg.reward.router_r1, workers,
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt_ids(self, tokenizer: Any, question: str) -> list[int]:
        """Router-R1's chat prompt (`routing.protocol.router_r1.render_chat_prompt`), before the
        episode keeps its last ``rollout.router_r1.start_max_tokens``."""
        text = r1.render_chat_prompt(question, tokenizer,
                                     variant=self.cfg.rollout.router_r1.prompt_variant)
        return list(tokenizer.encode(text, add_special_tokens=False))

    def plan(self, batch: QueryBatch) -> list[Record]:
        return list(batch.records)  # no modes to force

    def forced_ratio(self, batch_index: int) -> float:
        return 0.0  # check_train_config keeps the curriculum off

    def prices(self, pool: WorkerPool) -> Prices | None:
        return None  # Router-R1 costs calls with its own price table, in its reward

    def score(self, trajs: Sequence[Trajectory]
              ) -> tuple[list[rw.Rewards], list[RouterR1Reward]]:
        return self.scorer.score(trajs)

    def state_dict(self) -> dict[str, Any]:
        return {WINDOW_KEY: self.scorer.state_dict()}

    def load_state_dict(self, loop: Mapping[str, Any], where: Any) -> None:
        if WINDOW_KEY not in loop:
            raise ValueError(f"{where}: the saved loop state has no Router-R1 cost window "
                             "(not a router_r1 run?)")
        self.scorer.load_state_dict(loop[WINDOW_KEY])

    def step_metrics(self, rho: float) -> dict[str, float]:
        return {}  # no curriculum, so no ρ to log (0 would read as "annealed")
