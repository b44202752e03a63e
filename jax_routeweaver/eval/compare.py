"""`eval baselines` and `eval compare`: the baselines and the whole comparison table.

`run_baselines(cfg, options)`: the single-round baselines of `eval.baselines` (random,
largest, oracle, kNN, MLP) on the evaluation sets, with the workers `eval run` uses
(`evaluate.build_eval_pool`: the config's ``workers`` section in the record/replay cache,
HTTP workers at the evaluation temperature). Evaluation sets load as in `eval run`
(`evaluate.load_sets`). The learned routers fit on the TRAINING sets, loaded the same way
except that a ``synthetic[:N]`` without SEED takes ``data.synthetic_seed`` (the questions
the router trained on; evaluation sets default to the next seed); a training question that
is also an evaluation question (same sample_id or same text) is dropped from training, so
the two never overlap. Each baseline gets ``OUT/<router>/`` with ``rows.jsonl`` (rewritten
whole on every run; the worker cache makes that cheap), ``eval.json`` and the summary files
of `eval run`, so `eval report --runs` takes them as they are.

`run_comparison(cfg, options)`: the table of issue 8 in one call. Into ``OUT/``::

    router/             the trained router, free (greedy)            `evaluate.Evaluator`
    forced_<mode>/      the same router forced to single, multi, agentic (same model load)
    router_r1/          a Router-R1 checkpoint in its own dialect, when given
    <baseline>/         random, largest, oracle, knn, mlp              `run_baselines`
    worker_cache.jsonl  ONE record/replay cache for all of them (unless placed elsewhere)
    comparison.json/.md, mode_shares.png, accuracy_vs_cost.png     `report.write_comparison`
    mode_oracle.json/.md   per-question mode choice vs the best forced mode  `mode_oracle`

The evaluation sets are loaded once, with the router's config, and every row evaluates
exactly those questions (Router-R1 too, whatever its own config's data section says). A
directory holding rows of other questions too (an earlier run without ``--limit``) keeps
them, but the comparison counts only this run's questions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from jax_routeweaver.config import fields_of, redact_secrets, to_dict
from jax_routeweaver.data.records import FORCED_MODES, Record
from jax_routeweaver.eval import report
from jax_routeweaver.eval.baselines import BASELINE_NAMES, aevaluate_baselines
from jax_routeweaver.eval.evaluate import (
    CACHE_FILE,
    CheckpointSampling,
    EvalConfig,
    EvalResult,
    EvalSet,
    EvalSets,
    Evaluator,
    build_eval_pool,
    load_router_sets,
    load_sets,
)
from jax_routeweaver.eval.mode_oracle import ModeOracle, mode_oracle, mode_oracle_markdown
from jax_routeweaver.rl.run.router_checkpoint import resolve_checkpoint
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.pools.replay import ReplayStats
from jax_routeweaver.routing.protocol.calls import WorkerPool

ROUTER = "router"
MODE_ORACLE_JSON = "mode_oracle.json"
MODE_ORACLE_MD = "mode_oracle.md"
ROUTER_R1 = "router_r1"
BASELINE_KIND = "baseline"
LEARNED = ("knn", "mlp")


def forced_name(mode: str) -> str:
    """The comparison's name of the router forced to `mode`: ``forced_<mode>``."""
    return f"forced_{mode}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaselineConfig(EvalSets):
    """The single-round baselines on `EvalSets` (module doc; each baseline writes
    OUT/<router>/). `train_sets`: what kNN/MLP fit on (needed only when they run).
    `largest_worker`: the "largest" router's worker (None = the priciest by the price
    table). `k`, `lambda_cost`, `seed`, `mlp_steps`: as `baselines.aevaluate_baselines`."""

    # Training sets of kNN/MLP (same forms as `sets`); required when either runs.
    train_sets: tuple[str, ...] = ()
    # Baselines to run: distinct names from `BASELINE_NAMES`, at least one.
    routers: tuple[str, ...] = BASELINE_NAMES
    # Worker of the "largest" router (an offered worker id); None = the priciest one.
    largest_worker: str | None = None
    # Neighbours of the kNN router, >= 1.
    k: int = 10
    # Cost weight λ of kNN/MLP, per USD, >= 0 (0 = accuracy routing; a call costs about
    # 1e-5..1e-3 USD, so λ matters from about 1e3).
    lambda_cost: float = 0.0
    # Seed of the random router's picks and of the MLP's initialisation; any int.
    seed: int = 0
    # Full-batch Adam steps of the MLP router, >= 1.
    mlp_steps: int = 300

    def __post_init__(self) -> None:
        unknown = [n for n in self.routers if n not in BASELINE_NAMES]
        if unknown or not self.routers or len(set(self.routers)) != len(self.routers):
            raise ValueError(f"routers={list(self.routers)}: expected distinct names from "
                             f"{list(BASELINE_NAMES)}")
        super().__post_init__()
        if self.k < 1 or not self.lambda_cost >= 0:
            raise ValueError(f"k={self.k}, lambda_cost={self.lambda_cost}: need k >= 1 and "
                             "lambda_cost >= 0")
        learned = [n for n in self.routers if n in LEARNED]
        if learned and not self.train_sets:
            raise ValueError(f"routers {learned} learn from training questions: give "
                             "--train-sets (or leave them out of --routers)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareConfig(BaselineConfig, CheckpointSampling):
    """The comparison (module doc): the baselines' settings (`BaselineConfig`, with the
    `EvalSets` every router shares), `CheckpointSampling` for the checkpoints, and
    `checkpoint` evaluated free and forced to each mode, and `router_r1` (a checkpoint,
    "" = none) with its own config. `cache` "" = OUT/worker_cache.jsonl, shared by all."""

    # The trained router, evaluated free and forced to each mode (as `EvalConfig`).
    checkpoint: str
    # A Router-R1 checkpoint to add as a row; "" = none.
    router_r1: str = ""

    def baseline_options(self, cache: str) -> BaselineConfig:
        """The baselines' part of these settings, with the comparison's worker `cache`."""
        return BaselineConfig(**{**fields_of(self, BaselineConfig), "cache": cache})

    def eval_options(self, checkpoint: str, out_dir: Path, name: str, cache: str,
                     force_mode: Literal["single", "multi", "agentic"] | None = None
                     ) -> EvalConfig:
        """One checkpoint's evaluation: these sets and sampling, its own output directory,
        name, worker `cache` and forced mode."""
        return EvalConfig(**{**fields_of(self, EvalSets),
                             **fields_of(self, CheckpointSampling),
                             "checkpoint": checkpoint, "out_dir": str(out_dir), "name": name,
                             "cache": cache, "force_mode": force_mode})


# ------------------------------------------------------------------------------ sets
def _norm(text: str) -> str:
    return " ".join(text.split())


def ordered_questions(sets: Sequence[EvalSet], limit: int | None) -> list[tuple[str, Record]]:
    """(set name, record) of every evaluation question in order, the first `limit` only
    (as `Evaluator.evaluate` takes them)."""
    ordered = [(s.name, r) for s in sets for r in s.records]
    return ordered if limit is None else ordered[:limit]


def load_train_records(specs: Sequence[str], cfg: TrainConfig, evaluation: Sequence[Record],
                       console: Console | None = None) -> list[Record]:
    """The training questions of the learned baselines (module doc): `specs` loaded as
    evaluation sets are, ``synthetic`` defaulting to ``data.synthetic_seed``, minus every
    question that is also in `evaluation` (same sample_id or same text)."""
    sets = load_sets(specs, cfg, synthetic_seed=cfg.data.synthetic_seed)
    ids = {r.sample_id for r in evaluation}
    texts = {_norm(r.question) for r in evaluation}
    records, dropped = [], 0
    for r in (r for s in sets for r in s.records):
        if r.sample_id in ids or _norm(r.question) in texts:
            dropped += 1
        else:
            records.append(r)
    if dropped and console is not None:
        console.print(f"train sets: left out {dropped} question(s) that are also evaluation "
                      f"questions; {len(records)} remain")
    if not records:
        raise ValueError(f"train sets {list(specs)} hold no question outside the evaluation "
                         "sets (give other sets, or another SEED for synthetic)")
    return records


# ------------------------------------------------------------------------------ baselines
def _workers_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the RouteWeaver dialect: baselines see the workers' replies as they are
    (a Router-R1 config would strip the simulated replies' tags)."""
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                dialect="routeweaver"))


def _check_baseline_dirs(out: Path, routers: Sequence[str]) -> None:
    """ValueError if OUT/<router> holds an evaluation other than a baseline's (it would be
    overwritten)."""
    for name in routers:
        meta_file = out / name / report.META_FILE
        if meta_file.is_file() and \
                json.loads(meta_file.read_text()).get("kind") != BASELINE_KIND:
            raise ValueError(f"{out / name} holds another evaluation (its {report.META_FILE} "
                             "is not a baseline's); use another --out")


def _write_baseline(out: Path, name: str, rows: list[dict[str, Any]],
                    meta: dict[str, Any]) -> EvalResult:
    out.mkdir(parents=True, exist_ok=True)
    meta_file = out / report.META_FILE
    tmp = meta_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"router": name, **meta}, indent=1) + "\n")
    tmp.replace(meta_file)
    dump = out / report.ROWS_FILE
    staged = dump.with_suffix(".jsonl.tmp")
    staged.unlink(missing_ok=True)
    report.append_rows(staged, rows)
    staged.replace(dump)
    summary = report.summarize(rows, router=name)
    report.write_summary(summary, out)
    return EvalResult(out, rows, summary, len(rows), None)


def run_baselines(cfg: TrainConfig, options: BaselineConfig, *,
                  pool: WorkerPool | None = None, eval_sets: Sequence[EvalSet] | None = None,
                  embedder: Any = None, console: Console | None = None
                  ) -> dict[str, EvalResult]:
    """Run the baselines (module doc); returns router name -> its `EvalResult` (``replay``:
    the cache counts of the whole run). `pool`: the raw worker pool instead of the config's
    (tests); `eval_sets`: already loaded evaluation sets; `embedder`: the sentence embedder
    of kNN/MLP (default: the bundled all-MiniLM-L6-v2)."""
    console = console or Console()
    out = Path(options.out_dir)
    _check_baseline_dirs(out, options.routers)
    sets = list(eval_sets) if eval_sets is not None else load_sets(options.sets, cfg)
    questions = ordered_questions(sets, options.limit)
    if not questions:
        raise ValueError(f"{out}: nothing to evaluate (empty sets or --limit 0)")
    evaluation = [r for _, r in questions]
    learned = any(n in LEARNED for n in options.routers)
    train = load_train_records(options.train_sets, cfg, evaluation, console) if learned \
        else []
    cache = options.cache or str(out / CACHE_FILE)
    wrapped = build_eval_pool(_workers_config(cfg), [*evaluation, *train], EvalConfig(
        checkpoint="", sets=options.sets, out_dir=str(out), replay=options.replay,
        cache=cache, worker_temperature=options.worker_temperature), pool)

    async def run() -> dict[str, list[dict[str, Any]]]:
        try:
            return await aevaluate_baselines(
                train, evaluation, wrapped, routers=options.routers, embedder=embedder,
                largest_worker=options.largest_worker, seed=options.seed, k=options.k,
                lambda_cost=options.lambda_cost, mlp_steps=options.mlp_steps)
        finally:
            closer = getattr(wrapped.pool, "aclose", None)
            if closer is not None:
                await closer()

    console.print(f"baselines {', '.join(options.routers)}: {len(evaluation)} questions"
                  + (f", trained on {len(train)}" if learned else ""))
    table = asyncio.run(run())
    stats: ReplayStats = wrapped.stats
    console.print(f"worker cache: {stats.hits} hits, {stats.recorded} calls made, "
                  f"{stats.coalesced} coalesced")
    set_of = {(r.dataset, r.sample_id): s for s, r in questions}
    meta = {"kind": BASELINE_KIND, "checkpoint": None, "step": None, "force_mode": None,
            "dialect": None, "workers": cfg.workers.pool,
            "worker_temperature": options.worker_temperature, "alpha": None,
            "sets": [s.name for s in sets], "limit": options.limit,
            "train_sets": list(options.train_sets), "train_questions": len(train),
            "largest_worker": options.largest_worker, "k": options.k,
            "lambda_cost": options.lambda_cost, "seed": options.seed,
            "mlp_steps": options.mlp_steps, "config": redact_secrets(to_dict(cfg))}
    results = {}
    for name, rows in table.items():
        rows = [{**row, "set": set_of[report.row_key(row)]} for row in rows]
        results[name] = dataclasses.replace(_write_baseline(out / name, name, rows, meta),
                                            replay=stats)
    return results


# ------------------------------------------------------------------------------ comparison
def _same_workers(cfg: TrainConfig, other: TrainConfig) -> None:
    fields = ("pool", "seed", "failure_rate")
    diff = {f: (getattr(cfg.workers, f), getattr(other.workers, f)) for f in fields
            if getattr(cfg.workers, f) != getattr(other.workers, f)}
    if diff:
        raise ValueError(f"the Router-R1 config's workers differ from the router's ({diff}); "
                         "the rows would not share workers: align workers.* (overrides or "
                         "--router-r1-config)")


def _comparison_rows(result: EvalResult, keys: list[tuple[str, str]]
                     ) -> list[dict[str, Any]]:
    """`result`'s rows of exactly `keys`; ValueError if one is missing."""
    by_key = {report.row_key(r): r for r in result.rows}
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise ValueError(f"{result.out_dir}: no rows for {len(missing)} evaluation "
                         f"question(s), e.g. {missing[:3]}")
    return [by_key[k] for k in keys]


def write_mode_oracle(oracle: ModeOracle, out: Path) -> list[Path]:
    """``mode_oracle.json`` and ``mode_oracle.md`` under `out`."""
    paths = [out / MODE_ORACLE_JSON, out / MODE_ORACLE_MD]
    paths[0].write_text(json.dumps(oracle.to_json(), indent=1) + "\n")
    paths[1].write_text(mode_oracle_markdown(oracle))
    return paths


def run_comparison(cfg: TrainConfig, options: CompareConfig, *,
                   r1_cfg: TrainConfig | None = None, pool: WorkerPool | None = None,
                   embedder: Any = None, console: Console | None = None
                   ) -> dict[str, report.Summary]:
    """Run every row of the comparison (module doc) and write OUT/comparison.*; returns name
    -> `report.Summary` in table order (router, forced_*, router_r1, baselines). `cfg`: the
    router's config; `r1_cfg`: Router-R1's (needed with ``options.router_r1``). `pool`: the
    raw worker pool instead of the configs' (tests)."""
    console = console or Console()
    if cfg.rollout.dialect == "router_r1":
        raise ValueError("--checkpoint must be a RouteWeaver router (its config has "
                         "rollout.dialect: router_r1); give a Router-R1 checkpoint with "
                         "--router-r1")
    if options.router_r1:
        if r1_cfg is None:
            raise ValueError("router_r1: its config is needed (--router-r1-config)")
        if r1_cfg.rollout.dialect != "router_r1":
            raise ValueError("--router-r1: its config must have rollout.dialect: router_r1")
        _same_workers(cfg, r1_cfg)
    out = Path(options.out_dir)
    _check_baseline_dirs(out, options.routers)
    baseline_options = options.baseline_options(options.cache or str(out / CACHE_FILE))
    out.mkdir(parents=True, exist_ok=True)
    cache = baseline_options.cache
    sets = load_router_sets(options.sets, cfg, resolve_checkpoint(options.checkpoint), console)
    keys = [(r.dataset, r.sample_id) for _, r in ordered_questions(sets, options.limit)]
    if not keys:
        raise ValueError(f"{out}: nothing to evaluate (empty sets or --limit 0)")
    results: dict[str, EvalResult] = {}

    runs: list[tuple[str, Any]] = [(ROUTER, None), *((forced_name(m), m) for m in FORCED_MODES)]
    base = options.eval_options(options.checkpoint, out / ROUTER, ROUTER, cache)
    with Evaluator(cfg, base, pool=pool, eval_sets=sets, console=console) as evaluator:
        for name, mode in runs:
            results[name] = evaluator.evaluate(dataclasses.replace(
                base, out_dir=str(out / name), name=name, force_mode=mode))
    if options.router_r1:
        assert r1_cfg is not None
        r1 = options.eval_options(options.router_r1, out / ROUTER_R1, ROUTER_R1, cache)
        with Evaluator(r1_cfg, r1, pool=pool, eval_sets=sets, console=console) as evaluator:
            results[ROUTER_R1] = evaluator.evaluate()
    results.update(run_baselines(cfg, baseline_options, pool=pool,
                                 eval_sets=sets, embedder=embedder, console=console))

    rows = {name: _comparison_rows(result, keys) for name, result in results.items()}
    summaries = {name: report.summarize(rows[name], router=name, alpha=result.summary.alpha)
                 for name, result in results.items()}
    paths = report.write_comparison(summaries, out)
    oracle = mode_oracle(rows[ROUTER], {m: rows[forced_name(m)] for m in FORCED_MODES})
    paths += write_mode_oracle(oracle, out)
    console.print(report.console_table(summaries))
    console.print(mode_oracle_markdown(oracle))
    console.print(f"wrote {', '.join(str(p) for p in paths)}")
    return summaries
