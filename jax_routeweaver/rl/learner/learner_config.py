"""The learner's settings: the optimizer (`OptimConfig`) and the policy objective
(`LossConfig`), as the ``optim`` and ``algo.loss`` sections of a train config declare them."""

from __future__ import annotations

import dataclasses

from jax_routeweaver.config import bounded

REDUCTIONS = ("segment", "global")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW as verl runs it (docs/algorithm.md, "Optimizer"): lr 1e-6 set explicitly; betas,
    eps, weight decay 0.01 and grad-norm clip 1.0 are verl's defaults. ``warmup_steps`` > 0:
    linear warmup."""

    lr: float = bounded(1e-6, "(0, inf)")  # peak learning rate
    weight_decay: float = bounded(0.01, "[0, inf)")  # AdamW decoupled weight decay
    grad_clip: float = bounded(1.0, "[0, inf)")  # global grad-norm clip; 0 = off
    warmup_steps: int = bounded(0, "[0, inf)")  # optimizer steps
    b1: float = bounded(0.9, "[0, 1)")  # Adam first-moment decay
    b2: float = bounded(0.999, "[0, 1)")  # Adam second-moment decay
    eps: float = bounded(1e-8, "(0, inf)")  # Adam denominator epsilon
    # The trunk's learning rate as a multiple of lr: every weight but the output head (the
    # lm_head; with tied embeddings the embedding, which is the head); the head keeps lr.
    # 1 = one rate for all (the paper); below 1 the choice rows move before the states that
    # every question shares (`trainer.scale_groups`; docs/algorithm.md, "Optimizer").
    trunk_lr_scale: float = bounded(1.0, "(0, inf)")

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not self.trunk_lr_scale > 0:
            raise ValueError(f"optim.trunk_lr_scale={self.trunk_lr_scale} must be > 0")
        for name in ("weight_decay", "grad_clip", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Policy objective (docs/algorithm.md, "The policy loss"). ``micro_batch_size``: rows per
    micro-batch (0 = the whole mini-batch in one). ``ppo_mini_batches`` × ``ppo_epochs``
    optimizer steps per batch (the original: 1 × 1). ``support_chunk``: the declaration rows
    of docs/algorithm.md, "The minimum-support loss", scored per forward (their weights and
    floors are ``algo.exploration``'s, `rl.learner.curriculum.ExplorationConfig`; the support
    gradient joins every optimizer step, as the original's hook joins every backward).
    ``group_by_length``: micro-batches of length-sorted rows, each at its own length bucket
    (module docstring; verl's ``use_dynamic_bsz`` serves the same end by packing)."""

    # "segment": mode-declaration and other policy tokens each over their own count;
    # "global": all policy tokens over one count (docs/algorithm.md, "The policy loss")
    reduction: str = "segment"
    clip_low: float = bounded(0.2, "[0, 1)")  # ratio clipped below at 1 - clip_low
    clip_high: float = bounded(0.2, "[0, inf)")  # ratio clipped above at 1 + clip_high
    clip_c: float = bounded(3.0, "(1, inf)")  # dual-clip constant
    kl_coef: float = bounded(0.001, "[0, inf)")  # weight of the k3 KL to the reference; 0 = off
    entropy_coef: float = bounded(0.0, "[0, inf)")  # entropy bonus weight
    micro_batch_size: int = bounded(0, "[0, inf)")  # rows; 0 = the whole mini-batch
    support_chunk: int = bounded(12, "[1, inf)")  # rows per support forward
    ppo_mini_batches: int = bounded(1, "[1, inf)")
    ppo_epochs: int = bounded(1, "[1, inf)")
    group_by_length: bool = False

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"loss.reduction={self.reduction!r}: expected one of {REDUCTIONS}")
        if self.micro_batch_size < 0:
            raise ValueError(f"loss.micro_batch_size={self.micro_batch_size} must be >= 0")
        if self.support_chunk < 1:
            raise ValueError(f"loss.support_chunk={self.support_chunk} must be >= 1")
        if self.ppo_mini_batches < 1 or self.ppo_epochs < 1:
            raise ValueError(f"loss.ppo_mini_batches={self.ppo_mini_batches} and "
                             f"loss.ppo_epochs={self.ppo_epochs} must be >= 1")

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per batch."""
        return self.ppo_mini_batches * self.ppo_epochs
