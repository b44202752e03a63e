"""The accuracy-cost frontier of several routers: which of them no other beats on both.

A router is a point (accuracy, cost per question). Point ``a`` dominates ``b`` when it is at
least as accurate and at most as dear, and strictly better in one (`dominates`); the
frontier is the set of non-dominated points (`pareto_frontier`), two identical points both
on it. Routers named "...oracle..." are upper bounds (`is_upper_bound`): they are set apart,
neither on the frontier nor dominating, since no router can be built from them.
`eval.report` draws the frontier on ``accuracy_vs_cost.png`` and writes `frontier_line`
under the comparison table.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

UPPER_BOUND = "oracle"


def is_upper_bound(name: str) -> bool:
    """Whether a router is an upper bound (its name contains "oracle", any case): plotted,
    but never on the frontier and never dominating."""
    return UPPER_BOUND in name.lower()


def _placed(points: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    return {n: (float(a), float(c)) for n, (a, c) in points.items()
            if math.isfinite(a) and math.isfinite(c)}


def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether the (accuracy, cost) point `a` dominates `b`: accuracy >=, cost <= and at
    least one of them strictly better."""
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


def pareto_frontier(points: Mapping[str, tuple[float, float]]) -> list[str]:
    """The names of the non-dominated points of name -> (accuracy, cost), sorted by cost
    (then higher accuracy, then name). A point is dominated when another has accuracy >=,
    cost <= and at least one strictly better (`dominates`); so two points with identical
    accuracy and cost are both on the frontier. Points whose accuracy or cost is not a
    finite number are left out (neither on the frontier nor dominating)."""
    placed = _placed(points)
    keep = [n for n, p in placed.items() if not any(dominates(q, p) for q in placed.values())]
    return sorted(keep, key=lambda n: (placed[n][1], -placed[n][0], n))


def dominators(points: Mapping[str, tuple[float, float]]) -> dict[str, str]:
    """Each dominated point of `pareto_frontier(points)`'s rule -> the first frontier point
    (in frontier order: the cheapest) that dominates it; in the points' order."""
    placed = _placed(points)
    frontier = pareto_frontier(placed)
    return {n: next(f for f in frontier if dominates(placed[f], p))
            for n, p in placed.items() if n not in frontier}


@dataclasses.dataclass(frozen=True)
class Frontier:
    """The accuracy-cost frontier of several routers. `frontier`: names on it, by cost;
    `dominated`: name -> the frontier router that dominates it; `upper_bounds`: routers left
    out as upper bounds (`is_upper_bound`); `unplaced`: routers without a finite accuracy
    and cost, left out too."""

    frontier: tuple[str, ...]
    dominated: dict[str, str]
    upper_bounds: tuple[str, ...]
    unplaced: tuple[str, ...]

    def entry(self, name: str) -> dict[str, Any]:
        """The keys `write_comparison` adds to `name`'s entry of ``comparison.json``."""
        return {"on_frontier": name in self.frontier,
                "dominated_by": self.dominated.get(name),
                "upper_bound": name in self.upper_bounds}


def frontier_of(points: Mapping[str, tuple[float, float]]) -> Frontier:
    """The `Frontier` of name -> (accuracy, cost): upper bounds (`is_upper_bound`) and
    points without a finite accuracy and cost set apart, `pareto_frontier` and
    `dominators` over the rest."""
    bounds = tuple(n for n in points if is_upper_bound(n))
    rest = {n: p for n, p in points.items() if n not in bounds}
    placed = _placed(rest)
    return Frontier(frontier=tuple(pareto_frontier(placed)), dominated=dominators(placed),
                    upper_bounds=bounds, unplaced=tuple(n for n in rest if n not in placed))


def _why(better: tuple[float, float], worse: tuple[float, float]) -> str:
    if better[0] > worse[0]:
        return "more accurate and cheaper" if better[1] < worse[1] \
            else "more accurate at the same cost"
    return "as accurate and cheaper"


def frontier_line(points: Mapping[str, tuple[float, float]]) -> str:
    """One markdown line: the frontier routers (by cost), each dominated router with the
    router that dominates it and how, the upper bounds and the unplaced routers."""
    f = frontier_of(points)
    dominated = ", ".join(f"{n} (by {d}: {_why(points[d], points[n])})"
                          for n, d in f.dominated.items()) or "none"
    parts = [f"**Accuracy-cost frontier** (Avg against $ / query): "
             f"{', '.join(f.frontier) or 'none'}; dominated: {dominated}."]
    parts += [f"{n}: an upper bound, not on the frontier." for n in f.upper_bounds]
    parts += [f"{n}: no Avg or cost, not placed." for n in f.unplaced]
    return " ".join(parts)
