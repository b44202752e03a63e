"""Advantage estimators (docs/algorithm.md, "Advantages"): properties, an oracle, hand examples."""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_routeweaver.rl.core.advantages import (
    EPS,
    Advantages,
    check_identity,
    comet_gdpo,
    comet_grpo,
    grpo_gated,
    identity_error,
    mode_token_mask,
    validate_inputs,
)

G, K, T = 4, 4, 10
N = G * K
EXAMPLES = settings(max_examples=200, deadline=None)

_grpo = jax.jit(lambda r, g, c, m: grpo_gated(r, g, c, m, num_groups=G))
_comet = jax.jit(lambda r, g, c, f, mo, s, m: comet_grpo(r, g, c, f, mo, s, m, num_groups=G))
_gdpo = jax.jit(lambda tr, er, g, c, f, mo, s, m, a, cc: comet_gdpo(
    tr, er, g, c, f, mo, s, m, alpha=a, num_groups=G, cost_complete=cc))


def np_out(adv: Advantages) -> Advantages:
    return Advantages(*(np.asarray(x) for x in adv))


def run_comet(b):
    return np_out(_comet(b["r"], b["g"], b["clean"], b["forced"], b["mode"], b["span"], b["mask"]))


def run_gdpo(b, alpha):
    return np_out(_gdpo(b["r"], b["eff"], b["g"], b["clean"], b["forced"], b["mode"], b["span"],
                        b["mask"], np.float32(alpha), b["cc"]))


def run_grpo(b):
    return np_out(_grpo(b["r"], b["g"], b["clean"], b["mask"]))


REWARD = st.one_of(st.sampled_from([-1.0, 0.0, 1.0]),
                   st.floats(-2.0, 2.0, allow_nan=False, allow_subnormal=False, width=32))


@st.composite
def batches(draw, modes=None, rewards=None):
    """A batch of N rows in G groups (shuffled row order); modes/rewards may be overridden."""
    g = np.array(draw(st.permutations(np.repeat(np.arange(G), K).tolist())), np.int32)
    forced_g = np.array(draw(st.lists(st.booleans(), min_size=G, max_size=G)))
    b = {
        "g": g,
        "r": np.array(draw(st.lists(REWARD, min_size=N, max_size=N)), np.float32),
        "eff": np.array(draw(st.lists(REWARD, min_size=N, max_size=N)), np.float32),
        "clean": np.array(draw(st.lists(st.booleans(), min_size=N, max_size=N)) if draw(
            st.booleans()) else [True] * N),
        "cc": np.array(draw(st.lists(st.booleans(), min_size=N, max_size=N)) if draw(
            st.booleans()) else [True] * N),
        "forced": forced_g[g],
        "mode": np.array(draw(st.lists(st.integers(0, 3), min_size=N, max_size=N)), np.int32),
        "span": np.array(draw(st.lists(st.integers(0, T), min_size=N, max_size=N)), np.int32),
        "mask": np.array(draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T),
                                       min_size=N, max_size=N))).astype(np.float32),
    }
    if modes is not None:
        b["mode"] = modes(g).astype(np.int32)
    if rewards is not None:
        b["r"] = rewards(g).astype(np.float32)
    return b


# --------------------------------------------------------------------------- oracle
def oracle_component(r, g, surv, free, mode):
    """Literal float64 transcription of docs/algorithm.md, "Group statistics and the
    zero-variance gate" and "COMET-GRPO", for one reward component."""
    a_mode, a_inner, a_grpo = (np.zeros(len(r)) for _ in range(3))
    for grp in np.unique(g):
        rows = np.flatnonzero((g == grp) & surv)
        if len(rows) == 0:
            continue
        if len(rows) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu, sd = r[rows].mean(), r[rows].std(ddof=1)
            if sd < 1e-4:
                continue
        for i in rows:
            a_grpo[i] = (r[i] - mu) / (sd + EPS)
            if free[i]:
                mu_m = r[rows][mode[rows] == mode[i]].mean()
                a_mode[i] = (mu_m - mu) / (sd + EPS)
                a_inner[i] = (r[i] - mu_m) / (sd + EPS)
            else:
                a_inner[i] = a_grpo[i]
    return a_mode, a_inner, a_grpo


def oracle_tokens(a_mode, a_inner, free, span, mask):
    t = np.arange(mask.shape[1])[None, :]
    return np.where(free[:, None] & (t < span[:, None]), a_mode[:, None], a_inner[:, None]) * mask


def assert_adv_close(out, a_mode, a_inner, a_grpo, tokens, tol=2e-4):
    for got, want in ((out.a_mode, a_mode), (out.a_inner, a_inner), (out.a_grpo, a_grpo),
                      (out.token_advantages, tokens)):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.slow
@EXAMPLES
@given(batches())
def test_comet_matches_oracle(b):
    free = ~b["forced"]
    am, ai, ag = oracle_component(b["r"].astype(np.float64), b["g"], b["clean"], free, b["mode"])
    out = run_comet(b)
    assert_adv_close(out, am, ai, ag, oracle_tokens(am, ai, free, b["span"], b["mask"]))


@pytest.mark.slow
@EXAMPLES
@given(batches(), st.sampled_from([0.1, 0.3, 0.5, 1.0]))
def test_gdpo_matches_oracle(b, alpha):
    free = ~b["forced"]
    surv = b["clean"] & b["cc"]
    t = oracle_component(b["r"].astype(np.float64), b["g"], surv, free, b["mode"])
    e = oracle_component(b["eff"].astype(np.float64), b["g"], surv, free, b["mode"])
    am, ai, ag = ((1 - alpha) * x + alpha * y for x, y in zip(t, e, strict=True))
    out = run_gdpo(b, alpha)
    assert_adv_close(out, am, ai, ag, oracle_tokens(am, ai, free, b["span"], b["mask"]))


@pytest.mark.slow
@EXAMPLES
@given(batches())
def test_grpo_gated_matches_oracle(b):
    _, _, ag = oracle_component(b["r"].astype(np.float64), b["g"], b["clean"],
                                np.zeros(N, bool), b["mode"])
    out = run_grpo(b)
    assert_adv_close(out, np.zeros(N), ag, ag, ag[:, None] * b["mask"])


# --------------------------------------------------------------------------- properties
@pytest.mark.slow
@EXAMPLES
@given(batches(), st.sampled_from([0.0, 0.3, 0.7]))
def test_identity(b, alpha):
    out = run_comet(b)
    check_identity(out, b["forced"], b["clean"])
    assert float(identity_error(out, b["forced"], b["clean"])) <= 1e-4 * (
        1 + np.abs(out.a_grpo).max())
    check_identity(run_gdpo(b, alpha), b["forced"], b["clean"])


@pytest.mark.slow
@EXAMPLES
@given(batches(), st.data())
def test_permutation_invariance(b, data):
    perm = np.array(data.draw(st.permutations(range(N))))
    out = run_comet(b)
    permuted = run_comet({k: v[perm] for k, v in b.items()})
    for x, y in zip(out, permuted, strict=True):
        np.testing.assert_allclose(x[perm], y, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@EXAMPLES
@given(batches())
def test_gdpo_alpha_zero_is_comet_grpo(b):
    for x, y in zip(run_gdpo(b, 0.0), run_comet(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
@EXAMPLES
@given(batches(modes=lambda g: g % 4))
def test_one_mode_groups_have_zero_a_mode(b):
    # μ_m = μ needs ≥ 2 survivors: a singleton group has μ := 0, so A_mode = r there
    # (docs/algorithm.md, "COMET-GRPO").
    out = run_comet(b)
    multi = np.bincount(b["g"], weights=b["clean"], minlength=G)[b["g"]] >= 2
    np.testing.assert_allclose(out.a_mode[multi], 0.0, atol=1e-5)
    np.testing.assert_allclose(out.a_inner, out.a_grpo - out.a_mode, rtol=1e-5, atol=1e-5)
    single = ~multi & b["clean"] & ~b["forced"]
    np.testing.assert_allclose(out.a_mode[single], b["r"][single] / (1 + EPS), rtol=1e-6,
                               atol=1e-30)  # XLA CPU flushes subnormals


def _distinct_modes(g):
    mode = np.zeros_like(g)
    for grp in range(G):
        mode[g == grp] = np.arange(K)
    return mode


@pytest.mark.slow
@EXAMPLES
@given(batches(modes=_distinct_modes))
def test_single_sample_modes_have_zero_a_inner(b):
    out = run_comet(b)
    np.testing.assert_allclose(out.a_inner[~b["forced"]], 0.0, atol=1e-5)
    np.testing.assert_allclose(out.a_mode, np.where(b["forced"], 0.0, out.a_grpo),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@EXAMPLES
@given(batches(rewards=lambda g: (g % 3 - 1).astype(float)), st.sampled_from([0.0, 0.5]))
def test_zero_variance_groups_are_zeroed(b, alpha):
    n_clean = np.bincount(b["g"], weights=b["clean"], minlength=G)
    multi = n_clean[b["g"]] >= 2
    for out in (run_comet(b), run_grpo(b)):
        for x in out:
            assert np.all(x[multi] == 0.0)
    b["eff"] = (b["g"] % 2).astype(np.float32)  # both GDPO components constant per group
    surv = b["clean"] & b["cc"]
    multi_s = np.bincount(b["g"], weights=surv, minlength=G)[b["g"]] >= 2
    sel = multi_s if alpha else multi
    for x in run_gdpo(b, alpha):
        assert np.all(x[sel] == 0.0)


@pytest.mark.slow
@EXAMPLES
@given(batches(), st.lists(st.floats(-1e6, 1e6, width=32) | st.just(float("nan")),
                          min_size=N, max_size=N), st.sampled_from([0.0, 0.4]))
def test_dirty_rows_have_no_influence_and_zero_advantage(b, junk, alpha):
    b2 = dict(b)
    b2["r"] = np.where(b["clean"], b["r"], np.array(junk, np.float32))
    b2["eff"] = np.where(b["clean"] & b["cc"], b["eff"], np.array(junk, np.float32)[::-1])
    for run in (run_comet, run_grpo, lambda x: run_gdpo(x, alpha)):
        out, out2 = run(b), run(b2)
        for x, y in zip(out, out2, strict=True):
            np.testing.assert_array_equal(x, y)
            assert np.all(y[~b["clean"]] == 0.0)
    gd = run_gdpo(b, 0.4)
    for x in gd:
        assert np.all(x[~(b["clean"] & b["cc"])] == 0.0)


@pytest.mark.slow
@EXAMPLES
@given(batches())
def test_forced_rows_get_plain_grpo_on_all_tokens(b):
    out, plain = run_comet(b), run_grpo(b)
    f = b["forced"]
    np.testing.assert_array_equal(out.a_mode[f], 0.0)
    np.testing.assert_allclose(out.a_grpo, plain.a_grpo, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.token_advantages[f], plain.token_advantages[f],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.token_advantages[f],
                               out.a_grpo[f, None] * b["mask"][f], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@EXAMPLES
@given(batches())
def test_mode_tokens_carry_a_mode(b):
    out = run_comet(b)
    mm = np.asarray(mode_token_mask(b["forced"], b["span"], b["mask"]))
    rows = np.broadcast_to(np.arange(N)[:, None], mm.shape)
    np.testing.assert_array_equal(out.token_advantages[mm], out.a_mode[rows[mm]])
    inner = ~mm & (b["mask"] != 0)
    np.testing.assert_array_equal(out.token_advantages[inner], out.a_inner[rows[inner]])
    np.testing.assert_array_equal(out.token_advantages[b["mask"] == 0], 0.0)


# --------------------------------------------------------------------------- hand examples
def _rows(r, g, clean=None, forced=None, mode=None, span=None, t=4):
    n = len(r)
    return dict(
        rewards=np.array(r, np.float32), group_ids=np.array(g, np.int32),
        clean=np.ones(n, bool) if clean is None else np.array(clean),
        forced=np.zeros(n, bool) if forced is None else np.array(forced),
        mode_ids=np.zeros(n, np.int32) if mode is None else np.array(mode, np.int32),
        mode_span_end=np.full(n, 2, np.int32) if span is None else np.array(span, np.int32),
        response_mask=np.ones((n, t), np.float32))


def test_hand_example_free_group_three_modes():
    # r = [1, 0, -1], modes [single, single, agentic]: μ = 0, σ = sqrt(2/2) = 1,
    # μ_single = 1/2, μ_agentic = -1.
    x = _rows([1, 0, -1], [0, 0, 0], mode=[0, 0, 2], span=[1, 2, 3])
    out = comet_grpo(**x, num_groups=1)
    d = 1 + EPS
    np.testing.assert_allclose(out.a_grpo, [1 / d, 0, -1 / d], rtol=1e-6)
    np.testing.assert_allclose(out.a_mode, [0.5 / d, 0.5 / d, -1 / d], rtol=1e-6)
    np.testing.assert_allclose(out.a_inner, [0.5 / d, -0.5 / d, 0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out.token_advantages, [
        [0.5 / d, 0.5 / d, 0.5 / d, 0.5 / d],
        [0.5 / d, 0.5 / d, -0.5 / d, -0.5 / d],
        [-1 / d, -1 / d, -1 / d, 0],
    ], rtol=1e-6, atol=1e-7)


def test_hand_example_forced_dirty_singleton_and_invalid_bucket():
    # group 0 (forced): r = [1, 1, 0, 0]: μ = 1/2, σ = sqrt(4·(1/4)/3) = sqrt(1/3).
    # group 1 (free): rows 4 and 5 dirty, only row 6 clean → singleton: A_mode = r/(1+ε).
    # group 2 (free): r = [1, 0, 1, 0]: modes [invalid, invalid, multi, multi]:
    #   μ = 1/2, σ = sqrt(1/3), μ_invalid = μ_multi = 1/2 → A_mode = 0, A_inner = A_grpo.
    # group 3 (free): r = [1, 1]: σ = 0 → zeroed.
    x = _rows([1, 1, 0, 0, 5, -5, -1, 1, 0, 1, 0, 1, 1], [0] * 4 + [1] * 3 + [2] * 4 + [3] * 2,
              clean=[True] * 4 + [False, False] + [True] * 7,
              forced=[True] * 4 + [False] * 9,
              mode=[0] * 4 + [0, 1, 2] + [3, 3, 1, 1] + [0, 0])
    out = comet_grpo(**x, num_groups=4)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    s = -1 / (1 + EPS)
    np.testing.assert_allclose(out.a_grpo, [a, a, -a, -a, 0, 0, s, a, -a, a, -a, 0, 0],
                               rtol=1e-6)
    np.testing.assert_allclose(out.a_mode, [0] * 6 + [s] + [0] * 6, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out.a_inner, [a, a, -a, -a, 0, 0, 0, a, -a, a, -a, 0, 0],
                               rtol=1e-6, atol=1e-6)
    # Forced rows: plain GRPO on every token; mode_span_end is ignored for them.
    np.testing.assert_allclose(out.token_advantages[:4], np.repeat([[a], [a], [-a], [-a]], 4, 1),
                               rtol=1e-6)
    np.testing.assert_allclose(out.token_advantages[6], [s, s, 0, 0], rtol=1e-6)
    plain = grpo_gated(x["rewards"], x["group_ids"], x["clean"], x["response_mask"], num_groups=4)
    np.testing.assert_allclose(plain.a_grpo, out.a_grpo, rtol=1e-6)
    np.testing.assert_allclose(plain.token_advantages[6], [s] * 4, rtol=1e-6)


def test_hand_example_gdpo():
    # Free pair with different modes, task r = [1, -1], eff r = [0.2, 0.6], α = 0.3.
    # task: μ = 0, σ = sqrt(2) → A_mode,task = ±1/(sqrt(2)+ε), A_inner,task = 0.
    # eff:  μ = 0.4, σ = sqrt(0.08) → A_mode,eff = ∓0.2/(sqrt(0.08)+ε).
    # Second (forced) group: task r = [1, 0], eff constant 0.5 → eff gated, contributes 0;
    # task μ = 1/2, σ = sqrt(1/2). Third group: row 7 cost-incomplete → singleton row 6.
    x = _rows([1, -1, 1, 0, 0, 1, 1, -1], [0, 0, 1, 1, 2, 2, 3, 3],
              clean=[True] * 4 + [False, False, True, True],
              forced=[False, False, True, True, False, False, False, False],
              mode=[0, 2, 1, 1, 0, 0, 1, 1])
    eff = np.array([0.2, 0.6, 0.5, 0.5, 1, 1, 0.25, 0.75], np.float32)
    cc = np.array([True] * 7 + [False])
    alpha = 0.3
    out = comet_gdpo(x["rewards"], eff, x["group_ids"], x["clean"], x["forced"], x["mode_ids"],
                     x["mode_span_end"], x["response_mask"], alpha=alpha, num_groups=4,
                     cost_complete=cc)
    at = 1 / (math.sqrt(2) + EPS)
    ae = 0.2 / (math.sqrt(0.08) + EPS)
    af = 0.5 / (math.sqrt(0.5) + EPS)
    m0 = (1 - alpha) * at - alpha * ae
    # row 6: singleton over survivors: task 1/(1+ε), eff 0.25/(1+ε) both on A_mode.
    s6 = ((1 - alpha) * 1 + alpha * 0.25) / (1 + EPS)
    np.testing.assert_allclose(out.a_mode, [m0, -m0, 0, 0, 0, 0, s6, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.a_inner, [0, 0, (1 - alpha) * af, -(1 - alpha) * af,
                                             0, 0, 0, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.a_grpo, [m0, -m0, (1 - alpha) * af, -(1 - alpha) * af,
                                            0, 0, s6, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.token_advantages[0], [m0, m0, 0, 0], rtol=1e-5, atol=1e-6)
    # α = 0 delegates to comet_grpo, which ignores cost completeness: row 7 is back in.
    out0 = comet_gdpo(x["rewards"], eff, x["group_ids"], x["clean"], x["forced"],
                      x["mode_ids"], x["mode_span_end"], x["response_mask"], alpha=0.0,
                      num_groups=4, cost_complete=cc)
    np.testing.assert_allclose(out0.a_grpo[6:], [at, -at], rtol=1e-6)


def test_hand_example_gdpo_both_components_zero_variance():
    x = _rows([1, 1], [0, 0], mode=[0, 1])
    out = comet_gdpo(x["rewards"], np.array([0.3, 0.3], np.float32), x["group_ids"], x["clean"],
                     x["forced"], x["mode_ids"], x["mode_span_end"], x["response_mask"],
                     alpha=0.5, num_groups=1)
    for v in out:
        assert np.all(np.asarray(v) == 0.0)


def test_near_threshold_gate_is_strict():
    # σ of [0, 2e-4] is sqrt(2)·1e-4 ≥ 1e-4 → kept; of [0, 1e-4] is 0.707e-4 → zeroed.
    keep = grpo_gated(np.array([0, 2e-4], np.float32), np.array([0, 0], np.int32),
                      np.ones(2, bool), np.ones((2, 1), np.float32), num_groups=1)
    assert np.all(np.asarray(keep.a_grpo) != 0)
    drop = grpo_gated(np.array([0, 1e-4], np.float32), np.array([0, 0], np.int32),
                      np.ones(2, bool), np.ones((2, 1), np.float32), num_groups=1)
    assert np.all(np.asarray(drop.a_grpo) == 0)


# --------------------------------------------------------------------------- helpers / guards
def test_check_identity_detects_violation():
    bad = Advantages(None, np.array([1.0, 0.0]), np.array([1.0, 0.0]), np.array([1.0, 0.0]))
    with pytest.raises(AssertionError, match="rows \\[0\\]"):
        check_identity(bad, np.array([False, False]), np.array([True, True]))
    # Forced or dirty rows are not checked.
    check_identity(bad, np.array([True, False]), np.array([True, True]))
    check_identity(bad, np.array([False, False]), np.array([False, True]))
    assert float(identity_error(bad, np.array([False, False]), np.array([True, True]))) == 1.0


def test_debug_flag_runs_under_jit():
    x = _rows([1, 0, -1, 1], [0, 0, 0, 0], mode=[0, 1, 1, 3])
    f = jax.jit(lambda r: comet_grpo(r, *list(x.values())[1:], num_groups=1, debug=True))
    out = f(x["rewards"])
    jax.block_until_ready(out)
    check_identity(out, x["forced"], x["clean"])


def test_validate_inputs():
    validate_inputs([0, 0, 1, 1], [True, True, False, False], [0, 0, 3, 4], num_groups=2)
    with pytest.raises(ValueError, match="mixing"):
        validate_inputs([0, 0, 1, 1], [True, False, False, False], [5] * 4, num_groups=2)
    with pytest.raises(ValueError, match="mode_span_end"):
        validate_inputs([0, 0], [False, False], [3, -1], num_groups=1)
    validate_inputs([0, 0], [False, False], [3, -1], num_groups=1, clean=[True, False])
    validate_inputs([0, 0], [True, True], [-1, -1], num_groups=1)
    with pytest.raises(ValueError, match="group ids"):
        validate_inputs([0, 2], [True, True], [0, 0], num_groups=2)


def test_shape_and_dtype_asserts():
    x = _rows([1, 0], [0, 0])
    with pytest.raises(AssertionError):
        comet_grpo(**{**x, "response_mask": np.ones((3, 4), np.float32)}, num_groups=1)
    with pytest.raises(AssertionError):
        comet_grpo(**{**x, "clean": np.ones(2, np.float32)}, num_groups=1)
    with pytest.raises(AssertionError):
        comet_grpo(**{**x, "mode_ids": np.zeros(3, np.int32)}, num_groups=1)
    with pytest.raises(AssertionError):
        grpo_gated(np.array([1, 0], np.int32), x["group_ids"], x["clean"], x["response_mask"],
                   num_groups=1)
