"""`train(config)`: the RL loop that ties data, episodes, rewards, advantages and the learner.

One step (docs/design.md, "One RL step"): query batch -> curriculum plan (forced/free per query)
-> B×K episodes on the sampler and the worker pool -> verdicts and rewards -> advantages
-> one update -> policy checkpoint (every step) and full train state (every N) -> publish the
weights to the sampler as policy version = step and check it took. Metrics go to
``metrics.jsonl`` and TensorBoard; the run ends with plots and a summary table.

``rollout.dialect: router_r1`` runs Router-R1 in the same loop (`router_r1_run`): its
episodes and reward, no curriculum, PPO with a critic (``ppo_gae``, `rl.ppo`) or GRPO grouped
by query; its cost window (and the critic) are saved with the full train state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from rich.console import Console

from jax_routeweaver.config import dump_config, redact_secrets, to_dict
from jax_routeweaver.data.pipeline import PipelineConfig, QueryBatch, QueryPipeline
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
from jax_routeweaver.rl import curriculum, distributed, ppo, stand_in
from jax_routeweaver.rl import router_r1_run as r1run
from jax_routeweaver.rl.batch import (
    check_query_groups,
    compute_advantages,
    mode_mask,
    pack_rollouts,
)
from jax_routeweaver.rl.checkpoint import (
    PolicyCheckpointer,
    StateCheckpointer,
    list_steps,
    restore_policy,
)
from jax_routeweaver.rl.critic import Critic
from jax_routeweaver.rl.metrics import advantage_metrics, rollout_metrics
from jax_routeweaver.rl.pool_check import check_run_pool, run_price_table_version
from jax_routeweaver.rl.provenance import provenance
from jax_routeweaver.rl.replica import HostReplicas
from jax_routeweaver.rl.run_log import Progress, RunLogger, plot_run, read_metrics, summary_table
from jax_routeweaver.rl.sidecar import Sidecar
from jax_routeweaver.rl.train_config import TrainConfig
from jax_routeweaver.rl.trainer import Trainer, support_batch
from jax_routeweaver.routing import grammar as g
from jax_routeweaver.routing import prompts
from jax_routeweaver.routing.channels import load_channels
from jax_routeweaver.routing.episode import EpisodeStats, run_episodes_async
from jax_routeweaver.routing.pricing import C_REF_USD, load_cost_ref, pool_prices
from jax_routeweaver.routing.routeweaver_env import NO_CANDIDATE_ANSWER, EnvConfig, routeweaver_envs
from jax_routeweaver.routing.simulated import SimulatedWorkerPool
from jax_routeweaver.routing.synthetic_tasks import synthetic_tasks
from jax_routeweaver.routing.workers import HttpWorkerPool
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import GrammarConstraints
from jax_routeweaver.sampling.jax_sampler import DEFAULT_BATCH_BUCKETS, JaxSampler
from jax_routeweaver.sampling.vllm_sidecar import SidecarError

CONFIG_FILE = "config.yaml"
SAMPLER_SHAPES_KEY = "sampler_shapes"  # full-state loop item: the JaxSampler's shapes run


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
    to the tokens of this run's text (`routing_corpus`, or Router-R1's); otherwise a
    tokenizer directory."""
    if cfg.model.tokenizer == "qwen3":
        return build_qwen3_tokenizer()
    if cfg.model.tokenizer == "qwen3-pruned":
        corpus = r1run.routing_corpus(cfg, records, pool) \
            if cfg.rollout.dialect == "router_r1" \
            else routing_corpus(records, pool, cfg.rollout.protocol, cfg.rollout.task_text,
                                cfg.rollout.rulebook)
        return prune_tokenizer(build_qwen3_tokenizer(), corpus)
    return load_tokenizer(cfg.model.tokenizer)


CORPUS_REPLIES = 200  # queries whose simulated worker replies join the pruning corpus


def routing_corpus(records: list[Record], pool: Any, protocol: Any,
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


def build_policy(cfg: TrainConfig, mesh: Any, tokenizer: Any,
                 records: Sequence[Record] = (), log: Callable[[str], None] | None = None
                 ) -> Qwen3:
    """The initial policy, born sharded on `mesh` (see `ModelSection`). A random model takes
    vocab_size (rounded up to 128) and the eos/pad/bos ids from the tokenizer unless given;
    ``init: stand-in`` distils that random model on the questions of `records` first (or
    loads it from the cache, `rl.stand_in`); ``init: hf`` loads the Hugging Face checkpoint
    directory in ``model.path``."""
    m = cfg.model
    runtime = m.runtime()
    if m.init == "random":
        return random_policy(cfg, mesh, tokenizer)
    if m.init == "stand-in":
        path = stand_in_path(cfg, mesh, tokenizer, records, log)
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    if m.init == "hf":
        path = Path(m.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} is not a Hugging Face checkpoint "
                                    "directory (no config.json)")
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    path = Path(m.init)
    if (path / "config.json").is_file():
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    model, _ = restore_policy(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype,
                              **runtime)
    return model


def random_config(cfg: TrainConfig, tokenizer: Any) -> ModelConfig:
    """The architecture of ``model.random``, with vocab_size (rounded up to 128) and the
    eos/pad/bos ids from the tokenizer unless given."""
    m = cfg.model
    fields = {"vocab_size": -(-len(tokenizer) // 128) * 128,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, **m.random}
    return ModelConfig(**{**fields, "param_dtype": m.param_dtype, "dtype": m.dtype,
                          **m.runtime()})


def random_policy(cfg: TrainConfig, mesh: Any, tokenizer: Any) -> Qwen3:
    """The random-init router of ``model.random`` (seeded by ``cfg.seed``)."""
    mc = random_config(cfg, tokenizer)
    return create_sharded(lambda: Qwen3(mc, rngs=nnx.Rngs(cfg.seed)), mesh)


def stand_in_path(cfg: TrainConfig, mesh: Any, tokenizer: Any, records: Sequence[Record],
                  log: Callable[[str], None] | None = None) -> Path:
    """The HF directory of the run's stand-in (`rl.stand_in`), distilled from
    `random_policy` on the questions of `records` when not cached yet (the random
    weights are only built then)."""
    if not records:
        raise ValueError("model.init: stand-in needs the run's questions to distil on")
    contexts = None
    if cfg.model.stand_in.worker_weight > 0:
        pool = build_pool(cfg, list(records), check=False)  # train() checked it
        config = random_config(cfg, tokenizer)
        make_env = routeweaver_envs(tokenizer, pool, env_config(cfg, config.eos_token_id))
        offered = len(cfg.workers.offered) or len(pool.worker_ids())
        contexts = stand_in.env_worker_contexts(make_env, tokenizer, offered)
    return stand_in.ensure_stand_in(random_config(cfg, tokenizer),
                                    lambda: random_policy(cfg, mesh, tokenizer), tokenizer,
                                    records, cfg.model.stand_in, seed=cfg.seed,
                                    worker_contexts=contexts, log=log)


def build_sampler(cfg: TrainConfig, model: Qwen3, tokenizer: Any, mesh: Any, rows: int,
                  *, pad_id: int) -> JaxSampler:
    """The in-process sampler of ``cfg.rollout`` (grammar constraints, prompt buckets, KV
    cache kind, ...). ``rows``: the episodes of a call's first round, all sampled at once,
    made an exact batch bucket (dropping the default buckets between it and twice it)."""
    r = cfg.rollout
    constraints = GrammarConstraints(tokenizer, model.config.vocab_size) \
        if r.constrained else None
    buckets = sorted({*DEFAULT_BATCH_BUCKETS, rows}
                     - {b for b in DEFAULT_BATCH_BUCKETS if rows < b < 2 * rows})
    return JaxSampler(model, decode=tokenizer.decode, pad_id=pad_id, mesh=mesh,
                      rules=SAMPLE_RULES, constraints=constraints, batch_buckets=buckets,
                      prefix_cache_mb=r.prefix_cache_mb, prompt_buckets=r.prompt_buckets,
                      device_choices=r.device_choices, kv_cache=r.kv_cache, paged=r.paged)


def build_records(cfg: TrainConfig, console: Console) -> list[Record]:
    d = cfg.data
    if d.source == "synthetic":
        return synthetic_tasks(d.synthetic_queries, seed=d.synthetic_seed,
                               levels=d.synthetic_levels)
    stats = ReadStats()
    records = read_records(d.source, bad_rows=d.bad_rows, stats=stats)
    if stats.skipped:
        console.print(f"[yellow]{d.source}: skipped {stats.skipped} bad rows of {stats.rows}; "
                      f"first: {stats.errors[:1]}[/]")
    return records


def build_pool(cfg: TrainConfig, records: list[Record], *, check: bool = True) -> Any:
    """The run's worker pool, checked first (`rl.pool_check.check_run_pool`: every offered
    worker priced in the run's table; a channel pool's keys set and its endpoints reachable
    and serving the configured model names): PoolCheckError naming the worker otherwise,
    before the pool (or anything after it) is built. Its calls bill at `pool_prices(pool)`:
    the channel file's prices, the reference table for the simulated pool. `check` False:
    the caller checked already (`train` does, before the run directory is made)."""
    if check:
        check_run_pool(cfg)
    w = cfg.workers
    if w.pool == "simulated":
        # A SIMULATION of the paid worker APIs (see routing/simulated.py).
        return SimulatedWorkerPool(records, seed=w.seed, latency_s=w.latency_s,
                                   failure_rate=w.failure_rate)
    return HttpWorkerPool(load_channels(w.pool), concurrency=w.concurrency)


def c_ref(cfg: TrainConfig) -> float:
    """C_ref in USD: the config's number, a `cost_ref.json` it names, or the reference's."""
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


def stop_ids(eos: int | tuple[int, ...]) -> tuple[int, ...]:
    """The model's EOS as stop token ids (HF configs may list several, e.g. Llama 3)."""
    return tuple(eos) if isinstance(eos, tuple | list) else (eos,)


def env_config(cfg: TrainConfig, eos_id: int | tuple[int, ...]) -> EnvConfig:
    r = cfg.rollout
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_new_tokens=r.max_new_tokens, stop_token_ids=stop_ids(eos_id))
    return EnvConfig(protocol=r.protocol, sampling=sampling, constrained=r.constrained,
                     answer_choices=r.answer_choices, task_text=r.task_text,
                     rulebook=r.rulebook, execution_feedback=r.execution_feedback,
                     offered=tuple(cfg.workers.offered))


def mode_declarations(tokenizer: Any) -> list[list[int]]:
    """Token ids of ``<mode>m</mode>`` for single, multi, agentic (the support loss)."""
    return [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
            for m in curriculum.MODES]


# ------------------------------------------------------------------------------ the loop
class _Run:
    """The live objects of one run (kept together so `step` reads like docs/design.md, "One RL
    step")."""

    def __init__(self, cfg: TrainConfig, console: Console,
                 runtime: distributed.Runtime | None = None):
        self.cfg, self.console = cfg, console
        self.sidecar: Sidecar | None = None
        try:
            self._build(runtime)
        except BaseException:
            if self.sidecar is not None:  # a server process: do not leave it running
                self.sidecar.close()
            raise
        # One event loop for the whole run: an HTTP worker pool keeps its client and
        # concurrency limit on the loop of its first call (a fresh loop per step broke step 2).
        self.events = asyncio.new_event_loop()

    def _build(self, runtime: distributed.Runtime | None) -> None:
        cfg, console = self.cfg, self.console
        self.runtime = runtime or distributed.Runtime()
        self.out = Path(cfg.out_dir)
        self.records = build_records(cfg, console)
        self.router_r1 = cfg.rollout.dialect == "router_r1"
        self.pool = build_pool(cfg, self.records, check=False)  # train() checked it
        if self.router_r1:
            self.pool = r1run.router_r1_pool(self.pool)
        self.tokenizer = build_tokenizer(cfg, self.records, self.pool)
        self.mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
        model = build_policy(cfg, self.mesh, self.tokenizer, self.records,
                             log=console.print)
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
        self.sync_times: dict[str, float] = {}
        if cfg.rollout.sampler == "vllm":
            # One sidecar per host, each with its own work directory.
            where = self.out if self.runtime.num_processes == 1 \
                else self.out / "hosts" / str(self.runtime.process_id)
            self.sidecar = Sidecar(cfg, model, self.tokenizer, where)
            self.sampler = self.sidecar.sampler
        else:
            processes = self.runtime.num_processes
            rollouts = -(-d.batch_size // processes) * d.group_size
            sample_model, sample_mesh = model, self.mesh
            if processes > 1:
                # Multi-host: each host rolls out its share of the queries on its own devices
                # with a replica of the policy (one SPMD sampler over all hosts would make
                # every host run every episode in lockstep).
                self.replicas = HostReplicas(model, cfg.mesh.tensor)
                sample_model = replica_model(
                    model, self.replicas.refresh(nnx.state(model, nnx.Param)))
                sample_mesh = self.replicas.mesh
            self.sampler = build_sampler(cfg, sample_model, self.tokenizer, sample_mesh,
                                         rollouts, pad_id=self.pad_id)
        explore = cfg.algo.exploration
        loss = dataclasses.replace(cfg.algo.loss, support_lambda0=explore.support_lambda0,
                                   support_floor=explore.support_floor)
        self.trainer = Trainer(model, cfg.optim, loss,
                               temperature=cfg.rollout.temperature, mesh=self.mesh,
                               seed=cfg.seed)
        # Router-R1's PPO: a critic started from the policy's initial weights (docs/router_r1.md).
        self.critic = Critic(model, cfg.algo.critic, batching=self.trainer) \
            if cfg.algo.estimator == "ppo_gae" else None
        del model  # the sampler, the trainer and the critic hold their own copies
        # Router-R1: one cost window for the whole run, saved with the full train state.
        self.r1_scorer: r1run.RouterR1Scorer | None = None
        if self.router_r1:
            workers = r1run.model_workers(cfg, self.pool)
            self.make_env = r1run.env_factory(cfg, self.tokenizer, workers,
                                              stop_ids(self.eos_id))
            self.r1_scorer = r1run.RouterR1Scorer(
                cfg.reward.router_r1, workers,
                lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False))
        else:
            self.make_env = routeweaver_envs(self.tokenizer, self.pool,
                                             env_config(cfg, self.eos_id))
        self.reward_cfg = reward_config(cfg)
        self.declarations = mode_declarations(self.tokenizer)
        ckpt = self.out / "checkpoints"
        self.policy_ckpt = PolicyCheckpointer(ckpt / "policy", keep=cfg.checkpoint.keep_policy)
        self.state_ckpt = StateCheckpointer(ckpt / "state", keep=cfg.checkpoint.keep_full)
        # Written by `write_record`, once the run is known to start.
        self.tokenizer_dir = self.out / "tokenizer"
        self.recorded = False
        self.iterator = iter(self.pipeline)
        self.step = 0

    def write_record(self) -> None:
        """Write the run's record, config.yaml (atomically) and tokenizer/ (main process
        only, once). Called only when the run is known to start (config, data, model and any
        restored state all checked), so a failed start never rewrites an existing run's
        record with a config that did not run."""
        if self.recorded:
            return
        if self.runtime.is_main:
            self.tokenizer.save_pretrained(str(self.tokenizer_dir))
            dump_config(self.cfg, self.out / CONFIG_FILE)
        self.recorded = True

    # -------------------------------------------------------------- resume
    @property
    def train_state(self) -> Any:
        """What a full checkpoint saves: the policy's train state, and the critic's with
        ``ppo_gae``."""
        if self.critic is None:
            return self.trainer.state
        return {"policy": self.trainer.state, "critic": self.critic.state}

    @train_state.setter
    def train_state(self, state: Any) -> None:
        if self.critic is None:
            self.trainer.state = state
        else:
            self.trainer.state, self.critic.state = state["policy"], state["critic"]

    def resume(self) -> bool:
        """Continue from the latest full train state in the run directory, if any (else
        start from ``checkpoint.init_from``'s, when given; that is not a resume). Everything
        is restored and checked before the abandoned attempt's policy steps are deleted: a
        failed resume (CheckpointError for an unreadable or incompatible state) deletes
        nothing."""
        if not self.cfg.checkpoint.resume or self.state_ckpt.latest_step() is None:
            if self.cfg.checkpoint.init_from:
                self.start_from(Path(self.cfg.checkpoint.init_from))
            return False
        state, loop, step = self.state_ckpt.restore(self.train_state)
        if self.r1_scorer is not None and r1run.WINDOW_KEY not in loop:
            raise ValueError(f"{self.state_ckpt.step_dir(step)}: the saved loop state has "
                             "no Router-R1 cost window (not a router_r1 run?)")
        self.iterator.set_state(loop["data"])
        self._load_sampler_shapes(loop)
        if self.r1_scorer is not None:
            self.r1_scorer.load_state_dict(loop[r1run.WINDOW_KEY])
        self.train_state = state
        # Policy steps after the restored state belong to the abandoned attempt.
        self.policy_ckpt.delete_after(step)
        self.step = step
        self.publish(step)
        return True

    def _load_sampler_shapes(self, loop: dict[str, Any]) -> None:
        """A saved loop item's JaxSampler shapes (absent in older checkpoints: none run), so
        this run cuts its calls as the run that saved them would."""
        if isinstance(self.sampler, JaxSampler):
            self.sampler.load_shape_state(loop.get(SAMPLER_SHAPES_KEY, []))

    def start_from(self, state_dir: Path) -> None:
        """Take another run's latest full state (params, optimizer, step N, RNG, the sampler's
        shapes run) and start this run's data at batch N, as if it had trained those N batches
        (the reference's main arm: resumed from the cold arm's step, on the train file's
        batches N...)."""
        if self.state_ckpt.latest_step() is not None or self.policy_ckpt.latest_step() is not None:
            raise ValueError(f"checkpoint.init_from: {self.out} already has checkpoints; "
                             "init_from only starts a fresh run directory")
        with StateCheckpointer(state_dir, keep=None) as source:
            if source.latest_step() is None:
                raise FileNotFoundError(f"checkpoint.init_from: {state_dir} has no full "
                                        "train-state checkpoint")
            state, loop, step = source.restore(self.train_state)
        if step >= self.cfg.steps:
            raise ValueError(f"checkpoint.init_from: {state_dir} is at step {step}, not "
                             f"before this run's steps={self.cfg.steps}")
        self.train_state = state
        self._load_sampler_shapes(loop)
        for _ in range(step):  # the data position of a run that trained `step` batches
            next(self.iterator)
        self.step = step
        self.write_record()  # the policy save below copies the tokenizer from the record
        self.policy_ckpt.save(self.trainer.model(), step, tokenizer_dir=self.tokenizer_dir,
                              block=True)
        self.publish(step)
        self.console.print(f"starting from {state_dir} at step {step}")

    # -------------------------------------------------------------- one step
    def run_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step + 1
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        batch = next(self.iterator)
        records = self.plan(batch)
        rt = self.runtime
        share = host_share(records, rt.process_id, rt.num_processes)
        for attempt in (1, 2):
            if cfg.deterministic:
                self.sampler.reseed(cfg.seed * 1_000_003 + step)
            stats = EpisodeStats()
            try:
                # Router-R1 costs calls with its own price table (in its reward).
                trajs = self.events.run_until_complete(run_episodes_async(
                    share, self.sampler, self.pool, self.make_env, repeats=batch.group_size,
                    stats=stats, prices=None if self.router_r1 else pool_prices(self.pool)))
                if rt.num_processes > 1:
                    trajs = merge_host_shares(distributed.allgather_objects(trajs),
                                              batch.group_size)
                break
            except SidecarError as e:
                if attempt == 2 or self.sidecar is None or self.sidecar.server is None:
                    raise
                # The server died mid-rollout: the next call restarts it with the current
                # policy version; the step's rollout runs again from scratch (same batch,
                # same seeds), so no step is lost or counted twice.
                self.console.print(f"step {step}: the vLLM sidecar failed ({e}); restarting "
                                   "it and running the rollout again")
        times["time/rollout_s"] = time.perf_counter() - t0
        if self.sidecar is not None:
            self.sidecar.release()  # time-shared placement: the update gets its memory
        prefix = getattr(self.sampler, "prefix_store", None)
        if prefix is not None:
            times["rollout/prefix_hits"] = prefix.hits
            times["rollout/prefix_tokens"] = prefix.reused
            prefix.clear()  # its caches would otherwise stay in device memory for the update

        t = time.perf_counter()
        # GRPO groups are consecutive rows: each must be one query (Router-R1's uid pitfall).
        check_query_groups(trajs, batch.group_size)
        r1_details = None
        if self.r1_scorer is not None:
            rewards, r1_details = self.r1_scorer.score(trajs)
        else:
            rewards = score_batch(trajs, self.reward_cfg, workers=cfg.reward.score_workers)
        times["time/reward_s"] = time.perf_counter() - t

        t = time.perf_counter()
        packed = pack_rollouts(trajs, rewards, group_size=batch.group_size, pad_id=self.pad_id,
                               row_multiple=self.trainer.row_multiple())
        estimator = cfg.algo.estimator
        if self.critic is not None:
            adv, mmask = None, np.zeros_like(packed.response_mask)
            ppo_in, ppo_metrics = self.ppo_step(packed)
            token_adv, old_logp = ppo_in.advantages, ppo_in.old_logp
        else:
            adv = compute_advantages(packed, estimator, alpha=cfg.reward.alpha)
            mmask = mode_mask(packed, estimator)
            token_adv, old_logp, ppo_metrics = packed.gather(
                np.asarray(adv.token_advantages)), None, {}
        # Router-R1 has no forced arm (check_train_config keeps its curriculum off).
        rho = 0.0 if self.router_r1 else curriculum.forced_ratio(batch.index,
                                                                 cfg.algo.exploration)
        support = None
        if cfg.algo.support and cfg.algo.exploration.support_lambda0 * rho > 0:
            selector = [prompts.selector_prompt_ids(self.tokenizer, r.question)
                        for r in batch.records]
            support = support_batch(selector, self.declarations, pad_id=self.pad_id,
                                    chunk=cfg.algo.loss.support_chunk,
                                    span=cfg.algo.mode_score_span,
                                    max_prompt=cfg.algo.support_max_prompt,
                                    constrained=cfg.rollout.constrained,
                                    forced=[r.forced_mode is not None for r in records])
        train_metrics = self.trainer.update(
            packed.tokens, packed.positions, packed.attention_mask, packed.policy_valid,
            packed.gather(mmask), token_adv, packed.clean, index=packed.policy_index,
            sampler_logp=packed.gather(packed.sampler_logp), old_logp=old_logp, support=support,
            support_rho=rho, num_queries=len(batch.records))
        times["time/update_s"] = time.perf_counter() - t

        t = time.perf_counter()
        self.step = step
        # Async orbax write (it overlaps the next rollout) unless the sidecar reads it now.
        self.policy_ckpt.save(self.trainer.model(), step, tokenizer_dir=self.tokenizer_dir,
                              block=self.sidecar is not None)
        write_s = time.perf_counter() - t
        if step % cfg.checkpoint.full_every == 0 or step == cfg.steps:
            loop: dict[str, Any] = {"step": step, "data": self.iterator.get_state()}
            if isinstance(self.sampler, JaxSampler):  # its cuts depend on the shapes it ran
                loop[SAMPLER_SHAPES_KEY] = self.sampler.shape_state()
            if self.r1_scorer is not None:
                loop[r1run.WINDOW_KEY] = self.r1_scorer.state_dict()
            self.state_ckpt.save(step, self.train_state, loop)
        self.publish(step)
        times["time/checkpoint_s"] = time.perf_counter() - t
        if self.sidecar is not None:  # the sync's three parts: write, load, verify
            times |= self.sync_times | {"sync/write_s": write_s}
        times["time/step_s"] = time.perf_counter() - t0
        times["time/sampler_s"] = stats.sampler_s
        times["time/workers_s"] = stats.workers_s

        metrics = rollout_metrics(trajs, rewards, group_size=batch.group_size,
                                  router_r1=r1_details,
                                  prices=None if self.router_r1 else pool_prices(self.pool))
        if adv is not None:
            metrics |= advantage_metrics(adv, forced=packed.forced, clean=packed.clean,
                                         response_mask=packed.response_mask,
                                         mode_token_mask=mmask, with_modes=not self.router_r1)
        metrics |= ppo_metrics | train_metrics | times
        # Router-R1 has no curriculum, so no ρ to log (0 would read as "annealed").
        metrics |= {} if self.router_r1 else {"curriculum/rho": rho}
        metrics |= {"curriculum/batch_index": float(batch.index),
                    "policy/version": float(self.sampler.policy_version),
                    "episode/rounds": float(stats.rounds),
                    # Multi-host: the queries this (the logging) process rolled out itself.
                    "rollout/host_queries": float(len(share)),
                    # The update's padded shape: a new one compiles the step again.
                    "update/rows": float(packed.shape[0]),
                    "update/length": float(packed.shape[1]),
                    "update/policy_width": float(packed.policy_index.shape[1])}
        return metrics

    def ppo_step(self, packed: Any) -> tuple[ppo.PPOInputs, dict[str, float]]:
        """``ppo_gae``: the batch's GAE advantages and old logprobs (`rl.ppo`), after which
        the critic takes its step; returns them with the critic's and GAE's metrics."""
        gae = self.cfg.algo.gae
        inputs = ppo.ppo_inputs(self.trainer, self.critic, packed, gamma=gae.gamma,
                                lam=gae.lam, kl_coef=gae.reward_kl_coef, whiten=gae.whiten)
        critic = self.critic.update(packed.tokens, packed.positions, packed.attention_mask,
                                    packed.policy_index, inputs.mask, inputs.returns,
                                    inputs.values)
        return inputs, inputs.metrics | critic

    def plan(self, batch: QueryBatch) -> list[Record]:
        """The batch's records as its episodes run them: with the curriculum's forced modes
        (RouteWeaver), or as they are (Router-R1 has no modes)."""
        if self.router_r1:
            return list(batch.records)
        ids = [r.sample_id for r in batch.records]
        baked = [r.forced_mode for r in batch.records]
        plans = curriculum.plan_batch(
            ids, batch.index, self.cfg.algo.exploration, group_size=batch.group_size,
            forced_modes=baked if all(m in curriculum.MODES for m in baked) else None)
        by_query = {p.sample_id: p for p in plans}
        return [r.replace(forced_mode=by_query[r.sample_id].forced_mode)
                for r in batch.records]

    def publish(self, version: int) -> None:
        """Hand the new weights to the sampler as policy version `version` and verify (the
        sidecar loads the policy step just written, see `rl.sidecar`)."""
        if self.sidecar is not None:
            self.sync_times = self.sidecar.publish(
                self.trainer.model(), self.policy_ckpt.step_dir(version), version)
        elif self.runtime.num_processes > 1:
            self.sampler.update_weights(
                nnx.from_flat_state(self.replicas.refresh(self.trainer.state.params)), version)
        else:
            self.sampler.update_weights(self.trainer.state.params, version)
        if self.sampler.policy_version != version:
            raise SyncError(f"sampler reports policy version {self.sampler.policy_version} "
                            f"after publishing {version}")

    def close(self) -> None:
        self.policy_ckpt.close()
        self.state_ckpt.close()
        if self.sidecar is not None:
            self.sidecar.close()
        aclose = getattr(self.pool, "aclose", None)
        if aclose is not None:
            self.events.run_until_complete(aclose())
        self.events.close()


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse, before anything is built or written, a run directory this config cannot
    continue: ValueError naming `cfg.out_dir` if it resumes and its newest full train state
    is past ``steps`` (the run already trained more steps than asked)."""
    out = Path(cfg.out_dir)
    full = list_steps(out / "checkpoints" / "state") if cfg.checkpoint.resume else []
    if full and full[-1] > cfg.steps:
        raise ValueError(f"{out}: the run already has {full[-1]} steps, more than "
                         f"steps={cfg.steps}; give steps > {full[-1]} to continue it, or a "
                         "new out_dir")


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainResult:
    """Run `cfg.steps` RL steps (resuming a run in `cfg.out_dir` when allowed). Multi-host
    (see `rl.distributed`): every process runs this; each rolls out its share of the queries,
    all write the orbax checkpoints, and only process 0 writes the config, logs and plots.

    Everything is checked before the run's record is written (`check_run_dir`, the data,
    the model, the restored state): a run that fails to start leaves an existing run
    directory's config.yaml, tokenizer and checkpoints as they were."""
    console = console or Console()
    runtime = distributed.initialize()
    main = runtime.is_main
    out = Path(cfg.out_dir)
    check_run_dir(cfg)
    check_run_pool(cfg)  # before the run directory exists: a refused pool leaves nothing
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(cfg, console, runtime)
    try:
        resumed = run.resume()
        run.write_record()
        # What the run is made of, read when it starts (code, config, input files).
        trace = provenance(cfg) if main else {}
        if resumed and main:
            console.print(f"resuming {out} after step {run.step}")
        with RunLogger(out, jsonl=cfg.logging.jsonl and main,
                       tensorboard=cfg.logging.tensorboard and main, resume=resumed) as log:
            if resumed:
                log.truncate_after(run.step)
            with Progress(cfg.steps, start=run.step, enabled=cfg.logging.progress and main,
                          console=console if main else Console(quiet=True)) as progress:
                while run.step < cfg.steps:
                    metrics = run.run_step()
                    log.log(run.step, metrics)
                    progress.update(run.step, metrics)
    finally:
        run.close()
    records = read_metrics(out / "metrics.jsonl") if cfg.logging.jsonl and main else []
    if cfg.logging.plots and records:
        plot_run(records, out)
    if records:
        w = cfg.logging.summary_window
        console.print(summary_table(records, first=w, last=w))
    if main:
        (out / "run.json").write_text(json.dumps(
            {"last_step": run.step, **trace, "config": redact_secrets(to_dict(cfg))},
            indent=1))
    return TrainResult(out, run.step, records)


def replica_model(model: Qwen3, params: dict) -> Qwen3:
    """``model`` with its parameters replaced by ``params`` (`HostReplicas.refresh`)."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, value in params.items():
        flat[path] = flat[path].replace(value) if isinstance(flat[path], nnx.Variable) \
            else value
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def host_share(records: list[Record], process: int, processes: int) -> list[Record]:
    """The queries process ``process`` of ``processes`` rolls out: every ``processes``-th,
    from its index (all K rollouts of a query stay on one host, so its group is whole)."""
    return list(records[process::processes])


def merge_host_shares(shares: list[list[Any]], group_size: int) -> list[Any]:
    """Trajectories of all hosts (``shares[p]``: process p's, K per query, in its queries'
    order) back in batch order: query j is process ``j % P``'s ``(j // P)``-th."""
    groups = [[share[i:i + group_size] for i in range(0, len(share), group_size)]
              for share in shares]
    total = sum(len(g) for g in groups)
    return [t for j in range(total) for t in groups[j % len(shares)][j // len(shares)]]
