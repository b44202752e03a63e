"""A request's cost budget, honoured by construction, and the fallback worker.

`BudgetedPool` wraps the server's worker pool for one request. Before a call is sent it
prices the call's worst case,

    W(call) = (P_max × in + max_tokens × out) / 1e6   USD

(`P_max`: the most prompt tokens the worker may bill for this request body,
`HttpWorkerPool.usage_bound`; `max_tokens`: the completion cap sent with it; in/out: the
worker's price per 1M tokens) and reserves it against what is left of `max_cost`. A call
whose worst case does not fit is not made: the pool answers it as a failed call
(``over_budget``), which the router observes like any failed call, and the refusal is kept
for the routing record. When a call returns, its reservation is replaced by what it billed
(`pricing.call_cost`; a call whose usage is unknown keeps its worst case), so a reply never
costs more than was reserved for it and the sum stays within `max_cost`.

A call that fails after the pool's retries is made again on the channel's `fallback`
worker (if one is configured and its own worst case fits); with none, the pool raises
`WorkerFailed`, which ends the request with a clear error (the episode runner ends its run
on a pool exception).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.routing.calls import PoolView, WorkerCall
from jax_routeweaver.routing.pricing import Prices, billable_tokens, call_cost, usage_unknown

OVER_BUDGET = "over_budget"


class WorkerFailed(RuntimeError):
    """A worker call failed after its retries and no fallback could take it."""

    def __init__(self, worker: str, error: str | None, fallback: str | None = None):
        self.worker, self.error, self.fallback = worker, error, fallback
        # The routing record so far, set by the service that ran the request.
        self.record: dict[str, Any] | None = None
        tail = f"; its fallback {fallback} failed too" if fallback else ""
        super().__init__(f"worker {worker} failed after retries ({error}){tail}")


@dataclasses.dataclass
class LedgerEntry:
    """One call the request made (or was refused). `call_index`: which `BudgetedPool.call`
    it belongs to (a fallback shares its failed call's); `cost_usd`: billed for it (its worst
    case when its usage is unknown); `worst_case_usd`: what was reserved for it;
    `fallback_for`: the worker whose failed call this one replaced; `refused`: not sent (over
    budget)."""

    call_index: int
    worker: str
    worst_case_usd: float
    cost_usd: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    success: bool = False
    error: str | None = None
    role: str | None = None
    node: str | None = None
    fallback_for: str | None = None
    refused: bool = False
    usage_known: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "role": self.role, "node": self.node,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cost_usd": self.cost_usd, "worst_case_usd": self.worst_case_usd,
                "latency_s": round(self.latency_s, 4), "success": self.success,
                "error": self.error, "fallback_for": self.fallback_for,
                "refused": self.refused, "usage_known": self.usage_known}


class BudgetedPool(PoolView):
    """One request's view of the server's pool (`WorkerPool` protocol): calls priced at
    `prices`, kept within `max_cost` USD (None: no budget), replaced by their channel's
    fallback on failure. `pool` must offer ``usage_bound(worker, prompt, max_tokens)`` (the
    HTTP pool does); `fallbacks`: worker -> fallback worker. `ledger`: every call, in order of
    completion; `worker_s`: wall time this request spent waiting for workers."""

    def __init__(self, pool: Any, prices: Prices, max_cost: float | None,
                 fallbacks: Mapping[str, str] | None = None, *,
                 default_max_tokens: int | None = None):
        super().__init__(pool)
        self.prices, self.max_cost = prices, max_cost
        self.fallbacks = dict(fallbacks or {})
        self.default_max_tokens = default_max_tokens
        self.ledger: list[LedgerEntry] = []
        self.spent = 0.0     # billed by finished calls, USD
        self.reserved = 0.0  # worst cases of calls in flight, USD
        self._calls = 0
        self._waiting = 0
        self._wait_started = 0.0
        self.worker_s = 0.0

    # -- WorkerPool protocol (ids and descriptions: the served pool's) ------------------------
    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        max_tokens = max_tokens or self.default_max_tokens
        # Numbered before any await: the runner's calls of one turn start in request order,
        # so call k is the trajectory's k-th `WorkerCall` (`label`).
        index, self._calls = self._calls, self._calls + 1
        entry, result = await self._priced_call(index, worker, prompt, max_tokens, None)
        if result.success or entry.refused:
            return result
        fallback = self.fallbacks.get(worker)
        if fallback is None:
            raise WorkerFailed(worker, result.error)
        entry, second = await self._priced_call(index, fallback, prompt, max_tokens, worker)
        if entry.refused:  # the fallback does not fit: the router sees the refusal
            return second
        if not second.success:
            raise WorkerFailed(worker, result.error, fallback)
        return second

    # -- budget ------------------------------------------------------------------------------
    @property
    def remaining(self) -> float | None:
        """USD left for new calls (None: no budget)."""
        if self.max_cost is None:
            return None
        return self.max_cost - self.spent - self.reserved

    def worst_case(self, worker: str, prompt: str, max_tokens: int | None) -> float:
        """W(call) in USD (module docstring); KeyError for an unpriced worker."""
        price = self.prices[worker]
        bound = self.pool.usage_bound(worker, prompt, max_tokens)
        return (bound.prompt_tokens * price.input_usd_per_m
                + bound.completion_tokens * price.output_usd_per_m) / 1e6

    def fits(self, cost_usd: float) -> bool:
        """Whether a call of worst case `cost_usd` may start now."""
        remaining = self.remaining
        return remaining is None or cost_usd <= remaining

    @property
    def refusals(self) -> list[LedgerEntry]:
        return [e for e in self.ledger if e.refused]

    @property
    def within_budget(self) -> bool:
        return self.max_cost is None or self.spent <= self.max_cost

    async def _priced_call(self, index: int, worker: str, prompt: str, max_tokens: int | None,
                           fallback_for: str | None) -> tuple[LedgerEntry, WorkerCall]:
        worst = self.worst_case(worker, prompt, max_tokens)
        entry = LedgerEntry(index, worker, worst, fallback_for=fallback_for)
        if not self.fits(worst):
            entry.refused, entry.error = True, OVER_BUDGET
            self.ledger.append(entry)
            return entry, WorkerCall(worker, prompt, "", False, attempts=0, error=OVER_BUDGET)
        self.reserved += worst
        self._enter_wait()
        try:
            result = await self.pool.call(worker, prompt, max_tokens=max_tokens)
        finally:
            self._leave_wait()
            self.reserved -= worst
        entry.usage_known = not usage_unknown(result)
        # What the call billed; a call whose usage is unknown is charged its worst case.
        cost = call_cost(result, self.prices) if entry.usage_known else worst
        entry.cost_usd = cost
        entry.prompt_tokens, entry.completion_tokens = billable_tokens(result)
        entry.latency_s, entry.success, entry.error = result.latency_s, result.success, \
            result.error
        self.spent += cost
        self.ledger.append(entry)
        return entry, result

    # Worker wall time of the request: the time at least one of its calls was in flight.
    def _enter_wait(self) -> None:
        if self._waiting == 0:
            self._wait_started = time.perf_counter()
        self._waiting += 1

    def _leave_wait(self) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            self.worker_s += time.perf_counter() - self._wait_started

    def label(self, calls: Sequence[WorkerCall]) -> None:
        """Copy the agentic role and node of the trajectory's calls (the runner sets them on
        what the pool returned) onto the ledger entries of the same call."""
        for entry in self.ledger:
            if entry.call_index < len(calls):
                entry.role = calls[entry.call_index].role
                entry.node = calls[entry.call_index].node
