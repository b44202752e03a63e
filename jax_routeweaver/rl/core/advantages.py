"""Advantage estimators: gated GRPO, COMET-GRPO and COMET-GDPO (docs/algorithm.md, "Advantages").

Pure, jittable functions over a flat batch of N trajectories of T response tokens.
Groups (queries, K rollouts each) are integer ids in ``[0, num_groups)``; ``num_groups``
must be static under ``jax.jit``. All group statistics use ``jax.ops.segment_sum``.

Per-row inputs (shapes in brackets):

- ``rewards [N]`` float: the task reward (sum of the token-level rewards).
- ``group_ids [N]`` int: the query a rollout belongs to.
- ``clean [N]`` bool: False for rows with a failed worker call or an infra failure; such
  rows leave the group statistics and get zero advantage (docs/algorithm.md, "Clean rows").
- ``forced [N]`` bool: the row's query was forced into a mode (never mixed within a group).
- ``mode_ids [N]`` int: executed mode, 0 single, 1 multi, 2 agentic, 3 invalid ("" mode,
  its own bucket). Values outside [0, 3] are clipped into [0, 3].
- ``mode_span_end [N]`` int: response tokens ``t < mode_span_end`` are mode tokens (free rows).
- ``response_mask [N, T]``: 1 on policy tokens, 0 on environment/padding tokens.

Host-side validation of the conditions the original raises on (groups mixing forced and
free rows, ``mode_span_end < 0`` on a free row) lives in :func:`validate_inputs`, since a
jitted function cannot raise on data.
"""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6
"""Estimator epsilon: the denominator is ``σ + ε``."""
GROUP_STD_THRESHOLD = 1e-4
"""Groups (|S| ≥ 2) whose Bessel std is strictly below this are zeroed."""
NUM_MODES = 4
"""Mode buckets: single, multi, agentic, invalid."""
MODE_SINGLE, MODE_MULTI, MODE_AGENTIC, MODE_INVALID = 0, 1, 2, 3


class Advantages(NamedTuple):
    """Estimator output.

    token_advantages [N, T] float32: per-token advantage (already × response_mask).
    a_mode [N]: per-row mode advantage (0 for forced rows, grpo_gated rows and dirty rows).
    a_inner [N]: per-row inner advantage (= a_grpo for forced / grpo_gated rows).
    a_grpo [N]: per-row plain group-normalised advantage (a_mode + a_inner for GDPO).
    """

    token_advantages: jax.Array
    a_mode: jax.Array
    a_inner: jax.Array
    a_grpo: jax.Array


class _GroupStats(NamedTuple):
    mean: jax.Array  # [G] μ (0 for singleton groups)
    denom: jax.Array  # [G] σ + ε (1 + ε for singleton groups)
    active: jax.Array  # [G] bool: at least one survivor and not zero-variance gated


def _group_stats(values, group_ids, survivors, num_groups, eps, std_threshold) -> _GroupStats:
    """μ, σ+ε and the gate of each group over its survivors (docs/algorithm.md, "Group
    statistics and the zero-variance gate").

    values [N] float32, group_ids [N] int32, survivors [N] bool.
    """
    s = survivors.astype(jnp.float32)
    v = jnp.where(survivors, values, 0.0)  # dirty values (even NaN/inf) never enter a sum
    count = jax.ops.segment_sum(s, group_ids, num_segments=num_groups)
    total = jax.ops.segment_sum(v, group_ids, num_segments=num_groups)
    raw_mean = total / jnp.maximum(count, 1.0)
    dev = jnp.where(survivors, values - raw_mean[group_ids], 0.0)
    sq = jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups)
    std = jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0))  # Bessel (ddof=1), torch.std
    singleton = count == 1.0
    mean = jnp.where(singleton, 0.0, raw_mean)
    std = jnp.where(singleton, 1.0, std)
    gated = (count >= 2.0) & (std < std_threshold)
    active = (count >= 1.0) & ~gated
    return _GroupStats(mean=mean, denom=std + eps, active=active)


def _mode_means(values, group_ids, mode_ids, survivors, num_groups):
    """μ_{m_i}: mean of ``values`` over the survivors of row i's (group, mode) bucket. [N]."""
    bucket = group_ids * NUM_MODES + mode_ids
    n_buckets = num_groups * NUM_MODES
    s = survivors.astype(jnp.float32)
    v = jnp.where(survivors, values, 0.0)
    count = jax.ops.segment_sum(s, bucket, num_segments=n_buckets)
    total = jax.ops.segment_sum(v, bucket, num_segments=n_buckets)
    return (total / jnp.maximum(count, 1.0))[bucket]


class _RowAdvantages(NamedTuple):
    a_mode: jax.Array
    a_inner: jax.Array
    a_grpo: jax.Array


def _decompose(values, group_ids, survivors, free, mode_ids, num_groups, eps, std_threshold):
    """Per-row (A_mode, A_inner, A_grpo) of one reward component (docs/algorithm.md,
    "COMET-GRPO").

    Free rows: A_mode = (μ_m − μ)/(σ+ε), A_inner = (r − μ_m)/(σ+ε).
    Forced rows: A_mode = 0, A_inner = A_grpo = (r − μ)/(σ+ε).
    Non-survivors and rows of skipped / gated groups: all zero.
    """
    stats = _group_stats(values, group_ids, survivors, num_groups, eps, std_threshold)
    keep = survivors & stats.active[group_ids]
    mu = stats.mean[group_ids]
    denom = stats.denom[group_ids]
    mu_m = _mode_means(values, group_ids, mode_ids, survivors, num_groups)
    safe_values = jnp.where(survivors, values, 0.0)
    a_grpo = jnp.where(keep, (safe_values - mu) / denom, 0.0)
    a_mode = jnp.where(keep & free, (mu_m - mu) / denom, 0.0)
    a_inner = jnp.where(free, jnp.where(keep, (safe_values - mu_m) / denom, 0.0), a_grpo)
    return _RowAdvantages(a_mode=a_mode, a_inner=a_inner, a_grpo=a_grpo)


def _token_advantages(a_mode, a_inner, free, mode_span_end, response_mask):
    """[N, T]: A_mode on free rows' tokens t < mode_span_end, A_inner elsewhere, × mask
    (docs/algorithm.md, "Token advantages and the mode-token mask")."""
    t = jnp.arange(response_mask.shape[1], dtype=jnp.int32)[None, :]
    is_mode_tok = free[:, None] & (t < mode_span_end[:, None])
    adv = jnp.where(is_mode_tok, a_mode[:, None], a_inner[:, None])
    return adv * response_mask.astype(jnp.float32)


def mode_token_mask(forced, mode_span_end, response_mask):
    """Mode-token mask [N, T] bool: free row, ``t < mode_span_end``, response token
    (docs/algorithm.md, "Token advantages and the mode-token mask")."""
    t = jnp.arange(response_mask.shape[1], dtype=jnp.int32)[None, :]
    free = ~jnp.asarray(forced, bool)
    span = jnp.asarray(mode_span_end, jnp.int32)
    return free[:, None] & (t < span[:, None]) & (jnp.asarray(response_mask) != 0)


def _check_rows(rewards, group_ids, clean, response_mask):
    chex.assert_rank(rewards, 1)
    chex.assert_rank(response_mask, 2)
    chex.assert_equal_shape_prefix([rewards, group_ids, clean, response_mask], 1)
    chex.assert_type(rewards, float)
    chex.assert_type(group_ids, int)
    chex.assert_type(clean, bool)


def _check_mode_rows(rewards, forced, mode_ids, mode_span_end):
    chex.assert_equal_shape([rewards, forced, mode_ids, mode_span_end])
    chex.assert_type(forced, bool)
    chex.assert_type([mode_ids, mode_span_end], int)


def grpo_gated(
    rewards: jax.Array,
    group_ids: jax.Array,
    clean: jax.Array,
    response_mask: jax.Array,
    *,
    num_groups: int,
    eps: float = EPS,
    std_threshold: float = GROUP_STD_THRESHOLD,
) -> Advantages:
    """Gated GRPO (docs/algorithm.md, "grpo_gated"): one advantage per row on every response
    token.

    rewards [N] float, group_ids [N] int in [0, num_groups), clean [N] bool,
    response_mask [N, T]. Statistics over clean members only (singleton: mean 0 / std 1),
    groups with Bessel std < ``std_threshold`` zeroed, dirty rows zeroed.
    Returns ``Advantages`` with a_mode = 0 and a_inner = a_grpo. ``num_groups`` is static.
    """
    _check_rows(rewards, group_ids, clean, response_mask)
    rewards = rewards.astype(jnp.float32)
    group_ids = group_ids.astype(jnp.int32)
    everything_forced = jnp.zeros_like(clean)
    rows = _decompose(rewards, group_ids, clean, everything_forced, jnp.zeros_like(group_ids),
                      num_groups, eps, std_threshold)
    tokens = rows.a_grpo[:, None] * response_mask.astype(jnp.float32)
    return Advantages(tokens, rows.a_mode, rows.a_inner, rows.a_grpo)


def comet_grpo(
    rewards: jax.Array,
    group_ids: jax.Array,
    clean: jax.Array,
    forced: jax.Array,
    mode_ids: jax.Array,
    mode_span_end: jax.Array,
    response_mask: jax.Array,
    *,
    num_groups: int,
    eps: float = EPS,
    std_threshold: float = GROUP_STD_THRESHOLD,
    debug: bool = False,
) -> Advantages:
    """COMET-GRPO (docs/algorithm.md, "COMET-GRPO").

    rewards [N] float, group_ids [N] int, clean [N] bool, forced [N] bool, mode_ids [N] int
    (0..3, 3 = invalid), mode_span_end [N] int, response_mask [N, T].

    Forced rows: plain GRPO ``(r − μ)/(σ+ε)`` on all response tokens. Free rows: A_mode on
    tokens ``t < mode_span_end``, A_inner on the rest (one σ per group, mode means μ_m over
    the survivors of the same executed mode). ``num_groups``/``eps``/``std_threshold``/
    ``debug`` are static; ``debug=True`` checks the identity A_mode + A_inner = A_grpo on
    free clean rows with a host callback (raises on violation).
    """
    _check_rows(rewards, group_ids, clean, response_mask)
    _check_mode_rows(rewards, forced, mode_ids, mode_span_end)
    rewards = rewards.astype(jnp.float32)
    group_ids = group_ids.astype(jnp.int32)
    mode_ids = jnp.clip(mode_ids.astype(jnp.int32), 0, NUM_MODES - 1)
    mode_span_end = mode_span_end.astype(jnp.int32)
    free = ~forced
    rows = _decompose(rewards, group_ids, clean, free, mode_ids, num_groups, eps, std_threshold)
    tokens = _token_advantages(rows.a_mode, rows.a_inner, free, mode_span_end, response_mask)
    out = Advantages(tokens, rows.a_mode, rows.a_inner, rows.a_grpo)
    if debug:
        _debug_identity(out, forced, clean)
    return out


def comet_gdpo(
    task_rewards: jax.Array,
    eff_rewards: jax.Array,
    group_ids: jax.Array,
    clean: jax.Array,
    forced: jax.Array,
    mode_ids: jax.Array,
    mode_span_end: jax.Array,
    response_mask: jax.Array,
    *,
    alpha: float | jax.Array,
    num_groups: int,
    cost_complete: jax.Array | None = None,
    eps: float = EPS,
    std_threshold: float = GROUP_STD_THRESHOLD,
    debug: bool = False,
) -> Advantages:
    """COMET-GDPO (docs/algorithm.md, "COMET-GDPO"): task and efficiency components normalised
    separately, then mixed.

    task_rewards [N] float, eff_rewards [N] float, cost_complete [N] bool (None = all True),
    other inputs as in :func:`comet_grpo`; ``alpha`` scalar (may be traced).

    Survivors = clean ∧ cost_complete. Per component d: μ_d, Bessel σ_d, singleton and
    zero-variance gate as in COMET-GRPO, each component gated on its own. Mix after normalisation:
    A_x = (1−α)·A_x,task + α·A_x,eff for x ∈ {mode, inner, grpo}; no re-whitening.
    At α = 0 the result is exactly ``comet_grpo(task_rewards, ...)`` (which ignores
    cost completeness), as in the original's delegation.
    """
    _check_rows(task_rewards, group_ids, clean, response_mask)
    _check_mode_rows(task_rewards, forced, mode_ids, mode_span_end)
    chex.assert_equal_shape([task_rewards, eff_rewards])
    chex.assert_type(eff_rewards, float)
    if cost_complete is None:
        cost_complete = jnp.ones_like(clean)
    chex.assert_equal_shape([task_rewards, cost_complete])
    chex.assert_type(cost_complete, bool)
    base = comet_grpo(task_rewards, group_ids, clean, forced, mode_ids, mode_span_end,
                      response_mask, num_groups=num_groups, eps=eps,
                      std_threshold=std_threshold)
    task = task_rewards.astype(jnp.float32)
    eff = eff_rewards.astype(jnp.float32)
    group_ids = group_ids.astype(jnp.int32)
    mode_ids = jnp.clip(mode_ids.astype(jnp.int32), 0, NUM_MODES - 1)
    mode_span_end = mode_span_end.astype(jnp.int32)
    free = ~forced
    survivors = clean & cost_complete
    rt = _decompose(task, group_ids, survivors, free, mode_ids, num_groups, eps, std_threshold)
    re = _decompose(eff, group_ids, survivors, free, mode_ids, num_groups, eps, std_threshold)
    a = jnp.asarray(alpha, jnp.float32)
    mix = lambda x_task, x_eff: (1.0 - a) * x_task + a * x_eff
    a_mode = mix(rt.a_mode, re.a_mode)
    a_inner = mix(rt.a_inner, re.a_inner)
    a_grpo = mix(rt.a_grpo, re.a_grpo)
    tokens = _token_advantages(a_mode, a_inner, free, mode_span_end, response_mask)
    mixed = Advantages(tokens, a_mode, a_inner, a_grpo)
    out = jax.tree.map(lambda b, m: jnp.where(a == 0.0, b, m), base, mixed)
    if debug:
        _debug_identity(out, forced, clean)
    return out


def identity_error(adv: Advantages, forced, clean) -> jax.Array:
    """max |A_mode + A_inner − A_grpo| over free clean rows (scalar, jittable; 0 if none)."""
    err = jnp.abs(adv.a_mode + adv.a_inner - adv.a_grpo)
    sel = ~jnp.asarray(forced, bool) & jnp.asarray(clean, bool)
    return jnp.max(jnp.where(sel, err, 0.0), initial=0.0)


def check_identity(adv: Advantages, forced, clean, *, atol: float = 1e-5,
                   rtol: float = 1e-5) -> float:
    """Host-side assert that A_mode + A_inner = A_grpo (within tolerance) on free clean rows.

    Tolerance per row: ``atol + rtol·max(|A_mode|, |A_inner|, |A_grpo|)``. Returns the max
    absolute error; raises ``AssertionError`` on violation.
    """
    a_mode = np.asarray(adv.a_mode, np.float64)
    a_inner = np.asarray(adv.a_inner, np.float64)
    a_grpo = np.asarray(adv.a_grpo, np.float64)
    sel = ~np.asarray(forced, bool) & np.asarray(clean, bool)
    err = np.abs(a_mode + a_inner - a_grpo)
    scale = np.maximum(np.maximum(np.abs(a_mode), np.abs(a_inner)), np.abs(a_grpo))
    bad = sel & ~(err <= atol + rtol * scale)
    if bad.any():
        rows = np.flatnonzero(bad).tolist()
        raise AssertionError(f"A_mode + A_inner != A_grpo on rows {rows}: err {err[bad]}")
    return float(err[sel].max(initial=0.0))


def _debug_identity(adv: Advantages, forced, clean) -> None:
    def _cb(a_mode, a_inner, a_grpo, forced_, clean_):
        check_identity(Advantages(None, a_mode, a_inner, a_grpo), forced_, clean_)

    jax.debug.callback(_cb, adv.a_mode, adv.a_inner, adv.a_grpo, forced, clean)


def validate_inputs(group_ids, forced, mode_span_end, *, num_groups: int,
                    clean=None) -> None:
    """Host-side checks the original raises on (not jittable; call before the estimator).

    - group ids in ``[0, num_groups)``;
    - no group mixes forced and free rows;
    - ``mode_span_end >= 0`` on every free row (only clean rows if ``clean`` is given).
    Raises ``ValueError``.
    """
    g = np.asarray(group_ids)
    f = np.asarray(forced, bool)
    span = np.asarray(mode_span_end)
    if g.size and (g.min() < 0 or g.max() >= num_groups):
        raise ValueError(f"group ids must lie in [0, {num_groups})")
    n_forced = np.bincount(g, weights=f.astype(np.float64), minlength=num_groups)
    n_all = np.bincount(g, minlength=num_groups)
    mixed = np.flatnonzero((n_forced > 0) & (n_forced < n_all))
    if mixed.size:
        raise ValueError(f"groups mixing forced and free rows: {mixed.tolist()}")
    rows = ~f if clean is None else (~f & np.asarray(clean, bool))
    neg = np.flatnonzero(rows & (span < 0))
    if neg.size:
        raise ValueError(f"mode_span_end < 0 on free rows {neg.tolist()}")
