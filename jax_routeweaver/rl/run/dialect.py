"""The run's dialect: everything a RouteWeaver run and a Router-R1 run do differently.

The loop (`rl.run.loop`) and the evaluator (`eval.evaluate`) hold one `Dialect`, chosen when the
run is built (`rl.run.builders.dialect_for`), and never branch on ``rollout.dialect`` again. The
two implementations are `rl.run.routeweaver_run.RouteWeaverDialect` (modes, the forced-mode
curriculum, the pool's prices, the RouteWeaver reward) and
`rl.run.router_r1_run.RouterR1Dialect` (no modes, Router-R1's own price table and hierarchical
reward with a cost window that is part of the train state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from jax_routeweaver.data.pipeline import QueryBatch
from jax_routeweaver.data.records import Record
from jax_routeweaver.rewards.reward import Rewards
from jax_routeweaver.routing.episodes.episode import EnvFactory, Trajectory
from jax_routeweaver.routing.pools.pricing import Prices
from jax_routeweaver.routing.protocol.calls import WorkerPool


class Dialect(Protocol):
    """What a dialect supplies to the loop. Built from the config alone; `start` binds it to
    the run's tokenizer and pool once both exist."""

    has_modes: bool
    """The router declares an execution mode: mode tokens, the forced-mode curriculum and
    the support loss apply, and the mode-level metrics are logged."""

    make_env: EnvFactory
    """One environment per episode (set by `start`)."""

    def worker_pool(self, pool: WorkerPool) -> WorkerPool:
        """The pool this dialect's episodes call (``pool`` as built from ``workers``)."""
        ...

    def corpus(self, records: Sequence[Record], pool: WorkerPool) -> list[str]:
        """The text a run tokenizes, for ``model.tokenizer: qwen3-pruned``."""
        ...

    def start(self, tokenizer: Any, pool: WorkerPool, eos_id: int | tuple[int, ...]) -> None:
        """Build the environment factory and the scorer for this tokenizer and pool."""
        ...

    def prompt_ids(self, tokenizer: Any, question: str) -> list[int]:
        """The router's first prompt for `question` in full (no truncation): what a question
        must fit the router's context with (`rl.run.builders.question_limit`)."""
        ...

    def plan(self, batch: QueryBatch) -> list[Record]:
        """The batch's records as its episodes run them (with any forced modes)."""
        ...

    def forced_ratio(self, batch_index: int) -> float:
        """ρ, the share of forced queries at this batch (0 without a curriculum)."""
        ...

    def prices(self, pool: WorkerPool) -> Prices | None:
        """What the episode runner bills calls at (None: the dialect's reward prices them)."""
        ...

    def score(self, trajs: Sequence[Trajectory]) -> tuple[list[Rewards], list[Any] | None]:
        """(one `Rewards` row per trajectory, the dialect's own diagnostics or None)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Scorer state saved with the full train state (the loop item's extra keys)."""
        ...

    def load_state_dict(self, loop: Mapping[str, Any], where: Any) -> None:
        """Restore `state_dict` from a saved loop item; ValueError naming ``where`` when the
        item lacks it."""
        ...

    def step_metrics(self, rho: float) -> dict[str, float]:
        """The dialect's per-step scalars (the curriculum's ρ for RouteWeaver)."""
        ...


def stop_ids(eos: int | tuple[int, ...]) -> tuple[int, ...]:
    """The model's EOS as stop token ids (HF configs may list several, e.g. Llama 3)."""
    return tuple(eos) if isinstance(eos, tuple | list) else (eos,)
