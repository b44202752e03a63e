"""COMET-GRPO policy losses as pure functions of per-token log-probabilities.

Nothing here runs a model: the trainer produces ``logp [B, T]`` (and, once per step,
``old_logp`` / ``ref_logp``) and hands them in. Shapes use B = rows (sequences) of one
micro-batch, T = response positions, Q = queries of a batch.

Reduction contract (Tunix-style; docs/algorithm.md, "Reductions")
-----------------------------------------------------------------
Every loss returns :class:`WeightedSum` parts ``(total, denom, coef)``: ``total`` is an
*unreduced* masked sum over the tokens of this call, ``denom`` is the count it is divided
by and ``coef`` a fixed weight. :func:`combine` turns parts into the scalar
``Σ_k coef_k · total_k / max(denom_k, 1)``.

Denominators are **mini-batch-global** token counts, fixed before the mini-batch is split
into micro-batches (the trainer counts them over the whole mini-batch's host arrays, so no
cross-device sum is needed), exactly as verl does for the segment reduction: see
:func:`segment_counts`. Totals are additive, so for any split of a mini-batch into
micro-batches

    combine(parts(full batch)) == Σ_mb combine(parts(mb)) == combine(accumulate(parts_mb))

and the same holds for gradients, which is what makes micro-batching exact. When no
counts are passed, the denominators are the counts of the call's own tokens (correct for a
single full-batch call, and what :func:`ppo_dual_clip` / :func:`kl_loss` report stand-alone).
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0  # |log π − log π_old| and |log π_ref − log π| clamp (verl)
KL_VALUE_CLAMP = 10.0  # low_var_kl value clamp to [−10, 10] (verl)
SUPPORT_EPS = 1e-12  # log(π̄_m + eps) in the minimum-support loss
MODES = ("single", "multi", "agentic")


class WeightedSum(NamedTuple):
    """One loss term: contributes ``coef · total / max(denom, 1)`` to the objective.

    A pytree (NamedTuple), so it passes through ``jit`` / ``grad`` / ``psum`` unchanged.
    """

    total: jax.Array
    denom: jax.Array
    coef: float = 1.0

    def value(self) -> jax.Array:
        """``total / max(denom, 1)`` without the coefficient (for metrics)."""
        return self.total / jnp.maximum(self.denom, 1.0)


class SegmentCounts(NamedTuple):
    """Mini-batch-global token counts for the segment reduction (docs/algorithm.md,
    "Reductions").

    ``n_mode``: policy tokens of the selector span on free rows; ``n_inner`` = ``n_tokens``
    − ``n_mode``; ``n_tokens``: every response token (dirty rows included, as the original
    implementation counts them).
    """

    n_mode: jax.Array
    n_inner: jax.Array
    n_tokens: jax.Array


Parts = dict[str, WeightedSum]


# --------------------------------------------------------------------------- helpers


def _as_float_mask(mask: jax.Array) -> jax.Array:
    return (jnp.asarray(mask) > 0).astype(jnp.float32)


def _masked(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x`` where mask else 0, with zero (not NaN) gradient through padded positions."""
    return jnp.where(mask > 0, x, 0.0)


def combine(parts: Parts | list[Parts] | tuple[Parts, ...]) -> jax.Array:
    """Scalar objective ``Σ_k coef_k · total_k / max(denom_k, 1)``.

    ``parts`` is one mapping name → :class:`WeightedSum`, or a sequence of them (one per
    micro-batch), which is first reduced with :func:`accumulate`.
    """
    if not hasattr(parts, "items"):
        parts = accumulate(parts)
    out = jnp.zeros((), jnp.float32)
    for part in parts.values():
        out = out + part.coef * part.value()
    return out


def accumulate(parts_list: list[Parts] | tuple[Parts, ...]) -> dict[str, WeightedSum]:
    """Sum the totals of per-micro-batch parts; denominators are global and shared.

    All micro-batches must carry the same keys and the same (global) denominators and
    coefficients; the first one's are kept.
    """
    if not parts_list:
        raise ValueError("accumulate needs at least one set of parts")
    first = parts_list[0]
    out: dict[str, WeightedSum] = {}
    for key, part in first.items():
        total = part.total
        for other in parts_list[1:]:
            if key not in other:
                raise KeyError(f"micro-batch parts disagree on key {key!r}")
            total = total + other[key].total
        out[key] = WeightedSum(total, part.denom, part.coef)
    return out


# --------------------------------------------------------------------------- PPO


def ppo_token_losses(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """verl ``vanilla`` policy loss per token (docs/algorithm.md, "PPO dual clip"), no
    masking.

    Args: ``logp [B, T]`` current policy, ``old_logp [B, T]`` behaviour policy,
    ``advantages [B, T]`` (or ``[B, 1]`` broadcast).

    Returns ``(loss [B, T], clipped [B, T], dual_clipped [B, T], log_ratio [B, T])``:
    ``ρ = exp(clamp(logp − old_logp, ±20))``,
    ``ℓ = max(−A·ρ, −A·clip(ρ, 1−clip_low, 1+clip_high))`` and for ``A < 0``
    ``ℓ = min(ℓ, −A·clip_c)``. ``clipped`` marks where the clipped branch is strictly
    larger, ``dual_clipped`` where the dual clip bites (both as verl's clip fractions).
    """
    if clip_c <= 1.0:
        raise ValueError(f"dual-clip constant must be > 1, got {clip_c}")
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    adv = jnp.broadcast_to(advantages, logp.shape)
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_loss = jnp.maximum(loss1, loss2)
    loss3 = -adv * clip_c
    negative = adv < 0
    loss = jnp.where(negative, jnp.minimum(loss3, clipped_loss), clipped_loss)
    clipped = (loss2 > loss1).astype(jnp.float32)
    dual_clipped = ((clipped_loss > loss3) & negative).astype(jnp.float32)
    return loss, clipped, dual_clipped, log_ratio


def ppo_dual_clip(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[WeightedSum, dict[str, WeightedSum]]:
    """Masked PPO dual-clip loss of one (micro-)batch.

    Args: ``logp, old_logp [B, T]``; ``advantages [B, T]`` or ``[B, 1]``; ``mask [B, T]``
    (bool or 0/1: the tokens the loss is taken over).

    Returns ``(WeightedSum(Σ_mask ℓ, n_mask), metrics)``; metrics are ``WeightedSum``s over
    the same tokens: ``pg_clipfrac``, ``pg_clipfrac_lower`` (dual clip) and ``ppo_kl``
    (mean of ``old_logp − logp``, verl's approx KL). Padded positions may hold any finite
    or non-finite values; they get zero loss and zero gradient.
    """
    chex.assert_rank([logp, old_logp, mask], 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    chex.assert_rank(advantages, 2)
    chex.assert_equal(advantages.shape[0], logp.shape[0])
    m = _as_float_mask(mask)
    logp_s = _masked(logp, m)
    old_s = _masked(old_logp, m)
    adv_s = _masked(jnp.broadcast_to(advantages, logp.shape), m)
    loss, clipped, dual, log_ratio = ppo_token_losses(
        logp_s, old_s, adv_s, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c
    )
    n = m.sum()
    metrics = {
        "pg_clipfrac": WeightedSum((clipped * m).sum(), n),
        "pg_clipfrac_lower": WeightedSum((dual * m).sum(), n),
        "ppo_kl": WeightedSum(jax.lax.stop_gradient(-(log_ratio * m).sum()), n),
    }
    return WeightedSum((loss * m).sum(), n), metrics


# --------------------------------------------------------------------------- KL / entropy


def low_var_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """verl ``low_var_kl`` (k3) per token: ``d = clamp(ref − logp, ±20)``,
    ``kl = clamp(e^d − d − 1, −10, 10)``. ``logp, ref_logp [B, T]`` → ``kl [B, T]`` ≥ 0.
    """
    chex.assert_equal_shape([logp, ref_logp])
    d = jnp.clip(ref_logp - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(d) - d - 1.0, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def kl_loss(
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    *,
    beta: float = 0.001,
    denom: jax.Array | None = None,
) -> WeightedSum:
    """``β · token-mean(k3)``: ``WeightedSum(Σ_mask kl, denom or n_mask, coef=β)``.

    ``logp, ref_logp, mask [B, T]``; ``denom`` is the global token count (docs/algorithm.md,
    "KL to the reference (k3)": KL keeps one reduction over the clean response mask with the
    global ``batch_num_tokens``).
    """
    chex.assert_rank([logp, ref_logp, mask], 2)
    chex.assert_equal_shape([logp, ref_logp, mask])
    m = _as_float_mask(mask)
    kl = low_var_kl(_masked(logp, m), _masked(ref_logp, m))
    n = m.sum() if denom is None else jnp.asarray(denom, jnp.float32)
    return WeightedSum((kl * m).sum(), n, beta)


def entropy_loss(
    entropy: jax.Array,
    mask: jax.Array,
    *,
    coef: float = 0.0,
    denom: jax.Array | None = None,
) -> WeightedSum:
    """Entropy bonus as a loss, ``−coef · token-mean(H)``. ``entropy, mask [B, T]``.

    The paper runs use ``coef = 0`` (docs/algorithm.md, "Entropy bonus"); the trainer then
    computes no entropies and leaves the term out.
    """
    chex.assert_rank([entropy, mask], 2)
    chex.assert_equal_shape([entropy, mask])
    m = _as_float_mask(mask)
    n = m.sum() if denom is None else jnp.asarray(denom, jnp.float32)
    return WeightedSum((_masked(entropy, m) * m).sum(), n, -coef)


# --------------------------------------------------------------------------- reductions


def segment_counts(response_mask: jax.Array, mode_mask: jax.Array) -> SegmentCounts:
    """Token counts of a mini-batch (the trainer passes the whole mini-batch's masks; counts
    of parts of it would have to be summed before use).

    ``response_mask, mode_mask [B, T]``. Dirty rows are counted, as the original
    implementation does (docs/algorithm.md, "Reductions"); the mode count is taken inside the
    response mask. Clamping to ≥ 1 happens at division.
    """
    chex.assert_rank([response_mask, mode_mask], 2)
    chex.assert_equal_shape([response_mask, mode_mask])
    resp = _as_float_mask(response_mask)
    mode = _as_float_mask(mode_mask) * resp
    n_tokens = resp.sum()
    n_mode = mode.sum()
    return SegmentCounts(n_mode, n_tokens - n_mode, n_tokens)


def policy_loss_parts(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    mode_mask: jax.Array | None = None,
    clean: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    counts: SegmentCounts | None = None,
    reduction: str = "segment",
    kl_coef: float = 0.001,
    entropy_coef: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[dict[str, WeightedSum], dict[str, WeightedSum]]:
    """All policy-side loss parts of one micro-batch (docs/algorithm.md, "The policy loss").

    Args:
      logp, old_logp, response_mask: ``[B, T]``; ``advantages [B, T]`` per-token
        (``A_mode`` on mode tokens, ``A_inner`` elsewhere, as the estimator assigned them).
      mode_mask: ``[B, T]`` selector-span tokens of free rows (docs/algorithm.md, "Token
        advantages and the mode-token mask"); None = all zero.
      clean: ``[B]`` clean-row flag; dirty rows drop out of every policy-gradient numerator
        but stay in the denominators; the KL and entropy parts drop them with
        ``"segment"`` and keep them with ``"global"`` (docs/algorithm.md, "Reductions").
        None = all clean.
      ref_logp: ``[B, T]`` frozen reference; None = no KL part.
      entropy: ``[B, T]`` per-token entropies; None = no entropy part.
      counts: mini-batch-global :class:`SegmentCounts`; None = this call's own counts.
      reduction: ``"segment"`` (``Σ_mode ℓ / N_mode + Σ_inner ℓ / N_inner``) or
        ``"global"`` (one token-mean ``Σ ℓ / N_tokens``; cold start and ablations).

    Returns ``(parts, metrics)``: parts ``pg_mode``/``pg_inner`` (segment) or ``pg``
    (global), plus ``kl`` and ``entropy`` when given; :func:`combine` gives the loss.
    """
    chex.assert_rank([logp, old_logp, response_mask], 2)
    chex.assert_equal_shape([logp, old_logp, response_mask])
    chex.assert_rank(advantages, 2)
    b = logp.shape[0]
    if mode_mask is None:
        mode_mask = jnp.zeros(logp.shape, jnp.float32)
    chex.assert_equal_shape([mode_mask, logp])
    if clean is None:
        clean = jnp.ones((b,), jnp.float32)
    chex.assert_shape(clean, (b,))
    if reduction not in ("segment", "global"):
        raise ValueError(f"reduction must be 'segment' or 'global', got {reduction!r}")
    if counts is None:
        counts = segment_counts(response_mask, mode_mask)

    resp = _as_float_mask(response_mask)
    row = _as_float_mask(clean)[:, None]
    mode = _as_float_mask(mode_mask) * resp
    loss_mask = resp * row
    ppo_kwargs = dict(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c)

    parts: dict[str, WeightedSum] = {}
    if reduction == "segment":
        pg_mode, _ = ppo_dual_clip(logp, old_logp, advantages, mode * row, **ppo_kwargs)
        pg_inner, _ = ppo_dual_clip(logp, old_logp, advantages, (resp - mode) * row, **ppo_kwargs)
        parts["pg_mode"] = WeightedSum(pg_mode.total, counts.n_mode)
        parts["pg_inner"] = WeightedSum(pg_inner.total, counts.n_inner)
    else:
        pg, _ = ppo_dual_clip(logp, old_logp, advantages, loss_mask, **ppo_kwargs)
        parts["pg"] = WeightedSum(pg.total, counts.n_tokens)
    # KL and entropy: the segment path reduces them over the clean rows; the global path
    # (verl's stock loss, whose gate only zeroes dirty rows' advantages) keeps every row.
    reg_mask = loss_mask if reduction == "segment" else resp
    if ref_logp is not None:
        parts["kl"] = kl_loss(logp, ref_logp, reg_mask, beta=kl_coef, denom=counts.n_tokens)
    if entropy is not None:
        parts["entropy"] = entropy_loss(
            entropy, reg_mask, coef=entropy_coef, denom=counts.n_tokens
        )

    _, raw = ppo_dual_clip(logp, old_logp, advantages, loss_mask, **ppo_kwargs)
    metrics = {k: WeightedSum(v.total, counts.n_tokens) for k, v in raw.items()}
    return parts, metrics


# --------------------------------------------------------------------------- support loss


def support_loss(
    mode_scores: jax.Array,
    *,
    rho: float | jax.Array,
    lambda0: float = 0.002,
    floor: float = 0.05,
) -> tuple[WeightedSum, dict[str, jax.Array]]:
    """Minimum-support loss over the batch's queries (docs/algorithm.md, "The minimum-support
    loss").

    Args: ``mode_scores [Q, 3]``: teacher-forced summed log-probs ``s_m`` of the three
    declarations (``single, multi, agentic``, content span) per query; ``rho`` the batch's
    forced ratio ρ_b.

    ``π_M(·|x) = softmax(s)`` per query, ``π̄ = mean over Q`` (mean of softmaxes),
    ``L = (1/3) Σ_m max(0, log δ − log(π̄_m + 1e-12))``; returned as
    ``WeightedSum(L, 1, coef=λ0·ρ_b)``. The trainer skips it when ``λ0·ρ_b ≤ 0``.
    ``L`` is not additive over queries, so it is computed on the whole batch of Q queries;
    use :func:`support_score_cotangent` to back-propagate through chunked scoring.
    """
    chex.assert_rank(mode_scores, 2)
    chex.assert_axis_dimension(mode_scores, 1, len(MODES))
    probs = jax.nn.softmax(mode_scores.astype(jnp.float32), axis=-1)
    pibar = probs.mean(axis=0)
    penalty = jnp.maximum(0.0, jnp.log(floor) - jnp.log(pibar + SUPPORT_EPS))
    loss = penalty.mean()
    lam = lambda0 * rho
    metrics: dict[str, jax.Array] = {
        "support/loss": loss,
        "support/lambda": jnp.asarray(lam, jnp.float32),
        "support/weighted_loss": lam * loss,
        "support/n_queries": jnp.asarray(mode_scores.shape[0], jnp.float32),
    }
    for i, name in enumerate(MODES):
        metrics[f"support/pibar_{name}"] = pibar[i]
        metrics[f"support/penalty_{name}"] = penalty[i]
    return WeightedSum(loss, jnp.ones((), jnp.float32), lam), metrics


def mode_probability_metrics(mode_scores: jax.Array, first_scores: jax.Array,
                             forced: jax.Array) -> dict[str, jax.Array]:
    """The policy's mode distribution from the support pass's teacher-forced scores
    (docs/algorithm.md, "The minimum-support loss"; docs/metrics.md, "Mode choice"), per query
    ``π_M(·|x) = softmax(s)`` as in :func:`support_loss`.

    Args: ``mode_scores [Q, 3]`` summed declaration log-probs; ``first_scores [Q, 3]`` the
    log-prob of each declaration's first scored token; ``forced [Q]`` which queries the
    curriculum forced this batch.

    Returns ``mode/pibar_all_{m}`` (π̄ over all queries), ``mode/entropy_mean`` (mean over
    queries of the entropy of π_M, nats), ``mode/pi1_{m}`` (mean over queries of the first
    token's probability: how likely the next token starts declaration m), and
    ``free/pi_{m}``, ``forced/pi_{m}`` (π̄ over the free / forced queries; NaN when there
    are none, which the trainer drops)."""
    chex.assert_shape([mode_scores, first_scores], (mode_scores.shape[0], len(MODES)))
    probs = jax.nn.softmax(mode_scores.astype(jnp.float32), axis=-1)
    entropy = -(probs * jnp.log(jnp.maximum(probs, SUPPORT_EPS))).sum(-1)
    first = jnp.exp(first_scores.astype(jnp.float32))
    forced = forced.astype(jnp.float32)[:, None]

    def arm_mean(weight: jax.Array) -> jax.Array:
        n = weight.sum()
        return jnp.where(n > 0, (probs * weight).sum(0) / jnp.maximum(n, 1.0), jnp.nan)

    arms = {"free": arm_mean(1.0 - forced), "forced": arm_mean(forced)}
    out = {"mode/entropy_mean": entropy.mean()}
    for i, name in enumerate(MODES):
        out[f"mode/pibar_all_{name}"] = probs[:, i].mean()
        out[f"mode/pi1_{name}"] = first[:, i].mean()
        for arm, pi in arms.items():
            out[f"{arm}/pi_{name}"] = pi[i]
    return out


def question_floor_loss(mode_scores: jax.Array, *, floor: float
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-question mode floor (docs/algorithm.md, "The per-question mode floor").

    ``mode_scores [Q, 3]`` as in :func:`support_loss`; ``π_M(·|x) = softmax(s)`` per query and
    ``L = mean_q (1/3) Σ_m max(0, log δ_q − log(π_M(m|x_q) + 1e-12))``: zero while every query
    gives every mode at least ``floor``. Unlike the support loss (a floor on the batch mean
    π̄), it keeps each mode sampled for each question, where a mode the policy dropped on a
    whole domain would otherwise never be tried there again. Returns ``(L, metrics)``
    (unweighted)."""
    chex.assert_rank(mode_scores, 2)
    chex.assert_axis_dimension(mode_scores, 1, len(MODES))
    probs = jax.nn.softmax(mode_scores.astype(jnp.float32), axis=-1)
    penalty = jnp.maximum(0.0, jnp.log(floor) - jnp.log(probs + SUPPORT_EPS))  # [Q, 3]
    loss = penalty.mean()
    metrics = {"floor/loss": loss, "floor/min_prob": probs.min(),
               "floor/below_share": (probs < floor).any(-1).mean()}
    return loss, metrics


def declaration_objective(mode_scores: jax.Array, *, rho: float | jax.Array,
                          lambda0: float = 0.002, floor: float = 0.05,
                          question_floor: float = 0.0, question_weight: float | jax.Array = 0.0
                          ) -> jax.Array:
    """The weighted declaration terms of a batch's ``mode_scores [Q, 3]``:
    ``λ0·ρ·L_support + w_q·L_floor``, the second only when ``question_floor`` > 0
    (``w_q`` = λ_q·(1 − ρ), `curriculum.question_floor_weight`)."""
    part, _ = support_loss(mode_scores, rho=rho, lambda0=lambda0, floor=floor)
    total = part.coef * part.value()
    if question_floor > 0:
        loss, _ = question_floor_loss(mode_scores, floor=question_floor)
        total = total + question_weight * loss
    return total


def support_score_cotangent(
    mode_scores: jax.Array,
    *,
    rho: float | jax.Array,
    lambda0: float = 0.002,
    floor: float = 0.05,
    question_floor: float = 0.0,
    question_weight: float | jax.Array = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """``(value, d value/ds [Q, 3])`` of :func:`declaration_objective` for the two-pass scheme
    (docs/algorithm.md, "The exact two-pass gradient"): score all chunks without gradients,
    get the exact cotangent here, then re-run each chunk's scoring under ``jax.vjp`` with its
    slice of the cotangent and sum the parameter gradients.
    """

    def weighted(s: jax.Array) -> jax.Array:
        return declaration_objective(s, rho=rho, lambda0=lambda0, floor=floor,
                                     question_floor=question_floor,
                                     question_weight=question_weight)

    value, grad = jax.value_and_grad(weighted)(mode_scores.astype(jnp.float32))
    return value, grad
