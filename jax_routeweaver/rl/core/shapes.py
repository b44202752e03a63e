"""Padded sizes of the learner's arrays: a few compiled shapes per run instead of one per
batch (rows and lengths change every step)."""

from __future__ import annotations


def length_bucket(n: int, minimum: int = 64) -> int:
    """The smallest of ``minimum·2^k`` and ``1.5·minimum·2^k`` that holds ``n``: a handful of
    compiled shapes per run (lengths change every step), at most 50% padding."""
    size = minimum
    while True:
        if n <= size:
            return size
        if n <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` >= max(n, 1)."""
    return -(-max(n, 1) // multiple) * multiple

