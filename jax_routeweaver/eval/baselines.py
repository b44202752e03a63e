"""Single-round baselines: routers that send each query to ONE worker, once.

Every baseline is scored from one table of worker outcomes, so all of them see the same
replies, scorers and prices (the reference points a routing framework is expected to offer,
as listed with Router-R1; the RouteWeaver router's own rows come from `eval.evaluate`):

1. `collect_worker_outcomes`: for each record and each worker, one plain single-mode call with
   the payload a single-mode worker receives when the router's task is the question itself
   (`prompts.single_multi_payload(q, q)`), graded by `rewards.reward.judge` exactly as the
   training loop grades a single-mode answer (the reply is the answer: its `<answer>` body,
   `\\boxed{}` or last line; code rows try its programs) ->
   `correct[r, w]`, `infra[r, w]` (call failed or grading raised: never a wrong answer),
   `cost_usd[r, w] = (in × p_in + out × p_out) / 1e6` at the pool's price table
   (`routing.pricing.pool_prices`: a channel file's prices, the reference table for the
   simulated pool).
   The pool is any `WorkerPool`; a caching pool (record/replay) makes reruns free.
2. Routers pick one worker per record:
   - `RandomRouter(seed)`: uniform, from a hash of (seed, sample_id): reproducible, order-free.
   - `LargestWorkerRouter`: always one worker; default the priciest offered worker by the price
     table (max of in + out USD per 1M tokens; the reference table gives worker_6).
   - `OracleRouter`: upper bound from the collected replies: the cheapest worker that was
     correct on the record if any, else the cheapest worker whose call did not fail.
   - `KNNRouter(k)`, `MLPRouter`: over all-MiniLM-L6-v2 query embeddings, fitted on the
     outcomes of TRAINING records only. kNN: p̂_w = success rate of w over the k most cosine-
     similar training queries (infra cells left out), ĉ_w = their mean cost of w. MLP:
     standardised 384-d input -> 128 (ReLU) -> W logits, p̂ = sigmoid, masked BCE + L2, Adam,
     fixed seed; ĉ_w = mean training cost of w. Both choose argmax_w p̂_w − λ·ĉ_w
     (λ = `lambda_cost`, per USD; 0 = accuracy routing; a call costs about 1e-5..1e-3 USD,
     so λ matters from about 1e3); ties go to the lower ĉ, then to catalog order.
3. `evaluate_baselines` runs the routers on the eval records and returns, per router, one row
   per record in the evaluator's schema (`ROW_KEYS`); `write_rows` writes them as JSONL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jax_routeweaver.data.records import CODE_SCORER_DATASETS, Record
from jax_routeweaver.models.sentence_encoder import Embedder
from jax_routeweaver.rewards.reward import CodeScorerMode, Verdict, candidate_programs, judge
from jax_routeweaver.routing.answers import extract_answer
from jax_routeweaver.routing.calls import WorkerCall, WorkerPool
from jax_routeweaver.routing.episode import Trajectory
from jax_routeweaver.routing.pricing import (
    REFERENCE_PRICES,
    Prices,
    billable_tokens,
    pool_prices,
    trajectory_cost,
    verify_pool,
)
from jax_routeweaver.routing.prompts import single_multi_payload

__all__ = [
    "BASELINE_NAMES",
    "ROW_KEYS",
    "KNNRouter",
    "LargestWorkerRouter",
    "MLPRouter",
    "OracleRouter",
    "RandomRouter",
    "SingleRoundRouter",
    "WorkerOutcomes",
    "acollect_worker_outcomes",
    "aevaluate_baselines",
    "collect_worker_outcomes",
    "evaluate_baselines",
    "priciest_worker",
    "route_rows",
    "single_payload",
    "write_rows",
]

ROW_KEYS = ("sample_id", "dataset", "domain", "router", "mode", "workers", "answer", "correct",
            "verdict", "cost_usd", "calls", "tokens")
BASELINE_NAMES = ("random", "largest", "oracle", "knn", "mlp")
_LEARNED = frozenset({"knn", "mlp"})


# ============================================================================ outcomes
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


def _check_records(records: Sequence[Record], what: str) -> None:
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
    """Call every worker once per record through `pool` and grade each reply (module doc, 1).

    `workers`: default all of `pool.worker_ids()`, in catalog order; every one must be priced
    in `prices` (default: the pool's own table, `pricing.pool_prices`: a channel file's
    prices, the reference table for the simulated pool; PricingError otherwise: a
    baseline's cost must never read as free). At most
    `concurrency` calls are in flight and `grade_concurrency` gradings run in threads (code
    verdicts run programs in child processes). A failed call is an infra cell, not wrong.
    """
    records = list(records)
    _check_records(records, "collect_worker_outcomes")
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
    return _run(acollect_worker_outcomes(records, pool, **kwargs), "collect_worker_outcomes")


def _run(coro: Any, name: str) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(f"{name} called inside a running event loop; await a{name} instead")


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


def _pick(p_success: np.ndarray, cost: np.ndarray, lambda_cost: float) -> np.ndarray:
    """argmax_w p̂ − λ ĉ per row [N]; ties -> lower ĉ, then the lower column."""
    score = p_success - lambda_cost * cost
    tied = score >= score.max(axis=1, keepdims=True) - 1e-12
    return np.argmin(np.where(tied, cost, np.inf), axis=1)


def _training_targets(outcomes: WorkerOutcomes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels float32 [R, W], valid mask float32 [R, W], cost USD float64 [R, W]).

    Infra cells (failed call or grading error) are masked: the worker was never judged."""
    return (outcomes.correct.astype(np.float32), (~outcomes.infra).astype(np.float32),
            outcomes.cost_usd.astype(np.float64))


def _masked_mean(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per-column mean over valid cells [W] (0 where a column has none)."""
    return (values * valid).sum(0) / np.maximum(valid.sum(0), 1.0)


class _EmbeddingRouter:
    """Shared plumbing of the learned routers: embed questions, fit on training outcomes."""

    def __init__(self, embedder: Embedder, lambda_cost: float, name: str) -> None:
        if not lambda_cost >= 0:
            raise ValueError(f"{type(self).__name__}: lambda_cost={lambda_cost} must be >= 0")
        self.embedder, self.lambda_cost, self.name = embedder, float(lambda_cost), name
        self.workers: tuple[str, ...] = ()
        # sample_ids of the training records: evaluation asserts it misses every eval record.
        self.trained_on: frozenset[str] = frozenset()

    def _embed(self, records: Sequence[Record]) -> np.ndarray:
        return np.asarray(self.embedder.embed([r.question for r in records]), np.float32)

    def fit(self, outcomes: WorkerOutcomes) -> _EmbeddingRouter:
        """Fit on the outcomes of TRAINING records; returns self."""
        if not outcomes.records:
            raise ValueError(f"{type(self).__name__}.fit: no training records")
        self._fit(self._embed(outcomes.records), *_training_targets(outcomes))
        self.workers = outcomes.workers
        self.trained_on = frozenset(r.sample_id for r in outcomes.records)
        return self

    def choose(self, records: Sequence[Record]) -> list[str]:
        """argmax_w p̂_w − λ ĉ_w per record (ties: lower ĉ, then catalog order)."""
        if not self.trained_on:
            raise RuntimeError(f"{type(self).__name__}: call fit(training outcomes) first")
        if not records:
            return []
        p_success, cost = self.predict(self._embed(records))
        return [self.workers[j] for j in _pick(p_success, cost, self.lambda_cost)]

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p̂ success [N, W], ĉ cost USD [N, W]) for query embeddings [N, D]."""
        raise NotImplementedError

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        raise NotImplementedError


class KNNRouter(_EmbeddingRouter):
    """k-NN over unit query embeddings (cosine = dot product): p̂_w = Σ_n valid·correct /
    Σ_n valid over the k nearest training queries (equal similarities: earlier training record
    first), falling back to w's training success rate when no neighbour judged w; ĉ_w = the
    neighbours' mean cost of w (same fallback)."""

    def __init__(self, embedder: Embedder, k: int = 10, *, lambda_cost: float = 0.0,
                 name: str = "knn") -> None:
        super().__init__(embedder, lambda_cost, name)
        if k < 1:
            raise ValueError(f"KNNRouter: k={k} must be >= 1")
        self.k = k

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        self._x, self._labels, self._valid, self._cost = x, labels, valid, cost
        self._prior = _masked_mean(labels, valid)
        self._mean_cost = _masked_mean(cost, valid)

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = min(self.k, len(self._x))
        sims = queries @ self._x.T  # [N, R]
        nearest = np.argsort(-sims, axis=1, kind="stable")[:, :k]  # [N, k]
        valid = self._valid[nearest]  # [N, k, W]
        n_valid = valid.sum(1)  # [N, W]
        judged = n_valid > 0
        p = np.where(judged, (self._labels[nearest] * valid).sum(1) / np.maximum(n_valid, 1),
                     self._prior)
        cost = np.where(judged, (self._cost[nearest] * valid).sum(1) / np.maximum(n_valid, 1),
                        self._mean_cost)
        return p, cost


class MLPRouter(_EmbeddingRouter):
    """Per-worker success probability from a small MLP (JAX + optax), full-batch training.

    p̂ = sigmoid(W2 · relu(W1 x + b1) + b2), x the query embedding [D] standardised per
    dimension with the training queries' mean and std, -> [W];
    loss = Σ valid · BCE(p̂, correct) / Σ valid + l2/2 · (‖W1‖² + ‖W2‖²);
    `steps` full-batch Adam steps at `learning_rate`; init from `seed` (deterministic).
    The labels are single noisy draws per (query, worker): without the L2 term the MLP
    memorises them and routes worse (measured on the simulated pool).
    ĉ_w = mean training cost of w (the MLP predicts success only).
    """

    def __init__(self, embedder: Embedder, *, hidden: int = 128, steps: int = 300,
                 learning_rate: float = 3e-3, l2: float = 0.1, seed: int = 0,
                 lambda_cost: float = 0.0, name: str = "mlp") -> None:
        super().__init__(embedder, lambda_cost, name)
        if hidden < 1 or steps < 1 or not learning_rate > 0 or not l2 >= 0:
            raise ValueError(f"MLPRouter: need hidden >= 1, steps >= 1, learning_rate > 0, "
                             f"l2 >= 0; got {hidden}, {steps}, {learning_rate}, {l2}")
        self.hidden, self.steps = hidden, steps
        self.learning_rate, self.l2, self.seed = learning_rate, l2, seed
        self.final_loss: float | None = None

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        # Standardise each embedding dimension on the training queries: unit-norm 384-d
        # vectors have entries around 0.05, which would make the L2 term dominate.
        self._mean = x.mean(0)
        self._scale = x.std(0) + 1e-6
        self._params, self.final_loss = _train_mlp(
            (x - self._mean) / self._scale, labels, valid, hidden=self.hidden, steps=self.steps,
            learning_rate=self.learning_rate, l2=self.l2, seed=self.seed)
        self._mean_cost = _masked_mean(cost, valid)

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(_mlp_probs(self._params, (queries - self._mean) / self._scale),
                       np.float64)
        return p, np.broadcast_to(self._mean_cost, p.shape)


def _mlp_logits(params: Mapping[str, Any], x: Any) -> Any:
    import jax.numpy as jnp

    hidden = jnp.maximum(x @ params["w1"] + params["b1"], 0.0)
    return hidden @ params["w2"] + params["b2"]


def _mlp_probs(params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    import jax

    return np.asarray(jax.nn.sigmoid(_mlp_logits(params, x)))


def _train_mlp(x: np.ndarray, labels: np.ndarray, valid: np.ndarray, *, hidden: int,
               steps: int, learning_rate: float, l2: float, seed: int
               ) -> tuple[dict[str, Any], float]:
    """Full-batch Adam on the masked BCE + L2 (MLPRouter doc); returns (params, final
    data loss)."""
    import jax
    import jax.numpy as jnp
    import optax

    n_in, n_out = x.shape[1], labels.shape[1]
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    # He init for the ReLU layer, Glorot for the output: a standard, stable start.
    params = {
        "w1": jax.random.normal(k1, (n_in, hidden), jnp.float32) * jnp.sqrt(2.0 / n_in),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, n_out), jnp.float32)
        * jnp.sqrt(2.0 / (hidden + n_out)),
        "b2": jnp.zeros((n_out,), jnp.float32),
    }
    tx = optax.adam(learning_rate)
    xs, ys, ms = (jnp.asarray(a, jnp.float32) for a in (x, labels, valid))
    denominator = jnp.maximum(ms.sum(), 1.0)

    def loss_fn(p: dict[str, Any]) -> tuple[Any, Any]:
        bce = optax.sigmoid_binary_cross_entropy(_mlp_logits(p, xs), ys)
        data = (bce * ms).sum() / denominator
        return data + 0.5 * l2 * ((p["w1"] ** 2).sum() + (p["w2"] ** 2).sum()), data

    def step(carry: tuple[Any, Any], _: Any) -> tuple[tuple[Any, Any], Any]:
        p, opt_state = carry
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), loss

    @jax.jit
    def train(p: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        (p, _), losses = jax.lax.scan(step, (p, tx.init(p)), None, length=steps)
        return p, losses[-1]

    params, last = train(params)
    return jax.device_get(params), float(last)


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
    _check_records(eval_records, "eval records")
    learned = [n for n in routers if n in _LEARNED]
    if learned:
        _check_records(train_records, "train records")
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
    return _run(aevaluate_baselines(train_records, eval_records, pool, **kwargs),
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
