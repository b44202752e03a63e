"""The table of worker outcomes every single-round baseline is scored from.

`collect_worker_outcomes`: for each record and each worker, one plain single-mode call with
the payload a single-mode worker receives when the router's task is the question itself
(`prompts.single_multi_payload(q, q)`), graded by `rewards.reward.judge` exactly as the
training loop grades a single-mode answer (the reply is the answer: its `<answer>` body,
`\\boxed{}` or last line; code rows try its programs) ->
`correct[r, w]`, `infra[r, w]` (call failed or grading raised: never a wrong answer),
`cost_usd[r, w] = (in × p_in + out × p_out) / 1e6` at the pool's price table
(`routing.pools.pricing.pool_prices`: a channel file's prices, the original price table for
the simulated pool).
The pool is any `WorkerPool`; a caching pool (record/replay) makes reruns free. Every
baseline (`eval.baselines`) routes over the same `WorkerOutcomes`, so all of them see the same
replies, scorers and prices; `WorkerOutcomes.row` gives the evaluator row (`ROW_KEYS`) of one
pick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_routeweaver.data.records import CODE_SCORER_DATASETS, Record
from jax_routeweaver.rewards.reward import CodeScorerMode, Verdict, candidate_programs, judge
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.pools.pricing import (
    Prices,
    billable_tokens,
    pool_prices,
    trajectory_cost,
    verify_pool,
)
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.routing.protocol.calls import WorkerCall, WorkerPool
from jax_routeweaver.routing.protocol.prompts import single_multi_payload

__all__ = [
    "ROW_KEYS",
    "WorkerOutcomes",
    "acollect_worker_outcomes",
    "collect_worker_outcomes",
    "single_payload",
]

ROW_KEYS = ("sample_id", "dataset", "domain", "router", "mode", "workers", "answer", "correct",
            "verdict", "cost_usd", "calls", "tokens")


@dataclasses.dataclass(frozen=True, eq=False)
class WorkerOutcomes:
    """One plain call per (record, worker), graded. Rows follow `records`, columns `workers`.

    `correct`, `infra`, `cost_complete`: bool [R, W]; `cost_usd`: float64 [R, W];
    `calls`, `answers` (extracted answer, "" if none), `verdicts` (failure kind, e.g.
    "correct", "genuine_incorrect", "provider_error"): `[R][W]` nested tuples.
    """

    records: tuple[Record, ...]
    workers: tuple[str, ...]
    correct: np.ndarray
    infra: np.ndarray
    cost_usd: np.ndarray
    cost_complete: np.ndarray
    calls: tuple[tuple[WorkerCall, ...], ...]
    answers: tuple[tuple[str, ...], ...]
    verdicts: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        shape = (len(self.records), len(self.workers))
        for name in ("correct", "infra", "cost_usd", "cost_complete"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"WorkerOutcomes.{name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape} (records x workers)")

    @functools.cached_property
    def positions(self) -> dict[str, int]:
        """sample_id -> row index."""
        return {r.sample_id: i for i, r in enumerate(self.records)}

    def select(self, records: Iterable[Record]) -> WorkerOutcomes:
        """The rows of `records` (by sample_id), in their order; KeyError names a missing one."""
        wanted = list(records)
        missing = [r.sample_id for r in wanted if r.sample_id not in self.positions]
        if missing:
            raise KeyError(f"WorkerOutcomes has no outcomes for {len(missing)} record(s), "
                           f"e.g. {missing[:3]}; collect them first")
        idx = [self.positions[r.sample_id] for r in wanted]
        return WorkerOutcomes(
            records=tuple(self.records[i] for i in idx), workers=self.workers,
            correct=self.correct[idx], infra=self.infra[idx], cost_usd=self.cost_usd[idx],
            cost_complete=self.cost_complete[idx],
            calls=tuple(self.calls[i] for i in idx), answers=tuple(self.answers[i] for i in idx),
            verdicts=tuple(self.verdicts[i] for i in idx))

    def column(self, worker: str) -> int:
        """Column index of `worker`; ValueError if it was not collected."""
        try:
            return self.workers.index(worker)
        except ValueError:
            raise ValueError(f"worker {worker!r} is not in the collected outcomes "
                             f"(workers: {list(self.workers)})") from None

    def row(self, index: int, worker: str, router: str) -> dict[str, Any]:
        """The evaluator row (`ROW_KEYS`) for record `index` answered by `worker`."""
        j = self.column(worker)
        record, call = self.records[index], self.calls[index][j]
        prompt_tokens, completion_tokens = billable_tokens(call)
        return {
            "sample_id": record.sample_id, "dataset": record.dataset,
            "domain": str(record.domain), "router": router, "mode": "single",
            "workers": [worker], "answer": self.answers[index][j],
            "correct": bool(self.correct[index, j]), "verdict": self.verdicts[index][j],
            "cost_usd": float(self.cost_usd[index, j]), "calls": 1,
            "tokens": {"router": 0, "worker_prompt": int(prompt_tokens),
                       "worker_completion": int(completion_tokens)},
        }


def single_payload(record: Record) -> str:
    """The payload of a single-mode call whose task is the question itself (docs/protocol.md,
    "What a worker receives")."""
    return single_multi_payload(record.question, record.question)


def _single_trajectory(record: Record, call: WorkerCall) -> Trajectory:
    """A single-mode episode in which the worker's reply is the final answer."""
    answer = extract_answer(call.text) if call.success else None
    return Trajectory(record=record, repeat=0, prompt_ids=[], mode="single", calls=[call],
                      answer=answer, final_turn=call.text if call.success else None,
                      infra_failed=not call.success, finish="answer")


def _grading_key(traj: Trajectory) -> tuple[Any, ...] | None:
    """What the verdict of a successful single call depends on: the scored texts only.

    Two workers giving the same answer (or, for code, the same candidate programs) get the
    same verdict, so it is graded once (a code verdict costs a sandbox run)."""
    if not traj.calls[0].success:
        return None
    if traj.record.scorer_dataset in CODE_SCORER_DATASETS:
        return (traj.record.sample_id, "code", tuple(p for _, p in candidate_programs(traj)))
    return (traj.record.sample_id, "answer", traj.answer)


def check_records(records: Sequence[Record], what: str) -> None:
    seen: set[str] = set()
    for r in records:
        if not isinstance(r, Record):
            raise TypeError(f"{what}: expected Records, got {type(r).__name__}")
        if r.sample_id in seen:
            raise ValueError(f"{what}: sample_id {r.sample_id!r} appears twice")
        seen.add(r.sample_id)


async def acollect_worker_outcomes(
        records: Iterable[Record], pool: WorkerPool, *, workers: Sequence[str] | None = None,
        prices: Prices | None = None, max_tokens: int | None = None,
        concurrency: int = 16, grade_concurrency: int = 2,
        code_scorer: CodeScorerMode = "union") -> WorkerOutcomes:
    """Call every worker once per record through `pool` and grade each reply (module doc).

    `workers`: default all of `pool.worker_ids()`, in catalog order; every one must be priced
    in `prices` (default: the pool's own table, `pricing.pool_prices`: a channel file's
    prices, the original price table for the simulated pool; PricingError otherwise: a
    baseline's cost must never read as free). At most
    `concurrency` calls are in flight and `grade_concurrency` gradings run in threads (code
    verdicts run programs in child processes). A failed call is an infra cell, not wrong.
    """
    records = list(records)
    check_records(records, "collect_worker_outcomes")
    offered = list(pool.worker_ids())
    workers = tuple(offered if workers is None else workers)
    unknown = [w for w in workers if w not in offered]
    if unknown or not workers:
        raise ValueError(f"collect_worker_outcomes: workers {list(workers)} must be a "
                         f"non-empty subset of the pool's {offered}")
    prices = pool_prices(pool) if prices is None else prices
    verify_pool(workers, prices)
    if concurrency < 1 or grade_concurrency < 1:
        raise ValueError("collect_worker_outcomes: concurrency and grade_concurrency must be "
                         ">= 1")
    call_slots = asyncio.Semaphore(concurrency)
    grade_slots = asyncio.Semaphore(grade_concurrency)
    graded: dict[tuple[Any, ...], asyncio.Future[Verdict]] = {}

    async def grade(traj: Trajectory) -> Verdict:
        async with grade_slots:
            return await asyncio.to_thread(judge, traj, code_scorer=code_scorer)

    async def one(record: Record, worker: str) -> tuple[WorkerCall, Verdict]:
        async with call_slots:
            call = await pool.call(worker, single_payload(record), max_tokens=max_tokens)
        traj = _single_trajectory(record, call)
        key = _grading_key(traj)
        if key is None:
            return call, await grade(traj)
        if key not in graded:
            graded[key] = asyncio.ensure_future(grade(traj))
        return call, await graded[key]

    results = await asyncio.gather(*(one(r, w) for r in records for w in workers))
    n_rec, n_w = len(records), len(workers)
    correct = np.zeros((n_rec, n_w), bool)
    infra = np.zeros((n_rec, n_w), bool)
    cost = np.zeros((n_rec, n_w), np.float64)
    complete = np.zeros((n_rec, n_w), bool)
    calls: list[list[WorkerCall]] = [[] for _ in records]
    answers: list[list[str]] = [[] for _ in records]
    verdicts: list[list[str]] = [[] for _ in records]
    for flat, (call, verdict) in enumerate(results):
        i, j = divmod(flat, n_w)
        summary = trajectory_cost([call], prices)
        correct[i, j] = verdict.correct
        infra[i, j] = verdict.infra
        cost[i, j] = summary.cost_usd
        complete[i, j] = summary.complete
        calls[i].append(call)
        answers[i].append((extract_answer(call.text) or "") if call.success else "")
        verdicts[i].append(verdict.failure_kind)
    return WorkerOutcomes(tuple(records), workers, correct, infra, cost, complete,
                          tuple(map(tuple, calls)), tuple(map(tuple, answers)),
                          tuple(map(tuple, verdicts)))


def collect_worker_outcomes(records: Iterable[Record], pool: WorkerPool,
                            **kwargs: Any) -> WorkerOutcomes:
    """Synchronous `acollect_worker_outcomes` (runs its own event loop)."""
    return run_sync(acollect_worker_outcomes(records, pool, **kwargs), "collect_worker_outcomes")


def run_sync(coro: Any, name: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(f"{name} called inside a running event loop; await a{name} instead")
