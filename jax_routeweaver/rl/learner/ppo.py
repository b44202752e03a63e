"""One batch's PPO inputs with a critic (``algo.estimator: ppo_gae``, Router-R1's recipe).

Before the update, with the pre-update policy, the frozen reference and the critic:

1. ``old_logp`` and ``ref_logp`` of the policy tokens, and the critic's ``values``;
2. per-token rewards: the row's score on its last policy token minus the reward-KL
   ``β · (old_logp − ref_logp)`` on each policy token (`gae.token_rewards`);
3. GAE advantages and returns (`gae.gae`), the advantages whitened over the batch.

Rows that do not train (infra-failed rows, padding rows) are masked out of the rewards, the
whitening and the value loss; their advantages are 0. The policy then takes the usual PPO
step on these token advantages (``old_logp`` given, so the ratio uses exactly the logprobs the
KL penalty used), and the critic a clipped value-loss step towards the returns.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_routeweaver.models.sharding import to_host
from jax_routeweaver.rl.core import gae
from jax_routeweaver.rl.learner.batch import RolloutBatch
from jax_routeweaver.rl.learner.critic import Critic
from jax_routeweaver.rl.learner.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class PPOInputs:
    """Host arrays ``[N, P]`` at the batch's policy tokens: ``advantages`` (whitened),
    ``returns``, ``values`` (the critic's, before its update), ``old_logp``, ``mask`` (the
    entries that train); ``metrics`` the batch's ``ppo_gae/*`` diagnostics."""

    advantages: np.ndarray
    returns: np.ndarray
    values: np.ndarray
    old_logp: np.ndarray
    mask: np.ndarray
    metrics: dict[str, float]


def ppo_inputs(trainer: Trainer, critic: Critic, batch: RolloutBatch, *, gamma: float,
               lam: float, kl_coef: float, whiten: bool = True) -> PPOInputs:
    """Steps 1-3 of the module docstring on a packed batch (scores: ``batch.r_task``)."""
    args = (batch.tokens, batch.positions, batch.attention_mask)
    index = batch.policy_index
    mask = batch.policy_valid * batch.clean[:, None].astype(np.float32)
    old_logp = to_host(trainer.logprobs(trainer.state.params, *args, index))
    ref_logp = to_host(trainer.logprobs(trainer.ref_params, *args, index)) if kl_coef > 0 \
        else old_logp
    values = critic.values(*args, index)
    rewards = gae.token_rewards(jnp.asarray(batch.r_task), jnp.asarray(old_logp),
                                jnp.asarray(ref_logp), jnp.asarray(mask), kl_coef=kl_coef)
    adv, returns = gae.gae(rewards, jnp.asarray(values), jnp.asarray(mask), gamma=gamma,
                           lam=lam)
    final = gae.whiten(adv, jnp.asarray(mask)) if whiten else adv
    out = PPOInputs(np.asarray(final), np.asarray(returns), values * mask, old_logp, mask, {})
    return dataclasses.replace(out, metrics=diagnostics(out, np.asarray(adv),
                                                        (old_logp - ref_logp) * mask))


def diagnostics(inputs: PPOInputs, raw_advantages: np.ndarray, kl: np.ndarray
                ) -> dict[str, float]:
    """``ppo_gae/*`` over the entries that train (none: no keys): ``values_mean``,
    ``returns_mean``, ``advantages_raw_mean`` (before whitening), ``kl_mean`` (mean
    logp − ref_logp per token, the reward penalty's estimate before β), and
    ``explained_variance`` = 1 − Var(R − V) / Var(R) (1: the critic predicts the returns),
    and ``adv/gae_abs_mean`` (mean |Â| of the advantages the policy trains on)."""
    m = inputs.mask.astype(bool)
    if not m.any():
        return {}
    returns, values = inputs.returns[m], inputs.values[m]
    var = float(np.var(returns))
    out = {"ppo_gae/values_mean": float(values.mean()),
           "ppo_gae/returns_mean": float(returns.mean()),
           "ppo_gae/advantages_raw_mean": float(raw_advantages[m].mean()),
           "ppo_gae/kl_mean": float(kl[m].mean()),
           "adv/gae_abs_mean": float(np.abs(inputs.advantages[m]).mean())}
    if var > 0:
        out["ppo_gae/explained_variance"] = 1.0 - float(np.var(returns - values)) / var
    return out
