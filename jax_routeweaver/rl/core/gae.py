"""Generalised advantage estimation over the policy tokens (Router-R1's PPO; docs/router_r1.md,
"PPO with a critic").

Router-R1 trains PPO with a learned critic. Its per-token reward is the episode's score on the
last policy token minus a KL penalty on every policy token; GAE turns rewards and the critic's
values into advantages, and the advantages are whitened over the batch.

All arrays are ``[N, P]``: row n's policy tokens in order (``RolloutBatch.policy_index``),
``mask`` 1 on real entries, which come first in each row (padding after them). Observation
tokens are not among the entries: the recursion runs over the tokens the policy wrote
(docs/router_r1.md, "PPO with a critic"); with γ = λ = 1 (Router-R1's settings) this gives the
same advantage at every policy token as running it over observation tokens too, because an
observation token's value cancels between its two δ terms.

    r_t   = −β · (logp_t − ref_t)                    every policy token (reward-KL, "kl")
          + score                                     added on the row's last policy token
    δ_t   = r_t + γ · V_{t+1} − V_t                   V after the last token is 0
    A_t   = δ_t + γλ · A_{t+1}
    R_t   = A_t + V_t                                 the critic's target (returns)
    Â_t   = (A_t − mean) / sqrt(var + 1e-8)           mean and unbiased var over the batch's
                                                      real entries of the rows that train
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8


def token_rewards(scores: jax.Array, logp: jax.Array, ref_logp: jax.Array, mask: jax.Array,
                  *, kl_coef: float) -> jax.Array:
    """Per-token rewards ``[N, P]``: ``scores [N]`` on each row's last real entry, minus
    ``kl_coef · (logp − ref_logp)`` on every real entry (Router-R1's "kl" estimator, a fixed
    coefficient). A row without real entries gets nothing."""
    mask = mask.astype(jnp.float32)
    last = jnp.clip(mask.sum(axis=1).astype(jnp.int32) - 1, 0, None)  # [N]
    at_last = jax.nn.one_hot(last, mask.shape[1], dtype=jnp.float32) * mask
    penalty = kl_coef * (logp - ref_logp) * mask
    return scores[:, None].astype(jnp.float32) * at_last - penalty


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
    """``(advantages, returns)``, both ``[N, P]`` and 0 on padding (see the module formulas).

    ``rewards, values, mask [N, P]``: the values of padding entries are ignored, so the
    critic's output can be passed as it is."""
    mask = mask.astype(jnp.float32)
    values = values.astype(jnp.float32) * mask
    rewards = rewards.astype(jnp.float32) * mask
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def back(carry: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        delta, m = xs
        adv = (delta + gamma * lam * carry) * m
        return adv, adv

    # Scan the token axis from the end: carry A_{t+1} (0 past the row's last entry).
    _, adv = jax.lax.scan(back, jnp.zeros(rewards.shape[0], jnp.float32),
                          (deltas.T, mask.T), reverse=True)
    adv = adv.T
    return adv, (adv + values) * mask


def whiten(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``(x − mean) / sqrt(var + 1e-8)`` over the entries of ``mask`` (unbiased variance, as
    the original's masked whitening), 0 elsewhere. Fewer than two entries: centred only."""
    mask = mask.astype(jnp.float32)
    n = mask.sum()
    mean = (x * mask).sum() / jnp.maximum(n, 1.0)
    var = (((x - mean) * mask) ** 2).sum() / jnp.maximum(n - 1.0, 1.0)
    scale = jnp.where(n >= 2, jax.lax.rsqrt(var + WHITEN_EPS), 1.0)
    return (x - mean) * scale * mask
