"""The paper's training schedule as the tests check it: its two arms (cold start, main), the
wo_progressive ablation's exploration, step -> batch index, the support weight λ_b and the
launcher's balance check of forced modes. The run itself reads all of this from its config
(configs/paper/); these tables are what the configs and `rl.learner.curriculum` are checked
against."""

from __future__ import annotations

import dataclasses

from jax_routeweaver.rl.learner.curriculum import MODES, ExplorationConfig, forced_ratio


@dataclasses.dataclass(frozen=True)
class Phase:
    """One training arm as run (docs/algorithm.md, "Phases as configured"): steps are 1-based,
    ``batch_index = step − 1``."""

    name: str
    first_step: int
    last_step: int
    parquet: str
    exploration: ExplorationConfig
    estimator: str  # "grpo_gated" | "comet_grpo"
    reduction: str  # "global" | "segment"
    support: bool


COLD_PHASE = Phase(
    name="cold",
    first_step=1,
    last_step=25,
    parquet="routeweaver_cold_pool.parquet",
    exploration=ExplorationConfig(forced_start_batch=999),  # ρ = 1 throughout
    estimator="grpo_gated",
    reduction="global",
    support=False,
)
MAIN_PHASE = Phase(
    name="main",
    first_step=26,
    last_step=90,
    parquet="routeweaver_train.parquet",
    exploration=ExplorationConfig(),
    estimator="comet_grpo",
    reduction="segment",
    support=True,
)
PAPER_PHASES = (COLD_PHASE, MAIN_PHASE)

# Ablations (docs/algorithm.md, "Phases as configured"): `wo_progressive` starts free at batch 0
# with λ = 0.
WO_PROGRESSIVE = ExplorationConfig(
    forced_start_batch=-1, forced_anneal_steps=1, support_lambda0=0.0
)


def batch_index_for_step(step: int) -> int:
    """``batch_index = step − 1`` (sequential parquet, 32 rows per batch)."""
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    return step - 1


def phase_for_step(step: int, phases: tuple[Phase, ...] = PAPER_PHASES) -> Phase:
    for phase in phases:
        if phase.first_step <= step <= phase.last_step:
            return phase
    raise ValueError(f"step {step} is outside every phase")


DEFAULT_EXPLORATION = ExplorationConfig()


def support_lambda(batch_index: int, cfg: ExplorationConfig = DEFAULT_EXPLORATION) -> float:
    """``λ_b = λ0 · ρ_b``; the support term is skipped when this is ≤ 0."""
    return cfg.support_lambda0 * forced_ratio(batch_index, cfg)


def check_balanced(forced_modes: list[str]) -> None:
    """Raise unless every mode appears and counts differ by at most one (launcher check)."""
    counts = [forced_modes.count(m) for m in MODES]
    if sum(counts) != len(forced_modes):
        raise ValueError(f"unknown forced modes in {sorted(set(forced_modes))}")
    if max(counts) - min(counts) > 1:
        raise ValueError(f"forced modes unbalanced: {dict(zip(MODES, counts, strict=True))}")
