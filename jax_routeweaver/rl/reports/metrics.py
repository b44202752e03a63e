"""Per-step training metrics (docs/metrics.md), computed on the host from one rollout batch.

Pure functions over plain Python objects and numpy arrays (jax arrays are accepted through
``np.asarray``); each returns ``dict[str, float]`` keyed by '/'-separated names, ready for
`rl.reports.run_log.RunLogger`. The per-episode diagnostics (observation truncation, execution
feedback, mask provenance, the forced arm per mode, cost coverage, ...) live in
`rl.reports.episode_metrics`, with the mode-label helpers both modules share; `rollout_metrics` logs
them too.

Conventions:
- Mode labels are ``single``, ``multi``, ``agentic`` and ``invalid`` (a trajectory whose mode is
  None, i.e. the selector failed; like the original's "" mode it is its own bucket).
- A *free* row chose its mode itself; a *forced* row had it injected by the curriculum
  (docs/algorithm.md, "The forced-mode curriculum").
- A metric averaged over an empty set of rows or groups is left out rather than logged as 0 or
  NaN, so a missing key always means "nothing to measure this step" (the logger and
  `window_mean` tolerate missing keys). Exceptions are stated per metric.
- Group statistics follow the estimator (docs/algorithm.md, "Group statistics and the
  zero-variance gate"): over clean members only, Bessel std, and a group is zero-variance when
  its clean rewards are all equal (or it has ≤ 1 clean member).
- Router-R1 rows (`rollout_metrics(..., router_r1=...)`) have no mode: every mode, curriculum
  and mode-segment key is left out (a Router-R1 row would otherwise count as an ``invalid``
  mode), violations are its format violations, and ``r1/*`` keys are added.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_routeweaver.rewards.reward import FAILURE_KINDS, Rewards
from jax_routeweaver.rewards.router_r1_reward import RouterR1Reward
from jax_routeweaver.rl.reports.episode_metrics import (
    INVALID,
    MODE_LABELS,
    MODES,
    episode_diagnostics,
    mode_label,
)
from jax_routeweaver.rl.reports.episode_metrics import entropy as _entropy
from jax_routeweaver.rl.reports.episode_metrics import mean_or_none as _mean
from jax_routeweaver.rl.reports.episode_metrics import mode_shares as _shares
from jax_routeweaver.rl.reports.episode_metrics import put as _put
from jax_routeweaver.rl.reports.episode_metrics import zero_variance as _zero_variance
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.pools.pricing import Prices

if TYPE_CHECKING:  # the numeric core imports jax; metrics only read its arrays
    from jax_routeweaver.rl.core.advantages import Advantages

__all__ = ["INVALID", "MODES", "MODE_LABELS", "NONZERO_ATOL", "R1_UNROUTED_NOTICES",
           "advantage_metrics", "mode_label", "rollout_metrics", "router_r1_metrics",
           "summarize_steps", "window_mean"]

NONZERO_ATOL = 1e-6
"""|A| above this counts as non-zero: A_mode of a one-mode group is μ_m − μ, which float
rounding may leave at ~1e-8 instead of an exact 0."""


def rollout_metrics(trajs: Sequence[Trajectory], rewards: Sequence[Rewards], *,
                    group_size: int, router_r1: Sequence[RouterR1Reward] | None = None,
                    prices: Prices | None = None) -> dict[str, float]:
    """Metrics of one rollout batch.

    `trajs` / `rewards` align row by row, in query-major order: rows ``[g·K, (g+1)·K)`` are the
    `group_size` = K rollouts of query g. Rates are fractions of all rows unless named
    otherwise; ``*_by_domain/{DOMAIN}`` keys use the `Domain` value (``MATH``, ...). See the
    module doc for the conventions (mode labels, free rows, missing keys). `router_r1`: the
    Router-R1 reward details of the same rows, for a Router-R1 batch (no mode keys; see
    `router_r1_metrics`). `prices`: the run's price table (``cost/calls``). The episode
    diagnostics (``obs/*``, ``exec/*``, ``mask/*``, ``m1/*``, ``stage2/*``, ...) are
    `episode_metrics.episode_diagnostics`'. Raises ValueError on misaligned inputs or a row
    count that is not a multiple of `group_size`.
    """
    n = len(trajs)
    if len(rewards) != n or (router_r1 is not None and len(router_r1) != n):
        raise ValueError(f"{n} trajectories but {len(rewards)} rewards"
                         + ("" if router_r1 is None else f" and {len(router_r1)} Router-R1 rows"))
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows do not split into groups of {group_size}")
    if n == 0:
        return {}
    out: dict[str, float] = {}
    with_modes = router_r1 is None
    modes = [mode_label(t) for t in trajs]
    domains = [str(t.record.domain) for t in trajs]
    free = [not t.forced for t in trajs]
    r_task = [float(r.r_task) for r in rewards]
    rows = range(n)

    def by(key_fn) -> dict[Any, list[int]]:
        index: dict[Any, list[int]] = defaultdict(list)
        for i in rows:
            index[key_fn(i)].append(i)
        return index

    # --- rewards and accuracy
    out["reward/mean"] = _mean(r_task)
    _put(out, "reward/mean_clean", _mean(r_task[i] for i in rows if rewards[i].clean))
    by_mode = by(lambda i: modes[i])
    by_domain = by(lambda i: domains[i])
    if with_modes:
        out["reward/eff_mean"] = _mean(float(r.r_eff) for r in rewards)
        for mode, idx in sorted(by_mode.items()):
            out[f"reward/by_mode/{mode}"] = _mean(r_task[i] for i in idx)
    for domain, idx in sorted(by_domain.items()):
        out[f"reward/by_domain/{domain}"] = _mean(r_task[i] for i in idx)
    if with_modes:
        for (domain, mode), idx in sorted(by(lambda i: (domains[i], modes[i])).items()):
            out[f"reward/by_domain_mode/{domain}/{mode}"] = _mean(r_task[i] for i in idx)
            out[f"reward/eff_by_domain_mode/{domain}/{mode}"] = _mean(
                float(rewards[i].r_eff) for i in idx)
            out[f"rows/by_domain_mode/{domain}/{mode}"] = float(len(idx))
    out["accuracy/mean"] = _mean(float(r.correct) for r in rewards)
    for domain, idx in sorted(by_domain.items()):
        out[f"accuracy/by_domain/{domain}"] = _mean(float(rewards[i].correct) for i in idx)
    for domain, idx in sorted(by_domain.items()):
        out[f"rows/by_domain/{domain}"] = float(len(idx))
    out.update(_group_metrics(modes, free, r_task, [r.clean for r in rewards], group_size,
                              with_modes=with_modes))
    if with_modes:
        out.update(_mode_metrics(trajs, modes, free, by_domain))
    out.update(_failure_metrics(trajs, rewards))
    out.update(_episode_metrics(trajs))
    out.update(_worker_metrics(trajs, by_domain))
    out["cost/usd_mean"] = _mean(float(r.cost_usd) for r in rewards)
    if with_modes:
        for mode, idx in sorted(by_mode.items()):
            out[f"cost/usd_by_mode/{mode}"] = _mean(float(rewards[i].cost_usd) for i in idx)
        out.update(_violation_metrics([[t.violation] if t.violation is not None else []
                                       for t in trajs]))
    else:
        assert router_r1 is not None
        out.update(_violation_metrics([list(r.violations) for r in router_r1]))
        out.update(router_r1_metrics(trajs, router_r1))
    out.update(episode_diagnostics(trajs, rewards, group_size=group_size,
                                   with_modes=with_modes, prices=prices))
    return out


def _mode_metrics(trajs: Sequence[Trajectory], modes: list[str], free: list[bool],
                  by_domain: Mapping[str, list[int]]) -> dict[str, float]:
    """``mode/*``, ``curriculum/forced_share`` and the mode-span length (RouteWeaver rows)."""
    out: dict[str, float] = {}
    n = len(trajs)
    rows = range(n)
    # --- mode choice (free rows are the policy's own choices)
    for mode, share in _shares(modes).items():
        out[f"mode/share/{mode}"] = share
    free_rows = [i for i in rows if free[i]]
    if free_rows:
        free_shares = _shares([modes[i] for i in free_rows])
        for mode, share in free_shares.items():
            out[f"mode/share_free/{mode}"] = share
        out["mode/entropy"] = _entropy(free_shares.values())
        out["mode/selector_valid_rate"] = _mean(float(modes[i] != INVALID) for i in free_rows)
        for domain, idx in sorted(by_domain.items()):
            labels = [modes[i] for i in idx if free[i]]
            if labels:
                for mode, share in _shares(labels).items():
                    out[f"mode/share_by_domain/{domain}/{mode}"] = share
    out["curriculum/forced_share"] = 1.0 - len(free_rows) / n
    _put(out, "episode/mode_span_tokens_mean",
         _mean(trajs[i].mode_span_end for i in free_rows
               if modes[i] != INVALID and trajs[i].mode_span_end is not None))
    return out


def _violation_metrics(codes: Sequence[Sequence[str]]) -> dict[str, float]:
    """``violation/{code}``: share of rows with that code; ``violation/rate``: share of rows
    with any (a Router-R1 row may fail several format checks at once)."""
    n = len(codes)
    counts = Counter(c for row in codes for c in set(row))
    out = {f"violation/{code}": count / n for code, count in sorted(counts.items())}
    out["violation/rate"] = sum(bool(row) for row in codes) / n
    return out


def _failure_metrics(trajs: Sequence[Trajectory], rewards: Sequence[Rewards]
                     ) -> dict[str, float]:
    out: dict[str, float] = {}
    n = len(trajs)
    kinds = Counter(r.failure_kind for r in rewards)
    for kind in sorted(set(FAILURE_KINDS) | set(kinds)):
        out[f"failure_kind/{kind}"] = kinds[kind] / n
    out["infra/failed_rate"] = _mean(float(r.infra or t.infra_failed)
                                     for t, r in zip(trajs, rewards, strict=True))
    out["infra/dirty_rate"] = _mean(float(not r.clean) for r in rewards)
    return out


def _episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    out: dict[str, float] = {}
    n = len(trajs)
    policy_tokens = [sum(t.policy_mask) for t in trajs]
    out["episode/worker_calls_mean"] = _mean(len(t.calls) for t in trajs)
    out["episode/failed_worker_calls_mean"] = _mean(
        sum(not c.success for c in t.calls) for t in trajs)
    out["episode/turns_mean"] = _mean(t.turns for t in trajs)
    out["episode/policy_tokens_mean"] = _mean(policy_tokens)
    out["episode/env_tokens_mean"] = _mean(len(t.response_ids) - p
                                           for t, p in zip(trajs, policy_tokens, strict=True))
    out["episode/response_tokens_max"] = float(max(len(t.response_ids) for t in trajs))
    finishes = Counter(t.finish or "none" for t in trajs)
    for reason, count in sorted(finishes.items()):
        out[f"finish/{reason}"] = count / n
    return out


def _worker_metrics(trajs: Sequence[Trajectory],
                   by_domain: Mapping[str, list[int]]) -> dict[str, float]:
    """``workers/share/{worker}``: each worker's share of the batch's calls;
    ``workers/share_by_domain/{DOMAIN}/{worker}``: the same within a domain's rows, so a router
    that picks its workers by the question shows different shares per domain;
    ``workers/first_by_domain/{DOMAIN}/{worker}``: each worker's share of the domain's rows'
    first calls (the first choice of every mode). Over the workers called anywhere in the
    batch (0 where a domain's rows called one never); no key without calls."""
    calls = {"workers/share": [c.worker for t in trajs for c in t.calls]}
    for domain, idx in sorted(by_domain.items()):
        calls[f"workers/share_by_domain/{domain}"] = [
            c.worker for i in idx for c in trajs[i].calls]
        calls[f"workers/first_by_domain/{domain}"] = [
            trajs[i].calls[0].worker for i in idx if trajs[i].calls]
    workers = sorted(set(calls["workers/share"]))
    out: dict[str, float] = {}
    for prefix, names in calls.items():
        counts = Counter(names)
        for w in workers if names else ():
            out[f"{prefix}/{w}"] = counts[w] / len(names)
    return out


# Router-R1 env notices that mean the turn's action was not routed (invalid action, a name
# that did not resolve, a model the pool does not serve).
R1_UNROUTED_NOTICES = frozenset({"no_action", "placeholder", "no_colon", "empty_query",
                                 "unknown_model", "model_not_served"})


def router_r1_metrics(trajs: Sequence[Trajectory], details: Sequence[RouterR1Reward]
                      ) -> dict[str, float]:
    """``r1/*`` means over the rows: ``em``, ``f1``, ``format_score`` (0 or −1),
    ``format_ok_rate``, ``cost_raw`` (micro-dollars), ``cost_score`` (the window's C),
    ``routes`` (the route count of Router-R1's gating), ``calls`` (worker calls per episode),
    ``answered_rate``, ``unrouted_turns`` (turns whose action was not routed, per episode)."""
    if len(trajs) != len(details):
        raise ValueError(f"{len(trajs)} trajectories but {len(details)} Router-R1 rows")
    if not trajs:
        return {}
    out = {
        "r1/em": _mean(r.em for r in details),
        "r1/f1": _mean(r.f1 for r in details),
        "r1/format_score": _mean(r.format_score for r in details),
        "r1/format_ok_rate": _mean(float(not r.violations) for r in details),
        "r1/cost_raw": _mean(r.raw_cost for r in details if r.raw_cost is not None),
        "r1/cost_score": _mean(r.cost_score for r in details),
        "r1/routes": _mean(float(r.routes) for r in details),
        "r1/calls": _mean(float(len(t.calls)) for t in trajs),
        "r1/answered_rate": _mean(float(r.answer is not None) for r in details),
        "r1/unrouted_turns": _mean(float(sum(n in R1_UNROUTED_NOTICES for n in t.notices))
                                   for t in trajs),
    }
    # r1/cost_raw has no value when no row's raw cost is known: left out, not logged as None.
    return {k: v for k, v in out.items() if v is not None}


def _group_metrics(modes: list[str], free: list[bool], r_task: list[float], clean: list[bool],
                   k: int, *, with_modes: bool = True) -> dict[str, float]:
    """`groups/*` and `routing/mode_selection_signal` over consecutive groups of `k` rows
    (without the mode keys when `with_modes` is False)."""
    out: dict[str, float] = {}
    zero_var: list[bool] = []
    stds: list[float] = []
    unique_modes: list[int] = []
    signal: list[bool] = []
    mixing = 0
    for start in range(0, len(modes), k):
        members = range(start, start + k)
        clean_rewards = [r_task[i] for i in members if clean[i]]
        flat = _zero_variance(clean_rewards)
        zero_var.append(flat)
        if len(clean_rewards) >= 2:
            stds.append(float(np.std(clean_rewards, ddof=1)))
        n_free = sum(free[i] for i in members)
        if 0 < n_free < k:
            mixing += 1
        elif n_free == k:
            unique_modes.append(len({modes[i] for i in members}))
            # A mode signal needs survivors in two modes and a group the gate keeps.
            clean_modes = {modes[i] for i in members if clean[i]}
            signal.append(len(clean_modes) >= 2 and not flat)
    out["groups/zero_variance_ratio"] = _mean(float(z) for z in zero_var)
    _put(out, "groups/reward_std_mean", _mean(stds))
    if not with_modes:
        return out
    _put(out, "groups/unique_modes_mean", _mean(unique_modes))
    _put(out, "groups/all_same_mode_ratio", _mean(float(u == 1) for u in unique_modes))
    out["groups/mixing_forced_free"] = float(mixing)
    _put(out, "routing/mode_selection_signal", _mean(float(s) for s in signal))
    return out


def advantage_metrics(adv: Advantages, *, forced: Any, clean: Any, response_mask: Any,
                      mode_token_mask: Any, with_modes: bool = True) -> dict[str, float]:
    """Advantage and token-segment metrics of one batch (docs/metrics.md, "Advantages and
    token segments").

    `adv`: the estimator output (rows [N]); `forced`, `clean` [N] bool; `response_mask`,
    `mode_token_mask` [N, T]. ``adv/mode_*``, ``adv/inner_*`` and ``adv/identity_error`` are
    over free clean rows, ``adv/grpo_abs_mean`` over all clean rows; each is 0 when there is no
    such row. Non-zero means ``|A| > NONZERO_ATOL``. ``tokens/inner`` = response tokens − mode
    tokens; ``tokens/mode_frac`` = mode / response tokens (0 without response tokens).
    `with_modes=False` (rows without a mode, e.g. Router-R1's): only ``adv/grpo_abs_mean``,
    ``adv/grpo_nonzero_rate`` and ``tokens/policy`` (response tokens).
    """
    a_mode = np.asarray(adv.a_mode, np.float64)
    a_inner = np.asarray(adv.a_inner, np.float64)
    a_grpo = np.asarray(adv.a_grpo, np.float64)
    clean_rows = np.asarray(clean, bool)
    free_clean = ~np.asarray(forced, bool) & clean_rows

    def masked_mean(x: np.ndarray, sel: np.ndarray) -> float:
        return float(x[sel].mean()) if sel.any() else 0.0

    n_mode = float(np.asarray(mode_token_mask, np.float64).sum())
    n_response = float(np.asarray(response_mask, np.float64).sum())
    if not with_modes:
        return {"adv/grpo_abs_mean": masked_mean(np.abs(a_grpo), clean_rows),
                "adv/grpo_nonzero_rate": masked_mean(np.abs(a_grpo) > NONZERO_ATOL, clean_rows),
                "tokens/policy": n_response}
    return {
        "adv/mode_abs_mean": masked_mean(np.abs(a_mode), free_clean),
        "adv/inner_abs_mean": masked_mean(np.abs(a_inner), free_clean),
        "adv/grpo_abs_mean": masked_mean(np.abs(a_grpo), clean_rows),
        "adv/mode_nonzero_rate": masked_mean(np.abs(a_mode) > NONZERO_ATOL, free_clean),
        "adv/inner_nonzero_rate": masked_mean(np.abs(a_inner) > NONZERO_ATOL, free_clean),
        "adv/identity_error": float(np.abs(a_mode + a_inner - a_grpo)[free_clean]
                                    .max(initial=0.0)),
        "tokens/mode": n_mode,
        "tokens/inner": n_response - n_mode,
        "tokens/mode_frac": n_mode / n_response if n_response else 0.0,
    }


# ------------------------------------------------------------------------------ over steps
def _finite(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):  # None (a JSON null) or a non-numeric entry
        return None
    return value if math.isfinite(value) else None


def window_mean(records: Sequence[Mapping[str, Any]], key: str, *, first: int | None = None,
                last: int | None = None) -> float:
    """Mean of `key` over the first `first` or the last `last` step records (all records when
    neither is given; giving both is an error). `records` are in step order, as
    `run_log.read_metrics` returns them. Records missing the key, or holding None/NaN/inf for
    it, are skipped inside the window; NaN when no value is left."""
    if first is not None and last is not None:
        raise ValueError("window_mean: give `first` or `last`, not both")
    if first is not None:
        records = records[:max(first, 0)]
    elif last is not None:
        records = records[len(records) - max(last, 0):]
    values = [v for r in records if (v := _finite(r.get(key))) is not None]
    return sum(values) / len(values) if values else math.nan


def summarize_steps(records: Sequence[Mapping[str, Any]], *, first: int = 10,
                    last: int = 10) -> dict[str, float]:
    """For every metric key in `records` (``step`` excluded): ``{key}/first`` and
    ``{key}/last`` window means (see `window_mean`) and ``{key}/delta`` = last − first."""
    keys = dict.fromkeys(k for r in records for k in r if k != "step")
    out: dict[str, float] = {}
    for key in keys:
        a = window_mean(records, key, first=first)
        b = window_mean(records, key, last=last)
        out[f"{key}/first"], out[f"{key}/last"], out[f"{key}/delta"] = a, b, b - a
    return out
