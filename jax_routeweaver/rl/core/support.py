"""The minimum-support loss's inputs and exact gradient (docs/algorithm.md, "The
minimum-support loss").

Every query of a batch is scored teacher-forced under each of the three declarations
(``selector prompt + <mode>m</mode>``): :func:`support_batch` lays those rows out in chunks on
the host, and :func:`support_gradient` turns the chunk scores into the gradient of
``λ0·ρ·L_support`` with one forward over all chunks and one VJP per chunk, so the memory of
a chunk, not of the whole batch, bounds the pass. The learner (`rl.learner.trainer`) supplies
how one chunk is scored (its model, temperature and sharding).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_routeweaver.rl.core import losses
from jax_routeweaver.rl.core.shapes import round_up

ChunkLogp = Callable[[Any, tuple[jax.Array, ...]], tuple[jax.Array, jax.Array]]
"""``(params, chunk) -> (logp [R, D], span [R, D])``: one chunk's declaration logprobs and
which of them are scored; ``chunk`` is ``(tokens, positions, mask, index, span[, options])``."""


class SupportBatch(NamedTuple):
    """Teacher-forced declarations for the support loss: rows ``selector prompt +
    <mode>m</mode>`` in chunks, ``tokens, positions, attention_mask [C, R, L]``;
    ``index [C, R, D]`` the declaration's positions and ``span [C, R, D]`` which of them are
    scored; ``query [C, R]`` / ``mode [C, R]`` which query and mode a row scores
    (``query = -1`` on padding rows). ``options [C, R, D, A]`` (or None): the tokens a
    constrained sampler could pick at each declaration position (-1 padded); with them a
    declaration is scored under that constraint (:func:`choice_logprobs`). ``forced [Q]``
    (or None: none): which queries the curriculum forced, for the ``free|forced/pi_*``
    metrics."""

    tokens: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    index: jax.Array
    span: jax.Array
    query: jax.Array
    mode: jax.Array
    options: jax.Array | None = None
    forced: jax.Array | None = None


def support_gradient(params: Any, sb: SupportBatch, rho: jax.Array, num_queries: int, *,
                     chunk_logp: ChunkLogp, lambda0: float, floor: float,
                     question_floor: float = 0.0, question_weight: float | jax.Array = 0.0
                     ) -> tuple[Any, dict[str, jax.Array]]:
    """Exact gradient of the declaration terms ``λ0·ρ·L_support + w_q·L_floor``
    (`losses.declaration_objective`; the floor only with ``question_floor`` > 0) through
    chunked teacher-forced scoring (docs/algorithm.md, "The exact two-pass gradient"):
    forward all chunks, the cotangent of the scores, then one VJP per chunk. Also returns
    the terms' metrics and the mode probabilities of the pass
    (`losses.mode_probability_metrics`)."""

    def chunk_scores(p: Any, chunk: tuple[jax.Array, ...]) -> jax.Array:
        lp, span = chunk_logp(p, chunk)
        return (lp * span).sum(-1)  # [R] summed declaration logprobs

    def chunk_both(chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        lp, span = chunk_logp(params, chunk)
        first = jax.nn.one_hot(jnp.argmax(span > 0, axis=-1), span.shape[-1])
        return (lp * span).sum(-1), (lp * first).sum(-1)  # [R] sum, first scored token

    chunks = (sb.tokens, sb.positions, sb.attention_mask, sb.index, sb.span)
    if sb.options is not None:
        chunks += (sb.options,)
    row_scores, row_first = jax.lax.map(chunk_both, chunks)  # [C, R] each
    scores = scatter_scores(row_scores, sb.query, sb.mode, num_queries)
    first = scatter_scores(row_first, sb.query, sb.mode, num_queries)
    _, cot = losses.support_score_cotangent(scores, rho=rho, lambda0=lambda0, floor=floor,
                                            question_floor=question_floor,
                                            question_weight=question_weight)
    row_cot = jnp.where(sb.query >= 0, cot[jnp.maximum(sb.query, 0), sb.mode], 0.0)

    def body(acc: Any, xs: tuple[Any, ...]) -> tuple[Any, None]:
        chunk, ct = xs[:-1], xs[-1]
        _, vjp = jax.vjp(lambda p: chunk_scores(p, chunk), params)
        (g,) = vjp(ct)
        return jax.tree.map(jnp.add, acc, g), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(body, zeros, (*chunks, row_cot))
    _, metrics = losses.support_loss(scores, rho=rho, lambda0=lambda0, floor=floor)
    if question_floor > 0:
        _, floor_metrics = losses.question_floor_loss(scores, floor=question_floor)
        metrics |= floor_metrics | {"floor/weight": jnp.asarray(question_weight, jnp.float32)}
    forced = jnp.zeros(num_queries, bool) if sb.forced is None else sb.forced
    metrics |= losses.mode_probability_metrics(scores, first, forced)
    return grads, metrics


def scatter_scores(row_scores: jax.Array, query: jax.Array, mode: jax.Array,
                    num_queries: int) -> jax.Array:
    """``[C, R]`` row scores -> ``[Q, 3]`` by (query, mode); padding rows (query −1) drop."""
    q = jnp.where(query >= 0, query, num_queries)  # out of range: dropped by .at[].add
    out = jnp.zeros((num_queries, len(losses.MODES)), jnp.float32)
    return out.at[q.reshape(-1), mode.reshape(-1)].add(row_scores.reshape(-1), mode="drop")


def support_batch(prompts: list[list[int]], declarations: list[list[int]], *, pad_id: int,
                  chunk: int = 12, span: str = "content", max_prompt: int = 2048,
                  length_multiple: int = 64, constrained: bool = False,
                  forced: Sequence[bool] | None = None) -> SupportBatch:
    """Host-side support rows: for each query prompt (its last ``max_prompt`` tokens) and
    each of the three declaration token lists, one row ``prompt + declaration``.

    ``span="content"`` scores declaration tokens ``3 … n−4`` (the mode word, assuming
    ``<mode>`` and ``</mode>`` are 3 tokens each, as the original); ``"full"`` all of them.
    ``constrained``: the sampler picks the declaration as a choice among exactly these token
    sequences (a ``Grammar.choice``), so each position is scored against the tokens that
    continue some declaration there (``SupportBatch.options``), not the whole vocabulary.
    Unconstrained, a two-token word (``ag`` + ``entic``) scores far below a one-token word
    for a model that the grammar lets pick it as often; the support term then pushes
    ``ag`` up long after the sampler already picks agentic everywhere. ``forced``: one flag
    per prompt, whether the curriculum forced that query (``SupportBatch.forced``).
    """
    if len(declarations) != len(losses.MODES):
        raise ValueError(f"need {len(losses.MODES)} declarations, got {len(declarations)}")
    if span not in ("content", "full"):
        raise ValueError(f"support span {span!r}: expected 'content' or 'full'")
    rows = []
    for q, prompt in enumerate(prompts):
        prompt = list(prompt)[-max_prompt:]
        for m, decl in enumerate(declarations):
            lo, hi = (3, len(decl) - 4) if span == "content" else (0, len(decl) - 1)
            if hi < lo:
                raise ValueError(f"declaration {decl} too short for span {span!r}")
            rows.append((prompt + list(decl), len(prompt), lo, hi, q, m))
    n = round_up(len(rows), chunk)
    length = round_up(max(len(r[0]) for r in rows), length_multiple)
    width = max(len(d) for d in declarations)
    tokens = np.full((n, length), pad_id, np.int32)
    mask = np.zeros((n, length), bool)
    index = np.ones((n, width), np.int32)
    span_m = np.zeros((n, width), np.float32)
    query = np.full(n, -1, np.int32)
    mode = np.zeros(n, np.int32)
    for i, (ids, start, lo, hi, q, m) in enumerate(rows):
        tokens[i, :len(ids)] = ids
        mask[i, :len(ids)] = True
        index[i] = np.minimum(start + np.arange(width), len(ids) - 1)
        span_m[i, lo:hi + 1] = 1.0
        query[i], mode[i] = q, m
    mask[len(rows):, 0] = True
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()
    options = None
    if constrained:
        # Default: the position's own token, alone (scores 0); declaration positions: the
        # tokens of every declaration sharing its prefix (the choice trie's branches).
        options = np.full((n, width, len(declarations)), -1, np.int32)
        options[..., 0] = np.take_along_axis(tokens, index, axis=1)
        per_mode = [_choice_options(declarations, m) for m in range(len(declarations))]
        for i, (_, _, _, _, _, m) in enumerate(rows):
            options[i, :len(declarations[m])] = per_mode[m]
    c = n // chunk
    shape = lambda a: jnp.asarray(a.reshape(c, chunk, *a.shape[1:]))
    if forced is not None and len(forced) != len(prompts):
        raise ValueError(f"{len(forced)} forced flags for {len(prompts)} prompts")
    return SupportBatch(shape(tokens), shape(positions), shape(mask), shape(index),
                        shape(span_m), shape(query), shape(mode),
                        None if options is None else shape(options),
                        None if forced is None else jnp.asarray(forced, bool))


def _choice_options(sequences: list[list[int]], k: int) -> np.ndarray:
    """``[len(sequences[k]), len(sequences)]``: at each position of sequence ``k``, the next
    tokens of every sequence with the same prefix (itself included), -1 padded."""
    seq = sequences[k]
    out = np.full((len(seq), len(sequences)), -1, np.int32)
    for j in range(len(seq)):
        nxt = sorted({s[j] for s in sequences if len(s) > j and list(s[:j]) == list(seq[:j])})
        out[j, :len(nxt)] = nxt
    return out
