"""`evaluate(cfg, options)`: run a router checkpoint greedily over evaluation sets.

As the original's evaluation (docs/usage.md, "Evaluate and compare"): the router decodes
greedily, workers sample at temperature 0.2, one episode per question, verdicts from the real
scorers (the benchmark verdict `correct`, not the training reward: a correct answer that ended
in a violation counts as correct). The ``model`` (dtypes, runtime options), ``rollout``,
``workers`` and ``reward`` sections of the training config are used as in training
(`rl.run.loop`'s builders), with the router's sampling made greedy; worker calls bill at the pool's
price table (`pricing.pool_prices`: a channel file's prices, the original price table for the
simulated pool), and the pool is checked before anything is written (`rl.run.pool_check`: every
offered worker priced; unless the run only replays, keys set and endpoints serving the
configured models). Forcing a mode (`EvalConfig.force_mode`) injects the declaration the way
the curriculum's forced arm does, which gives the fixed-paradigm baselines.
``rollout.dialect: router_r1`` evaluates a Router-R1 router (its dialect and scorer; cost in
Router-R1's own prices, as in training).

Checkpoints (`resolve_checkpoint`): a Hugging Face directory, an orbax policy checkpoint
directory (its latest step), one policy step directory, or a training run directory (its
latest policy step; its ``config.yaml`` and tokenizer are found from there).

Sets (`load_sets`): record files (``.jsonl``/``.parquet``, e.g. from ``routeweaver data
prepare``) or ``synthetic[:N[:SEED]]`` questions for the simulated pool (N default 100, SEED
default ``data.synthetic_seed + 1``: questions the run did not train on; the domains of
``data.quotas``). A record file's bad rows, a question that cannot fit the checkpoint's
context with its prompt among them (`checkpoint_question_limit`), follow ``data.bad_rows``.

Output directory:
    rows.jsonl        one row per question (schema: `report.ROW_KEYS`, plus ``set``,
                      ``forced``, ``infra``, ``violation``, ``finish``, ``summarizer_answer``,
                      ``cost_complete``, ``em``, ``f1``, ``turns``), appended per batch
    eval.json         what was evaluated (checkpoint, step, sets, mode, config)
    worker_cache.jsonl the record/replay cache (`routing.pools.replay`), unless placed elsewhere
    summary.json/.md, mode_shares.png, accuracy_vs_cost.png   (`report.write_summary`)

Resumable: rows already in ``rows.jsonl`` (by dataset + sample_id) are skipped, so a crash
loses at most the batch in flight; rerunning with another checkpoint or mode into the same
directory is an error. `Evaluator` runs several evaluations of one checkpoint (free, forced
modes) on one model, sampler and worker cache; `evaluate` is one of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from jax_routeweaver.config import redact_secrets, to_dict
from jax_routeweaver.data.record_files import QuestionLimit, ReadStats, read_records
from jax_routeweaver.data.records import FORCED_MODES, Domain, Record
from jax_routeweaver.eval import report
from jax_routeweaver.rewards.sandbox import configure_default_sandbox
from jax_routeweaver.rl.run.builders import (
    build_pool,
    dialect_for,
)
from jax_routeweaver.rl.run.pool_check import check_run_pool
from jax_routeweaver.rl.run.preflight import run_isolation
from jax_routeweaver.rl.run.router_checkpoint import (
    RouterCheckpoint,
    checkpoint_question_limit,
    greedy_config,
    load_router_sampler,
    resolve_checkpoint,
)
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.episodes.episode import run_episodes_async
from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.pricing import WorkerPrice, billable_tokens
from jax_routeweaver.routing.pools.replay import (
    REPLAY_MODES,
    ReplayMode,
    ReplayPool,
    ReplayStats,
    http_identity,
)
from jax_routeweaver.routing.pools.workers import DEFAULT_TEMPERATURE, HttpWorkerPool
from jax_routeweaver.routing.protocol.calls import WorkerCall, WorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

CACHE_FILE = "worker_cache.jsonl"
SYNTHETIC = "synthetic"
SYNTHETIC_DEFAULT_QUERIES = 100
# What must match between a dump's rows and a run appending to it.
_IDENTITY_KEYS = ("router", "checkpoint", "step", "force_mode", "dialect", "workers",
                  "worker_temperature")


def check_run_options(sets: Sequence[str], replay: str, limit: int | None) -> None:
    """The checks every evaluation command shares: some sets, a known cache mode, a limit
    >= 0. Raises ValueError naming the field."""
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay={replay!r}: expected one of {list(REPLAY_MODES)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit}: must be >= 0")
    if not sets:
        raise ValueError("no evaluation sets given")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSets:
    """What every evaluation command shares (`EvalConfig`, `compare.BaselineConfig`,
    `compare.CompareConfig`), declared once: the questions, where the results go, the worker
    cache and the workers' temperature. Checked on construction (`check_run_options`)."""

    # Evaluation sets: record files (.jsonl/.json/.parquet) or ``synthetic[:N[:SEED]]``;
    # at least one.
    sets: tuple[str, ...]
    # Output directory: what each command writes there is in its module doc. Required.
    out_dir: str
    # Worker cache mode (`routing.pools.replay`): "record", "replay" (offline, a miss is an
    # error) or "off" (no cache).
    replay: ReplayMode = "record"
    # Worker cache file; "" = OUT/worker_cache.jsonl. Unused with replay="off".
    cache: str = ""
    # Evaluate only the first N questions over all sets, N >= 0; None = all (a later run
    # without it does the rest).
    limit: int | None = None
    # Sampling temperature of HTTP workers, >= 0 (not checked here; unused by the simulated
    # pool).
    worker_temperature: float = DEFAULT_TEMPERATURE  # the original's worker temperature

    def __post_init__(self) -> None:
        check_run_options(self.sets, self.replay, self.limit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSampling:
    """How a checkpoint's episodes are sampled and shown (`EvalConfig`, and the routers that
    `compare.CompareConfig` evaluates)."""

    # Episodes sampled together, >= 0; 0 = data.batch_size × data.group_size (the loop's
    # rollout batch).
    batch_size: int = 0
    # Show a progress bar while evaluating.
    progress: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(EvalSets, CheckpointSampling):
    """One evaluation of `checkpoint` on `EvalSets` with `CheckpointSampling` (their fields
    are this config's too). `name`: the router's name in rows and tables ("" = derived from
    the checkpoint and the forced mode)."""

    # The router to evaluate: an HF directory, a policy checkpoint or step directory, or a
    # run directory (`resolve_checkpoint`). Required.
    checkpoint: str
    # Force every episode into this mode ("single", "multi" or "agentic"); None = free
    # routing. Not allowed with the Router-R1 dialect.
    force_mode: Literal["single", "multi", "agentic"] | None = None
    # The router's name in rows and tables; "" = derived from checkpoint and forced mode.
    name: str = ""

    def __post_init__(self) -> None:
        if self.force_mode is not None and self.force_mode not in FORCED_MODES:
            raise ValueError(f"force_mode={self.force_mode!r}: expected one of "
                             f"{list(FORCED_MODES)}")
        super().__post_init__()
        if self.batch_size < 0:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 0")


@dataclasses.dataclass
class EvalResult:
    """`rows`: the whole dump; `evaluated`: rows this call added; `replay`: cache counts
    (None when nothing had to be evaluated)."""
    out_dir: Path
    rows: list[dict[str, Any]]
    summary: report.Summary
    evaluated: int
    replay: ReplayStats | None


# ------------------------------------------------------------------------------ sets
@dataclasses.dataclass(frozen=True)
class EvalSet:
    name: str
    records: tuple[Record, ...]


def is_synthetic_set(spec: str) -> bool:
    """`spec` names synthetic questions (``synthetic[:N[:SEED]]``), not a record file."""
    return spec == SYNTHETIC or spec.startswith(SYNTHETIC + ":")


def load_sets(specs: Sequence[str], cfg: TrainConfig, *,
              synthetic_seed: int | None = None, limit: QuestionLimit | None = None,
              console: Console | None = None) -> list[EvalSet]:
    """The evaluation sets; ValueError if a question (dataset + sample_id) appears twice.
    `synthetic_seed`: SEED of a ``synthetic[:N[:SEED]]`` spec without one (default
    ``data.synthetic_seed + 1``, questions the run did not train on). Record files are read
    under ``data.bad_rows`` (RecordError naming the file and line or row), a row whose
    question is over `limit` (the router's, `checkpoint_question_limit`) counting as bad; what
    ``skip`` dropped is printed to `console`."""
    default_seed = cfg.data.synthetic_seed + 1 if synthetic_seed is None else synthetic_seed
    sets: list[EvalSet] = []
    for spec in specs:
        if is_synthetic_set(spec):
            parts = spec.split(":")[1:]
            try:
                values = [int(p) for p in parts]
            except ValueError:
                values = []
            if len(parts) > 2 or len(values) != len(parts) or any(v < 0 for v in values):
                raise ValueError(f"set {spec!r}: expected synthetic[:N[:SEED]] with integers "
                                 "N, SEED >= 0")
            n = values[0] if values else SYNTHETIC_DEFAULT_QUERIES
            seed = values[1] if len(values) > 1 else default_seed
            domains = [d for d, k in cfg.data.quotas.items() if k > 0] or list(Domain)
            records = synthetic_tasks(n, seed=seed, domains=domains,
                                      levels=cfg.data.synthetic_levels)
            sets.append(EvalSet(spec, tuple(records)))
            continue
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"set {spec!r}: not a record file, nor synthetic[:N[:SEED]]")
        stats = ReadStats()
        records = read_records(path, bad_rows=cfg.data.bad_rows, stats=stats, limit=limit)
        note = stats.skip_note(path)
        if note is not None and console is not None:
            console.print(f"[yellow]{escape(note)}[/]")
        name = path.name.removesuffix(".jsonl").removesuffix(".parquet")
        sets.append(EvalSet(name, tuple(records)))
    owner: dict[tuple[str, str], str] = {}
    for s in sets:
        for r in s.records:
            key = (r.dataset, r.sample_id)
            if key in owner:
                raise ValueError(f"sample {r.sample_id!r} of dataset {r.dataset!r} is in both "
                                 f"{owner[key]!r} and {s.name!r}; evaluate each question once")
            owner[key] = s.name
    return sets


def load_router_sets(specs: Sequence[str], cfg: TrainConfig, ckpt: RouterCheckpoint,
                     console: Console | None = None) -> list[EvalSet]:
    """`load_sets` for the checkpoint's router: a record file's questions must fit its
    context (`checkpoint_question_limit`, only built when a set is a record file)."""
    limit = None if all(is_synthetic_set(s) for s in specs) \
        else checkpoint_question_limit(cfg, ckpt)
    return load_sets(specs, cfg, limit=limit, console=console)


# ------------------------------------------------------------------------------ workers
class CatalogOnlyPool:
    """The worker catalog of a channel file without any endpoint: replay never calls a
    worker, so it needs neither the network nor the API keys an `HttpWorkerPool` demands."""

    def __init__(self, channels: Any):
        self.channels = channels

    def worker_ids(self) -> list[str]:
        return self.channels.worker_ids()

    def description(self, worker: str) -> str:
        return self.channels.channel(worker).description

    def prices(self) -> dict[str, WorkerPrice]:
        """The channel file's prices (`pricing.pool_prices`), as the live pool's."""
        return self.channels.prices()

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        raise RuntimeError(f"{self.channels.path}: a replay-only pool cannot call {worker}")


def build_eval_pool(cfg: TrainConfig, records: list[Record], options: EvalConfig,
                    pool: WorkerPool | None = None, *, check: bool = True) -> ReplayPool:
    """The workers wrapped in the record/replay cache: the given `pool`, the simulated pool
    over the evaluation questions (deterministic: a reply depends only on seed, worker and
    payload, so no temperature), or the channel file's endpoints at the evaluation worker
    temperature. Router-R1 sees the simulated replies without tags, as in training.

    Without a given `pool` and with `check`, the config's pool is checked first
    (`check_run_pool`; an offline replay calls no endpoint, so only prices are checked):
    PoolCheckError naming the worker. The calls bill at `pricing.pool_prices` of the result.
    """
    identify = None
    secrets: list[str] = []
    if pool is None and check:
        check_run_pool(cfg, network=options.replay != "replay")
    if pool is None and cfg.workers.pool != "simulated":
        channels = load_channels(cfg.workers.pool)
        identify = http_identity(channels, temperature=options.worker_temperature)
        secrets = [os.environ.get(c.api_key_env, "").strip() for c in channels.channels
                   if c.api_key_env]
        pool = CatalogOnlyPool(channels) if options.replay == "replay" else HttpWorkerPool(
            channels, concurrency=cfg.workers.concurrency,
            temperature=options.worker_temperature)
    elif pool is None:
        pool = build_pool(cfg, records)
    pool = dialect_for(cfg).worker_pool(pool)  # Router-R1's replies without their tags
    cache = options.cache or str(Path(options.out_dir) / CACHE_FILE)
    return ReplayPool(pool, mode=options.replay, cache=None if options.replay == "off"
                      else cache, identify=identify, secrets=secrets)


# ------------------------------------------------------------------------------ rows
def episode_row(traj: Any, rewards: Any, *, router: str, set_name: str) -> dict[str, Any]:
    """One dump row (`report.ROW_KEYS` + extras) of a judged trajectory. ``tokens.router``:
    tokens the router chose (policy mask 1; grammar-forced tokens excluded);
    ``worker_prompt`` / ``worker_completion``: billed worker tokens, failed attempts
    included."""
    record = traj.record
    prompt_tokens = completion_tokens = 0
    for call in traj.calls:
        i, o = billable_tokens(call)
        prompt_tokens, completion_tokens = prompt_tokens + i, completion_tokens + o
    return {
        "sample_id": record.sample_id, "dataset": record.dataset, "domain": str(record.domain),
        "router": router, "mode": None if traj.mode is None else str(traj.mode),
        "workers": [c.worker for c in traj.calls], "answer": traj.answer,
        "correct": bool(rewards.correct), "verdict": rewards.failure_kind,
        "cost_usd": float(rewards.cost_usd), "calls": len(traj.calls),
        "tokens": {"router": int(sum(traj.policy_mask)), "worker_prompt": prompt_tokens,
                   "worker_completion": completion_tokens},
        "set": set_name, "forced": bool(traj.forced), "infra": bool(rewards.infra),
        "violation": traj.violation, "finish": traj.finish,
        "summarizer_answer": traj.summarizer_answer,
        "cost_complete": bool(rewards.cost_complete), "em": float(rewards.em),
        "f1": float(rewards.f1), "turns": traj.turns,
    }


# ------------------------------------------------------------------------------ the runner
class _Runner:
    """The live objects of an evaluation: model, sampler, episodes, scorer, one event loop
    for every batch (an `HttpWorkerPool` is bound to the loop of its first call)."""

    def __init__(self, cfg: TrainConfig, ckpt: RouterCheckpoint, records: list[Record],
                 pool: ReplayPool, batch_size: int, out: Path):
        self.cfg = greedy_config(cfg)
        self.pool = pool
        # As the loop does: the first round samples the whole batch.
        router = load_router_sampler(cfg, ckpt, records, pool, batch_size, out)
        self.sidecar, self.sampler = router.sidecar, router.sampler
        # The dialect's episodes and scorer, as in training (`rl.run.dialect`).
        self.dialect = dialect_for(self.cfg)
        self.dialect.start(router.tokenizer, pool, router.eos)
        self.loop = asyncio.new_event_loop()

    def run(self, batch: list[Record]) -> tuple[list[Any], list[Any]]:
        """(trajectories, rewards) of one episode per record, in order."""
        # Router-R1 costs its calls with its own price table (in its scorer), as in training;
        # the others at the pool's table (the channel file's, or the original's).
        trajs = self.loop.run_until_complete(run_episodes_async(
            batch, self.sampler, self.pool, self.dialect.make_env,
            prices=self.dialect.prices(self.pool)))
        rewards, _ = self.dialect.score(trajs)
        return trajs, rewards

    def close(self) -> None:
        try:
            closer = getattr(self.pool.pool, "aclose", None)
            if closer is not None:
                self.loop.run_until_complete(closer())
            if self.sidecar is not None:
                self.sidecar.close()
        finally:
            self.loop.close()


# ------------------------------------------------------------------------------ evaluate
def router_name(cfg: TrainConfig, ckpt: RouterCheckpoint, force_mode: str | None) -> str:
    base = ckpt.path.name if ckpt.kind == "hf" else f"{cfg.name}@step{ckpt.step}"
    return base if force_mode is None else f"{base}+forced-{force_mode}"


def run_alpha(cfg: TrainConfig) -> float:
    """The cost trade-off the router was trained with (Router-R1: its cost coefficient)."""
    return cfg.reward.router_r1.cost_coe if cfg.rollout.dialect == "router_r1" \
        else cfg.reward.alpha


def _check_meta(out: Path, meta: dict[str, Any]) -> None:
    """Write ``eval.json``, or check that an existing one describes the same evaluation."""
    path = out / report.META_FILE
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), meta[k]) for k in _IDENTITY_KEYS if old.get(k) != meta[k]}
        if diff:
            raise ValueError(f"{out} holds the evaluation of another setup "
                             f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}"
                             "); use another --out")
        meta = {**meta, "sets": list(dict.fromkeys([*old.get("sets", []), *meta["sets"]]))}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(path)


def _stats_delta(after: ReplayStats, before: ReplayStats) -> ReplayStats:
    return ReplayStats(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                          for f in dataclasses.fields(ReplayStats)})


class Evaluator:
    """Evaluations of one checkpoint over the same sets and workers that share one model,
    sampler and worker cache (`eval compare`: the router free and forced to each mode).

    `base` fixes what is shared (`SHARED`: checkpoint, sets, replay, cache, batch size,
    worker temperature; cache "" = ``base.out_dir``/worker_cache.jsonl); each
    `evaluate(options)` may change only ``out_dir``, ``force_mode``, ``name``, ``limit`` and
    ``progress``. `eval_sets`: already loaded sets to use instead of loading ``base.sets``
    with `cfg` (so routers of other configs see the very same questions). Without a given
    `pool`, the config's pool is checked first, before anything is loaded or written
    (`check_run_pool`; PoolCheckError naming the worker). The model loads on the first
    evaluation with work to do. Use as a context manager, or call `close`."""

    SHARED = ("checkpoint", "sets", "replay", "cache", "batch_size", "worker_temperature")

    def __init__(self, cfg: TrainConfig, base: EvalConfig, *, pool: WorkerPool | None = None,
                 eval_sets: Sequence[EvalSet] | None = None, console: Console | None = None):
        if pool is None:  # before anything is loaded or written
            check_run_pool(cfg, network=base.replay != "replay")
            # The scorers' sandbox at the run's level (the strongest the host gives for the
            # simulated pool's own code; "full" for real workers' unless the user says less).
            configure_default_sandbox(run_isolation(cfg))
        self.cfg, self.base, self.console = cfg, base, console or Console()
        self.ckpt = resolve_checkpoint(base.checkpoint)
        self.sets = list(eval_sets) if eval_sets is not None \
            else load_router_sets(base.sets, cfg, self.ckpt, self.console)
        self.records = [r for s in self.sets for r in s.records]
        self.batch_size = base.batch_size or cfg.data.batch_size * cfg.data.group_size
        self.cache = base.cache or str(Path(base.out_dir) / CACHE_FILE)
        self._pool = pool
        self._wrapped: ReplayPool | None = None
        self._runner: _Runner | None = None

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the sampler's event loop and the worker pool (and a vLLM sidecar)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()

    def _live(self) -> tuple[_Runner, ReplayPool]:
        if self._runner is None:
            options = dataclasses.replace(self.base, cache=self.cache)
            self._wrapped = build_eval_pool(self.cfg, self.records, options, self._pool,
                                            check=False)  # checked in __init__
            self._runner = _Runner(self.cfg, self.ckpt, self.records, self._wrapped,
                                   self.batch_size, Path(self.base.out_dir))
        assert self._wrapped is not None
        return self._runner, self._wrapped

    def evaluate(self, options: EvalConfig | None = None) -> EvalResult:
        """One evaluation into ``options.out_dir`` (default: `base`); see the module doc."""
        options = options or self.base
        changed = [k for k in self.SHARED if getattr(options, k) != getattr(self.base, k)]
        if changed:
            raise ValueError(f"Evaluator: options change the shared {changed}; use another "
                             "Evaluator")
        cfg, console = self.cfg, self.console
        out = Path(options.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if options.force_mode is not None and cfg.rollout.dialect == "router_r1":
            raise ValueError("force_mode: rollout.dialect: router_r1 has no modes to force")
        name = options.name or router_name(cfg, self.ckpt, options.force_mode)
        alpha = run_alpha(cfg)
        _check_meta(out, {
            "router": name, "checkpoint": str(self.ckpt.path), "step": self.ckpt.step,
            "kind": self.ckpt.kind, "force_mode": options.force_mode,
            "dialect": cfg.rollout.dialect, "workers": cfg.workers.pool,
            "worker_temperature": options.worker_temperature, "alpha": alpha,
            "sets": [s.name for s in self.sets], "config": redact_secrets(to_dict(cfg))})

        dump = out / report.ROWS_FILE
        done = {report.row_key(r) for r in report.read_rows(dump, repair=True)} \
            if dump.exists() else set()
        ordered = [(s.name, r) for s in self.sets for r in s.records]
        if options.limit is not None:
            ordered = ordered[:options.limit]
        todo = [(s, r.replace(forced_mode=options.force_mode)) for s, r in ordered
                if (r.dataset, r.sample_id) not in done]
        if done:
            console.print(f"{dump}: {len(done)} rows already there; {len(todo)} to evaluate")

        stats = None
        if todo:
            runner, wrapped = self._live()
            before = dataclasses.replace(wrapped.stats)
            batch_size = self.batch_size
            with Progress(TextColumn("{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                          console=console, disable=not options.progress) as progress:
                task = progress.add_task(f"eval {name}", total=len(todo))
                for start in range(0, len(todo), batch_size):
                    batch = todo[start:start + batch_size]
                    trajs, rewards = runner.run([r for _, r in batch])
                    report.append_rows(dump, [
                        episode_row(t, rw, router=name, set_name=s)
                        for (s, _), t, rw in zip(batch, trajs, rewards, strict=True)])
                    progress.advance(task, len(batch))
            stats = _stats_delta(wrapped.stats, before)
            console.print(f"worker cache: {stats.hits} hits, {stats.recorded} calls made, "
                          f"{stats.coalesced} coalesced")

        rows = report.read_rows(dump) if dump.exists() else []
        if not rows:
            raise ValueError(f"{out}: nothing evaluated (empty sets or --limit 0)")
        summary = report.summarize(rows, router=name, alpha=alpha)
        report.write_summary(summary, out)
        console.print(report.console_table({name: summary}))
        return EvalResult(out, rows, summary, len(todo), stats)


def evaluate(cfg: TrainConfig, options: EvalConfig, *, pool: WorkerPool | None = None,
             console: Console | None = None) -> EvalResult:
    """Evaluate `options.checkpoint` with `cfg`'s router/rollout/workers sections; see the
    module doc. `pool`: use this worker pool instead of the config's (tests)."""
    with Evaluator(cfg, options, pool=pool, console=console) as evaluator:
        return evaluator.evaluate(options)
