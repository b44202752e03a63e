"""`train(config)`: the RL loop that ties data, episodes, rewards, advantages and the learner.

One step (DESIGN.md "One RL step"): query batch -> curriculum plan (forced/free per query)
-> B×K episodes on the sampler and the worker pool -> verdicts and rewards -> advantages
-> one update -> policy checkpoint (every step) and full train state (every N) -> publish the
weights to the sampler as policy version = step and check it took. Metrics go to
``metrics.jsonl`` and TensorBoard; the run ends with plots and a summary table.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from rich.console import Console

from jax_routeweaver.config import dump_config, to_dict
from jax_routeweaver.data.pipeline import PipelineConfig, QueryPipeline
from jax_routeweaver.data.records import ReadStats, Record, read_records
from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, create_sharded, make_mesh
from jax_routeweaver.models.tokenizer import (
    build_qwen3_tokenizer,
    load_tokenizer,
    prune_tokenizer,
)
from jax_routeweaver.rewards.reward import RewardConfig, score_batch
from jax_routeweaver.rl import curriculum
from jax_routeweaver.rl.batch import compute_advantages, mode_mask, pack_rollouts
from jax_routeweaver.rl.checkpoint import PolicyCheckpointer, StateCheckpointer, restore_policy
from jax_routeweaver.rl.metrics import advantage_metrics, rollout_metrics
from jax_routeweaver.rl.run_log import Progress, RunLogger, plot_run, read_metrics, summary_table
from jax_routeweaver.rl.train_config import TrainConfig
from jax_routeweaver.rl.trainer import Trainer, support_batch
from jax_routeweaver.routing import grammar as g
from jax_routeweaver.routing import prompts
from jax_routeweaver.routing.episode import EpisodeStats, run_episodes
from jax_routeweaver.routing.pricing import C_REF_USD, REFERENCE_PRICES, load_cost_ref
from jax_routeweaver.routing.routeweaver_env import EnvConfig, routeweaver_envs
from jax_routeweaver.routing.simulated import SimulatedWorkerPool, synthetic_tasks
from jax_routeweaver.routing.workers import HttpWorkerPool, load_channels
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import GrammarConstraints
from jax_routeweaver.sampling.jax_sampler import DEFAULT_BATCH_BUCKETS, JaxSampler

CONFIG_FILE = "config.yaml"


@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    last_step: int
    metrics: list[dict[str, Any]]


class SyncError(RuntimeError):
    """The sampler did not take the published weights (a silent stale policy otherwise)."""


# ------------------------------------------------------------------------------ building
def build_tokenizer(cfg: TrainConfig, records: list[Record], pool: Any) -> Any:
    """"qwen3": the real Qwen3 tokenizer (built offline); "qwen3-pruned": the same BPE pruned
    to the tokens of this run's text (`routing_corpus`); otherwise a tokenizer directory."""
    if cfg.model.tokenizer == "qwen3":
        return build_qwen3_tokenizer()
    if cfg.model.tokenizer == "qwen3-pruned":
        return prune_tokenizer(build_qwen3_tokenizer(),
                               routing_corpus(records, pool, cfg.rollout.protocol))
    return load_tokenizer(cfg.model.tokenizer)


CORPUS_REPLIES = 200  # queries whose simulated worker replies join the pruning corpus


def routing_corpus(records: list[Record], pool: Any, protocol: Any) -> list[str]:
    """The text a RouteWeaver run tokenizes: selector prompts, the three rulebooks, action
    tags, and worker replies to single/multi payloads of the first queries (the environment
    frames the rest from the same pieces)."""
    catalog = prompts.catalog_entries(pool)
    texts = [prompts.selector_prompt(r.question) for r in records]
    texts += [prompts.mode_rulebook(m, catalog, protocol) for m in g.MODES]
    texts += [g.declaration_text(m) for m in g.MODES]
    texts += [f'<route model="{w}" role="{r}" refs="n1,n2">t</route><answer>a</answer>'
              for w, _ in catalog for r in ("planner", "executor", "verifier", "summarizer")]
    if isinstance(pool, SimulatedWorkerPool):
        for record in records[:CORPUS_REPLIES]:
            payload = prompts.single_multi_payload(record.question, "Solve the task.")
            texts += [pool.respond(w, payload).text for w, _ in catalog]
    return texts


def build_policy(cfg: TrainConfig, mesh: Any, tokenizer: Any) -> Qwen3:
    """The initial policy, born sharded on `mesh` (see `ModelSection`). A random model takes
    vocab_size (rounded up to 128) and the eos/pad/bos ids from the tokenizer unless given."""
    m = cfg.model
    runtime = dict(scan_layers=m.scan_layers, remat=m.remat, logprob_chunk=m.logprob_chunk)
    if m.init == "random":
        fields = {"vocab_size": -(-len(tokenizer) // 128) * 128,
                  "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                  "bos_token_id": tokenizer.bos_token_id, **m.random}
        mc = ModelConfig(**{**fields, "param_dtype": m.param_dtype, "dtype": m.dtype,
                            **runtime})
        return create_sharded(lambda: Qwen3(mc, rngs=nnx.Rngs(cfg.seed)), mesh)
    path = Path(m.init)
    if (path / "config.json").is_file():
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    model, _ = restore_policy(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype,
                              **runtime)
    return model


def build_records(cfg: TrainConfig, console: Console) -> list[Record]:
    d = cfg.data
    if d.source == "synthetic":
        return synthetic_tasks(d.synthetic_queries, seed=d.synthetic_seed)
    stats = ReadStats()
    records = read_records(d.source, bad_rows=d.bad_rows, stats=stats)
    if stats.skipped:
        console.print(f"[yellow]{d.source}: skipped {stats.skipped} bad rows of {stats.rows}; "
                      f"first: {stats.errors[:1]}[/]")
    return records


def build_pool(cfg: TrainConfig, records: list[Record]) -> Any:
    w = cfg.workers
    if w.pool == "simulated":
        # A SIMULATION of the paid worker APIs (see routing/simulated.py).
        return SimulatedWorkerPool(records, seed=w.seed, latency_s=w.latency_s,
                                   failure_rate=w.failure_rate)
    return HttpWorkerPool(load_channels(w.pool), concurrency=w.concurrency)


def c_ref(cfg: TrainConfig) -> float:
    text = cfg.reward.c_ref.strip()
    if not text:
        return C_REF_USD
    try:
        return float(text)
    except ValueError:
        return load_cost_ref(text)


def env_config(cfg: TrainConfig, eos_id: int) -> EnvConfig:
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=(eos_id,))
    return EnvConfig(protocol=r.protocol, sampling=sampling, constrained=r.constrained,
                     answer_choices=r.answer_choices, execution_feedback=r.execution_feedback)


def mode_declarations(tokenizer: Any) -> list[list[int]]:
    """Token ids of ``<mode>m</mode>`` for single, multi, agentic (the support loss)."""
    return [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
            for m in curriculum.MODES]


# ------------------------------------------------------------------------------ the loop
class _Run:
    """The live objects of one run (kept together so `step` reads like the spec)."""

    def __init__(self, cfg: TrainConfig, console: Console):
        self.cfg, self.console = cfg, console
        self.out = Path(cfg.out_dir)
        self.records = build_records(cfg, console)
        self.pool = build_pool(cfg, self.records)
        self.tokenizer = build_tokenizer(cfg, self.records, self.pool)
        self.mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
        model = build_policy(cfg, self.mesh, self.tokenizer)
        if len(self.tokenizer) > model.config.vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the model's "
                             f"vocab_size is {model.config.vocab_size}")
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.eos_id = model.config.eos_token_id if model.config.eos_token_id is not None \
            else self.tokenizer.eos_token_id
        d = cfg.data
        self.pipeline = QueryPipeline(self.records, PipelineConfig(
            batch_size=d.batch_size, group_size=d.group_size, quotas=d.quotas or None,
            shuffle=d.shuffle, seed=d.seed, num_batches=None if d.repeat else cfg.steps,
            repeat=d.repeat))
        constraints = GrammarConstraints(self.tokenizer, model.config.vocab_size) \
            if cfg.rollout.constrained else None
        # The first round samples all B×K rows at once: make that an exact batch bucket.
        rollouts = d.batch_size * d.group_size
        buckets = sorted({*DEFAULT_BATCH_BUCKETS, rollouts} - {b for b in DEFAULT_BATCH_BUCKETS
                                                               if rollouts < b < 2 * rollouts})
        self.sampler = JaxSampler(model, decode=self.tokenizer.decode, pad_id=self.pad_id,
                                  mesh=self.mesh, rules=SAMPLE_RULES, constraints=constraints,
                                  batch_buckets=buckets)
        explore = cfg.algo.exploration
        loss = dataclasses.replace(cfg.algo.loss, support_lambda0=explore.support_lambda0,
                                   support_floor=explore.support_floor)
        self.trainer = Trainer(model, cfg.optim, loss,
                               temperature=cfg.rollout.temperature, mesh=self.mesh,
                               seed=cfg.seed)
        del model  # the sampler and the trainer hold their own copies
        self.make_env = routeweaver_envs(self.tokenizer, self.pool,
                                         env_config(cfg, self.eos_id))
        self.reward_cfg = RewardConfig(alpha=cfg.reward.alpha, c_ref=c_ref(cfg),
                                       code_scorer=cfg.reward.code_scorer)
        self.declarations = mode_declarations(self.tokenizer)
        ckpt = self.out / "checkpoints"
        self.policy_ckpt = PolicyCheckpointer(ckpt / "policy", keep=cfg.checkpoint.keep_policy)
        self.state_ckpt = StateCheckpointer(ckpt / "state", keep=cfg.checkpoint.keep_full)
        self.tokenizer_dir = self.out / "tokenizer"
        self.tokenizer.save_pretrained(str(self.tokenizer_dir))
        self.iterator = iter(self.pipeline)
        self.step = 0

    # -------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Continue from the latest full train state in the run directory, if any."""
        if not self.cfg.checkpoint.resume or self.state_ckpt.latest_step() is None:
            return False
        state, loop, step = self.state_ckpt.restore(self.trainer.state)
        # Policy steps after the restored state belong to the abandoned attempt.
        self.policy_ckpt.delete_after(step)
        self.trainer.state = state
        self.iterator.set_state(loop["data"])
        self.step = step
        self.publish(step)
        return True

    # -------------------------------------------------------------- one step
    def run_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step + 1
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        batch = next(self.iterator)
        ids = [r.sample_id for r in batch.records]
        baked = [r.forced_mode for r in batch.records]
        plans = curriculum.plan_batch(
            ids, batch.index, cfg.algo.exploration, group_size=batch.group_size,
            forced_modes=baked if all(m in curriculum.MODES for m in baked) else None)
        by_query = {p.sample_id: p for p in plans}
        records = [r.replace(forced_mode=by_query[r.sample_id].forced_mode)
                   for r in batch.records]
        if cfg.deterministic:
            self.sampler.reseed(cfg.seed * 1_000_003 + step)
        stats = EpisodeStats()
        trajs = run_episodes(records, self.sampler, self.pool, self.make_env,
                             repeats=batch.group_size, prices=REFERENCE_PRICES, stats=stats)
        times["time/rollout_s"] = time.perf_counter() - t0

        t = time.perf_counter()
        rewards = score_batch(trajs, self.reward_cfg, workers=cfg.reward.score_workers)
        times["time/reward_s"] = time.perf_counter() - t

        t = time.perf_counter()
        packed = pack_rollouts(trajs, rewards, group_size=batch.group_size, pad_id=self.pad_id,
                               row_multiple=self.trainer.row_multiple())
        estimator = cfg.algo.estimator
        adv = compute_advantages(packed, estimator, alpha=cfg.reward.alpha)
        mmask = mode_mask(packed, estimator)
        rho = curriculum.forced_ratio(batch.index, cfg.algo.exploration)
        support = None
        if cfg.algo.support and cfg.algo.exploration.support_lambda0 * rho > 0:
            selector = [prompts.selector_prompt_ids(self.tokenizer, r.question)
                        for r in batch.records]
            support = support_batch(selector, self.declarations, pad_id=self.pad_id,
                                    chunk=cfg.algo.loss.support_chunk,
                                    span=cfg.algo.mode_score_span,
                                    max_prompt=cfg.algo.support_max_prompt)
        train_metrics = self.trainer.update(
            packed.tokens, packed.positions, packed.attention_mask, packed.policy_valid,
            packed.gather(mmask), packed.gather(np.asarray(adv.token_advantages)),
            packed.clean, index=packed.policy_index,
            sampler_logp=packed.gather(packed.sampler_logp), support=support,
            support_rho=rho, num_queries=len(batch.records))
        times["time/update_s"] = time.perf_counter() - t

        t = time.perf_counter()
        self.step = step
        self.policy_ckpt.save(self.trainer.model(), step, tokenizer_dir=self.tokenizer_dir)
        if step % cfg.checkpoint.full_every == 0 or step == cfg.steps:
            self.state_ckpt.save(step, self.trainer.state,
                                 {"step": step, "data": self.iterator.get_state()})
        self.publish(step)
        times["time/checkpoint_s"] = time.perf_counter() - t
        times["time/step_s"] = time.perf_counter() - t0
        times["time/sampler_s"] = stats.sampler_s
        times["time/workers_s"] = stats.workers_s

        metrics = rollout_metrics(trajs, rewards, group_size=batch.group_size)
        metrics |= advantage_metrics(adv, forced=packed.forced, clean=packed.clean,
                                     response_mask=packed.response_mask, mode_token_mask=mmask)
        metrics |= train_metrics | times
        metrics |= {"curriculum/rho": rho, "curriculum/batch_index": float(batch.index),
                    "policy/version": float(self.sampler.policy_version),
                    "episode/rounds": float(stats.rounds)}
        return metrics

    def publish(self, version: int) -> None:
        """Hand the new weights to the sampler as policy version `version` and verify."""
        self.sampler.update_weights(self.trainer.state.params, version)
        if self.sampler.policy_version != version:
            raise SyncError(f"sampler reports policy version {self.sampler.policy_version} "
                            f"after publishing {version}")

    def close(self) -> None:
        self.policy_ckpt.close()
        self.state_ckpt.close()


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainResult:
    """Run `cfg.steps` RL steps (resuming a run in `cfg.out_dir` when allowed)."""
    console = console or Console()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, out / CONFIG_FILE)
    run = _Run(cfg, console)
    try:
        resumed = run.resume()
        if resumed:
            console.print(f"resuming {out} after step {run.step}")
        with RunLogger(out, jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                       resume=resumed) as log:
            if resumed:
                log.truncate_after(run.step)
            with Progress(cfg.steps, start=run.step, enabled=cfg.logging.progress,
                          console=console) as progress:
                while run.step < cfg.steps:
                    metrics = run.run_step()
                    log.log(run.step, metrics)
                    progress.update(run.step, metrics)
    finally:
        run.close()
    records = read_metrics(out / "metrics.jsonl") if cfg.logging.jsonl else []
    if cfg.logging.plots and records:
        plot_run(records, out)
    if records:
        w = cfg.logging.summary_window
        console.print(summary_table(records, first=w, last=w))
    (out / "run.json").write_text(json.dumps({"last_step": run.step,
                                              "config": to_dict(cfg)}, indent=1))
    return TrainResult(out, run.step, records)
