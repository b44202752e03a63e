"""The SIMULATED workers' capability model: one `WorkerProfile` (skill table, verbosity) per
worker and one `DomainDynamics` (how errors correlate, what plans, checks and other workers'
outputs do) per domain, with the defaults `SimulatedWorkerPool` (`pool.py`) uses.

Profiles (p correct for a plain call, easy/medium/hard; price tier of the matching worker
of the original pool, USD per 1M tokens in/out):

| worker | tier | MATH | CODE | KNOWLEDGE | REASON | RECALL | verbosity |
|---|---|---|---|---|---|---|---|
| worker_1 | 0.02/0.05 | .70/.30/.06 | .60/.25/.05 | .62/.40/.22 | .65/.35/.12 | .85/.68/.48 | 0.9 |
| worker_2 | 0.02/0.05 | .55/.20/.04 | .50/.18/.03 | .70/.50/.32 | .55/.28/.10 | .95/.82/.62 | 0.8 |
| worker_3 | 0.10/0.30 | .97/.82/.52 | .95/.78/.45 | .65/.45/.28 | .88/.66/.40 | .50/.30/.15 | 1.2 |
| worker_4 | 0.119/0.2 | .85/.55/.22 | .78/.45/.18 | .90/.74/.55 | .78/.55/.28 | .70/.50/.30 | 1.0 |
| worker_5 | 0.10/0.32 | .82/.52/.20 | .80/.50/.22 | .92/.78/.58 | .86/.62/.36 | .88/.72/.52 | 1.3 |
| worker_6 | 0.10/0.40 | .95/.78/.48 | .96/.80/.48 | .72/.52/.35 | .90/.70/.45 | .55/.35/.20 | 1.0 |

Domain dynamics (`DEFAULT_DYNAMICS`): shared / persistent latent share, plan gain
easy/medium/hard, verifiability, distraction:

| domain | shared | persistent | plan gain | verifiability | distraction |
|---|---|---|---|---|---|
| MATH | .15 | .15 | .10/.40/.60 | .95 | 0 |
| CODE | .15 | .15 | .10/.40/.60 | .95 | 0 |
| KNOWLEDGE | .25 | .40 | .00/.00/.05 | .25 | .35 |
| REASON | .15 | .15 | .30/.55/.70 | .95 | 0 |
| RECALL | .75 | .25 | .00/.00/.00 | .20 | .45 |

Distraction is what another worker's output costs where answers are facts a worker knows or
does not: a worker whose prompt carries a plan, candidate answers or a rejection answers
right with probability p (1 - distraction) instead of p (the plan or the other candidates
talk it out of what it knew), and a summarizer choosing among disagreeing candidates is
swayed to another one with that probability too. It is why, as in the paper's Figure 4
(RECALL 96 % and KNOWLEDGE 72 % single), orchestration does not pay on RECALL and KNOWLEDGE,
while REASON's large plan gain and checkable steps make plan -> execute -> verify pay there
(Figure 4: REASON 99 % agentic). Both were set in issue 31 after measuring the pool's
favourites (`routeweaver eval favourites`; bench/RESULTS.md); before, the three modes
nearly tied on every domain but CODE.

Workers are specialists: at medium difficulty a domain's best and worst worker differ by
0.4-0.6 (as an 8B model and a frontier model do on Omni-MATH or LiveCodeBench), so which
worker to call is worth learning: over 1,500 synthetic tasks a plain call to a uniformly
random worker is right 0.50-0.58 of the time per domain, to the domain's best worker
0.74-0.79. (Flatter tables, with 0.1-0.3 between workers, left a random router within 0.2
of the best fixed strategy, too little for the CPU quickstart to show learning above its
step-to-step noise; bench/RESULTS.md.)

So, as in the paper, no mode wins everywhere: cheap workers are the best single choice for
RECALL/KNOWLEDGE and voting cannot fix shared ignorance; three independent answers and a
majority beat one call on noisy KNOWLEDGE/REASON items; plan -> execute -> verify ->
summarize wins on MATH/CODE/REASON where plans and checking pay off and loses badly on
RECALL/KNOWLEDGE (distraction); a single call is the best accuracy per dollar on easy items.
`tests/test_simulated.py` measures these strategies (with each domain's best workers:
accuracy single / multi / agentic about .79/.75/.91 MATH, .72/.71/.91 CODE, .75/.80/.52
KNOWLEDGE, .68/.75/.91 REASON, .79/.76/.45 RECALL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax_routeweaver.data.records import Domain
from jax_routeweaver.routing.simulated.tasks import LEVELS

__all__ = [
    "DEFAULT_DYNAMICS",
    "DEFAULT_PROFILES",
    "DomainDynamics",
    "WorkerProfile",
]


# ============================================================================ profiles
@dataclasses.dataclass(frozen=True)
class WorkerProfile:
    """One simulated worker: catalog description, skill table and reply length.

    `skill[domain] = (easy, medium, hard)`: probability that a plain call answers correctly.
    `verbosity` scales the length of the derivation (so the completion tokens).
    """

    # The worker's line in the router's catalog (free text, never empty in the defaults).
    description: str
    # Per domain (every `Domain` required): P(correct) of a plain call at (easy, medium, hard),
    # each in [0, 1].
    skill: Mapping[Domain, tuple[float, float, float]]
    # Scale of the derivation's step count, so of the completion tokens; > 0 (1: average).
    verbosity: float = 1.0

    def __post_init__(self) -> None:
        for domain in Domain:
            levels = self.skill.get(domain)
            if levels is None or len(levels) != 3 or not all(0.0 <= p <= 1.0 for p in levels):
                raise ValueError(f"WorkerProfile.skill[{domain.value}] must be three "
                                 f"probabilities (easy, medium, hard), got {levels!r}")
        if not self.verbosity > 0:
            raise ValueError(f"WorkerProfile.verbosity must be > 0, got {self.verbosity}")

    def p_correct(self, domain: Domain | str, difficulty: str) -> float:
        """P(correct) of a plain call on a task of this domain and difficulty."""
        return self.skill[Domain(domain)][level_index(difficulty)]


@dataclasses.dataclass(frozen=True)
class DomainDynamics:
    """How errors behave in a domain (see module doc, and `pool.py`'s for the latent-factor
    model): latent shares, plan gain, checkability."""

    # Share of the correctness latent common to all workers on a task (correlation between two
    # workers); >= 0, shared + persistent <= 1.
    shared: float
    # Share fixed per (worker, task) on top of `shared` (asking one worker again does not
    # help); >= 0, shared + persistent <= 1.
    persistent: float
    # Fraction g of the remaining error a good plan removes, p -> p + g (1 - p), at (easy,
    # medium, hard); each in [0, 1].
    plan_gain: tuple[float, float, float]
    # How checkable answers are, in [0, 1]: scales a verifier's chance to catch a wrong
    # candidate and the gain of a retry after a FAIL (REVISE_GAIN * verifiability).
    verifiability: float
    # Probability that another worker's output in the prompt (a plan, candidate answers, a
    # rejection) talks a worker out of an answer it knew; in [0, 1]. 0: context never hurts.
    distraction: float = 0.0

    def __post_init__(self) -> None:
        if min(self.shared, self.persistent) < 0 or self.shared + self.persistent > 1:
            raise ValueError("DomainDynamics: shared and persistent must be >= 0 with sum <= 1")
        if len(self.plan_gain) != 3 or not all(0 <= g <= 1 for g in self.plan_gain):
            raise ValueError("DomainDynamics.plan_gain must be three numbers in [0, 1]")
        if not 0 <= self.verifiability <= 1:
            raise ValueError("DomainDynamics.verifiability must be in [0, 1]")
        if not 0 <= self.distraction <= 1:
            raise ValueError(f"DomainDynamics.distraction must be in [0, 1], got "
                             f"{self.distraction}")


def _skills(math_: tuple, code: tuple, knowledge: tuple, reason: tuple, recall: tuple
            ) -> dict[Domain, tuple[float, float, float]]:
    return {Domain.MATH: math_, Domain.CODE: code, Domain.KNOWLEDGE: knowledge,
            Domain.REASON: reason, Domain.RECALL: recall}


DEFAULT_PROFILES: Mapping[str, WorkerProfile] = {
    "worker_1": WorkerProfile(
        "Dense model with about 8B parameters; multilingual instruction following and "
        "dialogue, mathematical and logical reasoning, code generation.",
        _skills((.70, .30, .06), (.60, .25, .05), (.62, .40, .22), (.65, .35, .12),
                (.85, .68, .48)), verbosity=0.9),
    "worker_2": WorkerProfile(
        "Dense model with 8B parameters, instruction-tuned for multilingual dialogue; general "
        "reasoning, text generation and coding.",
        _skills((.55, .20, .04), (.50, .18, .03), (.70, .50, .32), (.55, .28, .10),
                (.95, .82, .62)), verbosity=0.8),
    "worker_3": WorkerProfile(
        "Mixture-of-experts model, 30.5B parameters in total with 3.3B active; instruction "
        "following, text comprehension, logical reasoning, mathematics, science and coding.",
        _skills((.97, .82, .52), (.95, .78, .45), (.65, .45, .28), (.88, .66, .40),
                (.50, .30, .15)), verbosity=1.2),
    "worker_4": WorkerProfile(
        "Dense model in the 27B class; multilingual question answering, summarization, "
        "reasoning, math problem solving and code generation.",
        _skills((.85, .55, .22), (.78, .45, .18), (.90, .74, .55), (.78, .55, .28),
                (.70, .50, .30)), verbosity=1.0),
    "worker_5": WorkerProfile(
        "Dense model with 70B parameters, instruction-tuned for multilingual dialogue; "
        "reasoning, instruction following, text and code generation.",
        _skills((.82, .52, .20), (.80, .50, .22), (.92, .78, .58), (.86, .62, .36),
                (.88, .72, .52)), verbosity=1.3),
    "worker_6": WorkerProfile(
        "Sparse mixture-of-experts model, parameter counts undisclosed; translation, "
        "classification, information extraction, coding, mathematics and reasoning.",
        _skills((.95, .78, .48), (.96, .80, .48), (.72, .52, .35), (.90, .70, .45),
                (.55, .35, .20)), verbosity=1.0),
}

DEFAULT_DYNAMICS: Mapping[Domain, DomainDynamics] = {
    Domain.MATH: DomainDynamics(.15, .15, (.10, .40, .60), .95),
    Domain.CODE: DomainDynamics(.15, .15, (.10, .40, .60), .95),
    Domain.KNOWLEDGE: DomainDynamics(.25, .40, (.0, .0, .05), .25, distraction=.35),
    Domain.REASON: DomainDynamics(.15, .15, (.30, .55, .70), .95),
    Domain.RECALL: DomainDynamics(.75, .25, (.0, .0, .0), .20, distraction=.45),
}


def level_index(difficulty: str | None) -> int:
    if difficulty in LEVELS:
        return LEVELS.index(difficulty)
    return 1  # records without a difficulty count as medium
