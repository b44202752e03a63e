"""GAE, reward-KL and whitening (rl/core/gae.py) against hand-computed cases, and the critic's
clipped value loss (rl/learner/critic.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.rl.core import gae
from jax_routeweaver.rl.learner.critic import Critic, CriticConfig
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=16, param_dtype="float32",
                  dtype="float32")


def test_gae_golden_case_by_hand():
    # One row of three policy tokens and one padding entry; γ = 0.9, λ = 0.8.
    rewards = jnp.array([[0.0, 0.5, 1.0, 7.0]])  # the padding reward must be ignored
    values = jnp.array([[0.2, 0.4, 0.6, 9.0]])  # so must the padding value
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # δ2 = 1.0 + 0 − 0.6 = 0.4;           A2 = 0.4
    # δ1 = 0.5 + 0.9·0.6 − 0.4 = 0.64;    A1 = 0.64 + 0.72·0.4 = 0.928
    # δ0 = 0.0 + 0.9·0.4 − 0.2 = 0.16;    A0 = 0.16 + 0.72·0.928 = 0.82816
    np.testing.assert_allclose(adv, [[0.82816, 0.928, 0.4, 0.0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[1.02816, 1.328, 1.0, 0.0]], atol=1e-6)


def test_gae_with_gamma_lambda_one_is_future_reward_minus_value():
    # Router-R1's settings: A_t = Σ_{s≥t} r_s − V_t, whatever the other values are.
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 6)).astype(np.float32)
    values = rng.normal(size=(3, 6)).astype(np.float32)
    mask = np.array([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5], np.float32)
    adv, ret = gae.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                       gamma=1.0, lam=1.0)
    future = np.flip(np.cumsum(np.flip(rewards * mask, 1), 1), 1)
    np.testing.assert_allclose(adv, (future - values) * mask, atol=1e-5)
    np.testing.assert_allclose(ret, future * mask, atol=1e-5)


def test_token_rewards_put_the_score_last_and_the_kl_everywhere():
    scores = jnp.array([1.0, -1.0, 0.5])
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0], [0.0, 0.0, 0.0]])
    ref = jnp.array([[-1.5, -1.0, -3.0], [-0.5, -1.5, 0.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    r = gae.token_rewards(scores, logp, ref, mask, kl_coef=0.1)
    # Row 0: kl = [0.5, −1.0, 0]; row 1: kl = [0, 1.0] and the score on its second token.
    np.testing.assert_allclose(r, [[-0.05, 0.1, 1.0], [0.0, -1.1, 0.0], [0.0, 0.0, 0.0]],
                               atol=1e-6)


def test_whiten_over_the_mask_only():
    x = jnp.array([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = np.asarray(gae.whiten(x, mask))
    # Entries 1, 2, 3: mean 2, unbiased var 1.
    np.testing.assert_allclose(out, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-4)


@pytest.fixture(scope="module")
def critic():
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    trainer = Trainer(model, OptimConfig(lr=1e-3), LossConfig(reduction="global"))
    return Critic(model, CriticConfig(lr=1e-2, value_clip=0.5, weight_decay=0.0),
                  batching=trainer)


def batch(n: int = 2, length: int = 8):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, size=(n, length)).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (n, length)).copy()
    attention = np.ones((n, length), bool)
    index = np.tile(np.arange(4, 8, dtype=np.int32), (n, 1))
    mask = np.ones((n, 4), np.float32)
    return tokens, positions, attention, index, mask


@pytest.mark.slow
def test_critic_starts_at_zero_and_regresses_towards_the_returns(critic):
    tokens, positions, attention, index, mask = batch()
    v0 = critic.values(tokens, positions, attention, index)
    assert v0.shape == (2, 4) and np.all(v0 == 0.0)  # zero-initialised head
    returns = np.full((2, 4), 0.3, np.float32)
    first = critic.update(tokens, positions, attention, index, mask, returns, v0)
    # ½·mean((0 − 0.3)²) = 0.045, nothing clipped (|V − V_old| = 0 < 0.5).
    assert first["critic/vf_loss"] == pytest.approx(0.045, rel=1e-5)
    assert first["critic/vf_clipfrac"] == 0.0 and first["critic/grad_norm"] > 0
    for _ in range(20):
        critic.update(tokens, positions, attention, index, mask, returns,
                      critic.values(tokens, positions, attention, index))
    v = critic.values(tokens, positions, attention, index)
    assert np.abs(v - 0.3).max() < np.abs(v0 - 0.3).max() / 2


@pytest.mark.slow
def test_clipped_value_loss_takes_the_larger_term(critic):
    tokens, positions, attention, index, mask = batch()
    v = critic.values(tokens, positions, attention, index)
    # Old values far below the current ones: the clipped prediction V_old + 0.5 is further
    # from R than V is, so the clipped term is the loss on every token.
    old = v - 2.0
    returns = v + 0.1
    loss = critic._micro_loss(critic.state.params, tuple(jnp.asarray(a)[None][0] for a in (
        tokens, positions, attention, index, mask, returns, old)), jnp.float32(mask.sum()))
    expected = 0.5 * np.mean((old + 0.5 - returns) ** 2)
    assert float(loss[0]) == pytest.approx(expected, rel=1e-4)
    assert float(loss[1]["critic/vf_clipfrac"]) == 1.0
