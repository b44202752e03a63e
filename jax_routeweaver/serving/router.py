"""One served request: the router declares a mode, calls workers under the protocol's rules
within the request's budget, and answers; `RouterService.route` returns the answer and its
routing record.

Per request (`RouteRequest`):

1. The offered workers are the request's list (default: the served ones) less those whose
   first call's worst case already exceeds `max_cost` (the router is never offered a worker it
   cannot afford; `serving.budget`). None left: `BudgetTooSmall`.
2. One RouteWeaver episode runs against the shared batching sampler and a `BudgetedPool` over
   the server's worker pool (every attempt within the budget, a failed call replaced by its
   channel's fallback when that is one of the request's workers, else `WorkerFailed`). A
   forced mode is injected as the curriculum's forced arm is (the mode declaration is
   written for the router).
3. The answer is the router's. An episode that ends without one (a violation, the turn
   limit, a call refused for budget) falls back to the cheapest way to answer within the
   budget, and the record says which (`answer_source`): the last successful worker reply
   (free), else one call to the worker with the lowest worst-case price that still fits
   (``cheapest_worker``), else `BudgetExhausted`.

`RouterService.start` returns the request as a `RouteJob`, whose `record` is the routing
record so far at any moment: a request that ends in an error (402, 502, a timeout, a client
gone) keeps what was billed and reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.data.records import FORCED_MODES, UNSCORED, Record
from jax_routeweaver.routing.episodes.episode import (
    SOURCE_ENV,
    EnvFactory,
    Trajectory,
    run_episodes_async,
)
from jax_routeweaver.routing.episodes.routeweaver_env import EnvConfig, routeweaver_envs
from jax_routeweaver.routing.pools.pricing import Prices
from jax_routeweaver.routing.protocol import prompts
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.routing.protocol.calls import PoolView, Usage, WorkerCall
from jax_routeweaver.serving.budget import BudgetedPool, WorkerFailed

# The task the fallback's direct call carries (a single-mode payload).
DIRECT_TASK = "Answer the question."
# What `RouterService.warm_up` routes, and the text its canned worker replies repeat.
WARM_UP_QUESTION = "What is the sum of the first ten positive integers?"
WARM_UP_REPLY = ("Adding 1 + 2 + ... + 10 pairs 1 with 10, 2 with 9, and so on: five pairs of "
                 "11, so the sum is 55. ")
# The canned replies' lengths, as shares of the longest observation a reply can become: the
# router's contexts then reach the prompt buckets that short, medium and full replies make.
WARM_UP_REPLY_SHARES = (0.25, 0.5, 1.0)


class BudgetTooSmall(ValueError):
    """No offered worker's first call fits `max_cost`; `needed`: the cheapest worst case."""

    def __init__(self, max_cost: float, needed: float, worker: str):
        self.max_cost, self.needed, self.worker = max_cost, needed, worker
        super().__init__(f"max_cost={max_cost:g} USD is below the worst case of any offered "
                         f"worker's call (cheapest: {worker}, {needed:.6g} USD)")


class BudgetExhausted(RuntimeError):
    """The episode gave no answer and no worker call fits what is left of the budget."""

    def __init__(self, record: dict[str, Any]):
        self.record = record
        super().__init__(f"no answer within max_cost={record['max_cost_usd']:g} USD: the "
                         f"router gave none and no worker call fits the "
                         f"{record['budget_left_usd']:.6g} USD left")


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What one request asks for. `max_cost`: USD for all worker calls (None: no budget);
    `mode`: a forced mode (single | multi | agentic) or None (the router decides);
    `workers`: the worker ids it may call (() = every served one); `worker_max_tokens`: a
    lower completion cap for each worker call (None: the protocol's)."""

    question: str
    max_cost: float | None = None
    mode: str | None = None
    workers: tuple[str, ...] = ()
    worker_max_tokens: int | None = None
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


@dataclasses.dataclass(frozen=True)
class RouteResult:
    """The answer, the routing record (`routing_record`) and the router's own token counts
    (prompt: the episode's context tokens it read; completion: the tokens it wrote)."""

    answer: str
    record: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int


class WarmUpPool(PoolView):
    """A warm-up's pool: the served pool's catalog, but every call succeeds at once without
    being sent (nothing is paid), its reply the canned `reply`."""

    def __init__(self, pool: Any, reply: str):
        super().__init__(pool)
        self.reply = reply

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        return WorkerCall(worker, prompt, self.reply, True, usage=Usage(0, 0), attempts=0)


def warm_up_reply(tokenizer: Any, tokens: int) -> str:
    """`WARM_UP_REPLY` repeated and cut to `tokens` router tokens (>= 1); encoded again it
    is about as long (the tokenizer may merge a few tokens where the repeats join)."""
    unit = tokenizer.encode(WARM_UP_REPLY, add_special_tokens=False)
    ids = (unit * (tokens // len(unit) + 1))[:max(1, tokens)]
    return tokenizer.decode(ids)


class RouterService:
    """Routes requests with one tokenizer, one (batching) sampler and one worker pool.

    `config`: the RouteWeaver environment of the checkpoint's run (`rl.run.routeweaver_run.
    env_config`, greedy); `served`: the worker ids requests may use (default: the config's
    offered, else the pool's); `prices`: the table calls are billed at; `fallbacks`: worker ->
    fallback worker (the channel file's)."""

    def __init__(self, tokenizer: Any, sampler: Any, pool: Any, config: EnvConfig,
                 prices: Prices, *, fallbacks: Mapping[str, str] | None = None,
                 served: Sequence[str] = ()):
        self.tokenizer, self.sampler, self.pool, self.config = tokenizer, sampler, pool, config
        self.prices, self.fallbacks = prices, dict(fallbacks or {})
        self.served = tuple(served or config.offered or pool.worker_ids())
        unpriced = [w for w in (*self.served, *self.fallbacks.values()) if w not in prices]
        if unpriced:
            raise ValueError(f"served workers {unpriced} have no price: a budget cannot be "
                             "honoured for them")
        self._factories: dict[tuple[tuple[str, ...], int], EnvFactory] = {}

    async def warm_up(self, rows: Sequence[int], question: str = WARM_UP_QUESTION) -> int:
        """Compile the sampler's shapes before the first request: for each `rows` entry n
        and each canned reply length (`warm_up_lengths`), n episodes of `question` at once
        (through the shared sampler, as n concurrent requests would; modes cycling free,
        single, multi, agentic), against a pool that sends nothing (`WarmUpPool`: every
        call succeeds at once with the canned reply, so nothing is paid and the router's
        contexts grow as real replies make them). Returns the episodes run."""
        modes = (None, *FORCED_MODES)
        make_env = self._factory(self.served, self.config.protocol.worker_max_tokens)
        pools = [WarmUpPool(self.pool, warm_up_reply(self.tokenizer, length))
                 for length in self.warm_up_lengths()]
        done = 0
        for n in rows:
            for length, pool in zip(self.warm_up_lengths(), pools, strict=True):
                records = [Record(sample_id=f"warm-up-{n}-{length}-{i}", domain=None,
                                  dataset="serve", scorer_dataset=UNSCORED, question=question,
                                  gold=(), forced_mode=modes[i % len(modes)])
                           for i in range(n)]
                await asyncio.gather(*(run_episodes_async([r], self.sampler, pool, make_env)
                                       for r in records))
                done += n
        return done

    def warm_up_lengths(self) -> tuple[int, ...]:
        """The canned replies' lengths in router tokens: `WARM_UP_REPLY_SHARES` of the
        longest observation one reply can become (the protocol's `obs_budget_cap`, or
        `worker_max_tokens` if lower)."""
        pc = self.config.protocol
        longest = min(pc.obs_budget_cap, pc.worker_max_tokens)
        return tuple(sorted({max(1, round(share * longest)) for share in WARM_UP_REPLY_SHARES}))

    def check(self, request: RouteRequest) -> None:
        """ValueError naming the field for a request this service cannot run."""
        unknown = [w for w in request.workers if w not in self.served]
        if unknown:
            raise ValueError(f"workers: {unknown} not served (served: {list(self.served)})")
        if request.mode is not None and request.mode not in FORCED_MODES:
            raise ValueError(f"mode: {request.mode!r} is not one of {', '.join(FORCED_MODES)}")

    def start(self, request: RouteRequest) -> RouteJob:
        """The request, ready to `run` (module docstring). Raises `BudgetTooSmall`, or
        ValueError for a request `check` refuses."""
        self.check(request)
        max_tokens = self._worker_max_tokens(request)
        budget = BudgetedPool(self.pool, self.prices, request.max_cost, self.fallbacks,
                              default_max_tokens=max_tokens,
                              allowed=request.workers or None)
        offered = self._affordable(request, budget, max_tokens)
        return RouteJob(self, request, budget, offered, max_tokens)

    async def route(self, request: RouteRequest) -> RouteResult:
        """`start(request).run()`."""
        return await self.start(request).run()

    # -- helpers ---------------------------------------------------------------------------
    def _worker_max_tokens(self, request: RouteRequest) -> int:
        cap = self.config.protocol.worker_max_tokens
        return cap if request.worker_max_tokens is None else min(cap, request.worker_max_tokens)

    def _affordable(self, request: RouteRequest, budget: BudgetedPool,
                    max_tokens: int) -> tuple[str, ...]:
        """The requested workers whose first call (a direct payload of the question) fits."""
        _, worst = self._direct_call(request, budget, max_tokens)
        fits = tuple(w for w, cost in worst.items() if budget.fits(cost))
        if not fits:
            cheapest = min(worst, key=worst.__getitem__)
            raise BudgetTooSmall(request.max_cost or 0.0, worst[cheapest], cheapest)
        return fits

    def _direct_call(self, request: RouteRequest, budget: BudgetedPool, max_tokens: int
                     ) -> tuple[str, dict[str, float]]:
        """The payload of a direct single-mode call on the question, and its worst case (USD)
        on each requested worker, in catalog order."""
        payload = prompts.single_multi_payload(request.question, DIRECT_TASK)
        return payload, {w: budget.worst_case(w, payload, max_tokens)
                         for w in request.workers or self.served}

    def _factory(self, offered: tuple[str, ...], max_tokens: int) -> EnvFactory:
        """One env factory per (offered workers, worker cap), so the rulebook ids are shared."""
        key = (offered, max_tokens)
        if key not in self._factories:
            protocol = dataclasses.replace(self.config.protocol, worker_max_tokens=max_tokens)
            config = dataclasses.replace(self.config, offered=offered, protocol=protocol)
            self._factories[key] = routeweaver_envs(self.tokenizer, self.pool, config)
        return self._factories[key]

    async def _answer(self, traj: Trajectory, budget: BudgetedPool, request: RouteRequest,
                      max_tokens: int) -> tuple[str | None, str | None]:
        """The answer and where it came from (module docstring, step 3)."""
        if traj.answer is not None:
            return traj.answer, "router"
        for call in reversed(traj.calls):
            if call.success and call.text:
                return extract_answer(call.text) or call.text, "last_reply"
        payload, worst = self._direct_call(request, budget, max_tokens)
        affordable = [w for w, cost in worst.items() if budget.fits(cost)]
        if not affordable:
            return None, None
        worker = min(affordable, key=worst.__getitem__)
        call = await budget.call(worker, payload, max_tokens=max_tokens)
        if not call.success:  # refused: nothing fits any more
            return None, None
        return extract_answer(call.text) or call.text, "cheapest_worker"


class RouteJob:
    """One request under way: its budget, its offered workers and, once the episode has run,
    its trajectory. `record()` is its routing record at any moment."""

    def __init__(self, service: RouterService, request: RouteRequest, budget: BudgetedPool,
                 offered: tuple[str, ...], max_tokens: int):
        self.service, self.request, self.budget = service, request, budget
        self.offered, self.max_tokens = offered, max_tokens
        self.started = time.perf_counter()
        self.traj: Trajectory | None = None
        self.source: str | None = None

    def record(self) -> dict[str, Any]:
        """The routing record so far (`routing_record`; mode None until the episode ends)."""
        return routing_record(self.traj, self.budget, self.offered, self.source,
                              time.perf_counter() - self.started, self.request.request_id)

    async def run(self) -> RouteResult:
        """Route the request. Raises `BudgetExhausted` or `budget.WorkerFailed`, each with
        the record so far."""
        service, request, budget = self.service, self.request, self.budget
        record = Record(sample_id=request.request_id, domain=None, dataset="serve",
                        scorer_dataset=UNSCORED, question=request.question, gold=(),
                        forced_mode=request.mode)
        make_env = service._factory(self.offered, self.max_tokens)
        try:
            traj = (await run_episodes_async([record], service.sampler, budget, make_env))[0]
            budget.label(traj.calls)
            self.traj = traj
            answer, self.source = await service._answer(traj, budget, request,
                                                        self.max_tokens)
        except WorkerFailed as e:  # the client sees what was called (and billed) before
            e.record = self.record()
            raise
        if answer is None:
            raise BudgetExhausted(self.record())
        # The router read its prompt and the environment's tokens, and wrote the rest.
        read = traj.token_source.count(SOURCE_ENV)
        return RouteResult(answer, self.record(), len(traj.prompt_ids) + read,
                           len(traj.response_ids) - read)


def routing_record(traj: Trajectory | None, budget: BudgetedPool, offered: Sequence[str],
                   source: str | None, latency_s: float, request_id: str) -> dict[str, Any]:
    """The routing record of one request (the response's ``routeweaver`` field;
    docs/serving.md, "The routing record"); `traj` None: the episode did not finish (a
    worker failed, the request timed out or its client left), so only the calls and the
    budget are known. `reserved_usd`: the worst cases of attempts still in flight;
    `router_s`: latency not spent waiting for workers (sampling, queueing for the shared
    sampler, orchestration)."""
    worker_s = budget.worker_s
    return {
        "id": request_id,
        "mode": None if traj is None else traj.mode,
        "forced": bool(traj is not None and traj.forced), "offered": list(offered),
        "calls": [e.to_json() for e in budget.ledger],
        "total_cost_usd": budget.spent,
        "max_cost_usd": budget.max_cost,
        "reserved_usd": budget.reserved,
        "budget_left_usd": budget.remaining,
        "within_budget": budget.within_budget,
        "refused_calls": len(budget.refusals),
        "fallback_calls": sum(e.fallback_for is not None for e in budget.ledger),
        "answer_source": source,
        "latency_s": round(latency_s, 4),
        "worker_s": round(worker_s, 4),
        "router_s": round(max(0.0, latency_s - worker_s), 4),
        "turns": None if traj is None else traj.turns,
        "finish": None if traj is None else traj.finish,
        "violation": None if traj is None else traj.violation,
    }
