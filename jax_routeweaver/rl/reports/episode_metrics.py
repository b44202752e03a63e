"""Episode diagnostics of one rollout batch (docs/metrics.md), from what each
`Trajectory` records: observation truncation, in-loop execution, mask provenance, episode
shape, the forced arm per mode (``m1/*``), the two arms (``stage2/*``), per-question mode
choice, cost coverage and the policy's probability of the mode it chose.

`rl.reports.metrics.rollout_metrics` calls `episode_diagnostics` and follows the same
conventions (see its module doc): rows in query-major order, groups of K consecutive rows,
mode labels ``single`` / ``multi`` / ``agentic`` / ``invalid``, a metric over an empty set left
out, and no mode key for Router-R1 rows (`with_modes` False). The mode-label helpers live here
so both modules share them.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from jax_routeweaver.rewards.reward import WRAPPER_ERROR, Rewards, has_marker
from jax_routeweaver.routing.episodes.episode import (
    LOOP_ERROR,
    SOURCE_ENV,
    SOURCE_FORCED,
    SOURCE_POLICY,
    Trajectory,
)
from jax_routeweaver.routing.pools.pricing import UNPRICED, USAGE_UNKNOWN, Prices

MODES = ("single", "multi", "agentic")
INVALID = "invalid"
MODE_LABELS = (*MODES, INVALID)


def mode_label(traj: Trajectory) -> str:
    """The executed mode of a trajectory, ``invalid`` when none was declared."""
    return traj.mode if traj.mode in MODES else INVALID


def mean_or_none(values: Iterable[float]) -> float | None:
    """The mean, None for no values (the key is then left out)."""
    values = list(values)
    return sum(values) / len(values) if values else None


def put(out: dict[str, float], name: str, value: float | None) -> None:
    """Set `name` unless the value is undefined (empty denominator)."""
    if value is not None:
        out[name] = float(value)


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def zero_variance(clean_rewards: Sequence[float]) -> bool:
    """The estimator's gate (docs/algorithm.md, "Group statistics and the zero-variance
    gate"): ≤ 1 clean member, or all clean rewards equal."""
    return len(clean_rewards) <= 1 or len(set(clean_rewards)) == 1


def mode_shares(labels: Sequence[str]) -> dict[str, float]:
    counts = Counter(labels)
    return {m: counts[m] / len(labels) for m in MODE_LABELS}


def entropy(shares: Iterable[float]) -> float:
    """Shannon entropy in nats."""
    return -sum(p * math.log(p) for p in shares if p > 0)


def episode_diagnostics(trajs: Sequence[Trajectory], rewards: Sequence[Rewards], *,
                        group_size: int, with_modes: bool = True,
                        prices: Prices | None = None) -> dict[str, float]:
    """Every family of this module over one batch (`trajs` / `rewards` aligned, K =
    `group_size`); `with_modes` False leaves out the mode-only families (Router-R1 rows).
    `prices`: the run's price table, for ``cost/calls`` (left out without it)."""
    if not trajs:
        return {}
    modes = [mode_label(t) for t in trajs]
    domains = [str(t.record.domain) for t in trajs]
    out = observation_metrics(trajs, modes if with_modes else None, domains)
    out |= mask_metrics(trajs, with_modes=with_modes)
    out |= shape_metrics(trajs, modes, with_modes=with_modes)
    out |= cost_metrics(trajs, rewards, prices)
    if not with_modes:
        return out
    free = [not t.forced for t in trajs]
    out |= exec_metrics(trajs)
    out |= forced_mode_metrics(trajs, rewards, group_size)
    out |= arm_metrics(rewards, modes, free)
    out |= question_routing_metrics(modes, free, group_size)
    out |= mode_probability_metrics(trajs, modes, free)
    return out


def observation_metrics(trajs: Sequence[Trajectory], modes: Sequence[str] | None,
                        domains: Sequence[str]) -> dict[str, float]:
    """Observation truncation (docs/protocol.md, "Observations"; Router-R1: its 600-token cap).
    ``obs/blocks_mean``: observation blocks framed per row. ``obs/truncation_rate``: share of
    the batch's blocks cut to the observation budget; ``obs/row_truncation_rate``: share of the
    rows with a block that had at least one cut; ``obs/truncation_rate_by_mode/{mode}`` (not
    without `modes`) and ``obs/truncation_rate_by_domain/{DOMAIN}``: the block share within
    those rows. Rates are left out where no block was framed. Observations dropped whole when
    the budget reached 0 (finish ``obs_budget_exhausted``) are not blocks."""
    out = {"obs/blocks_mean": sum(t.obs_blocks for t in trajs) / len(trajs)}

    def rate(idx: Iterable[int]) -> float | None:
        idx = list(idx)
        return ratio(sum(trajs[i].obs_truncated for i in idx),
                     sum(trajs[i].obs_blocks for i in idx))

    rows = range(len(trajs))
    put(out, "obs/truncation_rate", rate(rows))
    put(out, "obs/row_truncation_rate",
        mean_or_none(float(t.obs_truncated > 0) for t in trajs if t.obs_blocks))
    for name, labels in (("mode", modes), ("domain", domains)):
        if labels is None:
            continue
        index: dict[str, list[int]] = defaultdict(list)
        for i in rows:
            index[labels[i]].append(i)
        for label, idx in sorted(index.items()):
            put(out, f"obs/truncation_rate_by_{name}/{label}", rate(idx))
    return out


def exec_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """In-loop execution feedback of agentic executors (docs/protocol.md, "What a worker
    receives"), batch counts:
    ``exec/runs`` executor replies judged in the loop (a verdict, or a harness failure),
    ``exec/sandbox_errors`` harness failures among them (the row is then infra),
    ``exec/rows_with_exec`` rows with at least one judged reply; and ``exec/pass_all_rate``:
    share of the verdicts against hidden tests (CODE rows, "no runnable code" included) that
    passed every test (left out without such a verdict)."""
    out = {"exec/runs": float(sum(t.exec_runs for t in trajs)),
           "exec/sandbox_errors": float(sum(t.exec_sandbox_errors for t in trajs)),
           "exec/rows_with_exec": float(sum(t.exec_runs > 0 for t in trajs))}
    put(out, "exec/pass_all_rate", ratio(sum(t.exec_passed_all for t in trajs),
                                         sum(t.exec_graded for t in trajs)))
    return out


def _mask_violated(traj: Trajectory) -> bool:
    expected = {SOURCE_ENV: 0, SOURCE_POLICY: 1, SOURCE_FORCED: 0}
    return any(m != expected.get(s, -1)
               for s, m in zip(traj.token_source, traj.policy_mask, strict=True))


def mask_metrics(trajs: Sequence[Trajectory], *, with_modes: bool = True) -> dict[str, float]:
    """Mask provenance checks, over rows whose `token_source` covers the response (rows
    built without it are skipped; no key when none is left). ``mask/violations``: rows with a
    token whose `policy_mask` contradicts its source (environment or grammar-forced token at
    1, a sampled token the grammar left a choice at 0); must be 0. ``mask/policy_span_min``:
    least mask of a sampled choice token (1); ``mask/env_span_max``: greatest mask of an
    environment token (0); ``mask/mode_span_min`` (with modes): least mask of a sampled choice
    token inside the mode span of a free row with a declared mode (1: the mode decision is
    trained; docs/algorithm.md, "Token advantages and the mode-token mask"). Each min/max is
    left out when it has no token."""
    known = [t for t in trajs if len(t.token_source) == len(t.policy_mask)
             == len(t.response_ids)]
    if not known:
        return {}
    out = {"mask/violations": float(sum(_mask_violated(t) for t in known))}

    def masks(rows: Iterable[Trajectory], source: int, end: bool = False) -> list[int]:
        return [m for t in rows for s, m in zip(
            t.token_source[:t.mode_span_end] if end else t.token_source,
            t.policy_mask, strict=False) if s == source]

    policy, env = masks(known, SOURCE_POLICY), masks(known, SOURCE_ENV)
    put(out, "mask/policy_span_min", min(policy, default=None))
    put(out, "mask/env_span_max", max(env, default=None))
    if with_modes:
        free = [t for t in known if not t.forced and t.mode in MODES
                and t.mode_span_end is not None]
        put(out, "mask/mode_span_min", min(masks(free, SOURCE_POLICY, end=True), default=None))
    return out


def shape_metrics(trajs: Sequence[Trajectory], modes: Sequence[str], *,
                  with_modes: bool = True) -> dict[str, float]:
    """``episode/route_count_mean``: dispatched routes per row (Router-R1: searches naming a known
    model). ``infra/loop_error_rate`` / ``infra/wrapper_error_rate``: rows an env exception
    (``loop_error:*``) / a worker payload failing its hygiene check (``wrapper_error``) ended
    (docs/protocol.md, "How an episode ends"). With modes: ``episode/selector_retries_mean``
    (selector attempts after the first, over free rows) and ``episode/max_layer_width_mean`` (most
    calls in one layer, over agentic rows that dispatched a layer)."""
    n = len(trajs)
    out = {"episode/route_count_mean": sum(len(t.routes) for t in trajs) / n,
           "infra/loop_error_rate": sum(has_marker(t, (LOOP_ERROR,)) for t in trajs) / n,
           "infra/wrapper_error_rate": sum(has_marker(t, (WRAPPER_ERROR,)) for t in trajs) / n}
    if with_modes:
        put(out, "episode/selector_retries_mean",
            mean_or_none(t.selector_retries for t in trajs if not t.forced))
        put(out, "episode/max_layer_width_mean",
            mean_or_none(t.max_layer_width for t, m in zip(trajs, modes, strict=True)
                         if m == "agentic" and t.routes))
    return out


def first_pass_valid(traj: Trajectory) -> bool:
    """No violation was recorded before the row's first worker call (a row that dispatched
    no call: no violation at all). With recovery off a violation ends the episode, so this
    is "the first violation, if any, came after a worker call"."""
    if traj.first_call_violations is None:
        return not traj.violations and traj.violation is None
    return traj.first_call_violations == 0


def unique_route_ratio(trajs: Iterable[Trajectory]) -> float | None:
    """Σ per-row distinct (worker, task) routes / Σ routes (None without routes)."""
    trajs = list(trajs)
    return ratio(sum(len(set(t.routes)) for t in trajs), sum(len(t.routes) for t in trajs))


def forced_mode_metrics(trajs: Sequence[Trajectory], rewards: Sequence[Rewards],
                        k: int) -> dict[str, float]:
    """``m1/{mode}/*`` over the forced rows of each forced mode (the record's `forced_mode`):
    ``rows``; ``reward_mean`` (r_task); ``task_accuracy``; ``first_pass_valid`` (see
    `first_pass_valid`); ``eventual_valid`` (ended on an accepted answer);
    ``terminal_invalid_rate`` (ended by a violation); ``infra_rate``;
    ``forced_mode_honoured`` (executed mode = forced mode); ``unique_route_ratio`` (see
    `unique_route_ratio`, left out without routes); ``worker_calls_mean``; ``turns_mean``;
    ``groups`` (all-forced groups of that mode) and ``zero_variance_group_ratio`` (their
    share the estimator's zero-variance gate zeroes)."""
    index: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        if t.forced:
            index[t.record.forced_mode or mode_label(t)].append(i)
    out: dict[str, float] = {}
    for mode, idx in sorted(index.items()):
        rows, p = [trajs[i] for i in idx], f"m1/{mode}/"
        out[p + "rows"] = float(len(idx))
        out[p + "reward_mean"] = sum(rewards[i].r_task for i in idx) / len(idx)
        out[p + "task_accuracy"] = sum(rewards[i].correct for i in idx) / len(idx)
        out[p + "first_pass_valid"] = sum(map(first_pass_valid, rows)) / len(idx)
        out[p + "eventual_valid"] = sum(t.finish == "answer" for t in rows) / len(idx)
        out[p + "terminal_invalid_rate"] = sum(t.violation is not None for t in rows) / len(idx)
        out[p + "infra_rate"] = sum(rewards[i].infra or trajs[i].infra_failed
                                    for i in idx) / len(idx)
        out[p + "forced_mode_honoured"] = sum(t.mode == mode for t in rows) / len(idx)
        put(out, p + "unique_route_ratio", unique_route_ratio(rows))
        out[p + "worker_calls_mean"] = sum(len(t.calls) for t in rows) / len(idx)
        out[p + "turns_mean"] = sum(t.turns for t in rows) / len(idx)
        groups = [g for g in range(0, len(trajs), k) if all(
            trajs[i].forced and (trajs[i].record.forced_mode or mode_label(trajs[i])) == mode
            for i in range(g, g + k))]
        out[p + "groups"] = float(len(groups))
        put(out, p + "zero_variance_group_ratio", mean_or_none(float(zero_variance(
            [rewards[i].r_task for i in range(g, g + k) if rewards[i].clean]))
            for g in groups))
    return out


def arm_metrics(rewards: Sequence[Rewards], modes: Sequence[str],
                free: Sequence[bool]) -> dict[str, float]:
    """The curriculum's two arms (docs/algorithm.md, "The forced-mode curriculum"):
    ``stage2/forced_ratio`` / ``stage2/free_ratio``
    (row shares); per arm (``free``, ``forced``, left out when the arm has no row)
    ``stage2/{arm}/reward_mean`` (r_task) and ``stage2/{arm}/mode_share/{label}`` (executed
    mode shares within the arm, ``invalid`` included)."""
    n = len(rewards)
    out = {"stage2/free_ratio": sum(free) / n, "stage2/forced_ratio": 1.0 - sum(free) / n}
    for arm, on in (("free", True), ("forced", False)):
        idx = [i for i in range(n) if free[i] == on]
        if not idx:
            continue
        out[f"stage2/{arm}/reward_mean"] = sum(rewards[i].r_task for i in idx) / len(idx)
        for label, share in mode_shares([modes[i] for i in idx]).items():
            out[f"stage2/{arm}/mode_share/{label}"] = share
    return out


def question_routing_metrics(modes: Sequence[str], free: Sequence[bool],
                             k: int) -> dict[str, float]:
    """Per-question mode choice over the K samples of each all-free group:
    ``routing/question_mode_entropy_mean`` (entropy in nats of the group's executed-mode
    shares, ``invalid`` a label of its own; mean over groups) and
    ``routing/unanimous_group_ratio`` (groups whose K rows all declared the same valid mode;
    an invalid row breaks unanimity). Left out without an all-free group."""
    groups = [[modes[i] for i in range(g, g + k)] for g in range(0, len(modes), k)
              if all(free[g:g + k])]
    out: dict[str, float] = {}
    put(out, "routing/question_mode_entropy_mean",
        mean_or_none(entropy(mode_shares(labels).values()) for labels in groups))
    put(out, "routing/unanimous_group_ratio",
        mean_or_none(float(len(set(labels)) == 1 and labels[0] != INVALID)
                     for labels in groups))
    return out


def cost_metrics(trajs: Sequence[Trajectory], rewards: Sequence[Rewards],
                 prices: Prices | None) -> dict[str, float]:
    """Cost coverage (docs/algorithm.md, "Trajectory cost") over the costed rows (a
    `Trajectory.cost`; none for Router-R1, which costs in its reward). ``cost/calls``: calls per
    costed row billed at a price of `prices` (left out without it); ``cost/usage_unknown_rate`` /
    ``cost/unpriced_rate``: rows whose cost misses a call's usage / prices a call of an unpriced
    worker; ``cost/complete_rate``: rows with a complete cost; ``cost/s_cost_mean``: mean
    S_cost = 1/(1 + C/C_ref) of the complete rows (left out without one)."""
    costed = [(t, r) for t, r in zip(trajs, rewards, strict=True) if t.cost is not None]
    if not costed:
        return {}
    n = len(costed)
    out = {"cost/usage_unknown_rate": sum(USAGE_UNKNOWN in t.cost.reasons
                                          for t, _ in costed) / n,
           "cost/unpriced_rate": sum(UNPRICED in t.cost.reasons for t, _ in costed) / n,
           "cost/complete_rate": sum(t.cost.complete for t, _ in costed) / n}
    if prices is not None:
        out["cost/calls"] = sum(c.worker in prices for t, _ in costed for c in t.calls) / n
    put(out, "cost/s_cost_mean",
        mean_or_none(r.s_cost for _, r in costed if r.cost_complete))
    return out


def mode_probability_metrics(trajs: Sequence[Trajectory], modes: Sequence[str],
                             free: Sequence[bool]) -> dict[str, float]:
    """The policy's probability of the mode it chose, over free rows with a declared mode:
    π = exp(`mode_logprob`), the sampler's probability (temperature applied, no top-p/top-k
    and no grammar mask: sampling/base.py's contract) of the whole selector turn that
    declared the mode, as sampled. Only the chosen mode's probability is known (the others
    would need a forward pass over the selector prompt), so ``mode/pi_chosen_mean`` is its
    mean, and ``mode/pi_chosen/{mode}`` its mean over the rows that chose `mode`: how sure
    the policy was of `mode` when it chose it, not π(mode) over all questions (the support
    loss's teacher-forced pass logs that: ``mode/pibar_all_*``, ``free|forced/pi_*``,
    ``mode/pi1_*``; `losses.mode_probability_metrics`). Under a grammar the forced tokens'
    raw probabilities are in π too. Forced rows sample no declaration. Left out without
    such rows."""
    rows = [i for i, t in enumerate(trajs)
            if free[i] and modes[i] in MODES and t.mode_logprob is not None]
    out: dict[str, float] = {}
    put(out, "mode/pi_chosen_mean", mean_or_none(math.exp(trajs[i].mode_logprob or 0.0)
                                                 for i in rows))
    for mode in MODES:
        put(out, f"mode/pi_chosen/{mode}", mean_or_none(math.exp(trajs[i].mode_logprob or 0.0)
                                                  for i in rows if modes[i] == mode))
    return out
