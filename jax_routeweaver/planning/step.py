"""Per-device memory of the whole RL step — update, reference pass and rollout engine — and the
search for settings that make it fit a machine.

:mod:`jax_routeweaver.planning.memory` compiles the trainer's two programs (the update, the
logprob pass) for real shapes. This module adds the rollout engine
(:mod:`jax_routeweaver.planning.rollout`) and prices the step as three **phases**, each with
what is resident on a device while it runs (bytes per device):

* **update**: the update program's peak + the frozen reference + what the rollout engine keeps
  between rollouts (``RolloutMemory.kept``);
* **reference**: the logprob pass's peak + the policy + its optimizer state + ``kept``;
* **rollout**: the policy + optimizer state + reference (nothing is offloaded while rollouts
  run) + the engine's whole footprint (``RolloutMemory.resident``).

A ``ppo_gae`` run's critic (params and optimizer state) is resident in all three
(``TrainFigures.critic``; its own update is priced as the policy's, see ``memory.MemoryPlan``).

The step's need is the largest phase; it fits when that is under ``1 - HEADROOM`` of the device
and the engine can hold at least one full-length row (a row that cannot finish never ends).

:func:`search` tries a small grid (:data:`REMAT_GROUPS` x the target's meshes for the trainer,
:data:`PAGED_MAX_ROWS` with the largest page pool that fits, :data:`VLLM_SHARES` x
:data:`VLLM_SLEEP_LEVELS`) and keeps, per target and engine, the first trainer setting in order
of preference (fewest tensor shards, then fewest layer groups: the fastest) for which some
rollout setting fits with at least K (``data.group_size``) full-length rows in flight, with
the rollout setting that keeps the most of them.
One row per device per micro-batch (more only costs memory) and the config's other settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.planning.memory import (
    GIB,
    HEADROOM,
    MemoryPlan,
    StepShape,
    Target,
    plan_config,
)
from jax_routeweaver.planning.rollout import (
    ENGINES,
    Engine,
    RolloutMemory,
    RolloutSettings,
    RolloutShape,
    SamplerMesh,
    kv_bytes_per_token,
    replica_dtype,
    rollout_memory,
)

REMAT_GROUPS = (1, 6)  # the trainer's layer groups tried, fastest first
PAGED_MAX_ROWS = (256, 128, 64, 32, 16, 8)  # decode slots tried
VLLM_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # --gpu-memory-utilization tried
VLLM_SLEEP_LEVELS = (0, 2)  # 1 leaves the GPU as 2 does (it keeps the weights in host RAM)


# ---------------------------------------------------------------------------- phases
@dataclasses.dataclass(frozen=True)
class TrainFigures:
    """What the whole-step plan needs of a compiled :class:`MemoryPlan` (bytes per device):
    the train state's parts (``critic``: a ppo_gae run's critic state, else 0) and the two
    programs' peaks; JSON round trip."""

    mesh: tuple[int, int, int]
    remat_groups: int
    params: int
    optimizer: int
    reference: int
    update: int
    logprobs: int
    compile_s: float = 0.0
    critic: int = 0

    @classmethod
    def of(cls, plan: MemoryPlan) -> TrainFigures:
        return cls(tuple(plan.mesh), plan.remat_groups, plan.params, plan.optimizer,
                   plan.reference, plan.update.peak, plan.logprobs.peak,
                   round(plan.update.compile_s + plan.logprobs.compile_s, 1), plan.critic)

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.reference + self.critic

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mesh": list(self.mesh)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainFigures:
        return cls(**{**d, "mesh": tuple(d["mesh"])})

    def label(self) -> str:
        groups = f", {self.remat_groups} groups" if self.remat_groups > 1 else ""
        return f"mesh {'x'.join(map(str, self.mesh))}{groups}"


def phases(train: TrainFigures, rollout: RolloutMemory) -> dict[str, int]:
    """Bytes per device resident in each phase of the step (see the module docstring)."""
    return {"update": train.update + train.reference + train.critic + rollout.kept,
            "reference": train.logprobs + train.params + train.optimizer + train.critic
            + rollout.kept,
            "rollout": train.state + rollout.resident}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One whole-step configuration on ``target``: the trainer's figures, the rollout
    settings and the engine's memory."""

    target: Target
    train: TrainFigures
    settings: RolloutSettings
    rollout: RolloutMemory

    @property
    def phases(self) -> dict[str, int]:
        return phases(self.train, self.rollout)

    @property
    def need(self) -> int:
        return max(self.phases.values())

    @property
    def limit(self) -> int:
        return int(self.target.memory_gib * GIB * (1.0 - HEADROOM))

    @property
    def fits(self) -> bool:
        return self.need <= self.limit and self.rollout.holds_a_row

    def as_dict(self) -> dict[str, Any]:
        gib = lambda b: round(b / GIB, 2)
        r = self.rollout
        return {
            "target": self.target.name, "engine": self.settings.engine,
            "trainer": self.train.label(), "rollout_settings": self.settings.label(),
            "overrides": self.overrides(),
            "phases_gib": {k: gib(v) for k, v in self.phases.items()},
            "need_gib": gib(self.need), "limit_gib": gib(self.limit),
            "memory_gib": self.target.memory_gib, "fits": self.fits,
            "rollout_gib": {"weights": gib(r.weights), "kv": gib(r.kv),
                            "temporaries": gib(r.temporaries), "kept": gib(r.kept),
                            "resident": gib(r.resident)},
            "kv_tokens": r.kv_tokens, "row_tokens": r.row_tokens, "full_rows": r.full_rows,
            "time_shared": self.settings.engine == "vllm" and self.settings.sleep_level > 0,
        }

    def overrides(self) -> list[str]:
        data, fsdp, tensor = self.train.mesh
        return [f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}",
                f"model.remat_groups={self.train.remat_groups}",
                f"algo.loss.micro_batch_size={data * fsdp}", *self.settings.overrides()]


def step_plan(target: Target, train: TrainFigures, settings: RolloutSettings,
              arch: ModelConfig, shape: RolloutShape, param_dtype: str) -> StepPlan:
    """The whole step of ``train`` (compiled figures) with the engine of ``settings``."""
    memory = rollout_memory(settings, arch, shape, SamplerMesh.of(target, train.mesh),
                            memory_bytes=int(target.memory_gib * GIB),
                            params=train.params, param_dtype=param_dtype,
                            backend=target.kind)
    return StepPlan(target, train, settings, memory)


# ---------------------------------------------------------------------------- search
def paged_candidates(target: Target, train: TrainFigures, arch: ModelConfig,
                     shape: RolloutShape, param_dtype: str, page_size: int = 16
                     ) -> Iterable[StepPlan]:
    """For each of :data:`PAGED_MAX_ROWS`: the largest pool (whole pages, at most
    ``max_rows`` full rows) that keeps every phase under the limit (none fits: a one-row
    pool, for the table)."""
    mesh = SamplerMesh.of(target, train.mesh)
    per_page = page_size * kv_bytes_per_token(arch, arch.dtype) // mesh.tensor
    row_pages = -(-shape.row_tokens // page_size)
    for max_rows in PAGED_MAX_ROWS:
        one_page = step_plan(target, train, RolloutSettings(
            "paged", page_size=page_size, budget_tokens=page_size, max_rows=max_rows),
            arch, shape, param_dtype)
        room = one_page.limit - (one_page.need - per_page)  # what the pool may take
        pages = min(room // per_page, max_rows * row_pages)
        yield step_plan(target, train, RolloutSettings(
            "paged", page_size=page_size, budget_tokens=max(pages, row_pages) * page_size,
            max_rows=max_rows), arch, shape, param_dtype)


def vllm_candidates(target: Target, train: TrainFigures, arch: ModelConfig,
                    shape: RolloutShape, base: RolloutSettings,
                    sleep_levels: Sequence[int] = VLLM_SLEEP_LEVELS) -> Iterable[StepPlan]:
    """:data:`VLLM_SHARES` x ``sleep_levels`` with ``base``'s tensor degree and dtype."""
    for sleep in sleep_levels:
        for share in VLLM_SHARES:
            settings = dataclasses.replace(base, engine="vllm", share=share, sleep_level=sleep)
            yield step_plan(target, train, settings, arch, shape, "float32")


def _rank(plan: StepPlan) -> tuple[Any, ...]:
    """Better first: plans that fit, by the most full rows in flight, the lowest sleep level
    (no sleep/wake per step), the most decode slots; then the others by the least need
    (then the fewest decode slots)."""
    if not plan.fits:
        return (1, plan.need / plan.limit, plan.rollout.rows)
    return (0, -plan.rollout.full_rows, plan.settings.sleep_level, -plan.rollout.rows,
            plan.need)


def best_rollout(target: Target, train: TrainFigures, engine: Engine, arch: ModelConfig,
                 shape: RolloutShape, param_dtype: str, base: RolloutSettings,
                 sleep_levels: Sequence[int] = VLLM_SLEEP_LEVELS) -> StepPlan:
    """The best rollout setting of ``engine`` beside ``train`` (:func:`_rank`); vLLM's with
    one of ``sleep_levels``."""
    if engine == "dense":
        return step_plan(target, train, RolloutSettings("dense"), arch, shape, param_dtype)
    if engine == "paged":
        plans = list(paged_candidates(target, train, arch, shape, param_dtype,
                                      base.page_size if base.engine == "paged" else 16))
    else:
        plans = list(vllm_candidates(target, train, arch, shape, base, sleep_levels))
    return min(plans, key=_rank)


def engines_for(target: Target) -> tuple[Engine, ...]:
    """The engines planned on ``target``: the vLLM sidecar only on GPUs (sleep mode is
    CUDA's)."""
    return ENGINES if target.kind == "gpu" else ("dense", "paged")


def variants(engines: Sequence[Engine]) -> list[tuple[Engine, tuple[int, ...]]]:
    """(engine, vLLM sleep levels) searched apart: vLLM awake (sleep 0: needs nothing of the
    trainer's allocator) and vLLM sleeping through the update (time-shared)."""
    out: list[tuple[Engine, tuple[int, ...]]] = []
    for engine in engines:
        if engine == "vllm":
            out += [(engine, (0,)), (engine, tuple(s for s in VLLM_SLEEP_LEVELS if s))]
        else:
            out.append((engine, ()))
    return out


def search(target: Target, trainers: Sequence[TrainFigures], arch: ModelConfig,
           shape: RolloutShape, param_dtype: str, base: RolloutSettings,
           engines: Sequence[Engine] | None = None, min_rows: int = 1) -> list[StepPlan]:
    """Per engine (:func:`variants`: vLLM awake and sleeping apart), the first of
    ``trainers`` (in order of preference) whose best rollout setting fits with at least
    ``min_rows`` full-length rows in flight (callers pass K, one query's group), and that
    setting; when none reaches ``min_rows``, the fitting plan with the most rows; when none
    fits, the plan that comes closest (least need over limit) — its ``fits`` is False."""
    if not trainers:
        raise ValueError(f"{target.name}: no trainer figures to search")
    out = []
    for engine, sleep_levels in variants(engines or engines_for(target)):
        best = [best_rollout(target, t, engine, arch, shape, param_dtype, base, sleep_levels)
                for t in trainers]
        fitting = [p for p in best if p.fits]
        enough = [p for p in fitting if p.rollout.full_rows >= min_rows]
        if enough:
            out.append(enough[0])
        elif fitting:
            out.append(max(fitting, key=lambda p: p.rollout.full_rows))  # first of the most
        else:
            out.append(min(best, key=lambda p: p.need / p.limit))
    return out


def trainer_candidates(target: Target) -> list[tuple[tuple[int, int, int], int]]:
    """(mesh, remat_groups) in order of preference: the target's meshes (fewest tensor
    shards first), then :data:`REMAT_GROUPS`."""
    return [(mesh, groups) for mesh in target.search_meshes for groups in REMAT_GROUPS]


def compile_trainers(target: Target, compile_one: Callable[[tuple[int, int, int], int],
                                                           MemoryPlan],
                     log: Callable[[str], None] = lambda _: None) -> list[TrainFigures]:
    """:func:`trainer_candidates` compiled by ``compile_one(mesh, remat_groups)``; a
    candidate the model's shapes cannot take (a mesh axis that does not divide a dimension,
    layers that do not split into the groups) is skipped and logged."""
    out = []
    for mesh, groups in trainer_candidates(target):
        try:
            figures = TrainFigures.of(compile_one(mesh, groups))
        except ValueError as e:
            log(f"{target.name}: mesh {mesh}, {groups} groups skipped: {e}")
            continue
        log(f"{target.name}: {figures.label()} compiled in {figures.compile_s:.1f} s: update "
            f"{figures.update / GIB:.1f} GiB, logprobs {figures.logprobs / GIB:.1f} GiB")
        out.append(figures)
    return out


def search_config(cfg: Any, arch: ModelConfig, target: Target, shape: StepShape, *,
                  devices: Sequence[Any], length: int | None = None,
                  log: Callable[[str], None] = lambda _: None
                  ) -> tuple[list[TrainFigures], list[StepPlan]]:
    """Compile ``target``'s trainer candidates for a ``TrainConfig``'s step ``shape`` (with
    the config's remat policy) and :func:`search` them with its rollout settings; returns the
    compiled figures and the plans found. ``length``: the longest row, as for ``shape``."""
    trainers = compile_trainers(
        target, lambda mesh, groups: plan_config(cfg, arch, target, shape, devices=devices,
                                                 remat=cfg.model.remat, mesh=mesh,
                                                 remat_groups=groups), log)
    model = arch.replace(dtype=cfg.model.dtype)
    rollout = RolloutShape.of_config(cfg, target.hosts, length)
    return trainers, search(target, trainers, model, rollout, replica_dtype(cfg),
                            RolloutSettings.of_config(cfg), min_rows=cfg.data.group_size)
