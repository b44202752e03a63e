"""Tests for jax_routeweaver.rl.curriculum (docs/algorithm.md, "The forced-mode curriculum")."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from jax_routeweaver.rl import curriculum as C


@pytest.mark.parametrize(
    ("b", "rho"),
    [
        (-5, 1.0),
        (0, 1.0),
        (24, 1.0),
        (25, 1.0),
        (26, 0.98),
        (50, 0.5),
        (74, 0.02),
        (75, 0.0),
        (89, 0.0),
        (1000, 0.0),
    ],
)
def test_forced_ratio_paper_schedule(b, rho):
    assert C.forced_ratio(b) == pytest.approx(rho, abs=1e-12)


def test_phase_schedules():
    cold = C.COLD_PHASE.exploration
    assert all(C.forced_ratio(C.batch_index_for_step(s), cold) == 1.0 for s in range(1, 26))
    assert C.phase_for_step(1).name == "cold"
    assert C.phase_for_step(25).name == "cold"
    main = C.phase_for_step(26)
    assert (main.name, main.reduction, main.estimator, main.support) == (
        "main",
        "segment",
        "comet_grpo",
        True,
    )
    assert C.forced_ratio(C.batch_index_for_step(26), main.exploration) == 1.0  # b = 25
    assert C.forced_ratio(C.batch_index_for_step(75), main.exploration) == pytest.approx(0.02)
    assert C.forced_ratio(C.batch_index_for_step(76), main.exploration) == 0.0
    with pytest.raises(ValueError):
        C.phase_for_step(91)
    with pytest.raises(ValueError):
        C.batch_index_for_step(0)
    assert C.forced_ratio(0, C.WO_PROGRESSIVE) == 0.0
    assert C.support_lambda(0, C.WO_PROGRESSIVE) == 0.0
    with pytest.raises(ValueError):
        C.ExplorationConfig(forced_anneal_steps=0)


def test_support_lambda():
    assert C.support_lambda(10) == pytest.approx(0.002)
    assert C.support_lambda(50) == pytest.approx(0.001)
    assert C.support_lambda(75) == 0.0


def test_query_draw_matches_spec_formula_and_is_deterministic():
    for sid in ["q0", "math-000123", "ünïcode"]:
        expected = int(hashlib.sha256(sid.encode()).hexdigest()[:16], 16) / 2**64
        assert C.query_draw(sid) == expected
        assert 0.0 <= C.query_draw(sid) < 1.0
    assert C.query_draw("a") != C.query_draw("b")


def test_is_forced_rule():
    ids = [f"q{i}" for i in range(4000)]
    assert all(C.is_forced(s, 25) for s in ids[:50])
    assert not any(C.is_forced(s, 75) for s in ids[:50])
    for sid in ids[:200]:
        assert C.is_forced(sid, 50) == (C.query_draw(sid) < 0.5)
    share = sum(C.is_forced(s, 50) for s in ids) / len(ids)
    assert 0.45 < share < 0.55
    # monotone in ρ: forced at a later (smaller-ρ) batch implies forced earlier
    for sid in ids[:200]:
        if C.is_forced(sid, 60):
            assert C.is_forced(sid, 40)
    with pytest.raises(ValueError):
        C.is_forced("q0", 50, stage2_arm="free")


def test_balanced_modes():
    ids = [f"row-{i}" for i in range(32)]
    modes = C.balanced_forced_modes(ids)
    assert sorted(Counter(modes).values()) == [10, 11, 11]
    C.check_balanced(modes)
    # deterministic and independent of row order
    rev = C.balanced_forced_modes(ids[::-1])[::-1]
    assert rev == modes
    assert C.balanced_forced_modes(ids) == modes
    with pytest.raises(ValueError):
        C.check_balanced(["single"] * 12 + ["multi"] * 10 + ["agentic"] * 10)
    with pytest.raises(ValueError):
        C.check_balanced(["single", "multi", "bogus"])
    with pytest.raises(ValueError):
        C.balanced_forced_modes(["a", "a"])


def test_plan_batch_k_rollouts_share_verdict():
    cfg = C.ExplorationConfig()
    ids = [f"row-{i}" for i in range(32)]
    plans = C.plan_batch(ids, 50, cfg)
    assert len(plans) == 32 * 8
    by_query: dict[str, list[C.RolloutPlan]] = {}
    for p in plans:
        by_query.setdefault(p.sample_id, []).append(p)
    assert all(len(v) == 8 for v in by_query.values())
    for sid, group in by_query.items():
        assert {p.rollout for p in group} == set(range(8))
        assert len({(p.forced, p.forced_mode) for p in group}) == 1
        assert group[0].forced == C.is_forced(sid, 50, cfg)
        assert (group[0].forced_mode is not None) == group[0].forced
    n_forced = sum(g[0].forced for g in by_query.values())
    assert 0 < n_forced < 32
    assert C.plan_batch(ids, 50, cfg) == plans
    assert len(C.plan_batch(ids, 50, cfg, group_size=3)) == 32 * 3
    full = C.plan_batch(ids, 0, cfg)
    assert all(p.forced for p in full)
    assert sorted(Counter(p.forced_mode for p in full if p.rollout == 0).values()) == [10, 11, 11]
    assert not any(p.forced for p in C.plan_batch(ids, 80, cfg))
    with pytest.raises(ValueError):
        C.plan_batch(ids[:2], 0, cfg, forced_modes=["single", "nope"])
