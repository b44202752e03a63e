"""Trajectories + rewards -> the padded arrays the estimator and the trainer consume.

Rows are laid out as ``prompt ids + response ids``, right-padded to a common length ``L``;
position ``t`` of ``response_mask`` is 1 where token ``t`` was written by the policy (so a
per-token logprob ``logp[:, t] = log π(tokens[t] | tokens[<t])`` lines up with it). The
estimators run on this layout directly with ``mode_span_end`` made absolute
(``prompt_len + span``), which keeps prompt and environment tokens at advantage 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jax_routeweaver.rewards.reward import Rewards
from jax_routeweaver.rl.core import advantages as adv_lib
from jax_routeweaver.rl.core.estimators import estimator as estimator_spec
from jax_routeweaver.rl.core.shapes import length_bucket, round_up
from jax_routeweaver.rl.learner.trainer import UpdateBatch
from jax_routeweaver.routing.episodes.episode import Trajectory

MODE_IDS = {"single": adv_lib.MODE_SINGLE, "multi": adv_lib.MODE_MULTI,
            "agentic": adv_lib.MODE_AGENTIC}
# The smallest policy-token width: a row's policy tokens (a few to a few dozen for constrained
# routers) then fit one shape, instead of a recompile of the update for each of 16/24/32/48.
POLICY_WIDTH_MIN = 64


@dataclasses.dataclass
class RolloutBatch:
    """Host (numpy) arrays of N rows; ``L`` a multiple of ``length_multiple``.

    tokens, positions [N, L] int32; attention_mask [N, L] bool (padding rows keep one valid
    token so attention never sees an all-masked row); response_mask [N, L] f32 policy
    tokens; sampler_logp [N, L] f32 (the sampler's logprobs on policy tokens);
    group_ids [N] int32; clean, forced, cost_complete [N] bool; mode_ids [N] int32;
    mode_span_end [N] int32 absolute; r_task, r_eff [N] f32; real [N] bool (False on
    padding rows). Padding rows form their own groups and carry no response tokens.
    policy_index [N, P] int32: the positions of each row's policy tokens (padded with 1),
    policy_valid [N, P] f32 which entries are real; :meth:`gather` maps ``[N, L]`` arrays
    onto them (the trainer's head then runs on P, not L, positions per row).
    """

    tokens: np.ndarray
    positions: np.ndarray
    attention_mask: np.ndarray
    response_mask: np.ndarray
    sampler_logp: np.ndarray
    group_ids: np.ndarray
    clean: np.ndarray
    forced: np.ndarray
    cost_complete: np.ndarray
    mode_ids: np.ndarray
    mode_span_end: np.ndarray
    r_task: np.ndarray
    r_eff: np.ndarray
    real: np.ndarray
    num_groups: int
    policy_index: np.ndarray
    policy_valid: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape  # type: ignore[return-value]

    def gather(self, x: np.ndarray) -> np.ndarray:
        """``[N, L]`` -> ``[N, P]`` at the policy tokens (0 on padding entries)."""
        out = np.take_along_axis(np.asarray(x), self.policy_index, axis=1)
        return (out * self.policy_valid).astype(np.float32)

    def for_update(self, advantages: np.ndarray, mode_mask: np.ndarray,
                   old_logp: np.ndarray | None = None) -> UpdateBatch:
        """The trainer's batch of these rows, at their policy tokens: ``advantages [N, P]``
        (and ``old_logp [N, P]``, None: recomputed by the trainer) are already gathered;
        ``mode_mask [N, L]`` is gathered here, as are the sampler's logprobs."""
        return UpdateBatch(self.tokens, self.positions, self.attention_mask, self.policy_valid,
                           self.gather(mode_mask), advantages, self.clean,
                           index=self.policy_index, sampler_logp=self.gather(self.sampler_logp),
                           old_logp=old_logp)


def pack_rollouts(trajs: Sequence[Trajectory], rewards: Sequence[Rewards], *, group_size: int,
                  pad_id: int, length_multiple: int = 64, row_multiple: int = 1,
                  max_length: int | None = None) -> RolloutBatch:
    """Pack query-major trajectories (``group_size`` consecutive rows per query).

    Rows are padded to a multiple of ``row_multiple`` (micro-batches × data shards), the
    length to a :func:`length_bucket` of ``length_multiple`` and the policy-token width to one
    of ``POLICY_WIDTH_MIN`` (few recompiles). A row longer than
    ``max_length`` is an error naming it (the original's ``truncation=error``).
    """
    if len(trajs) != len(rewards):
        raise ValueError(f"{len(trajs)} trajectories but {len(rewards)} rewards")
    if not trajs or len(trajs) % group_size:
        raise ValueError(f"{len(trajs)} trajectories do not form groups of {group_size}")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    if max_length is not None and max(lengths) > max_length:
        i = int(np.argmax(lengths))
        raise ValueError(f"trajectory {trajs[i].record.sample_id!r} (repeat "
                         f"{trajs[i].repeat}) has {lengths[i]} tokens > max_length {max_length}")
    n_real = len(trajs)
    n = round_up(n_real, row_multiple)
    length = length_bucket(max(lengths), length_multiple)
    tokens = np.full((n, length), pad_id, np.int32)
    attention = np.zeros((n, length), bool)
    response = np.zeros((n, length), np.float32)
    sampler_logp = np.zeros((n, length), np.float32)
    span = np.zeros(n, np.int32)
    mode_ids = np.full(n, adv_lib.MODE_INVALID, np.int32)
    forced = np.zeros(n, bool)
    for i, (traj, size) in enumerate(zip(trajs, lengths, strict=True)):
        p = len(traj.prompt_ids)
        tokens[i, :size] = traj.prompt_ids + traj.response_ids
        attention[i, :size] = True
        response[i, p:size] = traj.policy_mask
        sampler_logp[i, p:size] = traj.logprobs
        forced[i] = traj.forced
        mode_ids[i] = MODE_IDS.get(traj.mode or "", adv_lib.MODE_INVALID)
        # A failed selector ends the episode (recovery off), so its span is the whole
        # response: the policy span of the last selector attempt (docs/algorithm.md, "Batch
        # layout").
        end = traj.mode_span_end if traj.mode_span_end is not None else len(traj.response_ids)
        span[i] = p + end
    attention[n_real:, 0] = True
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()
    counts = response.sum(1).astype(int)
    width = length_bucket(int(counts.max()), POLICY_WIDTH_MIN)
    policy_index = np.ones((n, width), np.int32)
    policy_valid = np.zeros((n, width), np.float32)
    for i in range(n_real):
        pos = np.flatnonzero(response[i])
        policy_index[i, :len(pos)], policy_valid[i, :len(pos)] = pos, 1.0
    pad_rows = np.arange(n - n_real)
    real_groups = n_real // group_size
    group_ids = np.concatenate([np.arange(n_real) // group_size, real_groups + pad_rows])
    flag = lambda f, fill: np.array([f(r) for r in rewards] + [fill] * (n - n_real))
    return RolloutBatch(
        tokens=tokens, positions=positions, attention_mask=attention, response_mask=response,
        sampler_logp=sampler_logp, group_ids=group_ids.astype(np.int32),
        clean=flag(lambda r: r.clean, False).astype(bool), forced=forced,
        cost_complete=flag(lambda r: r.cost_complete, False).astype(bool),
        mode_ids=mode_ids, mode_span_end=span,
        r_task=flag(lambda r: r.r_task, 0.0).astype(np.float32),
        r_eff=flag(lambda r: r.r_eff, 0.0).astype(np.float32),
        real=np.arange(n) < n_real, num_groups=real_groups + len(pad_rows),
        policy_index=policy_index, policy_valid=policy_valid)


def compute_advantages(batch: RolloutBatch, estimator: str, *, alpha: float = 0.0,
                       debug: bool = True) -> adv_lib.Advantages:
    """Run the named estimator on the packed batch (after the host-side input checks).

    ``debug`` asserts ``A_mode + A_inner = A_grpo`` on every call (cheap at these sizes).
    """
    spec = estimator_spec(estimator)
    if not spec.function:
        raise ValueError(f"estimator {estimator!r} is not group-relative (the loop runs GAE)")
    adv_lib.validate_inputs(batch.group_ids, batch.forced, batch.mode_span_end,
                            num_groups=batch.num_groups, clean=batch.clean)
    common = dict(group_ids=jnp.asarray(batch.group_ids), clean=jnp.asarray(batch.clean),
                  response_mask=jnp.asarray(batch.response_mask), num_groups=batch.num_groups)
    fn = getattr(adv_lib, spec.function)
    if not spec.mode_tokens:
        return fn(jnp.asarray(batch.r_task), **common)
    mode_args = dict(forced=jnp.asarray(batch.forced), mode_ids=jnp.asarray(batch.mode_ids),
                     mode_span_end=jnp.asarray(batch.mode_span_end))
    if spec.cost:
        out = fn(jnp.asarray(batch.r_task), jnp.asarray(batch.r_eff), **common, **mode_args,
                 alpha=alpha, cost_complete=jnp.asarray(batch.cost_complete))
    else:
        out = fn(jnp.asarray(batch.r_task), **common, **mode_args)
    if debug:
        adv_lib.check_identity(out, batch.forced, batch.clean)
    return out


def mode_mask(batch: RolloutBatch, estimator: str) -> np.ndarray:
    """[N, L] selector-span tokens of free rows (docs/algorithm.md, "Token advantages and the
    mode-token mask"); all zero for an estimator that does not split at the mode tokens
    (``grpo_gated``: one value per row)."""
    if not estimator_spec(estimator).mode_tokens:
        return np.zeros_like(batch.response_mask)
    return np.asarray(adv_lib.mode_token_mask(jnp.asarray(batch.forced),
                                              jnp.asarray(batch.mode_span_end),
                                              jnp.asarray(batch.response_mask)), np.float32)


def check_query_groups(trajs: Sequence[Trajectory], group_size: int) -> None:
    """GRPO groups are rows ``[g·K, (g+1)·K)``: each must hold one query (``sample_id``), and
    no query two groups (Router-R1 upstream grouped by a per-dataset row index, so rows of two
    datasets with the same index shared a group; docs/router_r1.md, "The GRPO variant").
    ValueError naming the offending sample ids."""
    ids = [t.record.sample_id for t in trajs]
    groups = [ids[i:i + group_size] for i in range(0, len(ids), group_size)]
    mixed = [g for g in groups if len(set(g)) != 1]
    if mixed:
        raise ValueError(f"a GRPO group mixes queries: {mixed[0]}")
    firsts = [g[0] for g in groups]
    if len(set(firsts)) != len(firsts):
        raise ValueError(f"a query spans two GRPO groups: "
                         f"{sorted({i for i in firsts if firsts.count(i) > 1})}")

