"""The advantage estimators, by name: one registry that the config, the batch packer, the loop,
the preflight check and the memory plan read (docs/algorithm.md, "Advantages").

An estimator is either group-relative (a function of `rl.core.advantages` over the packed batch's
groups) or, for ``ppo_gae``, the critic's GAE (`rl.core.gae`, run by the loop). The registry says
which, and what else an estimator implies: whether it splits the advantage at the mode tokens
(``A_mode + A_inner = A_GRPO``), whether it needs a critic, and whether it reads the cost
reward (``reward.alpha`` > 0). Adding an estimator: its function in `rl.core.advantages`, an entry
here, its tests (docs/contributing.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator.

    Attributes:
        name: the value of ``algo.estimator``.
        function: its function's name in `rl.core.advantages`; "" for ``ppo_gae`` (GAE on the
            critic's values, in the loop).
        mode_tokens: splits the group advantage at the mode tokens (COMET); Router-R1's
            dialect, which has none, refuses it.
        critic: trains a critic (its state is in every checkpoint and every phase's memory).
        cost: reads the efficiency reward ``r_eff``, so ``reward.alpha`` > 0 is allowed.
    """

    name: str
    function: str
    mode_tokens: bool = False
    critic: bool = False
    cost: bool = False


ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("grpo_gated", "grpo_gated"),
    Estimator("comet_grpo", "comet_grpo", mode_tokens=True),
    Estimator("comet_gdpo", "comet_gdpo", mode_tokens=True, cost=True),
    Estimator("ppo_gae", "", critic=True),
)}


def estimator(name: str) -> Estimator:
    """The registry's entry for ``name`` (ValueError naming the known ones)."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator {name!r}: expected one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]
