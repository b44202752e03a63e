"""Router-R1's hierarchical reward (docs/router_r1.md), with its cost window as state.

Exactly as Router-R1's original code computes it, per trajectory, on the decoded response
(policy text and observations, no prompt):

    F = 0 if `router_r1.format_violations(response)` is empty else −1         (format check)
    EM, F1 of the last `<answer>` against the gold list, SQuAD-normalised
    C = CostWindow.update(raw_cost)       (sqrt, p5/p95 over the last 1000, inverted)
    reward = F                          if there is no answer (F = −1 in practice: rule 5)
           = −1                         if F = −1
           = (1 − α)·1  + α·C           if F = 0 and EM = 1          (metric "em")
           = (1 − α)·F1 + α·C           if F = 0 and F1 > 0          (metric "f1")
           = 0                          otherwise (a wrong answer gets 0 whatever its cost)

The window is updated for every trajectory in batch order, whether or not its cost is used,
and the current sample is part of its own statistics; a trajectory whose cost is unknown (a
successful call without a plausible usage report) leaves the window alone, gets C = 0 and
raw cost None, and is infra for the trainer (`rl/router_r1_run.as_rewards`). Raw cost is
Router-R1's: completion tokens × $/1M of every successful call, i.e. micro-dollars
(`router_r1_raw_cost`, as Router-R1's cost accounting).
Keep separate train and validation windows (the original shares one module-global window and
never checkpoints it; docs/paper_configs.md, "configs/router_r1.yaml"); save each with
`state_dict()`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from jax_routeweaver.routing.pools.pricing import PricingError, percentile_linear
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.protocol.calls import WorkerCall

if TYPE_CHECKING:
    from jax_routeweaver.routing.episodes.episode import Trajectory

Metric = Literal["em", "f1"]

WINDOW_SIZE = 1000
LOW_PERCENTILE, HIGH_PERCENTILE = 0.05, 0.95
DEGENERATE_SPREAD = 1e-8
DEGENERATE_SCORE = 0.5
_YES_NO = ("yes", "no", "noanswer")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


# ------------------------------------------------------------------------------ outcome
def normalize_answer(text: str) -> str:
    """SQuAD normaliser (as Router-R1's reward): lower-case -> drop punctuation -> articles to
    spaces -> collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _gold_list(gold: str | Iterable[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else [str(g) for g in gold]


def exact_match(prediction: str, gold: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in _gold_list(gold)))


def _f1_one(pred: str, gold: str) -> float:
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((collections.Counter(pred_tokens) & collections.Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str | Iterable[str]) -> float:
    """Token F1 of normalised strings, max over gold answers; 0 when either side is
    `yes`/`no`/`noanswer` and the two differ, or when no token is shared."""
    pred = normalize_answer(prediction)
    return max((_f1_one(pred, normalize_answer(g)) for g in _gold_list(gold)), default=0.0)


def format_score(violations: Sequence[str]) -> float:
    """F = 0 when no format check failed, else −1 (all penalty constants are −1)."""
    return 0.0 if not violations else -1.0


# --------------------------------------------------------------------------- cost window
class CostWindow:
    """Sliding window of the last `size` transformed costs x = sqrt(raw), as Router-R1's cost
    normalisation.

    `update(raw)`: push x, then lo/hi = 5th/95th percentile of the window (linear
    interpolation, numpy's default; min/max with one entry); return 0.5 if hi − lo < 1e-8,
    else 1 − clip((x − lo)/(hi − lo), 0, 1) (cheaper -> closer to 1).
    """

    def __init__(self, size: int = WINDOW_SIZE) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"CostWindow size={size!r} must be an int >= 1")
        self._values: collections.deque[float] = collections.deque(maxlen=size)

    @property
    def size(self) -> int:
        return self._values.maxlen or 0

    def __len__(self) -> int:
        return len(self._values)

    @property
    def values(self) -> tuple[float, ...]:
        """The transformed costs in the window, oldest first."""
        return tuple(self._values)

    @staticmethod
    def transform(raw_cost: float) -> float:
        """x = sqrt(raw_cost); raw cost must be a finite number >= 0."""
        if (isinstance(raw_cost, bool) or not isinstance(raw_cost, int | float)
                or not math.isfinite(raw_cost) or raw_cost < 0):
            raise ValueError(f"Router-R1 raw cost {raw_cost!r} must be a finite number >= 0")
        return math.sqrt(raw_cost)

    def bounds(self) -> tuple[float, float]:
        """(lo, hi) = (P5, P95) of the window (linear interpolation)."""
        if not self._values:
            raise ValueError("CostWindow.bounds: the window is empty")
        return (percentile_linear(self._values, LOW_PERCENTILE),
                percentile_linear(self._values, HIGH_PERCENTILE))

    def update(self, raw_cost: float) -> float:
        """Push one trajectory's raw cost and return its normalised cost score C in [0, 1]."""
        x = self.transform(raw_cost)
        self._values.append(x)
        lo, hi = self.bounds()
        if hi - lo < DEGENERATE_SPREAD:
            return DEGENERATE_SCORE
        return 1.0 - min(max((x - lo) / (hi - lo), 0.0), 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: {"size": int, "values": [x, ...] oldest first}."""
        return {"size": self.size, "values": list(self._values)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output (replaces size and contents)."""
        try:
            size, values = state["size"], state["values"]
        except (KeyError, TypeError):
            raise ValueError("CostWindow state needs keys 'size' and 'values'") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"CostWindow state: size={size!r} must be an int >= 1")
        if len(values) > size:
            raise ValueError(f"CostWindow state: {len(values)} values exceed size {size}")
        checked = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"CostWindow state: value {v!r} is not a finite number >= 0")
            checked.append(float(v))
        self._values = collections.deque(checked, maxlen=size)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> CostWindow:
        window = cls()
        window.load_state_dict(state)
        return window


# ------------------------------------------------------------------------------ raw cost
def worker_prices(model_workers: Mapping[str, str]) -> dict[str, float]:
    """Worker id -> $ per 1M completion tokens, from the Router-R1 model each id serves
    (`model_workers`: `RouterR1Model.name` -> worker id, as given to `router_r1_envs`)."""
    by_name = {m.name: m for m in r1.ALL_MODELS}
    prices: dict[str, float] = {}
    for name, worker in model_workers.items():
        model = by_name.get(name)
        if model is None:
            raise ValueError(f"{name!r} is not a Router-R1 model")
        if model.price_per_million is None:
            raise PricingError(f"Router-R1 model {name!r} has no price; refusing to cost it "
                               "as free")
        prices[worker] = model.price_per_million
    return prices


def router_r1_raw_cost(calls: Iterable[WorkerCall], prices: Mapping[str, float]
                       ) -> float | None:
    """Σ completion_tokens × $/1M over successful calls (micro-dollars). Prompt tokens and
    failed calls cost 0. None (unknown) if a successful call has no usage (the worker
    reported none, or an implausible one); raises for an unpriced worker."""
    total = 0.0
    unknown = False
    for call in calls:
        if not call.success:
            continue
        if call.worker not in prices:
            raise PricingError(f"no Router-R1 price for worker {call.worker!r} "
                               f"(priced: {sorted(prices)})")
        if call.usage is None:
            unknown = True
            continue
        total += call.usage.completion_tokens * prices[call.worker]
    return None if unknown else total


# -------------------------------------------------------------------------------- reward
@dataclasses.dataclass(frozen=True)
class RouterR1RewardConfig:
    """`alpha`: the cost trade-off (`cost_coe`, paper 0.6-0.9); `metric`: outcome driving the
    reward ("em" in the official scripts)."""

    # Weight α of the normalised cost score C against the outcome, in [0, 1] (module doc).
    alpha: float = 0.0
    # Outcome of a correct answer: "em" (exact match = 1) or "f1" (token F1 > 0, scaled by F1).
    metric: Metric = "em"

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) \
                or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"RouterR1RewardConfig.alpha={self.alpha!r} must be in [0, 1]")
        if self.metric not in ("em", "f1"):
            raise ValueError(f"RouterR1RewardConfig.metric={self.metric!r}: expected 'em' or "
                             "'f1'")


@dataclasses.dataclass(frozen=True)
class RouterR1Reward:
    """One trajectory's reward and diagnostics. `cost_score`: the normalised C; `correct`:
    EM = 1 (metric em) or F1 > 0 (metric f1); `routes`: validation route count."""

    reward: float
    format_score: float
    em: float
    f1: float
    correct: bool
    raw_cost: float | None
    cost_score: float
    answer: str | None
    violations: tuple[str, ...]
    routes: int


def combine(format_value: float, has_answer: bool, correct: bool, outcome: float,
            cost_value: float, alpha: float) -> float:
    """Hierarchical gating: format, then outcome, then cost (only for correct ones)."""
    if not has_answer:
        return format_value if format_value == -1.0 else format_value * (1.0 - alpha)
    if format_value == -1.0:
        return -1.0
    if not correct:
        return 0.0
    return (1.0 - alpha) * outcome + alpha * cost_value


def router_r1_reward(response: str, gold: str | Sequence[str], raw_cost: float | None,
                     window: CostWindow,
                     config: RouterR1RewardConfig | None = None) -> RouterR1Reward:
    """Router-R1's reward for one decoded `response`; updates `window` unless the cost
    is unknown (`raw_cost` None: then C = 0)."""
    config = config or RouterR1RewardConfig()
    cost_value = window.update(raw_cost) if raw_cost is not None else 0.0
    violations = tuple(str(v) for v in r1.format_violations(response))
    fmt = format_score(violations)
    answer = r1.extract_answer(response)
    em = exact_match(answer, gold) if answer is not None else 0.0
    f1 = f1_score(answer, gold) if answer is not None else 0.0
    outcome = em if config.metric == "em" else f1
    correct = outcome == 1.0 if config.metric == "em" else outcome > 0.0
    reward = combine(fmt, answer is not None, correct, outcome, cost_value, config.alpha)
    return RouterR1Reward(reward=reward, format_score=fmt, em=em, f1=f1, correct=correct,
                          raw_cost=None if raw_cost is None else float(raw_cost),
                          cost_score=cost_value, answer=answer,
                          violations=violations, routes=r1.count_routes(response))


def score_router_r1_batch(responses: Sequence[str], golds: Sequence[str | Sequence[str]],
                          raw_costs: Sequence[float | None], window: CostWindow,
                          config: RouterR1RewardConfig | None = None) -> list[RouterR1Reward]:
    """`router_r1_reward` for each trajectory, in batch order (the window sees them in order).
    """
    if not len(responses) == len(golds) == len(raw_costs):
        raise ValueError(f"score_router_r1_batch: {len(responses)} responses, {len(golds)} "
                         f"golds and {len(raw_costs)} costs must have the same length")
    return [router_r1_reward(r, g, c, window, config)
            for r, g, c in zip(responses, golds, raw_costs, strict=True)]


def trajectory_reward(traj: Trajectory, decode: Callable[[Sequence[int]], str],
                      prices: Mapping[str, float], window: CostWindow,
                      config: RouterR1RewardConfig | None = None) -> RouterR1Reward:
    """`router_r1_reward` of an episode: `decode(traj.response_ids)` (special tokens kept),
    gold from its record, raw cost from its calls at `prices` (see `worker_prices`)."""
    return router_r1_reward(decode(traj.response_ids), list(traj.record.gold),
                            router_r1_raw_cost(traj.calls, prices), window, config)
