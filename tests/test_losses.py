"""Tests for jax_routeweaver.rl.core.losses (hand-computed values and exactness identities)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_routeweaver.rl.core import losses as L

# Six tokens, one row: (A, ratio) -> per-token loss, by hand from
# ℓ = max(−Aρ, −A·clip(ρ, 0.8, 1.2)), and min(ℓ, −3A) when A < 0.
#   ( 1, 1.5): max(−1.5, −1.2) = −1.2            clipped
#   ( 1, 0.5): max(−0.5, −0.8) = −0.5
#   (−1, 1.5): max( 1.5,  1.2) =  1.5 ; min(3, 1.5) = 1.5
#   (−1, 5.0): max( 5.0,  1.2) =  5.0 ; min(3, 5.0) = 3.0   dual-clipped
#   (−1, 0.5): max( 0.5,  0.8) =  0.8 ; min(3, 0.8) = 0.8   clipped
#   ( 2, 1.0): −2.0
ADV = np.array([[1.0, 1.0, -1.0, -1.0, -1.0, 2.0]], np.float32)
RATIO = np.array([[1.5, 0.5, 1.5, 5.0, 0.5, 1.0]], np.float32)
OLD = np.array([[-1.0, -2.0, -0.5, -3.0, -1.5, -0.7]], np.float32)
LOGP = OLD + np.log(RATIO)
HAND_TOKEN_LOSS = np.array([[-1.2, -0.5, 1.5, 3.0, 0.8, -2.0]], np.float32)
# dℓ/dlogp = −Aρ on the unclipped branch, 0 where a clip is active.
HAND_GRAD = np.array([[0.0, -0.5, 1.5, 0.0, 0.0, -2.0]], np.float32)


def test_ppo_dual_clip_hand_values():
    part, metrics = L.ppo_dual_clip(LOGP, OLD, ADV, np.ones_like(ADV))
    assert float(part.total) == pytest.approx(1.6, abs=1e-5)
    assert float(part.denom) == 6.0
    assert float(part.value()) == pytest.approx(1.6 / 6, abs=1e-6)
    assert float(metrics["pg_clipfrac"].value()) == pytest.approx(2 / 6)
    assert float(metrics["pg_clipfrac_lower"].value()) == pytest.approx(1 / 6)
    assert float(metrics["ppo_kl"].value()) == pytest.approx(-math.log(2.8125) / 6, abs=1e-6)
    tok, *_ = L.ppo_token_losses(jnp.asarray(LOGP), jnp.asarray(OLD), jnp.asarray(ADV))
    np.testing.assert_allclose(tok, HAND_TOKEN_LOSS, atol=1e-5)


def test_ppo_dual_clip_hand_gradient():
    grad = jax.grad(lambda lp: L.ppo_dual_clip(lp, OLD, ADV, np.ones_like(ADV))[0].total)(
        jnp.asarray(LOGP)
    )
    np.testing.assert_allclose(grad, HAND_GRAD, atol=1e-5)


def test_ppo_asymmetric_clip_and_log_ratio_clamp():
    # clip_high 0.28: ratio 1.5, A = 1 -> max(−1.5, −1.28) = −1.28
    part, _ = L.ppo_dual_clip(
        jnp.log(jnp.array([[1.5]])),
        jnp.zeros((1, 1)),
        jnp.ones((1, 1)),
        jnp.ones((1, 1)),
        clip_high=0.28,
    )
    assert float(part.total) == pytest.approx(-1.28, abs=1e-5)
    # log-ratio 100 is clamped to 20: A = +1 -> −1.2 (clip), finite.
    part, m = L.ppo_dual_clip(
        jnp.array([[100.0]]), jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1))
    )
    assert float(part.total) == pytest.approx(-1.2, abs=1e-5)
    assert float(m["ppo_kl"].total) == pytest.approx(-20.0)


def test_ppo_rejects_bad_shapes():
    with pytest.raises(AssertionError):
        L.ppo_dual_clip(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ValueError):
        L.ppo_token_losses(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1, 1)), clip_c=1.0)


@pytest.mark.slow
def test_k3_nonnegative_zero_and_zero_grad_at_ref():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-2, 1.5, (4, 7)), jnp.float32)
    ref = jnp.asarray(rng.normal(-2, 1.5, (4, 7)), jnp.float32)
    kl = L.low_var_kl(logp, ref)
    assert bool(jnp.all(kl >= 0))
    assert bool(jnp.all(kl <= L.KL_VALUE_CLAMP))
    np.testing.assert_allclose(L.low_var_kl(logp, logp), 0.0, atol=1e-7)
    mask = jnp.ones_like(logp)
    g = jax.grad(lambda lp: L.kl_loss(lp, logp, mask).total)(logp)
    np.testing.assert_allclose(g, 0.0, atol=1e-7)
    # hand value: d = ref − logp = 1 -> e − 2
    v = L.low_var_kl(jnp.array([[0.0]]), jnp.array([[1.0]]))
    assert float(v[0, 0]) == pytest.approx(math.e - 2, abs=1e-6)
    # value clamp: d = 20 -> e^20 − 21 clamped to 10
    assert float(L.low_var_kl(jnp.array([[0.0]]), jnp.array([[50.0]]))[0, 0]) == 10.0
    part = L.kl_loss(jnp.array([[0.0, 0.0]]), jnp.array([[1.0, 0.0]]), jnp.ones((1, 2)))
    assert part.coef == 0.001
    assert float(L.combine({"kl": part})) == pytest.approx(0.001 * (math.e - 2) / 2, rel=1e-5)


def _toy_logp(params, tokens, feats):
    """logp [B, T] of `tokens` under a linear-softmax toy policy."""
    logits = jnp.einsum("btd,dv->btv", feats, params)
    lsm = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lsm, tokens[..., None], axis=-1)[..., 0]


def _toy_batch(b=16, t=6, d=5, v=7, seed=0):
    rng = np.random.default_rng(seed)
    params = jnp.asarray(rng.normal(0, 0.5, (d, v)), jnp.float32)
    feats = jnp.asarray(rng.normal(0, 1, (b, t, d)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, t)))
    lengths = rng.integers(2, t + 1, b)
    resp = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    free = rng.random(b) < 0.5
    mode = ((np.arange(t)[None, :] < 2) & free[:, None]).astype(np.float32) * resp
    clean = (rng.random(b) < 0.8).astype(np.float32)
    adv = rng.normal(0, 1, (b, t)).astype(np.float32) * resp
    base = _toy_logp(params, tokens, feats)
    old = base + jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32)
    ref = base + jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32)
    return dict(
        params=params,
        feats=feats,
        tokens=tokens,
        resp=jnp.asarray(resp),
        mode=jnp.asarray(mode),
        clean=jnp.asarray(clean),
        adv=jnp.asarray(adv),
        old=old,
        ref=ref,
    )


def _loss_fn(params, bt, idx, counts, reduction):
    logp = _toy_logp(params, bt["tokens"][idx], bt["feats"][idx])
    parts, _ = L.policy_loss_parts(
        logp,
        bt["old"][idx],
        bt["adv"][idx],
        bt["resp"][idx],
        mode_mask=bt["mode"][idx],
        clean=bt["clean"][idx],
        ref_logp=bt["ref"][idx],
        counts=counts,
        reduction=reduction,
        kl_coef=0.05,
    )
    return parts


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["segment", "global"])
def test_microbatch_equivalence(reduction):
    bt = _toy_batch()
    counts = L.segment_counts(bt["resp"], bt["mode"])
    full = np.arange(16)

    def full_loss(p):
        return L.combine(_loss_fn(p, bt, full, counts, reduction))

    loss_full, grad_full = jax.value_and_grad(full_loss)(bt["params"])

    loss_mb = 0.0
    grad_mb = jnp.zeros_like(bt["params"])
    parts_list = []
    for k in range(8):
        idx = np.arange(2 * k, 2 * k + 2)
        # counts are mini-batch-global: the same for every micro-batch
        lv, g = jax.value_and_grad(
            lambda p, idx=idx: L.combine(_loss_fn(p, bt, idx, counts, reduction))
        )(bt["params"])
        loss_mb = loss_mb + lv
        grad_mb = grad_mb + g
        parts_list.append(_loss_fn(bt["params"], bt, idx, counts, reduction))

    scale = float(jnp.max(jnp.abs(grad_full)))
    assert scale > 0
    assert abs(float(loss_full) - float(loss_mb)) <= 1e-6 * max(1.0, abs(float(loss_full)))
    assert float(jnp.max(jnp.abs(grad_full - grad_mb))) <= 1e-6 * scale
    assert float(L.combine(parts_list)) == pytest.approx(float(loss_full), rel=1e-6, abs=1e-7)


def test_microbatch_local_counts_would_differ():
    # Guard: per-micro-batch *local* denominators are NOT exact (so the test above can fail).
    bt = _toy_batch()
    counts = L.segment_counts(bt["resp"], bt["mode"])
    full = float(L.combine(_loss_fn(bt["params"], bt, np.arange(16), counts, "segment")))
    local = sum(
        float(L.combine(_loss_fn(bt["params"], bt, np.arange(2 * k, 2 * k + 2), None, "segment")))
        for k in range(8)
    )
    assert abs(full - local) > 1e-3


@pytest.mark.slow
def test_padding_leaves_loss_and_grad_unchanged():
    bt = _toy_batch(b=4, t=5)
    counts = L.segment_counts(bt["resp"], bt["mode"])

    def loss(lp, old, ref, adv, resp, mode):
        parts, _ = L.policy_loss_parts(
            lp, old, adv, resp, mode_mask=mode, clean=bt["clean"], ref_logp=ref, counts=counts
        )
        return L.combine(parts)

    lp = _toy_logp(bt["params"], bt["tokens"], bt["feats"])
    args = (bt["old"], bt["ref"], bt["adv"], bt["resp"], bt["mode"])
    v0, g0 = jax.value_and_grad(loss)(lp, *args)

    def pad(x, fill):
        return jnp.concatenate([x, jnp.full((x.shape[0], 3), fill, x.dtype)], axis=1)

    lp_p = pad(lp, 50.0)
    args_p = (
        pad(bt["old"], jnp.nan),
        pad(bt["ref"], -jnp.inf),
        pad(bt["adv"], 1e6),
        pad(bt["resp"], 0.0),
        pad(bt["mode"], 1.0),
    )
    v1, g1 = jax.value_and_grad(loss)(lp_p, *args_p)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    np.testing.assert_allclose(g1[:, :5], g0, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(g1[:, 5:], 0.0)


@pytest.mark.slow
def test_on_policy_gradient_is_reinforce():
    bt = _toy_batch(b=6, t=4, seed=3)
    mask = bt["resp"]
    n = float(mask.sum())

    def ppo(p):
        lp = _toy_logp(p, bt["tokens"], bt["feats"])
        part, _ = L.ppo_dual_clip(lp, jax.lax.stop_gradient(lp), bt["adv"], mask)
        return L.combine({"pg": part})

    def reinforce(p):
        lp = _toy_logp(p, bt["tokens"], bt["feats"])
        return -(bt["adv"] * lp * mask).sum() / n

    g_ppo = jax.grad(ppo)(bt["params"])
    g_rf = jax.grad(reinforce)(bt["params"])
    np.testing.assert_allclose(g_ppo, g_rf, rtol=1e-5, atol=1e-7)


def test_segment_normalisation_hand_values():
    # On-policy (ratio 1) so ℓ = −A. Row 0 free (mode tokens 0,1), row 1 forced, row 2 dirty.
    resp = jnp.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
    mode = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], jnp.float32)
    clean = jnp.array([1.0, 1.0, 0.0])
    adv = jnp.array([[2.0, 2.0, -1.0, -1.0], [0.5, 0.5, 0.5, 0.0], [9.0, 9.0, 0.0, 0.0]])
    lp = jnp.full((3, 4), -1.0)
    counts = L.segment_counts(resp, mode)
    # N_mode = 2 + 1 (dirty row counts) = 3; N_tokens = 9; N_inner = 6
    assert [float(c) for c in counts] == [3.0, 6.0, 9.0]
    parts, metrics = L.policy_loss_parts(lp, lp, adv, resp, mode_mask=mode, clean=clean)
    # mode: −(2+2)/3 ; inner: −(−1−1+0.5·3)/6 = 0.5/6
    assert float(parts["pg_mode"].total) == pytest.approx(-4.0)
    assert float(parts["pg_mode"].denom) == 3.0
    assert float(parts["pg_inner"].total) == pytest.approx(0.5)
    assert float(parts["pg_inner"].denom) == 6.0
    assert float(L.combine(parts)) == pytest.approx(-4 / 3 + 0.5 / 6, abs=1e-6)
    glob, _ = L.policy_loss_parts(
        lp, lp, adv, resp, mode_mask=mode, clean=clean, reduction="global"
    )
    assert float(L.combine(glob)) == pytest.approx(-3.5 / 9, abs=1e-6)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


@pytest.mark.slow
def test_segment_without_free_rows_equals_global():
    bt = _toy_batch(b=6, t=5, seed=1)
    lp = _toy_logp(bt["params"], bt["tokens"], bt["feats"])
    zero = jnp.zeros_like(bt["mode"])
    kw = dict(mode_mask=zero, clean=jnp.ones_like(bt["clean"]), ref_logp=bt["ref"])
    seg, _ = L.policy_loss_parts(lp, bt["old"], bt["adv"], bt["resp"], **kw)
    glob, _ = L.policy_loss_parts(lp, bt["old"], bt["adv"], bt["resp"], reduction="global", **kw)
    assert float(L.combine(seg)) == pytest.approx(float(L.combine(glob)), rel=1e-6)
    with pytest.raises(ValueError):
        L.policy_loss_parts(lp, bt["old"], bt["adv"], bt["resp"], reduction="mean")


def test_global_reduction_keeps_kl_on_dirty_rows():
    """docs/algorithm.md, "Reductions": the global path (grpo_gated: cold start, wo_comet) only
    zeroes a dirty row's advantage, so its KL (and entropy) still count; the segment path drops
    the row."""
    resp = jnp.array([[1, 1, 1], [1, 1, 0]], jnp.float32)
    clean = jnp.array([1.0, 0.0])
    lp = jnp.full((2, 3), -1.0)
    ref = jnp.array([[-1.0, -1.0, -1.0], [-2.0, -1.5, -1.0]])  # only the dirty row differs
    adv = jnp.zeros((2, 3))
    k3 = lambda d: math.exp(d) - d - 1  # d = log π_ref − log π
    kw = dict(clean=clean, ref_logp=ref, kl_coef=1.0)
    glob, _ = L.policy_loss_parts(lp, lp, adv, resp, reduction="global", **kw)
    seg, _ = L.policy_loss_parts(lp, lp, adv, resp, **kw)
    assert float(glob["kl"].total) == pytest.approx(k3(-1.0) + k3(-0.5), rel=1e-6)
    assert float(glob["kl"].denom) == 5.0
    assert float(seg["kl"].total) == 0.0 and float(seg["kl"].denom) == 5.0


def test_entropy_part():
    ent = jnp.array([[1.0, 3.0, 100.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    assert float(L.combine({"e": L.entropy_loss(ent, mask, coef=0.1)})) == pytest.approx(-0.2)
    assert float(L.combine({"e": L.entropy_loss(ent, mask)})) == 0.0


def test_support_loss_hand_values():
    probs = np.array([[0.9, 0.08, 0.02], [0.7, 0.29, 0.01]], np.float32)
    scores = jnp.log(jnp.asarray(probs)) + jnp.array([[3.0], [-1.0]])  # softmax-invariant shift
    part, m = L.support_loss(scores, rho=0.5)
    # π̄ = [0.8, 0.185, 0.015]; only agentic < δ: ln(0.05/0.015) = ln(10/3); L = that / 3
    assert float(part.total) == pytest.approx(math.log(10 / 3) / 3, rel=1e-5)
    assert part.coef == pytest.approx(0.001)
    assert float(L.combine({"s": part})) == pytest.approx(0.001 * math.log(10 / 3) / 3, rel=1e-5)
    assert float(m["support/pibar_agentic"]) == pytest.approx(0.015, rel=1e-5)
    assert float(m["support/penalty_single"]) == 0.0
    assert float(m["support/n_queries"]) == 2.0
    value, cot = L.support_score_cotangent(scores, rho=0.5)
    assert float(value) == pytest.approx(float(L.combine({"s": part})), rel=1e-6)
    assert cot.shape == (2, 3)
    np.testing.assert_allclose(cot.sum(axis=1), 0.0, atol=1e-8)  # softmax shift-invariance
    assert float(cot[:, 2].min()) < 0  # raising the agentic score lowers the loss


def test_support_loss_zero_when_supported():
    scores = jnp.log(jnp.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.9, 0.06, 0.04]]))
    part, _ = L.support_loss(scores, rho=1.0)
    assert float(part.total) == 0.0
    _, cot = L.support_score_cotangent(scores, rho=1.0)
    np.testing.assert_array_equal(cot, 0.0)
    with pytest.raises(AssertionError):
        L.support_loss(jnp.zeros((4, 2)), rho=1.0)
