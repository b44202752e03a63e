"""RouteWeaver as the loop runs it: its environment, reward and curriculum (`RouteWeaverDialect`).

The router declares a mode, the curriculum forces some queries' modes (docs/algorithm.md,
"Curriculum"), calls are billed at the pool's prices, and trajectories are scored by
`rewards.reward.score_batch` under the run's `RewardConfig`. The helpers here (`env_config`,
`reward_config`, `c_ref`, `routing_corpus`, `mode_declarations`) are shared with evaluation and
the stand-in's distillation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.data.pipeline import QueryBatch
from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.feedback import execution_feedback
from jax_routeweaver.rewards.reward import RewardConfig, Rewards, score_batch
from jax_routeweaver.rl.core.support import SupportBatch, support_batch
from jax_routeweaver.rl.learner import curriculum
from jax_routeweaver.rl.run.dialect import stop_ids
from jax_routeweaver.rl.run.pool_check import run_price_table_version
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.episodes.episode import EnvFactory, Trajectory
from jax_routeweaver.routing.episodes.routeweaver_env import (
    NO_CANDIDATE_ANSWER,
    EnvConfig,
    routeweaver_envs,
)
from jax_routeweaver.routing.pools.pricing import C_REF_USD, Prices, load_cost_ref, pool_prices
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol import prompts
from jax_routeweaver.routing.protocol.calls import WorkerPool
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.sampling.base import SamplingParams

CORPUS_REPLIES = 200  # queries whose simulated worker replies join the pruning corpus


def routing_corpus(records: Sequence[Record], pool: Any, protocol: Any,
                   task_text: str = "", rulebook: str = "reference") -> list[str]:
    """The text a RouteWeaver run tokenizes: selector prompts, the three rulebooks, action
    tags (with the fixed `task_text`, if any), and worker replies to single/multi payloads of
    the first queries (the environment frames the rest from the same pieces)."""
    catalog = prompts.catalog_entries(pool)
    texts = [prompts.selector_prompt(r.question) for r in records]
    rules = prompts.compact_rulebook if rulebook == "compact" else prompts.mode_rulebook
    texts += [rules(m, catalog, protocol) for m in g.MODES]
    texts += [g.declaration_text(m) for m in g.MODES]
    texts += [f'<route model="{w}" role="{r}" refs="n1,n2">{task_text or "t"}</route>'
              f'<answer>{NO_CANDIDATE_ANSWER}</answer>'
              for w, _ in catalog for r in ("planner", "executor", "verifier", "summarizer")]
    if isinstance(pool, SimulatedWorkerPool):
        for record in records[:CORPUS_REPLIES]:
            payload = prompts.single_multi_payload(record.question, "Solve the task.")
            texts += [pool.respond(w, payload).text for w, _ in catalog]
    return texts


def c_ref(cfg: TrainConfig) -> float:
    """C_ref in USD: the config's number, a `cost_ref.json` it names, or the original's."""
    if isinstance(cfg.reward.c_ref, int | float):
        return float(cfg.reward.c_ref)
    text = cfg.reward.c_ref.strip()
    if not text:
        return C_REF_USD
    try:
        return float(text)
    except ValueError:
        return load_cost_ref(text, price_table_version=run_price_table_version(cfg))


def reward_config(cfg: TrainConfig) -> RewardConfig:
    """The run's `RewardConfig` (training, evaluation and `eval favourites` alike): alpha,
    C_ref (`c_ref`), the code scorer, and the recovery branch of the task reward when the
    protocol runs with recovery (``rollout.protocol.recovery``)."""
    return RewardConfig(alpha=cfg.reward.alpha, c_ref=c_ref(cfg),
                        recovery=cfg.rollout.protocol.recovery,
                        code_scorer=cfg.reward.code_scorer)


def env_config(cfg: TrainConfig, eos_id: int | tuple[int, ...]) -> EnvConfig:
    """The RouteWeaver environment of ``cfg.rollout``: its protocol, sampling (stopping at the
    model's EOS ids), grammar, offered workers, and its execution-feedback port bound to the
    default sandbox (when ``rollout.execution_feedback`` is on)."""
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids(eos_id))
    return EnvConfig(protocol=r.protocol, sampling=sampling, constrained=r.constrained,
                     answer_choices=r.answer_choices, task_text=r.task_text,
                     rulebook=r.rulebook,
                     feedback=execution_feedback() if r.execution_feedback else None,
                     offered=tuple(cfg.workers.offered))


def declaration_rows(cfg: TrainConfig, tokenizer: Any, records: Sequence[Record], *,
                     rho: float) -> SupportBatch | None:
    """The declaration rows of a batch's queries (``selector prompt + <mode>m</mode>`` for
    each mode, `rl.core.support.support_batch`), scored by the learner for the minimum-support
    loss and the per-question mode floor; None when neither has weight this batch (the
    support loss: ``algo.support`` on and ``support_lambda0 · rho`` > 0; the floor:
    `curriculum.question_floor_weight` > 0). ``records``: the batch's queries, their
    ``forced_mode`` as the curriculum planned them."""
    algo = cfg.algo
    support = algo.support and algo.exploration.support_lambda0 * rho > 0
    if not (support or curriculum.question_floor_weight(rho, algo.exploration) > 0):
        return None
    selector = [prompts.selector_prompt_ids(tokenizer, r.question) for r in records]
    return support_batch(selector, mode_declarations(tokenizer),
                         pad_id=tokenizer.pad_token_id or 0, chunk=algo.loss.support_chunk,
                         span=algo.mode_score_span, max_prompt=algo.support_max_prompt,
                         constrained=cfg.rollout.constrained,
                         forced=[r.forced_mode is not None for r in records])


def mode_declarations(tokenizer: Any) -> list[list[int]]:
    """Token ids of ``<mode>m</mode>`` for single, multi, agentic (the support loss)."""
    return [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
            for m in curriculum.MODES]


class RouteWeaverDialect:
    """The RouteWeaver `Dialect`: mode declarations, the forced-mode curriculum, calls billed
    at the pool's prices, the RouteWeaver reward."""

    has_modes = True

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.reward_cfg: RewardConfig | None = None
        self.make_env: EnvFactory | None = None

    def worker_pool(self, pool: WorkerPool) -> WorkerPool:
        return pool

    def corpus(self, records: Sequence[Record], pool: WorkerPool) -> list[str]:
        r = self.cfg.rollout
        return routing_corpus(records, pool, r.protocol, r.task_text, r.rulebook)

    def start(self, tokenizer: Any, pool: WorkerPool, eos_id: int | tuple[int, ...]) -> None:
        self.make_env = routeweaver_envs(tokenizer, pool, env_config(self.cfg, eos_id))
        self.reward_cfg = reward_config(self.cfg)

    def prompt_ids(self, tokenizer: Any, question: str) -> list[int]:
        """The selector prompt (`routing.protocol.prompts.selector_prompt_ids`)."""
        return prompts.selector_prompt_ids(tokenizer, question)

    def plan(self, batch: QueryBatch) -> list[Record]:
        """The curriculum's forced modes on this batch's queries (records that carry a
        forced mode of their own keep it)."""
        ids = [r.sample_id for r in batch.records]
        baked = [r.forced_mode for r in batch.records]
        plans = curriculum.plan_batch(
            ids, batch.index, self.cfg.algo.exploration, group_size=batch.group_size,
            forced_modes=baked if all(m in curriculum.MODES for m in baked) else None)
        by_query = {p.sample_id: p for p in plans}
        return [r.replace(forced_mode=by_query[r.sample_id].forced_mode)
                for r in batch.records]

    def forced_ratio(self, batch_index: int) -> float:
        return curriculum.forced_ratio(batch_index, self.cfg.algo.exploration)

    def prices(self, pool: WorkerPool) -> Prices | None:
        return pool_prices(pool)

    def score(self, trajs: Sequence[Trajectory]) -> tuple[list[Rewards], None]:
        rewards = score_batch(trajs, self.reward_cfg, workers=self.cfg.reward.score_workers)
        return rewards, None

    def state_dict(self) -> dict[str, Any]:
        return {}  # the reward has no state

    def load_state_dict(self, loop: Mapping[str, Any], where: Any) -> None:
        return None

    def step_metrics(self, rho: float) -> dict[str, float]:
        return {"curriculum/rho": rho}
