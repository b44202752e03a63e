"""`PrefixStore`: the KV caches of a sampler's recent generate groups, found again by prompt.

A multi-turn episode's next prompt is its previous prompt + the completion it kept + the
environment's tokens, so most of its keys and values were computed by the previous call. The
store keeps the final cache of each recent group of rows (up to a byte budget, oldest evicted
first) and indexes every row's tokens (prompt + generated) by chained hashes of 16-token
blocks, as vLLM's automatic prefix caching does. `match` finds, for each new prompt, the
longest block-aligned prefix some stored row shares with it, all from one stored group (a
prefill reads one source cache). The caller must `clear` when the weights change: a cache
computed by other weights is not this policy's.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Group:
    """One stored group. `k`, `v`: its cache `[L, B, S, K, H]`; `tokens[r]` the token ids whose
    keys and values row r holds, at cache slots `start[r] .. start[r] + len(tokens[r])`."""

    k: Any
    v: Any
    tokens: tuple[np.ndarray, ...]
    start: tuple[int, ...]
    index: dict[int, int]  # chained block hash -> row

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes) + int(self.v.nbytes)


@dataclasses.dataclass(frozen=True)
class Match:
    """Where each prompt's reusable prefix lies in `group`: row `rows[i]`, slot `starts[i]`
    onwards, `lengths[i]` tokens (0: nothing reused, row and start then meaningless)."""

    group: Group
    rows: np.ndarray     # [n] int32
    starts: np.ndarray   # [n] int32
    lengths: np.ndarray  # [n] int32


def block_hashes(tokens: Sequence[int] | np.ndarray) -> list[int]:
    """Chained hashes of the full `BLOCK`-token blocks: hash i covers tokens[: (i+1) * BLOCK]."""
    out, h = [], 0
    arr = np.asarray(tokens, np.int64)
    for i in range(len(arr) // BLOCK):
        h = hash((h, arr[i * BLOCK:(i + 1) * BLOCK].tobytes()))
        out.append(h)
    return out


class PrefixStore:
    """Recent groups' caches within `max_bytes` (0 disables the store)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache budget {max_bytes} bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self._groups: OrderedDict[int, Group] = OrderedDict()
        self._next = 0
        self.hits = 0        # since the last clear: prompts that reused a prefix (`count`)
        self.reused = 0      # and the tokens whose keys and values they reused

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self._groups.values())

    def __len__(self) -> int:
        return len(self._groups)

    def clear(self) -> None:
        """Drop every group and zero the counters."""
        self._groups.clear()
        self.hits = self.reused = 0

    def add(self, k: Any, v: Any, tokens: Sequence[np.ndarray], start: Sequence[int]) -> None:
        """Keep a group's final cache; evicts the oldest groups to stay within the budget (a
        group larger than the budget is not kept)."""
        index: dict[int, int] = {}
        for r, row in enumerate(tokens):
            for h in block_hashes(row):
                index.setdefault(h, r)
        group = Group(k, v, tuple(np.asarray(t, np.int32) for t in tokens),
                      tuple(int(s) for s in start), index)
        if group.nbytes > self.max_bytes:
            return
        self._groups[self._next] = group
        self._next += 1
        while self.nbytes > self.max_bytes:
            self._groups.popitem(last=False)

    def match(self, prompts: Sequence[Sequence[int]]) -> Match | None:
        """The stored group that covers the most prompt tokens, and per prompt its prefix
        there (at most len - 1 tokens: the last prompt token must run to give the logits).
        None when no prompt shares a block with any stored row."""
        if not self._groups:
            return None
        hashes = [block_hashes(p) for p in prompts]
        best: tuple[int, Group, list[tuple[int, int]]] | None = None
        for group in reversed(self._groups.values()):  # newest first wins ties
            found = [_deepest(h, group.index) for h in hashes]
            total = sum(blocks for blocks, _ in found)
            if total and (best is None or total > best[0]):
                best = (total, group, found)
        if best is None:
            return None
        _, group, found = best
        n = len(prompts)
        rows, starts, lengths = (np.zeros(n, np.int32) for _ in range(3))
        for i, (blocks, row) in enumerate(found):
            if not blocks:
                continue
            prompt = np.asarray(prompts[i], np.int32)
            stored = group.tokens[row]
            length = min(_common_prefix(prompt, stored), len(prompt) - 1)
            rows[i], starts[i], lengths[i] = row, group.start[row], max(length, 0)
        return Match(group, rows, starts, lengths)

    def count(self, match: Match) -> None:
        """Add a match the caller used to `hits` and `reused`."""
        self.hits += int((match.lengths > 0).sum())
        self.reused += int(match.lengths.sum())


def _deepest(hashes: list[int], index: dict[int, int]) -> tuple[int, int]:
    """(blocks matched, row) for the longest chain of `hashes` found in `index`."""
    row, depth = 0, 0
    for d, h in enumerate(hashes):
        r = index.get(h)
        if r is None:
            break
        row, depth = r, d + 1
    return depth, row


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays (also guards against hash collisions)."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m
