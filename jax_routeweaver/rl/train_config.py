"""The typed configuration of `routeweaver train` (YAML + ``key.sub=value`` overrides).

Every section is a frozen dataclass; :func:`load_train_config` reads a YAML file through the
generic loader in ``jax_routeweaver.config`` (unknown keys are errors with the nearest valid
key suggested) and checks the cross-field rules below. Defaults are the reference's paper
numbers (``reference/routeweaver.md`` §6–7); ``configs/quickstart.yaml`` scales them down.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Literal

from jax_routeweaver.config import ConfigError, load_config
from jax_routeweaver.rl.curriculum import ExplorationConfig
from jax_routeweaver.rl.trainer import LossConfig, OptimConfig
from jax_routeweaver.routing.grammar import ProtocolConfig


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The router. ``init``: "random" (architecture from ``random``: ``ModelConfig``
    fields; vocab_size and eos/pad/bos ids default to the tokenizer's), a Hugging Face
    checkpoint directory, or an orbax policy checkpoint directory. ``tokenizer``: "qwen3"
    (the real Qwen3 tokenizer, built offline), "qwen3-pruned" (the same BPE restricted to
    the tokens of this run's prompts and worker replies) or a tokenizer directory."""

    init: str = "random"
    random: dict[str, Any] = dataclasses.field(default_factory=dict)
    tokenizer: str = "qwen3"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    logprob_chunk: int = 1024


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Device mesh ``('data', 'fsdp', 'tensor')``; one entry may be -1 (the rest)."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Queries. ``source``: "synthetic" (``synthetic_tasks`` for the five domains) or a
    ``.jsonl``/``.parquet`` file of records. ``quotas``: per-batch domain counts (sum =
    ``batch_size``; empty = plain sequential batches). ``group_size``: K rollouts."""

    source: str = "synthetic"
    synthetic_queries: int = 3200
    synthetic_seed: int = 0
    batch_size: int = 32
    group_size: int = 8
    quotas: dict[str, int] = dataclasses.field(default_factory=lambda: {
        "MATH": 7, "CODE": 7, "KNOWLEDGE": 7, "REASON": 6, "RECALL": 5})
    shuffle: bool = False
    seed: int = 42
    bad_rows: Literal["error", "skip"] = "error"
    repeat: bool = False


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Router decoding (§7.2: T 0.8, top-p 0.95, top-k off) and episode options.
    ``constrained``: grammar-constrained actions; ``answer_choices``: with constraints, an
    answer must be one of the candidate answers the workers returned (lets a tiny router
    act; off for real models). ``protocol``: ``ProtocolConfig`` fields."""

    sampler: Literal["jax"] = "jax"
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = -1
    max_new_tokens: int = 512
    constrained: bool = False
    answer_choices: bool = False
    execution_feedback: bool = True
    protocol: ProtocolConfig = dataclasses.field(default_factory=ProtocolConfig)


@dataclasses.dataclass(frozen=True)
class WorkersSection:
    """``pool``: "simulated" (a seeded stand-in for the paid worker APIs) or a channel
    YAML (OpenAI-compatible endpoints; keys come from the env vars it names)."""

    pool: str = "simulated"
    seed: int = 0
    latency_s: float = 0.0
    failure_rate: float = 0.0
    concurrency: int = 40


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """``alpha`` > 0 needs ``algo.estimator: comet_gdpo``. ``c_ref``: USD (number) or a
    ``cost_ref.json`` path (``routeweaver calibrate-cost``); "" = the reference C_ref."""

    alpha: float = 0.0
    c_ref: str = ""
    code_scorer: Literal["union", "final"] = "union"
    score_workers: int = 4


@dataclasses.dataclass(frozen=True)
class AlgoSection:
    """Estimator and curriculum. ``support`` turns the minimum-support loss on (weight
    ``exploration.support_lambda0 · ρ_b``, floor ``exploration.support_floor``);
    ``mode_score_span`` which declaration tokens it scores."""

    estimator: Literal["grpo_gated", "comet_grpo", "comet_gdpo"] = "comet_grpo"
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    exploration: ExplorationConfig = dataclasses.field(default_factory=ExplorationConfig)
    support: bool = True
    mode_score_span: Literal["content", "full"] = "content"
    support_max_prompt: int = 2048


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Policy params every step (what the sampler loads; the last ``keep_policy`` kept) and
    the full train state every ``full_every`` steps and at the end. ``resume``: continue from
    the latest full state in the run directory."""

    full_every: int = 10
    keep_policy: int = 2
    keep_full: int = 2
    resume: bool = True


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    jsonl: bool = True
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True
    summary_window: int = 10


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run. ``out_dir`` receives config.yaml, metrics.jsonl, tb/, checkpoints/, plots.
    ``first_step`` is the step number of the first batch (``batch_index = step − 1``).
    ``deterministic``: reseed the sampler per step so a resumed run repeats exactly."""

    name: str = "run"
    out_dir: str = "runs/run"
    seed: int = 0
    steps: int = 90
    deterministic: bool = True
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    workers: WorkersSection = dataclasses.field(default_factory=WorkersSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    algo: AlgoSection = dataclasses.field(default_factory=AlgoSection)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)


def check_train_config(cfg: TrainConfig, source: str = "<config>") -> None:
    """Cross-field rules; raises ConfigError naming the keys."""
    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{source}: {key}: {msg}")

    if cfg.steps < 1:
        fail("steps", f"must be >= 1, got {cfg.steps}")
    if cfg.reward.alpha > 0 and cfg.algo.estimator != "comet_gdpo":
        fail("reward.alpha", f"alpha={cfg.reward.alpha} > 0 needs algo.estimator: comet_gdpo")
    if cfg.data.quotas and sum(cfg.data.quotas.values()) != cfg.data.batch_size:
        fail("data.quotas", f"sum {sum(cfg.data.quotas.values())} != data.batch_size "
                            f"{cfg.data.batch_size}")
    if cfg.data.group_size < 1 or cfg.data.batch_size < 1:
        fail("data.group_size", "batch_size and group_size must be >= 1")
    if cfg.rollout.answer_choices and not cfg.rollout.constrained:
        fail("rollout.answer_choices", "needs rollout.constrained: true")
    if cfg.checkpoint.full_every < 1 or cfg.checkpoint.keep_policy < 1:
        fail("checkpoint.full_every", "full_every and keep_policy must be >= 1")
    default_loss = LossConfig()
    for name in ("support_lambda0", "support_floor"):
        if getattr(cfg.algo.loss, name) != getattr(default_loss, name):
            fail(f"algo.loss.{name}", f"set algo.exploration.{name} instead (the curriculum "
                 "owns the support schedule λ_b = λ0·ρ_b; the loss takes it from there)")
    if cfg.model.init != "random" and cfg.model.random:
        fail("model.random", "only used with model.init: random")


def load_train_config(path: str | os.PathLike[str] | None,
                      overrides: Sequence[str] = ()) -> TrainConfig:
    """YAML file (None: defaults) + ``key.sub=value`` overrides -> a checked TrainConfig."""
    cfg = load_config(TrainConfig, path, overrides)
    check_train_config(cfg, str(path) if path is not None else "<defaults>")
    return cfg
