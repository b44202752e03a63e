"""Fixed worker prices, the cost of a trajectory, S_cost, and the C_ref calibration statistic.

The price table is frozen configuration, never a live quote: two runs are comparable because
they bill the same tokens at the same versioned prices (the original's:
`fixed-reference-2026-09-20`). A run bills at its pool's table (`pool_prices`): a channel pool
at its channel file's `price` entries (configs/channels/reference.yaml's are REFERENCE_PRICES),
the simulated pool at REFERENCE_PRICES. A worker without a price is never billed as free:
`verify_pool` / `price_problems` refuse it before a run starts, and a call to it marks the
trajectory cost-incomplete.

    C_call = (input × in + output × out) / 1e6
             input  = usage.prompt_tokens + failed_usage.prompt_tokens + bound_usage.prompt_tokens
             output = the same sum of completion_tokens
    C      = Σ C_call over every worker call of the trajectory (router tokens are not costed)
    S_cost = 1 / (1 + C / C_ref)                                  ∈ (0, 1], 0.5 at C = C_ref

Every attempt a worker may bill is counted once, by one rule, in training, evaluation and
serving alike: at the usage it reported when that is plausible, else at its worst case (a
request that timed out after it was sent, a reply with no or implausible usage:
`WorkerCall.bound_usage`); an attempt that never reached the worker (connection refused) is
free. So C is never below what the workers can bill. Cached input is part of
`prompt_tokens` and billed at the normal input price (never added again); reasoning tokens
are already inside `completion_tokens`. Missing usage is never silently zero: it marks the
trajectory cost-incomplete (S_cost is then not used), and where the pool bounds it the cost
carries that bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jax_routeweaver.config import decode_utf8
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall

PRICE_TABLE_VERSION = "fixed-reference-2026-09-20"
# P95 of per-trajectory worker cost over 1024 calibration rollouts (the original's cost_ref.json).
C_REF_USD = 0.007071665299999997
C_REF_STATISTIC = "P95 of per-trajectory worker cost"

USAGE_UNKNOWN = "usage_unknown"
UNPRICED = "unpriced"


class PricingError(ValueError):
    """A worker has no price, or its price was set for a different backend."""


@dataclasses.dataclass(frozen=True)
class WorkerPrice:
    """USD per 1M tokens. `backend`: the model the price was set for (None: not pinned)."""

    input_usd_per_m: float
    output_usd_per_m: float
    backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("input_usd_per_m", "output_usd_per_m"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"WorkerPrice.{name}={value!r} must be a finite number >= 0")


Prices = Mapping[str, WorkerPrice]

REFERENCE_PRICES: Prices = MappingProxyType({
    "worker_1": WorkerPrice(0.02, 0.05, "qwen3_8b"),
    "worker_2": WorkerPrice(0.02, 0.05, "llama31_8b"),
    "worker_3": WorkerPrice(0.10, 0.30, "qwen3_30b_a3b"),
    "worker_4": WorkerPrice(0.119, 0.20, "gemma3_27b_it"),
    "worker_5": WorkerPrice(0.10, 0.32, "llama33_70b"),
    "worker_6": WorkerPrice(0.10, 0.40, "gemini25_flash_lite"),
})


@dataclasses.dataclass(frozen=True)
class CostSummary:
    """Trajectory cost. `complete` is False iff `reasons` is non-empty.

    `reasons`: distinct codes (`usage_unknown`, `unpriced`) in first-seen order; `cost_usd` then
    covers only the usage that was known and priced.
    """

    cost_usd: float
    complete: bool
    reasons: tuple[str, ...] = ()


def billable_tokens(call: WorkerCall) -> tuple[int, int]:
    """(input, output) tokens billed for one call, at most: its successful and failed
    attempts' reported usage and the worst case of those whose usage is unknown."""
    total = Usage(0, 0)
    for usage in (call.usage, call.failed_usage, call.bound_usage):
        if usage is not None:
            total = total + usage
    return total.prompt_tokens, total.completion_tokens


def usage_unknown(call: WorkerCall) -> bool:
    """True if the call's cost cannot be known from its record.

    An attempt billed at its worst case (`bound_usage`) is unknown. So is a successful reply
    without usage (None, or 0/0: a reply always has a prompt) even if failed attempts
    reported some; a failed call is unknown only if no attempt reported usage (a timed-out
    request may still have been billed).
    """
    if call.bound_usage is not None:
        return True
    if call.success:
        usage = call.usage
        return usage is None or (usage.prompt_tokens == 0 and usage.completion_tokens == 0)
    return call.usage is None and call.failed_usage is None


def tokens_cost(worker: str, input_tokens: int, output_tokens: int, prices: Prices) -> float:
    """USD for `input_tokens` / `output_tokens` of `worker` (module docstring's C_call);
    raises PricingError if unpriced. The one price rule: a call, an attempt and a worst case
    are all billed by it."""
    price = prices.get(worker)
    if price is None:
        raise PricingError(f"no price for worker {worker!r} (priced: {sorted(prices)})")
    return (input_tokens * price.input_usd_per_m + output_tokens * price.output_usd_per_m) / 1e6


def call_cost(call: WorkerCall, prices: Prices) -> float:
    """C_call in USD for the tokens the record bills (`billable_tokens`); raises
    PricingError if unpriced."""
    return tokens_cost(call.worker, *billable_tokens(call), prices)


def trajectory_cost(calls: Iterable[WorkerCall], prices: Prices) -> CostSummary:
    """C = Σ C_call; never raises for an unpriced id or missing usage (marks it incomplete)."""
    total = 0.0
    reasons: list[str] = []
    for call in calls:
        if usage_unknown(call):
            _add_reason(reasons, USAGE_UNKNOWN)
        if call.worker not in prices:
            _add_reason(reasons, UNPRICED)
            continue
        total += call_cost(call, prices)
    return CostSummary(cost_usd=total, complete=not reasons, reasons=tuple(reasons))


def _add_reason(reasons: list[str], reason: str) -> None:
    if reason not in reasons:
        reasons.append(reason)


def cost_score(cost_usd: float, c_ref: float = C_REF_USD) -> float:
    """S_cost = 1 / (1 + C / C_ref): 1 at C = 0, 0.5 at C = C_ref; never batch-normalised."""
    if not (isinstance(c_ref, int | float) and math.isfinite(c_ref) and c_ref > 0):
        raise ValueError(f"C_ref={c_ref!r} must be a finite positive number of USD")
    if not (isinstance(cost_usd, int | float) and math.isfinite(cost_usd) and cost_usd >= 0):
        raise ValueError(f"trajectory cost {cost_usd!r} must be a finite number >= 0 USD")
    return 1.0 / (1.0 + cost_usd / c_ref)


def price_problems(worker_ids: Iterable[str], prices: Prices,
                   backends: Mapping[str, str | None] | None = None) -> list[tuple[str, str]]:
    """(worker, what is wrong) for each of `worker_ids` that cannot be billed, in their order;
    empty when every one can.

    A worker cannot be billed if `prices` has no entry for it, or if, with `backends` (worker
    id -> the backend now serving it, e.g. `ChannelConfig.backends()`), its price is pinned to
    another backend (a re-pointed id must never be billed at another model's price). A price
    not pinned (`backend` None) is not checked against a backend.
    """
    problems: list[tuple[str, str]] = []
    for worker in worker_ids:
        price = prices.get(worker)
        if price is None:
            problems.append((worker, "has no price"))
        elif backends is not None and price.backend is not None \
                and backends.get(worker) != price.backend:
            problems.append((worker, f"its price was set for backend {price.backend!r} but "
                                     f"it is served by {backends.get(worker)!r}"))
    return problems


def verify_pool(worker_ids: Iterable[str], prices: Prices,
                backends: Mapping[str, str | None] | None = None) -> None:
    """Raise PricingError unless every offered worker can be billed (`price_problems`).

    With `backends` (worker id -> backend now serving it, e.g. from the channel file), a price
    pinned to a backend must match it, so a re-pointed id is never billed at another model's
    price. Run before cost-enabled training.
    """
    worker_ids = list(worker_ids)
    problems = price_problems(worker_ids, prices, backends)
    unpriced = [w for w, _ in problems if w not in prices]
    if unpriced:
        raise PricingError(f"offered workers {unpriced} have no price in the price table "
                           f"(priced: {sorted(prices)}); refusing to cost them as free")
    if problems:
        worker = problems[0][0]
        raise PricingError(f"the price of {worker} was set for backend "
                           f"{prices[worker].backend!r} but {worker} is served by "
                           f"{backends.get(worker) if backends else None!r}; fix the price "
                           "table or the channel file")


def pool_prices(pool: Any) -> Prices:
    """The price table calls to `pool` are billed at: that of the first of `pool` and the
    pools it wraps (each one's `pool` attribute, e.g. a record/replay cache's) to declare one
    with a `prices()` method (`HttpWorkerPool`: its channel file's `price` entries, a worker
    without one unpriced), else REFERENCE_PRICES (the simulated pool's worker_1..6 are the
    original's workers)."""
    seen: set[int] = set()
    while pool is not None and id(pool) not in seen:
        seen.add(id(pool))
        declared = getattr(pool, "prices", None)
        if callable(declared):
            return declared()
        pool = getattr(pool, "pool", None)
    return REFERENCE_PRICES


@dataclasses.dataclass(frozen=True)
class CRefCalibration:
    """Result of `c_ref_from_costs`: the value and how many rows it was computed from."""

    c_ref_usd: float
    n_reference_rollouts: int
    n_skipped_infra_failed: int
    n_skipped_cost_incomplete: int
    statistic: str = C_REF_STATISTIC

    def to_record(self, prices: Prices = REFERENCE_PRICES,
                  price_table_version: str = PRICE_TABLE_VERSION) -> dict[str, Any]:
        """The frozen `cost_ref.json` record (value + the price table it was computed with)."""
        return {
            "c_ref_usd": self.c_ref_usd,
            "statistic": self.statistic,
            "n_reference_rollouts": self.n_reference_rollouts,
            "price_table_version": price_table_version,
            "prices": {w: {"model": p.backend, "in": p.input_usd_per_m,
                           "out": p.output_usd_per_m} for w, p in prices.items()},
        }


def percentile_linear(values: Sequence[float], q: float) -> float:
    """q-quantile (q in [0, 1]) of `values` with linear interpolation on the sorted list.

    pos = q·(n−1); v = x[⌊pos⌋] + (x[⌊pos⌋+1] − x[⌊pos⌋])·(pos − ⌊pos⌋).
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q!r} must be in [0, 1]")
    ordered = sorted(float(v) for v in values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def c_ref_from_costs(rows: Iterable[Mapping[str, Any] | Any], q: float = 0.95
                     ) -> CRefCalibration:
    """C_ref = P95 (linear interpolation) of `cost_usd` over rows with `infra_failed == 0` and
    `cost_complete` true; correct and wrong rows alike, no filter on mode or dataset.

    `rows`: mappings (dump lines) or objects with attributes `cost_usd`, `infra_failed`,
    `cost_complete`. Raises ValueError if a row lacks one, or if no row is kept.
    """
    kept: list[float] = []
    infra_failed = incomplete = 0
    for index, row in enumerate(rows):
        if _row_field(row, "infra_failed", index):
            infra_failed += 1
        elif not _row_field(row, "cost_complete", index):
            incomplete += 1
        else:
            kept.append(_row_cost(row, index))
    if not kept:
        raise ValueError(f"no reference rollouts left ({infra_failed} infra-failed, "
                         f"{incomplete} cost-incomplete); refusing to invent a C_ref")
    return CRefCalibration(percentile_linear(kept, q), len(kept), infra_failed, incomplete)


def _row_field(row: Any, name: str, index: int) -> Any:
    if isinstance(row, Mapping):
        if name not in row:
            raise ValueError(f"cost row {index} has no field {name!r}")
        return row[name]
    if not hasattr(row, name):
        raise ValueError(f"cost row {index} has no field {name!r}")
    return getattr(row, name)


def _row_cost(row: Any, index: int) -> float:
    value = _row_field(row, "cost_usd", index)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"cost row {index}: cost_usd={value!r} must be a finite number >= 0")
    return float(value)


def load_cost_ref(path: str | Path, *, price_table_version: str | None = PRICE_TABLE_VERSION
                  ) -> float:
    """`c_ref_usd` of a cost-reference file (`routeweaver calibrate-cost` writes one;
    `configs/cost_ref.json` ships the paper's value). With `price_table_version`, the file must
    have been computed with that price table: a C_ref is only meaningful under its prices."""
    path = Path(path)
    try:
        record = json.loads(decode_utf8(path.read_bytes(), path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no cost-reference file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    value = record.get("c_ref_usd") if isinstance(record, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{path}: c_ref_usd={value!r} must be a positive number")
    version = record.get("price_table_version")
    if price_table_version is not None and version != price_table_version:
        raise ValueError(f"{path}: price_table_version={version!r}, expected "
                         f"{price_table_version!r}")
    return float(value)
