"""Behaviour cloning of demonstrated episodes (`rl.run.demonstrations`) for the stand-in.

A demonstrated trajectory becomes one row ``prompt + response`` whose decision tokens (the
tokens its constrained sampler chose among several: ``policy_mask`` 1) are the targets. The
loss is their mean negative log-likelihood under the router's full next-token distribution,

    L_bc = - Σ_{rows, decisions} log π(token | prefix) / #decisions

so the router learns to execute each mode as demonstrated (roles, refs, the answer) while
the demonstrations' uniformly drawn modes and workers keep those choices near uniform.
Rows are packed once (`pack`), sorted by length and cut into batches of similar length
(`length_batches`), each padded only to its own bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_routeweaver.models.qwen3 import Qwen3, gathered_logprobs
from jax_routeweaver.rl.core.shapes import round_up
from jax_routeweaver.routing.episodes.episode import Trajectory

BUCKET = 512  # a batch's rows are padded to a multiple of this many tokens (few compiled shapes)


class Rows(NamedTuple):
    """Packed demonstrations (host arrays, N rows): ``tokens [N, L]`` int32 right-padded,
    ``mask [N, L]`` bool, ``index [N, P]`` the decision tokens' positions (1 where padded),
    ``valid [N, P]`` f32 which of them are real, ``lengths [N]`` each row's tokens."""

    tokens: np.ndarray
    mask: np.ndarray
    index: np.ndarray
    valid: np.ndarray
    lengths: np.ndarray

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The objective's arrays of ``rows``, cut to their longest row's `BUCKET`."""
        length = min(self.tokens.shape[1], round_up(int(self.lengths[rows].max()), BUCKET))
        return {"d_tokens": self.tokens[rows, :length], "d_mask": self.mask[rows, :length],
                "d_index": self.index[rows], "d_valid": self.valid[rows]}


def pack(trajectories: Sequence[Trajectory], pad_id: int) -> Rows:
    """`Rows` of the trajectories (ValueError when one has no decision token)."""
    lengths = np.asarray([len(t.prompt_ids) + len(t.response_ids) for t in trajectories])
    decisions = [np.flatnonzero(t.policy_mask) + len(t.prompt_ids) for t in trajectories]
    empty = [t.record.sample_id for t, d in zip(trajectories, decisions, strict=True)
             if not len(d)]
    if empty:
        raise ValueError(f"demonstrations without a decision token: {empty[:3]}")
    n, width = len(trajectories), max(len(d) for d in decisions)
    length = round_up(int(lengths.max()), BUCKET)
    tokens = np.full((n, length), pad_id, np.int32)
    mask = np.zeros((n, length), bool)
    index = np.ones((n, width), np.int32)
    valid = np.zeros((n, width), np.float32)
    for i, (t, d) in enumerate(zip(trajectories, decisions, strict=True)):
        tokens[i, :lengths[i]] = t.prompt_ids + t.response_ids
        mask[i, :lengths[i]] = True
        index[i, :len(d)], valid[i, :len(d)] = d, 1.0
    return Rows(tokens, mask, index, valid, lengths)


def length_batches(rows: Rows, subset: np.ndarray, batch: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """The rows of ``subset`` in batches of ``batch`` rows of similar length (sorted by
    length, then the batches shuffled); the last one is topped up with the shortest rows."""
    order = subset[np.argsort(rows.lengths[subset], kind="stable")]
    pad = (-len(order)) % batch
    order = np.concatenate([order, order[:pad]])
    batches = list(order.reshape(-1, batch))
    rng.shuffle(batches)
    return batches


def nll(model: Qwen3, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(Σ −log π(decision | prefix), #decisions)`` of a batch of `Rows.take` arrays."""
    tokens = batch["d_tokens"]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    logp = gathered_logprobs(model, tokens, positions, batch["d_mask"], batch["d_index"])
    return -(logp * batch["d_valid"]).sum(), batch["d_valid"].sum()


def loss(model: Qwen3, batch: dict[str, jax.Array]) -> jax.Array:
    """`L_bc` (module doc) of one batch."""
    total, count = nll(model, batch)
    return total / jnp.maximum(count, 1.0)
