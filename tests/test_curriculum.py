"""Tests for jax_routeweaver.rl.learner.curriculum (docs/algorithm.md, "The forced-mode
curriculum")."""

from __future__ import annotations

import hashlib
from collections import Counter

import paper_schedule as P
import pytest

from jax_routeweaver.rl.learner import curriculum as C


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
    cold = P.COLD_PHASE.exploration
    assert all(C.forced_ratio(P.batch_index_for_step(s), cold) == 1.0 for s in range(1, 26))
    assert P.phase_for_step(1).name == "cold"
    assert P.phase_for_step(25).name == "cold"
    main = P.phase_for_step(26)
    assert (main.name, main.reduction, main.estimator, main.support) == (
        "main",
        "segment",
        "comet_grpo",
        True,
    )
    assert C.forced_ratio(P.batch_index_for_step(26), main.exploration) == 1.0  # b = 25
    assert C.forced_ratio(P.batch_index_for_step(75), main.exploration) == pytest.approx(0.02)
    assert C.forced_ratio(P.batch_index_for_step(76), main.exploration) == 0.0
    with pytest.raises(ValueError):
        P.phase_for_step(91)
    with pytest.raises(ValueError):
        P.batch_index_for_step(0)
    assert C.forced_ratio(0, P.WO_PROGRESSIVE) == 0.0
    assert P.support_lambda(0, P.WO_PROGRESSIVE) == 0.0
    with pytest.raises(ValueError):
        C.ExplorationConfig(forced_anneal_steps=0)


def test_support_lambda():
    assert P.support_lambda(10) == pytest.approx(0.002)
    assert P.support_lambda(50) == pytest.approx(0.001)
    assert P.support_lambda(75) == 0.0


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
    P.check_balanced(modes)
    # deterministic and independent of row order
    rev = C.balanced_forced_modes(ids[::-1])[::-1]
    assert rev == modes
    assert C.balanced_forced_modes(ids) == modes
    with pytest.raises(ValueError):
        P.check_balanced(["single"] * 12 + ["multi"] * 10 + ["agentic"] * 10)
    with pytest.raises(ValueError):
        P.check_balanced(["single", "multi", "bogus"])
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


def test_question_floor_weight_takes_over_as_forcing_ends():
    cfg = C.ExplorationConfig(question_floor=0.05, question_floor_weight=0.2)
    assert C.question_floor_weight(1.0, cfg) == 0.0
    assert C.question_floor_weight(0.25, cfg) == pytest.approx(0.15)
    assert C.question_floor_weight(0.0, cfg) == pytest.approx(0.2)
    # Off without a floor, whatever its weight; the paper's default is off.
    assert C.question_floor_weight(0.0, C.ExplorationConfig(question_floor_weight=1.0)) == 0.0
    assert C.ExplorationConfig().question_floor == 0.0
    with pytest.raises(ValueError, match="question_floor=0.4"):
        C.ExplorationConfig(question_floor=0.4)


@pytest.mark.parametrize("override, key", [
    ("algo.exploration.question_floor=0.5", "algo.exploration.question_floor"),
    ("algo.loss.question_floor=0.1", "algo.loss.question_floor"),  # not a loss field
    ("algo.loss.question_floor_weight=1", "algo.loss.question_floor_weight"),
])
def test_bad_question_floor_settings_name_the_field(override, key):
    from pathlib import Path

    from jax_routeweaver.config import ConfigError
    from jax_routeweaver.rl.run.train_config import load_train_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_train_config(quickstart, [override])


@pytest.mark.slow
def test_declaration_rows_are_scored_when_either_term_has_weight():
    """The support loss needs rows while ρ > 0; the per-question floor after the forced
    phase (ρ = 0) too; with neither, none are built."""
    import io
    from pathlib import Path

    from rich.console import Console

    from jax_routeweaver.rl.run import builders
    from jax_routeweaver.rl.run.routeweaver_run import declaration_rows
    from jax_routeweaver.rl.run.train_config import load_train_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    base = ["model.init=random", "data.synthetic_queries=20"]
    cfg = load_train_config(quickstart, base)
    records = builders.build_records(cfg, Console(file=io.StringIO()))
    tokenizer = builders.build_tokenizer(cfg, records, builders.build_pool(cfg, records))
    batch = records[:4]
    assert declaration_rows(cfg, tokenizer, batch, rho=1.0).query.max() == 3
    assert declaration_rows(cfg, tokenizer, batch, rho=0.0) is None
    floor = load_train_config(quickstart, [*base, "algo.exploration.question_floor=0.05",
                                           "algo.exploration.question_floor_weight=0.5"])
    rows = declaration_rows(floor, tokenizer, batch, rho=0.0)
    assert rows is not None and int((rows.query >= 0).sum()) == 4 * 3
    off = load_train_config(quickstart, [*base, "algo.support=false"])
    assert declaration_rows(off, tokenizer, batch, rho=1.0) is None


@pytest.mark.slow
def test_the_learner_takes_its_declaration_terms_from_exploration():
    from pathlib import Path

    from jax_routeweaver.models.sharding import make_mesh
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.rl.run import builders
    from jax_routeweaver.rl.run.train_config import load_train_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    cfg = load_train_config(quickstart, [
        "model.init=random", "model.tokenizer=qwen3", "algo.exploration.question_floor=0.04",
        "algo.exploration.question_floor_weight=0.3", "algo.exploration.support_floor=0.1",
        "algo.loss.micro_batch_size=8"])
    mesh = make_mesh((1, -1, 1))
    model = builders.random_policy(cfg, mesh, build_qwen3_tokenizer())
    terms = builders.build_trainer(cfg, model, mesh).declarations
    assert (terms.support_lambda0, terms.support_floor) == (0.002, 0.1)
    assert (terms.question_floor, terms.question_floor_weight) == (0.04, 0.3)
    off = load_train_config(quickstart, ["model.init=random", "algo.support=false",
                                         "algo.loss.micro_batch_size=8"])
    assert builders.build_trainer(off, model, mesh).declarations.support_lambda0 == 0.0
