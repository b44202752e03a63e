"""`train(config)`: the RL loop that ties data, episodes, rewards, advantages and the learner.

One step (docs/design.md, "One RL step"): query batch -> curriculum plan (forced/free per query)
-> B×K episodes on the sampler and the worker pool -> verdicts and rewards -> advantages
-> one update -> policy checkpoint (every step) and full train state (every N) -> publish the
weights to the sampler as policy version = step and check it took. Metrics go to
``metrics.jsonl`` and TensorBoard; the run ends with plots and a summary table.

The run's parts are built by `rl.run.builders`; what differs between the two dialects (pool,
environment, scorer, curriculum, saved scorer state) sits behind one `rl.run.dialect.Dialect`
chosen then. ``rollout.dialect: router_r1`` runs Router-R1 in the same loop
(`rl.run.router_r1_run`): its episodes and reward, no curriculum, PPO with a critic (``ppo_gae``,
`rl.learner.ppo`) or GRPO grouped by query; its cost window (and the critic) are saved with the full
train state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from rich.console import Console

from jax_routeweaver.config import dump_config, redact_secrets, to_dict
from jax_routeweaver.data.pipeline import PipelineConfig, QueryBatch, QueryPipeline
from jax_routeweaver.data.records import Record
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rewards.reward import Rewards
from jax_routeweaver.rl.core.advantages import Advantages
from jax_routeweaver.rl.core.estimators import ESTIMATORS
from jax_routeweaver.rl.core.support import SupportBatch
from jax_routeweaver.rl.learner import ppo
from jax_routeweaver.rl.learner.batch import (
    RolloutBatch,
    check_query_groups,
    compute_advantages,
    mode_mask,
    pack_rollouts,
)
from jax_routeweaver.rl.learner.critic import Critic
from jax_routeweaver.rl.learner.trainer import UpdateBatch
from jax_routeweaver.rl.reports.metrics import advantage_metrics, rollout_metrics
from jax_routeweaver.rl.reports.run_log import Progress, RunLogger, read_metrics
from jax_routeweaver.rl.reports.run_plots import plot_run, summary_table
from jax_routeweaver.rl.run import distributed
from jax_routeweaver.rl.run.builders import (
    build_policy,
    build_pool,
    build_sampler,
    build_tokenizer,
    build_trainer,
    dialect_for,
)
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer, StateCheckpointer
from jax_routeweaver.rl.run.preflight import preflight
from jax_routeweaver.rl.run.provenance import provenance
from jax_routeweaver.rl.run.replica import HostReplicas, replica_model
from jax_routeweaver.rl.run.routeweaver_run import declaration_rows
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.episodes.episode import EpisodeStats, Trajectory, run_episodes_async
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.sidecar import Sidecar
from jax_routeweaver.sampling.vllm_server import SidecarError

CONFIG_FILE = "config.yaml"
SAMPLER_SHAPES_KEY = "sampler_shapes"  # full-state loop item: the JaxSampler's shapes run


@dataclasses.dataclass
class TrainResult:
    out_dir: Path
    last_step: int
    metrics: list[dict[str, Any]]


class SyncError(RuntimeError):
    """The sampler did not take the published weights (a silent stale policy otherwise)."""


# ------------------------------------------------------------------------------ one step's parts
class StepClock:
    """Wall time of one step's named phases, logged as ``time/<phase>_s``, and of the whole
    step (``time/step_s``, from the clock's creation)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}_s"] = time.perf_counter() - t

    def total(self) -> dict[str, float]:
        return self.times | {"time/step_s": time.perf_counter() - self.start}


@dataclasses.dataclass
class Rollout:
    """One step's episodes: the batch, its records as run (forced modes set), the
    trajectories in batch order (``group_size`` per query, all hosts), the episode runner's
    stats and how many queries this process rolled out itself."""

    batch: QueryBatch
    records: list[Record]
    trajs: list[Trajectory]
    stats: EpisodeStats
    host_queries: int


@dataclasses.dataclass
class Learned:
    """One step's update: the packed rows, the GRPO-family advantages (None under PPO), the
    mode-token mask ``[N, L]``, the curriculum's ρ and the update's metrics."""

    packed: RolloutBatch
    advantages: Advantages | None
    mode_mask: np.ndarray
    rho: float
    metrics: dict[str, float]


# ------------------------------------------------------------------------------ the loop
class _Run:
    """The live objects of one run, kept together so `run_step` reads like docs/design.md,
    "One RL step". What differs between RouteWeaver and Router-R1 sits behind `dialect`."""

    def __init__(self, cfg: TrainConfig, console: Console, records: list[Record],
                 runtime: distributed.Runtime | None = None):
        self.cfg, self.console, self.records = cfg, console, records
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
        cfg = self.cfg
        self.runtime = runtime or distributed.Runtime()
        self.out = Path(cfg.out_dir)
        self.dialect = dialect_for(cfg)
        pool = build_pool(cfg, self.records, check=False)  # train() checked it
        self.pool = self.dialect.worker_pool(pool)
        self.tokenizer = build_tokenizer(cfg, self.records, self.pool)
        self.mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
        model = build_policy(cfg, self.mesh, self.tokenizer, self.records,
                             log=self.console.print)
        if len(self.tokenizer) > model.config.vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} tokens but the model's "
                             f"vocab_size is {model.config.vocab_size}")
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.eos_id = model.config.eos_token_id if model.config.eos_token_id is not None \
            else self.tokenizer.eos_token_id
        d = cfg.data
        self.pipeline = QueryPipeline(self.records, PipelineConfig.of(
            d, num_batches=None if d.repeat else cfg.steps))
        self._build_sampler(model)
        self.trainer = build_trainer(cfg, model, self.mesh)
        # Router-R1's PPO: a critic started from the policy's initial weights (docs/router_r1.md).
        self.critic = Critic(model, cfg.algo.critic, batching=self.trainer) \
            if ESTIMATORS[cfg.algo.estimator].critic else None
        del model  # the sampler, the trainer and the critic hold their own copies
        self.dialect.start(self.tokenizer, self.pool, self.eos_id)
        ckpt = self.out / "checkpoints"
        self.policy_ckpt = PolicyCheckpointer(ckpt / "policy", keep=cfg.checkpoint.keep_policy)
        self.state_ckpt = StateCheckpointer(ckpt / "state", keep=cfg.checkpoint.keep_full)
        # Written by `write_record`, once the run is known to start.
        self.tokenizer_dir = self.out / "tokenizer"
        self.recorded = False
        self.iterator = iter(self.pipeline)
        self.step = 0

    def _build_sampler(self, model: Qwen3) -> None:
        """The rollout engine: the vLLM sidecar, or the in-process sampler (on a replica of
        the policy per host when multi-host)."""
        cfg = self.cfg
        self.sync_times: dict[str, float] = {}
        if cfg.rollout.sampler == "vllm":
            # One sidecar per host, each with its own work directory.
            where = self.out if self.runtime.num_processes == 1 \
                else self.out / "hosts" / str(self.runtime.process_id)
            self.sidecar = Sidecar(cfg.rollout.vllm, model, self.tokenizer, where, seed=cfg.seed)
            self.sampler = self.sidecar.sampler
            return
        processes = self.runtime.num_processes
        rollouts = distributed.rows_per_host(cfg.data.batch_size, cfg.data.group_size,
                                             processes)
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
        self.dialect.load_state_dict(loop, self.state_ckpt.step_dir(step))
        self.iterator.set_state(loop["data"])
        self._load_sampler_shapes(loop)
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
        (the original's main arm: resumed from the cold arm's step, on the train file's
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
        """One RL step, phase by phase (docs/design.md, "One RL step"); returns its metrics."""
        step = self.step + 1
        clock = StepClock()
        with clock.phase("rollout"):
            rollout = self.rollout(step)
        extra = self.release_rollout_memory()
        with clock.phase("reward"):
            rewards, details = self.score(rollout)
        with clock.phase("update"):
            learned = self.learn(rollout, rewards)
        with clock.phase("checkpoint"):
            write_s = self.save(step)
            self.publish(step)
        if self.sidecar is not None:  # the sync's three parts: write, load, verify
            extra |= self.sync_times | {"sync/write_s": write_s}
        times = clock.total() | {"time/sampler_s": rollout.stats.sampler_s,
                                 "time/workers_s": rollout.stats.workers_s}
        return self.step_metrics(rollout, rewards, details, learned) | extra | times \
            | self.dialect.step_metrics(learned.rho) | self.shape_metrics(rollout, learned)

    def rollout(self, step: int) -> Rollout:
        """The next batch's episodes (this host's share, gathered in batch order over hosts).
        A vLLM sidecar that dies mid-rollout is restarted with the current policy version
        and the rollout runs again from scratch (same batch, same seeds), so no step is lost
        or counted twice."""
        batch = next(self.iterator)
        records = self.dialect.plan(batch)
        rt = self.runtime
        share = distributed.host_share(records, rt.process_id, rt.num_processes)
        try:
            trajs, stats = self.episodes(share, batch.group_size, step)
        except SidecarError as e:
            if self.sidecar is None or self.sidecar.server is None:
                raise
            self.console.print(f"step {step}: the vLLM sidecar failed ({e}); restarting "
                               "it and running the rollout again")
            # A second failure ends the run.
            trajs, stats = self.episodes(share, batch.group_size, step)
        return Rollout(batch, records, trajs, stats, len(share))

    def episodes(self, share: list[Record], group_size: int, step: int
                 ) -> tuple[list[Trajectory], EpisodeStats]:
        """``group_size`` episodes of each record of ``share``, all hosts' in batch order."""
        if self.cfg.deterministic:
            self.sampler.reseed(self.cfg.seed * 1_000_003 + step)
        stats = EpisodeStats()
        trajs = self.events.run_until_complete(run_episodes_async(
            share, self.sampler, self.pool, self.dialect.make_env, repeats=group_size,
            stats=stats, prices=self.dialect.prices(self.pool)))
        if self.runtime.num_processes > 1:
            trajs = distributed.merge_host_shares(distributed.allgather_objects(trajs),
                                                 group_size)
        return trajs, stats

    def release_rollout_memory(self) -> dict[str, float]:
        """Hand the rollout's device memory to the update (the sidecar's, under time-shared
        placement, and the dense prefix store's); returns the prompts and tokens the
        in-process sampler reused from cached keys and values."""
        if self.sidecar is not None:
            self.sidecar.release()
        take = getattr(self.sampler, "take_prefix_counts", None)
        if take is None:
            return {}
        hits, tokens = take()
        return {"rollout/prefix_hits": hits, "rollout/prefix_tokens": tokens}

    def score(self, rollout: Rollout) -> tuple[list[Rewards], list[Any] | None]:
        """The dialect's verdicts and rewards, one row per trajectory."""
        # GRPO groups are consecutive rows: each must be one query (Router-R1's uid pitfall).
        check_query_groups(rollout.trajs, rollout.batch.group_size)
        return self.dialect.score(rollout.trajs)

    def learn(self, rollout: Rollout, rewards: list[Rewards]) -> Learned:
        """Pack the rows, take their advantages and run the trainer's update (with the
        support rows when the support loss has weight this step)."""
        batch = rollout.batch
        packed = pack_rollouts(rollout.trajs, rewards, group_size=batch.group_size,
                               pad_id=self.pad_id, row_multiple=self.trainer.row_multiple())
        update, adv, mmask, metrics = self.advantages(packed)
        rho = self.dialect.forced_ratio(batch.index)
        support = self.support_rows(rollout, rho)
        metrics |= self.trainer.update(update, support=support, support_rho=rho,
                                       num_queries=len(batch.records))
        return Learned(packed, adv, mmask, rho, metrics)

    def advantages(self, packed: RolloutBatch
                   ) -> tuple[UpdateBatch, Advantages | None, np.ndarray, dict[str, float]]:
        """The update's batch, the GRPO-family advantages (None under ``ppo_gae``), the mode
        mask ``[N, L]`` and the estimator's metrics."""
        if self.critic is not None:
            inputs, metrics = self.ppo_step(packed)
            mmask = np.zeros_like(packed.response_mask)
            return (packed.for_update(inputs.advantages, mmask, old_logp=inputs.old_logp),
                    None, mmask, metrics)
        estimator = self.cfg.algo.estimator
        adv = compute_advantages(packed, estimator, alpha=self.cfg.reward.alpha)
        mmask = mode_mask(packed, estimator)
        token_adv = packed.gather(np.asarray(adv.token_advantages))
        return packed.for_update(token_adv, mmask), adv, mmask, {}

    def ppo_step(self, packed: RolloutBatch) -> tuple[ppo.PPOInputs, dict[str, float]]:
        """``ppo_gae``: the batch's GAE advantages and old logprobs (`rl.learner.ppo`), after which
        the critic takes its step; returns them with the critic's and GAE's metrics."""
        gae = self.cfg.algo.gae
        inputs = ppo.ppo_inputs(self.trainer, self.critic, packed, gamma=gae.gamma,
                                lam=gae.lam, kl_coef=gae.reward_kl_coef, whiten=gae.whiten)
        critic = self.critic.update(packed.tokens, packed.positions, packed.attention_mask,
                                    packed.policy_index, inputs.mask, inputs.returns,
                                    inputs.values)
        return inputs, inputs.metrics | critic

    def support_rows(self, rollout: Rollout, rho: float) -> SupportBatch | None:
        """The declaration rows of the batch's queries, when the learner's declaration terms
        have weight this step (`routeweaver_run.declaration_rows`)."""
        if not self.dialect.has_modes:
            return None
        return declaration_rows(self.cfg, self.tokenizer, rollout.records, rho=rho)

    def save(self, step: int) -> float:
        """The policy step (every step; an async orbax write that overlaps the next rollout,
        unless the sidecar reads it now) and the full train state (every ``full_every``
        steps and the last); returns the policy write's seconds."""
        self.step = step
        t = time.perf_counter()
        self.policy_ckpt.save(self.trainer.model(), step, tokenizer_dir=self.tokenizer_dir,
                              block=self.sidecar is not None)
        write_s = time.perf_counter() - t
        if step % self.cfg.checkpoint.full_every == 0 or step == self.cfg.steps:
            self.state_ckpt.save(step, self.train_state, self.loop_state(step))
        return write_s

    def loop_state(self, step: int) -> dict[str, Any]:
        """The full checkpoint's loop item: step, data position, the JaxSampler's shapes
        run (its cuts depend on them) and the dialect's scorer state."""
        loop: dict[str, Any] = {"step": step, "data": self.iterator.get_state()}
        if isinstance(self.sampler, JaxSampler):
            loop[SAMPLER_SHAPES_KEY] = self.sampler.shape_state()
        return loop | self.dialect.state_dict()

    def publish(self, version: int) -> None:
        """Hand the new weights to the sampler as policy version `version` and verify (the
        sidecar loads the policy step just written, see `sampling.sidecar`)."""
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

    def step_metrics(self, rollout: Rollout, rewards: list[Rewards], details: Any,
                     learned: Learned) -> dict[str, float]:
        """The step's episode, reward, advantage and update metrics."""
        metrics = rollout_metrics(rollout.trajs, rewards, group_size=rollout.batch.group_size,
                                  router_r1=details, prices=self.dialect.prices(self.pool))
        packed = learned.packed
        if learned.advantages is not None:
            metrics |= advantage_metrics(learned.advantages, forced=packed.forced,
                                         clean=packed.clean, response_mask=packed.response_mask,
                                         mode_token_mask=learned.mode_mask,
                                         with_modes=self.dialect.has_modes)
        return metrics | learned.metrics

    def shape_metrics(self, rollout: Rollout, learned: Learned) -> dict[str, float]:
        """Where the step stood: batch, policy version, rounds, this host's share, and the
        update's padded shape (a new one compiles the step again)."""
        packed = learned.packed
        return {"curriculum/batch_index": float(rollout.batch.index),
                "policy/version": float(self.sampler.policy_version),
                "episode/rounds": float(rollout.stats.rounds),
                # Multi-host: the queries this (the logging) process rolled out itself.
                "rollout/host_queries": float(rollout.host_queries),
                "update/rows": float(packed.shape[0]),
                "update/length": float(packed.shape[1]),
                "update/policy_width": float(packed.policy_index.shape[1])}

    def close(self) -> None:
        self.policy_ckpt.close()
        self.state_ckpt.close()
        if self.sidecar is not None:
            self.sidecar.close()
        aclose = getattr(self.pool, "aclose", None)
        if aclose is not None:
            self.events.run_until_complete(aclose())
        self.events.close()


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainResult:
    """Run `cfg.steps` RL steps (resuming a run in `cfg.out_dir` when allowed). Multi-host
    (see `rl.run.distributed`): every process runs this; each rolls out its share of the queries,
    all write the orbax checkpoints, and only process 0 writes the config, logs and plots.

    Everything that can stop it is checked in its first seconds, before anything is built
    (`rl.run.preflight`: the run directory, the pool, the data, directories, disk, the sandbox),
    and the model and restored state before the run's record is written: a run that fails to
    start leaves an existing run directory's config.yaml, tokenizer and checkpoints as they
    were."""
    console = console or Console()
    runtime = distributed.initialize()
    main = runtime.is_main
    out = Path(cfg.out_dir)
    records = preflight(cfg, console)  # before the run directory exists: a refusal leaves nothing
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(cfg, console, records, runtime)
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
