"""Single-round baselines: routers that send each query to ONE worker, once.

Every baseline is scored from one table of worker outcomes (`eval.worker_outcomes`), so all of
them see the same replies, scorers and prices (the reference points a routing framework is
expected to offer, as listed with Router-R1; the RouteWeaver router's own rows come from
`eval.evaluate`):

1. `worker_outcomes.collect_worker_outcomes`: one plain single-mode call per record and
   worker, graded as the training loop grades a single-mode answer, priced at the pool's
   table (that module's doc).
2. Routers pick one worker per record:
   - `RandomRouter(seed)`: uniform, from a hash of (seed, sample_id): reproducible, order-free.
   - `LargestWorkerRouter`: always one worker; default the priciest offered worker by the price
     table (max of in + out USD per 1M tokens; the original price table gives worker_6).
   - `OracleRouter`: upper bound from the collected replies: the cheapest worker that was
     correct on the record if any, else the cheapest worker whose call did not fail.
   - `KNNRouter(k)`, `MLPRouter` (`eval.learned_routers`): over all-MiniLM-L6-v2 query
     embeddings, fitted on the outcomes of TRAINING records only; both choose
     argmax_w p̂_w − λ·ĉ_w (λ = `lambda_cost`, per USD).
3. `evaluate_baselines` runs the routers on the eval records and returns, per router, one row
   per record in the evaluator's schema (`ROW_KEYS`); `write_rows` writes them as JSONL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jax_routeweaver.data.records import Record
from jax_routeweaver.eval.learned_routers import KNNRouter, MLPRouter
from jax_routeweaver.eval.worker_outcomes import (
    ROW_KEYS,
    WorkerOutcomes,
    acollect_worker_outcomes,
    check_records,
    run_sync,
)
from jax_routeweaver.models.sentence_encoder import Embedder
from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES, Prices, pool_prices, verify_pool
from jax_routeweaver.routing.protocol.calls import WorkerPool

__all__ = [
    "BASELINE_NAMES",
    "LargestWorkerRouter",
    "OracleRouter",
    "RandomRouter",
    "SingleRoundRouter",
    "aevaluate_baselines",
    "evaluate_baselines",
    "priciest_worker",
    "route_rows",
    "write_rows",
]

BASELINE_NAMES = ("random", "largest", "oracle", "knn", "mlp")
_LEARNED = frozenset({"knn", "mlp"})


# ============================================================================ routers
class SingleRoundRouter(Protocol):
    """Picks one worker per record. `name` labels its rows."""

    name: str

    def choose(self, records: Sequence[Record]) -> list[str]:
        """One worker id per record, in order."""
        ...


def priciest_worker(workers: Sequence[str], prices: Prices = REFERENCE_PRICES) -> str:
    """The offered worker with the highest input + output price (USD per 1M tokens); ties go
    to the higher output price, then to catalog order. PricingError if one is unpriced."""
    verify_pool(workers, prices)
    if not workers:
        raise ValueError("priciest_worker: no workers offered")
    total = lambda w: (prices[w].input_usd_per_m + prices[w].output_usd_per_m,
                       prices[w].output_usd_per_m)
    return max(workers, key=total)  # max keeps the first of equal keys


@dataclasses.dataclass
class RandomRouter:
    """Uniform choice from a hash of (seed, sample_id): the same seed gives the same picks
    whatever the order or batch of the records."""

    workers: Sequence[str]
    seed: int = 0
    name: str = "random"

    def choose(self, records: Sequence[Record]) -> list[str]:
        workers = list(self.workers)
        if not workers:
            raise ValueError("RandomRouter: no workers")
        picks = []
        for record in records:
            digest = hashlib.sha256(f"{self.seed}\x1f{record.sample_id}".encode()).digest()
            picks.append(workers[int.from_bytes(digest[:8], "big") % len(workers)])
        return picks


@dataclasses.dataclass
class LargestWorkerRouter:
    """Always `worker`; default `priciest_worker(workers, prices)` (module doc)."""

    workers: Sequence[str]
    worker: str | None = None
    prices: Prices = dataclasses.field(default_factory=lambda: REFERENCE_PRICES)
    name: str = "largest"

    def __post_init__(self) -> None:
        if self.worker is None:
            self.worker = priciest_worker(list(self.workers), self.prices)
        elif self.worker not in self.workers:
            raise ValueError(f"LargestWorkerRouter: worker {self.worker!r} is not offered "
                             f"(workers: {list(self.workers)})")

    def choose(self, records: Sequence[Record]) -> list[str]:
        return [str(self.worker)] * len(records)


@dataclasses.dataclass
class OracleRouter:
    """Upper bound: the cheapest correct worker per record, else the cheapest worker whose
    call did not fail (else the first). Reads the outcomes of the records it routes."""

    outcomes: WorkerOutcomes
    name: str = "oracle"

    def choose(self, records: Sequence[Record]) -> list[str]:
        out = self.outcomes.select(records)
        picks = []
        for i in range(len(out.records)):
            pool = out.correct[i] if out.correct[i].any() else ~out.infra[i]
            if not pool.any():
                picks.append(out.workers[0])
                continue
            cost = np.where(pool, out.cost_usd[i], np.inf)
            picks.append(out.workers[int(np.argmin(cost))])  # argmin: first of equal costs
        return picks

# ============================================================================ evaluation
def route_rows(router: SingleRoundRouter, outcomes: WorkerOutcomes) -> list[dict[str, Any]]:
    """Route every record of `outcomes` with `router`; the chosen worker's collected reply is
    the answer. One `ROW_KEYS` row per record, in order."""
    picks = router.choose(list(outcomes.records))
    if len(picks) != len(outcomes.records):
        raise ValueError(f"router {router.name!r} returned {len(picks)} choices for "
                         f"{len(outcomes.records)} records")
    return [outcomes.row(i, worker, router.name) for i, worker in enumerate(picks)]


def _check_disjoint(train: Sequence[Record], evaluation: Sequence[Record]) -> None:
    """Learned routers must never see an eval record: same sample_id or same question text."""
    ids = {r.sample_id for r in train} & {r.sample_id for r in evaluation}
    norm = lambda r: " ".join(r.question.split())
    texts = {norm(r) for r in train} & {norm(r) for r in evaluation}
    if ids or texts:
        example = sorted(ids)[:3] or [t[:60] for t in sorted(texts)[:2]]
        raise ValueError(f"train and eval records overlap ({len(ids)} sample_ids, {len(texts)} "
                         f"question texts, e.g. {example}); the learned baselines would be "
                         "scored on their own training data")


async def aevaluate_baselines(
        train_records: Sequence[Record], eval_records: Sequence[Record], pool: WorkerPool, *,
        routers: Sequence[str] = BASELINE_NAMES, outcomes: WorkerOutcomes | None = None,
        embedder: Embedder | None = None, workers: Sequence[str] | None = None,
        prices: Prices | None = None, largest_worker: str | None = None, seed: int = 0,
        k: int = 10, lambda_cost: float = 0.0, mlp_steps: int = 300,
        max_tokens: int | None = None, concurrency: int = 16
        ) -> dict[str, list[dict[str, Any]]]:
    """Baseline rows: router name -> one `ROW_KEYS` row per eval record (module doc).

    `routers`: names from `BASELINE_NAMES`. `outcomes`: reuse collected outcomes (must cover
    the eval records, and the training records when "knn"/"mlp" run); else they are collected
    through `pool`. `prices`: the table calls bill at and "largest" ranks by (default: the
    pool's own, `pricing.pool_prices`). `embedder`: default the bundled all-MiniLM-L6-v2
    (`models.sentence_encoder`).
    Raises ValueError if train and eval share a sample_id or question.
    """
    train_records, eval_records = list(train_records), list(eval_records)
    unknown = [n for n in routers if n not in BASELINE_NAMES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {unknown}; known: {list(BASELINE_NAMES)}")
    check_records(eval_records, "eval records")
    learned = [n for n in routers if n in _LEARNED]
    if learned:
        check_records(train_records, "train records")
        _check_disjoint(train_records, eval_records)
    needed = eval_records + (train_records if learned else [])
    prices = pool_prices(pool) if prices is None else prices
    if outcomes is None:
        outcomes = await acollect_worker_outcomes(needed, pool, workers=workers, prices=prices,
                                                  max_tokens=max_tokens,
                                                  concurrency=concurrency)
    eval_out = outcomes.select(eval_records)
    train_out = outcomes.select(train_records) if learned else None
    if learned and embedder is None:
        embedder = Embedder()  # loads torch + the bundled model only now
    offered = list(outcomes.workers)
    results: dict[str, list[dict[str, Any]]] = {}
    for name in routers:
        router: SingleRoundRouter
        if name == "random":
            router = RandomRouter(offered, seed=seed)
        elif name == "largest":
            router = LargestWorkerRouter(offered, largest_worker, prices)
        elif name == "oracle":
            router = OracleRouter(eval_out)
        elif name == "knn":
            router = KNNRouter(embedder, k, lambda_cost=lambda_cost).fit(train_out)
        else:
            router = MLPRouter(embedder, steps=mlp_steps, seed=seed,
                               lambda_cost=lambda_cost).fit(train_out)
        results[name] = route_rows(router, eval_out)
    return results


def evaluate_baselines(train_records: Sequence[Record], eval_records: Sequence[Record],
                       pool: WorkerPool, **kwargs: Any) -> dict[str, list[dict[str, Any]]]:
    """Synchronous `aevaluate_baselines` (runs its own event loop)."""
    return run_sync(aevaluate_baselines(train_records, eval_records, pool, **kwargs),
                "evaluate_baselines")


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write rows as JSONL (one object per line, UTF-8), creating parent folders; returns the
    path. A row missing a `ROW_KEYS` field is a ValueError (the evaluator reads them all)."""
    path = Path(path)
    lines = []
    for index, row in enumerate(rows):
        missing = [key for key in ROW_KEYS if key not in row]
        if missing:
            raise ValueError(f"{path}: row {index} lacks {missing}")
        lines.append(json.dumps(dict(row), ensure_ascii=False, allow_nan=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
