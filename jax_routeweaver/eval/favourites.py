"""`measure_favourites`: which execution mode the worker pool favours, per domain, measured.

For a run config (and optionally a trained checkpoint) it takes the run's own training
questions (`rl.run.builders.build_records`), the first ``per_domain`` of each domain present, and
runs every question ``samples`` times forced to each mode (``single``, ``multi``,
``agentic``; the declaration is injected as the curriculum's forced arm does, so the router
only executes the mode). The router samples at ``rollout.temperature`` with the config's
top-p/top-k (its rollout distribution as training sees it, not greedy), reseeded from
``seed`` per batch, so the same arguments give the same numbers. Episodes are scored with
the run's reward config and reduced to one scalar per episode,

    reward = (1 - α) · r_task + α · r_eff        (α = ``reward.alpha``)

(the trainer's COMET-GDPO mixes the two components after normalising each within a query
group; this is the same trade-off on the raw rewards; at α = 0 it is r_task itself).

What it measures, honestly: E[reward | domain, mode] under the CURRENT policy's execution of
each forced mode (which workers it calls, in which roles, which candidate answer it picks).
For the initial policy of a random-init router that execution is roughly random, so the
favourite is the direction the mode-level advantage points at that policy at the start of
training, not the best any execution of that mode could achieve. A trained checkpoint gives
the favourites at that checkpoint's own execution.

Statistics. Means are over the clean episodes of a cell (no infra failure, no failed worker
call: the rows the advantage estimator keeps); the others are counted as ``dropped``.
Episodes of one question are correlated (same question, same workers' shared ignorance),
so standard errors are clustered by question (`clustered_se`): with equal episodes per
question, the standard error of the per-question means. The favourite of a domain is the
mode of the highest mean reward (ties: the first of single, multi, agentic); its margin over
the runner-up is tested against 2 standard errors of the paired difference (both modes ran
on the same questions, so the question effect cancels).

Output (`write_outputs`): ``favourites.json`` (meta, cells, favourites, workers and one row
per episode, from which every number can be recomputed) and ``favourites.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from jax_routeweaver.config import redact_secrets, to_dict
from jax_routeweaver.data.records import FORCED_MODES, Domain, Record
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rewards.reward import Rewards, score_batch
from jax_routeweaver.rl.run.builders import (
    build_policy,
    build_pool,
    build_records,
    build_sampler,
    build_tokenizer,
)
from jax_routeweaver.rl.run.router_checkpoint import (
    load_router,
    load_router_tokenizer,
    resolve_checkpoint,
)
from jax_routeweaver.rl.run.routeweaver_run import env_config, reward_config
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.episodes.episode import Trajectory, run_episodes_async
from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs
from jax_routeweaver.routing.pools.pricing import pool_prices

MODES: tuple[str, ...] = FORCED_MODES  # single, multi, agentic: the order ties resolve in
JSON_FILE = "favourites.json"
MARKDOWN_FILE = "favourites.md"
SIGNIFICANCE_SE = 2.0  # a margin counts when it exceeds this many standard errors
SEED_STRIDE = 1_000_003  # batch b samples with seed * SEED_STRIDE + b (as the loop's steps)


# ------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class ModeCell:
    """One (domain, mode). `episodes`: clean episodes the means are over; `dropped`: the
    others; `questions`: distinct questions among the clean ones. `reward` ± `reward_se`
    (clustered by question; NaN below 2 questions), `task` mean r_task, `eff` mean r_eff,
    `cost_usd` mean worker cost per episode, `declared_share`: share of all the cell's
    episodes whose declared mode is the forced one (1.0 unless forcing is broken)."""

    domain: str
    mode: str
    episodes: int
    dropped: int
    questions: int
    reward: float
    reward_se: float
    task: float
    eff: float
    cost_usd: float
    declared_share: float


@dataclasses.dataclass(frozen=True)
class WorkerCell:
    """One (domain, mode, worker): mean reward over the clean episodes of the cell that
    called `worker` at least once (`episodes` of them)."""

    domain: str
    mode: str
    worker: str
    episodes: int
    reward: float


@dataclasses.dataclass(frozen=True)
class Favourite:
    """A domain's favoured mode: the highest mean reward; `margin` over `runner_up`,
    `margin_se` the clustered standard error of the paired difference, `significant`:
    margin > 2 standard errors (False when the error is undefined). `runner_up` is None
    (margin NaN) when only one mode has clean episodes."""

    domain: str
    mode: str
    runner_up: str | None
    margin: float
    margin_se: float
    significant: bool


@dataclasses.dataclass
class FavouritesResult:
    """`meta`: what was measured (router, alpha, seed, sizes, config); `rows`: one per
    episode (`episode_row`); the rest is `summarize(rows)`."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    cells: list[ModeCell]
    workers: list[WorkerCell]
    favourites: list[Favourite]

    def cell(self, domain: str, mode: str) -> ModeCell:
        return next(c for c in self.cells if c.domain == domain and c.mode == mode)

    def favourite(self, domain: str) -> Favourite:
        return next(f for f in self.favourites if f.domain == domain)

    def to_json(self) -> dict[str, Any]:
        """JSON-able (NaN written as null)."""
        return _finite({"meta": self.meta,
                        "cells": [dataclasses.asdict(c) for c in self.cells],
                        "favourites": [dataclasses.asdict(f) for f in self.favourites],
                        "workers": [dataclasses.asdict(w) for w in self.workers],
                        "rows": self.rows})


# ------------------------------------------------------------------------------ pure helpers
def check_options(cfg: TrainConfig, *, per_domain: int, samples: int) -> None:
    """ValueError (naming the flag or config field and the value) for what cannot be
    measured: fewer than one question per domain or one sample, a Router-R1 config (no
    modes), the vLLM sampler (this command samples in process)."""
    if isinstance(per_domain, bool) or not isinstance(per_domain, int) or per_domain < 1:
        raise ValueError(f"--per-domain {per_domain}: must be an integer >= 1 (questions per "
                         "domain)")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"--samples {samples}: must be an integer >= 1 (episodes per "
                         "question and mode)")
    if cfg.rollout.dialect != "routeweaver":
        raise ValueError(f"rollout.dialect={cfg.rollout.dialect}: eval favourites forces "
                         "execution modes, which only rollout.dialect=routeweaver has")
    if cfg.rollout.sampler != "jax":
        raise ValueError(f"rollout.sampler={cfg.rollout.sampler}: eval favourites samples "
                         "in process; use rollout.sampler=jax")


def pick_questions(records: Sequence[Record], per_domain: int) -> list[Record]:
    """The first `per_domain` records of each domain present, domain by domain in `Domain`
    order (a domain with fewer gives what it has)."""
    chosen: list[Record] = []
    for domain in Domain:
        chosen += [r for r in records if r.domain == domain][:per_domain]
    return chosen


def episode_reward(r_task: float, r_eff: float, alpha: float) -> float:
    """The scalar reward of an episode: (1 - α) r_task + α r_eff (r_task itself at α = 0)."""
    return float(r_task) if alpha == 0 else (1.0 - alpha) * float(r_task) + alpha * float(r_eff)


def batches(items: Sequence[Any], size: int) -> list[list[Any]]:
    """`items` cut into the fewest batches of at most `size`, as even as possible (so every
    batch but the last few samples the same number of rows)."""
    if not items:
        return []
    count = -(-len(items) // max(size, 1))
    base, extra = divmod(len(items), count)
    out, start = [], 0
    for b in range(count):
        end = start + base + (b < extra)
        out.append(list(items[start:end]))
        start = end
    return out


def episode_row(traj: Trajectory, rewards: Rewards, *, mode: str, alpha: float
                ) -> dict[str, Any]:
    """One output row of a scored episode forced to `mode`."""
    record = traj.record
    return {"domain": str(record.domain), "sample_id": record.sample_id,
            "dataset": record.dataset, "mode": mode,
            "declared": None if traj.mode is None else str(traj.mode),
            "forced": bool(traj.forced), "repeat": int(traj.repeat),
            "reward": episode_reward(rewards.r_task, rewards.r_eff, alpha),
            "r_task": float(rewards.r_task), "r_eff": float(rewards.r_eff),
            "correct": bool(rewards.correct), "cost_usd": float(rewards.cost_usd),
            "clean": bool(rewards.clean), "failure_kind": rewards.failure_kind,
            "violation": traj.violation, "workers": [c.worker for c in traj.calls]}


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.fsum(values) / len(values) if values else math.nan


def _influence(rows: Sequence[dict[str, Any]], key: str = "reward") -> dict[str, float]:
    """Per question, its rows' summed deviation from the mean, over the row count: the
    question's share of the mean's sampling error."""
    mean = _mean(r[key] for r in rows)
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[r["sample_id"]] += (r[key] - mean) / len(rows)
    return out


def clustered_se(*parts: tuple[Sequence[dict[str, Any]], float], key: str = "reward"
                 ) -> float:
    """Cluster-robust standard error (clusters: questions, ``sample_id``) of
    Σ weight · mean(rows[key]) over `parts` = (rows, weight) pairs: one part (weight 1) is
    a mean's error, two (1, -1) on the same questions a paired difference's. With Q
    questions and u_q the weighted sum of question q's influences,
    SE² = Q / (Q - 1) · Σ_q u_q²; with equal rows per question and one part, the standard
    error of the per-question means. NaN below 2 questions."""
    total: dict[str, float] = defaultdict(float)
    for rows, weight in parts:
        if not rows:
            return math.nan
        for q, u in _influence(rows, key).items():
            total[q] += weight * u
    n = len(total)
    if n < 2:
        return math.nan
    return math.sqrt(n / (n - 1) * math.fsum(u * u for u in total.values()))


def _ordered_domains(rows: Sequence[dict[str, Any]]) -> list[str]:
    present = {r["domain"] for r in rows}
    known = [str(d) for d in Domain]
    return [d for d in known if d in present] + sorted(present - set(known))


def summarize(rows: Sequence[dict[str, Any]]
              ) -> tuple[list[ModeCell], list[WorkerCell], list[Favourite]]:
    """Cells per (domain, mode), per (domain, mode, worker), and each domain's favourite,
    from `episode_row` rows (see the module doc for the statistics)."""
    by_cell: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_cell[(r["domain"], r["mode"])].append(r)
    cells: list[ModeCell] = []
    workers: list[WorkerCell] = []
    favourites: list[Favourite] = []
    for domain in _ordered_domains(rows):
        clean_by_mode: dict[str, list[dict[str, Any]]] = {}
        for mode in MODES:
            every = by_cell.get((domain, mode), [])
            if not every:
                continue
            clean = [r for r in every if r["clean"]]
            clean_by_mode[mode] = clean
            cells.append(ModeCell(
                domain=domain, mode=mode, episodes=len(clean), dropped=len(every) - len(clean),
                questions=len({r["sample_id"] for r in clean}),
                reward=_mean(r["reward"] for r in clean), reward_se=clustered_se((clean, 1.0)),
                task=_mean(r["r_task"] for r in clean), eff=_mean(r["r_eff"] for r in clean),
                cost_usd=_mean(r["cost_usd"] for r in clean),
                declared_share=_mean(float(r["declared"] == mode) for r in every)))
            names = sorted({w for r in clean for w in r["workers"]})
            for worker in names:
                called = [r for r in clean if worker in r["workers"]]
                workers.append(WorkerCell(domain, mode, worker, len(called),
                                          _mean(r["reward"] for r in called)))
        ranked = sorted((m for m, c in clean_by_mode.items() if c),
                        key=lambda m: (-_mean(r["reward"] for r in clean_by_mode[m]),
                                       MODES.index(m)))
        if not ranked:
            continue
        best = ranked[0]
        if len(ranked) == 1:
            favourites.append(Favourite(domain, best, None, math.nan, math.nan, False))
            continue
        second = ranked[1]
        a, b = clean_by_mode[best], clean_by_mode[second]
        margin = _mean(r["reward"] for r in a) - _mean(r["reward"] for r in b)
        se = clustered_se((a, 1.0), (b, -1.0))
        favourites.append(Favourite(domain, best, second, margin, se,
                                    bool(math.isfinite(se) and margin > SIGNIFICANCE_SE * se)))
    return cells, workers, favourites


def _finite(value: Any) -> Any:
    """`value` with NaN/inf floats as None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# ------------------------------------------------------------------------------ tables
def _num(x: float, digits: int = 3) -> str:
    return "-" if not math.isfinite(x) else f"{x:+.{digits}f}"


def _pm(mean: float, se: float) -> str:
    return f"{_num(mean)} ± {se:.3f}" if math.isfinite(se) else f"{_num(mean)} ± ?"


def _usd(x: float) -> str:
    return "-" if not math.isfinite(x) else f"${x:.2e}"


def mode_cell_text(c: ModeCell | None, sep: str = " ") -> str:
    """``reward ± se (task t, $cost)`` of one cell (`sep` between the two parts)."""
    if c is None:
        return "-"
    return f"{_pm(c.reward, c.reward_se)}{sep}(task {_num(c.task, 2)}, {_usd(c.cost_usd)})"


def favourite_text(f: Favourite | None) -> tuple[str, str, str]:
    """(favourite, "margin ± se over runner-up", "yes"/"no": margin > 2 se)."""
    if f is None:
        return "-", "-", "-"
    if f.runner_up is None:
        return f.mode, "(only mode)", "-"
    return f.mode, f"{_pm(f.margin, f.margin_se)} over {f.runner_up}", \
        "yes" if f.significant else "no"


def _title(result: FavouritesResult) -> str:
    m = result.meta
    return (f"E[reward | domain, mode] of {m['router']}: {m['per_domain']} questions x "
            f"{m['samples']} samples per domain and mode, α = {m['alpha']:g}, "
            f"router T = {m['temperature']:g}, seed {m['seed']}")


def modes_table(result: FavouritesResult) -> Any:
    """A rich table: per domain, each mode's reward ± se (task, cost), the favourite, its
    margin over the runner-up and whether that exceeds 2 standard errors."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(_title(result)))  # Text: no markup in "E[reward | ...]"
    for name in ("domain", *MODES, "favourite", "margin", "> 2 se"):
        table.add_column(name)
    cells = {(c.domain, c.mode): c for c in result.cells}
    favs = {f.domain: f for f in result.favourites}
    for domain in _ordered_domains(result.rows):
        table.add_row(domain, *(mode_cell_text(cells.get((domain, m)), "\n") for m in MODES),
                      *favourite_text(favs.get(domain)))
    return table


def _short(worker: str) -> str:
    return worker.removeprefix("worker_")


def workers_table(result: FavouritesResult) -> Any:
    """A rich table: per (domain, mode), each worker's mean reward over the episodes that
    called it (and how many)."""
    from rich.table import Table

    names = sorted({w.worker for w in result.workers})
    table = Table(title="mean reward of the episodes that called worker_N (episodes)")
    for name in ("domain", "mode", *map(_short, names)):
        table.add_column(name)
    by = {(w.domain, w.mode, w.worker): w for w in result.workers}
    for c in result.cells:
        table.add_row(c.domain, c.mode, *(
            f"{by[k].reward:+.2f} ({by[k].episodes})" if (k := (c.domain, c.mode, n)) in by
            else "-" for n in names))
    return table


def markdown(result: FavouritesResult) -> str:
    """``favourites.md``: what was measured, the two tables, and how to read them."""
    m = result.meta
    names = sorted({w.worker for w in result.workers})
    cells = {(c.domain, c.mode): c for c in result.cells}
    favs = {f.domain: f for f in result.favourites}
    lines = [f"# Favoured execution modes: {m['router']}", "",
             f"{_title(result)}. Config `{m['config_name']}`, workers `{m['workers']}`. "
             "Each question ran forced to each mode; reward = (1 - α) r_task + α r_eff, "
             "mean over clean episodes ± standard error clustered by question. This is the "
             "policy's own execution of each mode (roughly random for an initial random-init "
             "router), not the best execution the mode allows.", "",
             "| domain | " + " | ".join(MODES) + " | favourite | margin | > 2 se |",
             "|---" * (len(MODES) + 4) + "|"]
    for domain in _ordered_domains(result.rows):
        fav, margin, sig = favourite_text(favs.get(domain))
        lines.append(f"| {domain} | " + " | ".join(
            mode_cell_text(cells.get((domain, mode))) for mode in MODES)
            + f" | {fav} | {margin} | {sig} |")
    lines += ["", "Episodes (clean / dropped) and declared = forced share:", "",
              "| domain | mode | clean | dropped | questions | declared = forced |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {c.domain} | {c.mode} | {c.episodes} | {c.dropped} | {c.questions} | "
              f"{c.declared_share:.2f} |" for c in result.cells]
    by = {(w.domain, w.mode, w.worker): w for w in result.workers}
    lines += ["", "## Per worker: mean reward of the episodes that called it (n)", "",
              "| domain | mode | " + " | ".join(names) + " |",
              "|---" * (len(names) + 2) + "|"]
    for c in result.cells:
        lines.append(f"| {c.domain} | {c.mode} | " + " | ".join(
            f"{_num(by[k].reward)} ({by[k].episodes})" if (k := (c.domain, c.mode, n)) in by
            else "-" for n in names) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(result: FavouritesResult, out_dir: str | Path) -> list[Path]:
    """Write ``favourites.json`` and ``favourites.md`` into `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / JSON_FILE, out / MARKDOWN_FILE]
    paths[0].write_text(json.dumps(result.to_json(), indent=1, allow_nan=False) + "\n")
    paths[1].write_text(markdown(result))
    return paths


# ------------------------------------------------------------------------------ the driver
def measure_favourites(cfg: TrainConfig, *, checkpoint: str | None = None,
                       per_domain: int = 20, samples: int = 4, seed: int = 0,
                       console: Console | None = None, progress: bool = True
                       ) -> FavouritesResult:
    """Measure E[reward | domain, mode] (and per worker) of `cfg`'s router; see the module
    doc for what that is and is not.

    `checkpoint`: None for the config's initial policy (``model.init``, built as the
    training loop builds it, with its tokenizer); else a checkpoint `eval run` accepts (a
    run directory, a policy checkpoint or step directory, an HF directory), loaded with
    its saved tokenizer as `eval run` loads it. `per_domain`: questions per domain (the
    first of the run's training questions, `build_records`); `samples`: episodes per
    question and mode; `seed`: the router's sampling seed (batch b reseeds with
    ``seed * 1_000_003 + b``). Episodes run in batches of about ``data.batch_size ×
    data.group_size``; worker calls bill at the pool's table (`pricing.pool_prices`: the
    channel file's prices, the original's for the simulated pool). ValueError
    (`check_options`) before anything is built; PoolCheckError (`rl.run.pool_check`, through
    `build_pool`) naming a worker that is unpriced, unreachable or not serving its model."""
    check_options(cfg, per_domain=per_domain, samples=samples)
    console = console or Console()
    records = build_records(cfg, console)
    questions = pick_questions(records, per_domain)
    if not questions:
        raise ValueError(f"data.source={cfg.data.source}: no training questions to measure")
    pool = build_pool(cfg, records)
    mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
    if checkpoint is None:
        tokenizer = build_tokenizer(cfg, records, pool)
        model = build_policy(cfg, mesh, tokenizer, records, log=console.print)
        router, step = f"{cfg.name}:init({cfg.model.init})", None
    else:
        ckpt = resolve_checkpoint(checkpoint)
        tokenizer = load_router_tokenizer(cfg, ckpt, records, pool)
        model = load_router(cfg, ckpt, mesh)
        step = ckpt.step
        router = ckpt.path.name if ckpt.kind == "hf" else f"{cfg.name}@step{ckpt.step}"
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the router's vocab_size "
                         f"is {model.config.vocab_size}")
    eos = model.config.eos_token_id if model.config.eos_token_id is not None \
        else tokenizer.eos_token_id
    alpha = float(cfg.reward.alpha)
    reward_cfg = reward_config(cfg)
    make_env = routeweaver_envs(tokenizer, pool, env_config(cfg, eos))
    prices = pool_prices(pool)  # the channel file's, or the original price table (simulated)

    work = [q.replace(forced_mode=mode) for mode in MODES for q in questions]
    per_batch = max(1, cfg.data.batch_size * cfg.data.group_size // samples)
    plan = batches(work, per_batch)
    r = cfg.rollout
    sampler = build_sampler(cfg, model, tokenizer, mesh, len(plan[0]) * samples,
                            pad_id=tokenizer.pad_token_id or 0)
    del model

    rows: list[dict[str, Any]] = []
    events = asyncio.new_event_loop()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                      disable=not progress) as bar:
            task = bar.add_task("favourites (episodes)", total=len(work) * samples)
            for index, batch in enumerate(plan):
                sampler.reseed(seed * SEED_STRIDE + index)
                trajs = events.run_until_complete(run_episodes_async(
                    batch, sampler, pool, make_env, repeats=samples, prices=prices))
                rewards = score_batch(trajs, reward_cfg, workers=cfg.reward.score_workers)
                rows += [episode_row(t, rw, mode=str(t.record.forced_mode), alpha=alpha)
                         for t, rw in zip(trajs, rewards, strict=True)]
                bar.advance(task, len(trajs))
    finally:
        aclose = getattr(pool, "aclose", None)
        if aclose is not None:
            events.run_until_complete(aclose())
        events.close()

    cells, workers, favourites = summarize(rows)
    meta = {"router": router, "checkpoint": checkpoint, "step": step,
            "config_name": cfg.name, "workers": cfg.workers.pool, "alpha": alpha,
            "c_ref": reward_cfg.c_ref, "temperature": r.temperature, "top_p": r.top_p,
            "top_k": r.top_k, "seed": seed, "per_domain": per_domain, "samples": samples,
            "questions": len(questions), "episodes": len(rows),
            "batches": len(plan), "config": redact_secrets(to_dict(cfg))}
    return FavouritesResult(meta, rows, cells, workers, favourites)
