"""A request's cost budget, honoured per attempt whatever the workers do, and the fallback.

`BudgetedPool` wraps the server's worker pool for one request. Every attempt of a call that
a worker can bill, each retry included, reserves its worst case before it is sent,

    W(attempt) = (P_max × in + max_tokens × out) / 1e6   USD

(`P_max`: the most prompt tokens the worker may bill for this request body,
`HttpWorkerPool.usage_bound`; `max_tokens`: the completion cap sent with it; in/out: the
worker's price per 1M tokens), against what is left of `max_cost` after what was billed and
what is reserved by attempts in flight. An attempt that does not fit is not sent: a first
attempt is refused (``over_budget``, the router observes a failed call and the refusal is
kept for the routing record); a retry that does not fit ends its call the same way (failed,
``over_budget (attempts: ...)``, no fallback). When an attempt ends, its
reservation becomes its bill, by the one rule training and evaluation bill by
(`routing.pools.pricing`): its reported usage if plausible, else its worst case (a request that
timed out or was cancelled after it was sent, a reply without usage), nothing if it never
reached the worker. So what the workers can bill never exceeds `max_cost`, and the record's
cost is never below it.

What it cannot know: a provider that bills more than the request's own bound (tokens beyond
the body's length plus the template allowance, or beyond `max_tokens`) breaks no rule here
but is outside any budget a client can hold.

A call that fails after the pool's retries is made again on the channel's `fallback`
worker, if one is configured, is among the request's workers and its own attempts fit;
otherwise the pool raises `WorkerFailed`, which ends the request with a clear error (the
episode runner ends its run on a pool exception).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from jax_routeweaver.routing.pools.pricing import (
    Prices,
    billable_tokens,
    tokens_cost,
    usage_unknown,
)
from jax_routeweaver.routing.protocol.calls import OVER_BUDGET, PoolView, Usage, WorkerCall

CANCELLED = "cancelled"

__all__ = ["CANCELLED", "OVER_BUDGET", "BudgetedPool", "LedgerEntry", "WorkerFailed"]


class WorkerFailed(RuntimeError):
    """A worker call failed after its retries and no fallback could take it: `fallback` is
    the channel's fallback worker if it was tried, or `outside` if it was not one of the
    request's workers (so it was not called)."""

    def __init__(self, worker: str, error: str | None, fallback: str | None = None, *,
                 outside: str | None = None):
        self.worker, self.error, self.fallback, self.outside = worker, error, fallback, outside
        # The routing record so far, set by the service that ran the request.
        self.record: dict[str, Any] | None = None
        tail = f"; its fallback {fallback} failed too" if fallback else \
            f"; its fallback {outside} is not among the request's workers" if outside else ""
        super().__init__(f"worker {worker} failed after retries ({error}){tail}")


@dataclasses.dataclass
class LedgerEntry:
    """One call the request made (or was refused). `call_index`: which `BudgetedPool.call`
    it belongs to (a fallback shares its failed call's); `attempts`: attempts sent;
    `cost_usd`: billed for them (each at its reported usage, else its worst case);
    `worst_case_usd`: reserved for them (the first attempt's worst case if none was sent);
    `fallback_for`: the worker whose failed call this one replaced; `refused`: not sent
    (over budget); `usage_known`: every attempt reported its usage."""

    call_index: int
    worker: str
    worst_case_usd: float
    cost_usd: float = 0.0
    attempts: int = 0
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
                "completion_tokens": self.completion_tokens, "attempts": self.attempts,
                "cost_usd": self.cost_usd, "worst_case_usd": self.worst_case_usd,
                "latency_s": round(self.latency_s, 4), "success": self.success,
                "error": self.error, "fallback_for": self.fallback_for,
                "refused": self.refused, "usage_known": self.usage_known}


class _Meter:
    """One call's `routing.protocol.calls.AttemptMeter` over its request's budget and ledger
    entry."""

    def __init__(self, budget: BudgetedPool, entry: LedgerEntry):
        self.budget, self.entry = budget, entry

    def _usd(self, worker: str, usage: Usage) -> float:
        return tokens_cost(worker, usage.prompt_tokens, usage.completion_tokens,
                           self.budget.prices)

    def reserve(self, worker: str, worst: Usage) -> bool:
        cost = self._usd(worker, worst)
        if not self.budget.fits(cost):
            return False
        self.budget.reserved += cost
        self.entry.worst_case_usd = cost if self.entry.attempts == 0 else \
            self.entry.worst_case_usd + cost
        self.entry.attempts += 1
        return True

    def settle(self, worker: str, worst: Usage, billed: Usage | None) -> None:
        reserved = self._usd(worker, worst)
        cost = reserved if billed is None else self._usd(worker, billed)
        self.budget.reserved -= reserved
        self.budget.spent += cost
        self.entry.cost_usd += cost


class BudgetedPool(PoolView):
    """One request's view of the server's pool (`WorkerPool` protocol): calls priced at
    `prices`, every attempt kept within `max_cost` USD (None: no budget), a failed call
    replaced by its channel's fallback when that is in `allowed` (the request's workers;
    None: any). `pool` must offer ``usage_bound(worker, prompt, max_tokens)`` and take a
    ``meter`` in ``call`` (`HttpWorkerPool` does); `fallbacks`: worker -> fallback worker.
    `ledger`: every call, in order of completion (a cancelled call's entry included);
    `worker_s`: wall time this request spent waiting for workers."""

    def __init__(self, pool: Any, prices: Prices, max_cost: float | None,
                 fallbacks: Mapping[str, str] | None = None, *,
                 default_max_tokens: int | None = None,
                 allowed: Collection[str] | None = None):
        super().__init__(pool)
        self.prices, self.max_cost = prices, max_cost
        self.fallbacks = dict(fallbacks or {})
        self.allowed = None if allowed is None else frozenset(allowed)
        self.default_max_tokens = default_max_tokens
        self.ledger: list[LedgerEntry] = []
        self.spent = 0.0     # billed by ended attempts, USD
        self.reserved = 0.0  # worst cases of attempts in flight, USD
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
        if result.success or entry.refused or (result.error or "").startswith(OVER_BUDGET):
            return result  # a retry that did not fit ends the call as a refusal does
        fallback = self.fallbacks.get(worker)
        if fallback is None:
            raise WorkerFailed(worker, result.error)
        if self.allowed is not None and fallback not in self.allowed:
            raise WorkerFailed(worker, result.error, outside=fallback)
        entry, second = await self._priced_call(index, fallback, prompt, max_tokens, worker)
        if entry.refused:  # the fallback does not fit: the router sees the refusal
            return second
        if not second.success:
            raise WorkerFailed(worker, result.error, fallback)
        return second

    # -- budget ------------------------------------------------------------------------------
    @property
    def remaining(self) -> float | None:
        """USD left for new attempts (None: no budget)."""
        if self.max_cost is None:
            return None
        return self.max_cost - self.spent - self.reserved

    def worst_case(self, worker: str, prompt: str, max_tokens: int | None) -> float:
        """W(attempt) in USD (module docstring); PricingError for an unpriced worker."""
        bound = self.pool.usage_bound(worker, prompt, max_tokens)
        return tokens_cost(worker, bound.prompt_tokens, bound.completion_tokens, self.prices)

    def fits(self, cost_usd: float) -> bool:
        """Whether an attempt of worst case `cost_usd` may start now."""
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
        entry = LedgerEntry(index, worker, self.worst_case(worker, prompt, max_tokens),
                            fallback_for=fallback_for)
        result: WorkerCall | None = None
        self._enter_wait()
        try:
            if self.fits(entry.worst_case_usd):
                result = await self.pool.call(worker, prompt, max_tokens=max_tokens,
                                              meter=_Meter(self, entry))
        except asyncio.CancelledError:  # the request ended (timeout, disconnect) meanwhile
            entry.error = CANCELLED
            entry.usage_known = entry.attempts == 0
            raise
        finally:
            self._leave_wait()
            self.ledger.append(entry)
        if result is None or (result.attempts == 0 and result.error == OVER_BUDGET):
            # Its first attempt did not fit: nothing was sent.
            entry.refused, entry.error = True, OVER_BUDGET
            return entry, result or WorkerCall(worker, prompt, "", False, attempts=0,
                                               error=OVER_BUDGET)
        entry.usage_known = not usage_unknown(result)
        entry.prompt_tokens, entry.completion_tokens = billable_tokens(result)
        entry.latency_s, entry.success, entry.error = result.latency_s, result.success, \
            result.error
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
