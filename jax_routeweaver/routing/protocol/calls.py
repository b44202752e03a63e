"""What one worker call returns, and the pool interface every worker backend implements.

`WorkerCall` is the per-call record kept in a trajectory (usage, cost inputs, latency,
success). A call that finally fails is `success=False` with empty `text`: the episode gives an
empty observation and flags the trajectory as infra-failed; it is never scored as wrong.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class Usage:
    """Token usage as reported by the server. `cached_tokens` is part of `prompt_tokens`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens,
                     self.completion_tokens + other.completion_tokens,
                     self.cached_tokens + other.cached_tokens)


@dataclasses.dataclass(frozen=True)
class WorkerCall:
    """One worker call as recorded in a trajectory.

    `worker`: anonymous id (`worker_K`). `prompt`: the user-message payload sent. `text`: the
    reply's `message.content` stripped ("" on failure). `usage`: of the successful attempt
    (None if the server reported none, or an implausible one: the cost is then unknown).
    `failed_usage`: usage reported by failed attempts, billed too. `bound_usage`: the
    attempts whose bill cannot be known (a request that timed out after it was sent, a reply
    reporting no usage or an implausible one), each at its worst case (the most tokens it
    can be billed for, `http_replies.UsageLimits`), billed at that bound (None: every sent
    attempt's bill is known; a pool that cannot bound its attempts leaves it None). `role` /
    `node`: agentic
    role and node id (None in single/multi), filled in by the episode runner. `error`: why
    the call failed, or a note on a successful but empty reply (`final_content_missing`);
    never contains secrets.
    """

    worker: str
    prompt: str
    text: str
    success: bool
    usage: Usage | None = None
    failed_usage: Usage | None = None
    bound_usage: Usage | None = None
    latency_s: float = 0.0
    attempts: int = 1
    error: str | None = None
    reasoning_chars: int = 0
    role: str | None = None
    node: str | None = None


# Why a call (or an attempt of one) was not sent: its worst case did not fit the budget.
OVER_BUDGET = "over_budget"


class AttemptMeter(Protocol):
    """Meters one call's attempts against a budget (`serving.budget.BudgetedPool`).

    The pool calls `reserve` with an attempt's worst case (the most tokens it can be billed
    for) before sending it: False, and the attempt is not sent (the call ends, failed with
    `OVER_BUDGET`). Once the attempt has ended, even by cancellation, it calls `settle` with
    the same worst case and what the attempt is known to have billed (None: not known, so the
    worst case stands)."""

    def reserve(self, worker: str, worst: Usage) -> bool: ...

    def settle(self, worker: str, worst: Usage, billed: Usage | None) -> None: ...


@runtime_checkable
class WorkerPool(Protocol):
    """A set of workers addressed by anonymous id; HTTP endpoints or the simulated pool."""

    def worker_ids(self) -> list[str]:
        """Offered worker ids, in catalog order (`worker_1`, ...)."""
        ...

    def description(self, worker: str) -> str:
        """The capability description shown to the router (never a model name or price)."""
        ...

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        """Send `prompt` as one user message to `worker`; never raises for call failures."""
        ...


class PoolView:
    """A `WorkerPool` over another pool's workers (`pool`): the same ids and descriptions;
    a subclass says what its `call` does (strip tags, replay, keep a budget, ...)."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def worker_ids(self) -> list[str]:
        return self.pool.worker_ids()

    def description(self, worker: str) -> str:
        return self.pool.description(worker)
