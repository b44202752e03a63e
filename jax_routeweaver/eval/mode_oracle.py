"""Per-question mode choice against the per-question best mode (the mode oracle).

`eval compare` runs every evaluation question free (the router declares the mode) and forced
to each of single, multi and agentic. From those rows, for each question q,

    best(q)  = { m : correct(q, forced m) is maximal }          (the oracle's set of modes)
    hit(c)   = mean_q [ c(q) ∈ best(q) ]                        (c: a mode per question)

is the share of questions on which a mode choice ``c`` is as good as the best forced mode.
The router's choice is its free declaration; a fixed mode ``m`` chooses ``m`` everywhere.
Questions where every mode scores the same are decided for any choice, so the share is
also reported over the *informative* questions (where the modes differ). The oracle's
accuracy ``mean_q max_m correct(q, forced m)`` bounds what choosing the mode alone can reach
(the router's own execution of each mode held fixed); ``gap`` is it minus the free router's.

Rows are `eval.report` rows (`correct`, `mode`, `cost_usd`); a free row whose declaration is
missing (an episode ended before it) counts as a miss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.data.records import FORCED_MODES
from jax_routeweaver.eval.report import row_key

__all__ = ["ModeOracle", "mode_oracle", "mode_oracle_markdown"]


@dataclasses.dataclass(frozen=True)
class ModeOracle:
    """`questions`: evaluated questions; `informative`: those where the forced modes differ;
    `router_hit` / `router_hit_informative`: the free router's share (all / informative);
    `fixed_hit[m]` / `fixed_hit_informative[m]`: the same for fixed mode m; `best_fixed`: the
    fixed mode of the highest share; `router_accuracy`, `oracle_accuracy`, `gap`:
    mean correctness of the free router, of the per-question best mode, and their
    difference; `oracle_modes[m]`: share of questions whose best set contains m."""

    questions: int
    informative: int
    router_hit: float
    router_hit_informative: float
    fixed_hit: dict[str, float]
    fixed_hit_informative: dict[str, float]
    best_fixed: str
    router_accuracy: float
    oracle_accuracy: float
    gap: float
    oracle_modes: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan


def mode_oracle(free: Sequence[Mapping[str, Any]],
                forced: Mapping[str, Sequence[Mapping[str, Any]]]) -> ModeOracle:
    """The mode oracle of the module doc. `free`: the router's rows; `forced[m]`: its rows
    forced to m, for every m in single, multi, agentic, covering the same questions (matched
    by (dataset, sample_id)). ValueError if a mode or a question's forced row is missing."""
    missing = [m for m in FORCED_MODES if m not in forced]
    if missing:
        raise ValueError(f"mode oracle: no forced rows for mode(s) {missing}")
    by_mode = {m: {row_key(r): bool(r["correct"]) for r in forced[m]} for m in FORCED_MODES}
    best: list[set[str]] = []
    chosen: list[str | None] = []
    router_correct: list[bool] = []
    for row in free:
        key = row_key(row)
        scores = {}
        for m in FORCED_MODES:
            if key not in by_mode[m]:
                raise ValueError(f"mode oracle: question {key} has no row forced to {m}")
            scores[m] = by_mode[m][key]
        top = max(scores.values())
        best.append({m for m, s in scores.items() if s == top})
        chosen.append(row.get("mode"))
        router_correct.append(bool(row["correct"]))
    informative = [len(b) < len(FORCED_MODES) for b in best]

    def hits(choice: Sequence[str | None]) -> tuple[float, float]:
        flags = [c in b for c, b in zip(choice, best, strict=True)]
        return _share(flags), _share([f for f, i in zip(flags, informative, strict=True) if i])

    router_hit, router_info = hits(chosen)
    fixed = {m: hits([m] * len(best)) for m in FORCED_MODES}
    best_fixed = max(FORCED_MODES, key=lambda m: fixed[m][0])
    router_acc = _share(router_correct)
    oracle_acc = _share([any(by_mode[m][row_key(r)] for m in FORCED_MODES) for r in free])
    return ModeOracle(
        questions=len(best), informative=sum(informative), router_hit=router_hit,
        router_hit_informative=router_info, fixed_hit={m: v[0] for m, v in fixed.items()},
        fixed_hit_informative={m: v[1] for m, v in fixed.items()}, best_fixed=best_fixed,
        router_accuracy=router_acc, oracle_accuracy=oracle_acc, gap=oracle_acc - router_acc,
        oracle_modes={m: _share([m in b for b in best]) for m in FORCED_MODES})


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def mode_oracle_markdown(result: ModeOracle) -> str:
    """A short markdown section: hit shares of the router and of each fixed mode."""
    lines = [
        "## Mode choice per question against the mode oracle",
        "",
        f"{result.questions} questions, {result.informative} informative (the forced modes "
        "differ). Hit: the chosen mode is one of the question's best forced modes.",
        "",
        "| choice | hit (all) | hit (informative) |",
        "|---|---:|---:|",
        f"| router (free) | {_pct(result.router_hit)} | "
        f"{_pct(result.router_hit_informative)} |",
    ]
    for m in FORCED_MODES:
        mark = " (best fixed)" if m == result.best_fixed else ""
        lines.append(f"| always {m}{mark} | {_pct(result.fixed_hit[m])} | "
                     f"{_pct(result.fixed_hit_informative[m])} |")
    lines += ["", f"Accuracy: router {_pct(result.router_accuracy)}, per-question best mode "
              f"{_pct(result.oracle_accuracy)} (gap {100 * result.gap:+.1f} points)."]
    return "\n".join(lines) + "\n"
