"""The sampling half of one decode step, shared by the dense engine (`dense_steps`) and the
paged engine (`paged_engine`): next-token logits -> each row's token and logprob under its
grammar, whether it stopped, and its place in a choice trie. The engines differ only in how
they run the model on the token (a dense KV cache, or pages) and in their state.

`args` is either engine's runtime knobs (`dense_steps.SampleArgs`, `paged_scheduler.StepArgs`):
``temperature``, ``top_k``, ``top_p``, ``stop_ids``, ``allowed`` and the ``choice_*`` tables.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_routeweaver.sampling.constraints import unpack_bitmask
from jax_routeweaver.sampling.sample_ops import (
    choice_advance,
    choice_mask,
    sample_logits,
    stop_token_mask,
)


class StepMasks(NamedTuple):
    """What a decode loop computes once before its steps."""

    allowed: jax.Array | None  # [B, V] bool for grammar "mask", else None
    is_stop: jax.Array  # [V] bool: the stop tokens (a complete choice may end on one)


class Picked(NamedTuple):
    """One step's draw for rows `[B]`."""

    token: jax.Array  # [B] int32; pad where the row was done (it drew nothing)
    logprob: jax.Array  # [B] fp32; 0 where the row was done
    stopped: jax.Array  # [B] bool: it drew a stop token
    ended: jax.Array  # [B] bool: its choice trie completed without a stop token
    node: jax.Array  # [B] int32: its choice-trie node after the token (-1: unconstrained)


def step_masks(args: Any, vocab: int, grammar: str) -> StepMasks:
    """The masks of a decode loop: `args.allowed` unpacked to `[B, vocab]` when `grammar` is
    "mask", and the stop tokens as a `[vocab]` mask (-1 padding dropped)."""
    allowed = unpack_bitmask(args.allowed, vocab) if grammar == "mask" else None
    return StepMasks(allowed, stop_token_mask(args.stop_ids, vocab))


def pick_next(logits: jax.Array, keys: jax.Array, done: jax.Array, node: jax.Array,
              args: Any, masks: StepMasks, *, pad: int, greedy: bool, truncate: str,
              grammar: str) -> Picked:
    """Draw each row's next token from `logits` `[B, V]` with its own key `keys` `[B]`.

    grammar "none": unconstrained; "mask": `masks.allowed`; "choice": the tries in `args`
    from each row's `node` `[B]`. Rows already `done` `[B]` draw nothing (pad, logprob 0)."""
    mask = masks.allowed
    if grammar == "choice":
        mask, kids, at = choice_mask(node, args.choice_token, args.choice_stop, masks.is_stop)
    tok, lp = sample_logits(logits, keys, args.temperature, args.top_k, args.top_p,
                            greedy=greedy, truncate=truncate, allowed=mask)
    active = ~done
    tok = jnp.where(active, tok, pad)
    lp = jnp.where(active, lp, 0.0)
    hit = active & jnp.any(tok[:, None] == args.stop_ids[None, :], axis=-1)
    ended = jnp.zeros_like(hit)
    if grammar == "choice":
        node, ended = choice_advance(node, tok, active, kids, at, args.choice_child,
                                     args.choice_end)
    return Picked(tok, lp, hit, ended, node)
