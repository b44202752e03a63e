"""Progressive exploration curriculum (docs/algorithm.md, "The forced-mode curriculum" and
"The minimum-support loss").

Pure and deterministic: the forced ratio ρ_b is a function of the batch index, the
forced/free verdict of a query is a sha256 draw on its ``sample_id`` (so every one of its
K rollouts shares it), and forced modes are assigned balanced over the batch's queries
(11/11/10 of 32; the forced ones among them need not be balanced when 0 < ρ_b < 1), unless the
data file gives them.
"""

from __future__ import annotations

import dataclasses
import hashlib

from jax_routeweaver.config import bounded
from jax_routeweaver.data.pipeline import balanced_forced_modes

MODES = ("single", "multi", "agentic")


@dataclasses.dataclass(frozen=True)
class ExplorationConfig:
    """The original's numbers: ρ = 1 for b ≤ 25, linear to 0 at b = 75 (paper main arm).

    ``question_floor`` / ``question_floor_weight``: the per-question mode floor
    (docs/algorithm.md, "The per-question mode floor"), not in the paper, off by default:
    the minimum-support loss bounds the batch mean π̄ only, so once every query of a domain
    declares one mode its other modes are never sampled again there. The floor's hinge
    ``mean_q (1/3) Σ_m max(0, log δ_q − log π_M(m|q))`` keeps each mode at probability
    ≥ δ_q for every query, weighted ``λ_q·(1 − ρ_b)``: it takes over as forcing ends."""

    forced_start_batch: int = bounded(25, "[-1, inf)")  # batch index; -1: ρ = 0 from batch 0
    forced_anneal_steps: int = bounded(50, "[1, inf)")  # batches from ρ = 1 to ρ = 0
    support_lambda0: float = bounded(0.002, "[0, inf)")  # λ0, the support loss weight at ρ = 1
    support_floor: float = bounded(0.05, "[0, 1]")  # a mode's probability floor
    # δ_q: each query's floor on the probability of every mode; 0 = off; below 1/3
    question_floor: float = bounded(0.0, "[0, 0.3333)")
    # λ_q: the per-question floor's weight once ρ_b = 0 (it is λ_q·(1 − ρ_b))
    question_floor_weight: float = bounded(0.0, "[0, inf)")

    def __post_init__(self) -> None:
        if self.forced_anneal_steps <= 0:
            raise ValueError(f"forced_anneal_steps={self.forced_anneal_steps} must be positive")
        if not 0.0 <= self.question_floor < 1.0 / 3.0:
            raise ValueError(f"question_floor={self.question_floor} must be in [0, 1/3): "
                             "three modes cannot all stay above 1/3")


def forced_ratio(batch_index: int, cfg: ExplorationConfig = ExplorationConfig()) -> float:
    """``ρ_b = clamp(1 − (b − start)/steps, 0, 1)``."""
    rho = 1.0 - (batch_index - cfg.forced_start_batch) / cfg.forced_anneal_steps
    return min(1.0, max(0.0, rho))


def question_floor_weight(rho: float, cfg: ExplorationConfig = ExplorationConfig()) -> float:
    """The per-question mode floor's weight at forced ratio ``rho``: ``λ_q · (1 − ρ)`` when
    ``question_floor`` > 0, else 0 (skipped)."""
    if cfg.question_floor <= 0:
        return 0.0
    return cfg.question_floor_weight * (1.0 - rho)


def query_draw(sample_id: str) -> float:
    """``u = int(sha256(sample_id)[:8], big-endian) / 2^64`` in [0, 1)."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_forced(
    sample_id: str,
    batch_index: int,
    cfg: ExplorationConfig = ExplorationConfig(),
    *,
    stage2_arm: str = "",
) -> bool:
    """Forced iff ρ ≥ 1, never if ρ ≤ 0, else ``u < ρ``; a row with a ``stage2_arm`` is
    refused (docs/algorithm.md, "Which queries are forced")."""
    if stage2_arm:
        raise ValueError(f"row {sample_id!r} carries stage2_arm={stage2_arm!r}; refused")
    rho = forced_ratio(batch_index, cfg)
    if rho >= 1.0:
        return True
    if rho <= 0.0:
        return False
    return query_draw(sample_id) < rho


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """What the environment does for one rollout: inject ``<mode>{forced_mode}</mode>``
    (mask 0) when forced, else let the policy declare it (mask 1)."""

    sample_id: str
    rollout: int
    batch_index: int
    forced: bool
    forced_mode: str | None


def plan_batch(
    sample_ids: list[str],
    batch_index: int,
    cfg: ExplorationConfig = ExplorationConfig(),
    *,
    group_size: int = 8,
    forced_modes: list[str] | None = None,
) -> list[RolloutPlan]:
    """``group_size`` (K) rollouts per query (query-major), all sharing the query's forced
    verdict and mode.

    ``forced_modes`` are the parquet's ``extra_info.forced_mode`` values; None assigns
    them with :func:`balanced_forced_modes`.
    """
    if forced_modes is None:
        forced_modes = balanced_forced_modes(sample_ids)
    if len(forced_modes) != len(sample_ids):
        raise ValueError("one forced_mode per sample_id is required")
    plans = []
    for sid, mode in zip(sample_ids, forced_modes, strict=True):
        forced = is_forced(sid, batch_index, cfg)
        if forced and mode not in MODES:
            raise ValueError(f"forced row {sid!r} has invalid forced_mode {mode!r}")
        for k in range(group_size):
            plans.append(RolloutPlan(sid, k, batch_index, forced, mode if forced else None))
    return plans
