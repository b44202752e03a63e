"""Shape buckets of the dense path: what a group of prompts pads to, and where a `generate`
call is cut into groups.

Bucketing (so similar calls reuse compiled code): a group of prompts is left-padded to the
smallest `prompt_buckets` entry (empty: `DEFAULT_PROMPT_BUCKETS`) >= its longest prompt (P) and
to the smallest `batch_buckets` entry >= its size (B; filler rows are one-token dummies, done
from the start, whose output is dropped). A call's prompts are sorted by length and cut into
such groups where the padding saved pays for one more group, or for a shape this sampler has
not compiled yet (`length_groups`). The KV cache has P + N slots, N =
`new_token_bucket(max_new_tokens)` (a power of two, at least 16).
Compiled code depends only on (B, P, N, greedy, truncated sampling) and the weights'
shapes/shardings; temperature, top-k, top-p, max_new_tokens, stop tokens (padded to a
power-of-two count) and the RNG key are runtime values. A prompt longer than the largest
prompt bucket pads to a multiple of it. On a mesh only batch buckets divisible by the batch
shards are used. Every row samples from its own stream (the call's key folded with the row's
index in the call), so its tokens depend neither on the other rows nor on the cut.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set

import numpy as np

# Steps of 1.5x and 2x from 256 on: a prompt pads by at most half its length, not all of it
# (prefill attention grows with the square of the padded length), for a few more compiles.
DEFAULT_PROMPT_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_NEW_TOKEN_BUCKET = 16
# What one more group of a `generate` call costs, in padded prompt tokens: its own prefill and
# decode dispatches.
GROUP_COST = 2048
# What a group of a (batch, prompt) bucket pair not compiled yet costs on top: its prefill and
# decode compiles (~2.4 s for the quickstart's router on 2 cores, about 100k padded tokens of
# prefill). Less than that, since a shape compiled now is reused later: replaying a
# quickstart run's 422 calls, any value from 16k on kept 22 shapes instead of 49, for 54 s of
# compiles instead of 119 s and 14 s more execution (bench/RESULTS.md).
NEW_SHAPE_COST = 16384


def new_token_bucket(max_new_tokens: int) -> int:
    """Static decode length for `max_new_tokens`: the next power of two, at least 16."""
    return max(MIN_NEW_TOKEN_BUCKET, 1 << (max_new_tokens - 1).bit_length())


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def length_groups(lengths: Sequence[int], prompt_buckets: Sequence[int],
                  batch_buckets: Sequence[int], group_cost: int = GROUP_COST,
                  compiled: Set[tuple[int, int]] = frozenset(), new_shape_cost: int = 0
                  ) -> list[int]:
    """Cut rows sorted by length (`lengths` ascending) into consecutive groups: the ends of the
    groups (the last is `len(lengths)`).

    The cut minimises sum over groups of B x P + `group_cost` (+ `new_shape_cost` when (B, P)
    is not in `compiled`), B and P the group's batch and prompt buckets (B x P: its padded
    tokens, filler rows included); no group exceeds the largest batch bucket. Dynamic
    programming over the cut points, O(n x largest batch bucket).
    """
    n, largest = len(lengths), max(batch_buckets)
    batch_of = [pick_bucket(k, batch_buckets) for k in range(min(n, largest) + 1)]
    best = [0] + [math.inf] * n  # best[j]: cheapest cut of the first j rows
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        length = pick_bucket(lengths[j - 1], prompt_buckets)
        for i in range(max(0, j - largest), j):
            batch = batch_of[j - i]
            cost = best[i] + batch * length + group_cost
            if (batch, length) not in compiled:
                cost += new_shape_cost
            if cost < best[j]:
                best[j], start[j] = cost, i
    ends = [n]
    while start[ends[-1]] > 0:
        ends.append(start[ends[-1]])
    return ends[::-1]


def left_pad(prompts: Sequence[Sequence[int]], batch: int, length: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Left-pad prompts into `[batch, length]` arrays: tokens, mask, positions, plus lengths [B].

    Rows past `len(prompts)` are one-token dummies (`pad_id`) so every row has a real token.
    Positions count real tokens only (`cumsum(mask) - 1`, 0 on padding), as in HF.
    """
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    lens = np.ones((batch,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p):] = p
        mask[i, length - len(p):] = True
        lens[i] = len(p)
    mask[len(prompts):, -1] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions, lens


def check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    """`buckets` sorted, without duplicates; ValueError naming `name` unless they are a
    non-empty set of positive ints."""
    out = tuple(sorted(set(int(b) for b in buckets)))
    if not out or out[0] < 1:
        raise ValueError(f"{name}={tuple(buckets)} must be a non-empty set of positive ints")
    return out
