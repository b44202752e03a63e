"""`routeweaver eval favourites`: forced rollouts per (domain, mode), their statistics, the CLI.

Two real measurements, each built and compiled once per module: the quickstart's initial
policy measured in process at α = 0, and the same policy saved as a training run directory
measured through the CLI (config and tokenizer found from the run) at α = 1. Same seed, same
weights, same tokenizer: the episodes must be the same, only the rewards differ.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import pytest
from rich.console import Console

from jax_routeweaver.cli.app import main
from jax_routeweaver.config import dump_config
from jax_routeweaver.eval import favourites as fav
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rl.run.builders import build_policy, build_pool, build_records, build_tokenizer
from jax_routeweaver.rl.run.checkpoint import save_policy
from jax_routeweaver.rl.run.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
R1_QUICKSTART = ROOT / "configs" / "router_r1_quickstart.yaml"
# 8 questions per domain to draw from; all 60 episodes (5 domains x 2 questions x 3 modes x
# 2 samples) in one batch (10 x 6); few prompt buckets (fewer compiles).
FAST = ["model.init=random", "data.synthetic_queries=40", "data.group_size=6",
        "rollout.prompt_buckets=[256,1024,4096]"]
PER_DOMAIN, SAMPLES, SEED = 2, 2, 3
DOMAINS = ["MATH", "CODE", "KNOWLEDGE", "REASON", "RECALL"]
EPISODE_KEYS = ("domain", "sample_id", "mode", "declared", "repeat", "r_task", "r_eff",
                "correct", "cost_usd", "clean", "violation", "workers")


def quiet() -> Console:
    return Console(file=io.StringIO())


@pytest.fixture(scope="module")
def measured() -> fav.FavouritesResult:
    """The quickstart's initial policy (model.init: random), measured in process at α = 0."""
    cfg = load_train_config(QUICKSTART, FAST)
    return fav.measure_favourites(cfg, checkpoint=None, per_domain=PER_DOMAIN, samples=SAMPLES,
                                  seed=SEED, console=quiet(), progress=False)


@pytest.fixture(scope="module")
def via_cli(tmp_path_factory) -> tuple[int, str, Path, Path]:
    """The same initial policy saved as a training run (policy step 1, its tokenizer and
    config.yaml), measured by `routeweaver eval favourites --checkpoint RUN` at α = 1.
    Returns (exit code, stdout, run directory, output directory)."""
    root = tmp_path_factory.mktemp("favourites")
    run, out = root / "run", root / "out"
    cfg = load_train_config(QUICKSTART, [*FAST, f"out_dir={run}"])
    records = build_records(cfg, quiet())
    tokenizer = build_tokenizer(cfg, records, build_pool(cfg, records))
    tokenizer.save_pretrained(str(run / "tokenizer"))
    model = build_policy(cfg, make_mesh((1, -1, 1)), tokenizer)
    save_policy(model, run / "checkpoints" / "policy", 1, tokenizer_dir=run / "tokenizer")
    dump_config(cfg, run / "config.yaml")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["eval", "favourites", "--checkpoint", str(run), "--per-domain",
                     str(PER_DOMAIN), "--samples", str(SAMPLES), "--seed", str(SEED),
                     "--out", str(out), "--no-progress", "reward.alpha=1",
                     "algo.estimator=comet_gdpo"])
    return code, stdout.getvalue(), run, out


def by_cell(rows):
    cells = defaultdict(list)
    for r in rows:
        cells[(r["domain"], r["mode"])].append(r)
    return cells


def question_means(rows, key="reward"):
    per = defaultdict(list)
    for r in rows:
        per[r["sample_id"]].append(r[key])
    return {q: statistics.fmean(v) for q, v in per.items()}


# ------------------------------------------------------------------------------ measured
@pytest.mark.slow
def test_every_episode_executes_the_forced_mode(measured):
    rows = measured.rows
    assert len(rows) == len(DOMAINS) * PER_DOMAIN * len(fav.MODES) * SAMPLES
    protocol = load_train_config(QUICKSTART, FAST).rollout.protocol
    for (domain, mode), cell in by_cell(rows).items():
        assert domain in DOMAINS and mode in fav.MODES
        assert len(cell) == PER_DOMAIN * SAMPLES
        assert len({r["sample_id"] for r in cell}) == PER_DOMAIN
        assert sorted(r["repeat"] for r in cell) == sorted(list(range(SAMPLES)) * PER_DOMAIN)
    for r in rows:
        assert r["declared"] == r["mode"] and r["forced"]
        if r["violation"] is None:  # the mode's rules were followed: its number of calls
            if r["mode"] == "single":
                assert len(r["workers"]) == protocol.single_routes
            elif r["mode"] == "multi":
                assert protocol.multi_min_routes <= len(r["workers"]) <= \
                    protocol.multi_max_routes
    assert all(c.declared_share == 1.0 for c in measured.cells)
    # The first questions of each domain: the run's own training questions, in order.
    records = build_records(load_train_config(QUICKSTART, FAST), quiet())
    for domain in DOMAINS:
        first = [r.sample_id for r in records if str(r.domain) == domain][:PER_DOMAIN]
        assert sorted({r["sample_id"] for r in rows if r["domain"] == domain}) == sorted(first)


@pytest.mark.slow
def test_cells_recompute_from_the_rows(measured):
    rows = measured.rows
    assert all(r["reward"] == r["r_task"] for r in rows)  # α = 0: the task reward
    assert len(measured.cells) == len(DOMAINS) * len(fav.MODES)
    for c in measured.cells:
        cell = by_cell(rows)[(c.domain, c.mode)]
        clean = [r for r in cell if r["clean"]]
        assert (c.episodes, c.dropped) == (len(clean), len(cell) - len(clean))
        assert c.reward == pytest.approx(statistics.fmean(r["reward"] for r in clean))
        assert c.task == pytest.approx(statistics.fmean(r["r_task"] for r in clean))
        assert c.cost_usd == pytest.approx(statistics.fmean(r["cost_usd"] for r in clean))
        means = question_means(clean)
        if len(clean) == PER_DOMAIN * SAMPLES:  # balanced: the se of the question means
            se = statistics.stdev(means.values()) / math.sqrt(len(means))
            assert c.reward_se == pytest.approx(se, abs=1e-12)
    workers = {(w.domain, w.mode, w.worker): w for w in measured.workers}
    expected = defaultdict(list)
    for r in rows:
        for w in set(r["workers"]) if r["clean"] else ():
            expected[(r["domain"], r["mode"], w)].append(r["reward"])
    assert workers.keys() == expected.keys()
    for key, rewards in expected.items():
        assert workers[key].episodes == len(rewards)
        assert workers[key].reward == pytest.approx(statistics.fmean(rewards))


@pytest.mark.slow
def test_the_favourite_is_the_argmax_and_its_margin_is_paired(measured):
    assert [f.domain for f in measured.favourites] == DOMAINS
    for f in measured.favourites:
        rewards = {m: measured.cell(f.domain, m).reward for m in fav.MODES}
        best = max(rewards.values())
        assert f.mode == next(m for m in fav.MODES if rewards[m] == best)  # ties: menu order
        assert f.runner_up != f.mode
        assert f.margin == pytest.approx(best - rewards[f.runner_up])
        assert f.margin == pytest.approx(
            best - max(v for m, v in rewards.items() if m != f.mode))
        # paired by question: the se of the per-question differences
        cells = by_cell(measured.rows)
        a = question_means(cells[(f.domain, f.mode)])
        b = question_means(cells[(f.domain, f.runner_up)])
        diffs = [a[q] - b[q] for q in a]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs))
        assert f.margin_se == pytest.approx(se, abs=1e-12)
        assert f.significant == (f.margin > 2 * se)


# ------------------------------------------------------------------------------ the CLI
@pytest.mark.slow
def test_the_cli_loads_the_run_reproduces_the_episodes_and_applies_alpha(measured, via_cli):
    code, stdout, run, out = via_cli
    assert code == 0
    assert {p.name for p in out.iterdir()} == {fav.JSON_FILE, fav.MARKDOWN_FILE}
    data = json.loads((out / fav.JSON_FILE).read_text())
    assert data["meta"]["alpha"] == 1.0 and data["meta"]["seed"] == SEED
    assert data["meta"]["router"] == "quickstart@step1"
    assert data["meta"]["checkpoint"] == str(run) and data["meta"]["step"] == 1
    # Same seed, same weights and tokenizer (loaded from the run): the very same episodes.
    rows = data["rows"]
    assert [{k: r[k] for k in EPISODE_KEYS} for r in rows] == \
        [{k: r[k] for k in EPISODE_KEYS} for r in measured.rows]
    # α = 1: the reward is r_eff, S_cost = 1 / (1 + C / C_ref) when correct (no violations).
    c_ref = data["meta"]["c_ref"]
    assert all(r["reward"] == r["r_eff"] for r in rows)
    for r in rows:
        if r["violation"] is None and r["clean"]:
            s_cost = 1.0 / (1.0 + r["cost_usd"] / c_ref) if r["correct"] else 0.0
            assert r["reward"] == pytest.approx(s_cost)
            assert r["reward"] < 1.0
    # So every cell pays for its cost, and single, one call, is the cheapest mode here.
    cells_at_zero = by_cell(measured.rows)
    for c in data["cells"]:
        at_zero = measured.cell(c["domain"], c["mode"])
        paid = any(r["correct"] and r["clean"] for r in cells_at_zero[(c["domain"], c["mode"])])
        assert c["reward"] <= at_zero.reward
        assert (c["reward"] < at_zero.reward) == paid
    for domain in DOMAINS:
        cost = {c["mode"]: c["cost_usd"] for c in data["cells"] if c["domain"] == domain}
        assert cost["single"] < min(cost["multi"], cost["agentic"])
    # The written cells are the module's own reduction of the written rows.
    again = fav.FavouritesResult(data["meta"], rows, *fav.summarize(rows)).to_json()
    assert json.loads(json.dumps(again)) == data
    markdown = (out / fav.MARKDOWN_FILE).read_text()
    assert "| domain | single | multi | agentic | favourite | margin | > 2 se |" in markdown
    assert all(f"| {d} |" in markdown for d in DOMAINS)
    assert "E[reward | domain, mode] of quickstart@step1" in " ".join(stdout.split())
    assert "favourites.json" in stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--config", str(QUICKSTART), "--samples", "0"], "--samples 0: must be an integer >= 1"),
    (["--config", str(QUICKSTART), "--per-domain", "0"], "--per-domain 0: must be"),
    (["--config", str(R1_QUICKSTART)], "rollout.dialect=router_r1"),
    (["--config", str(QUICKSTART), "rollout.sampler=vllm"], "rollout.sampler=vllm"),
    ([], "--config is required"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(capsys, argv, message):
    assert main(["eval", "favourites", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("routeweaver: error: ")
    assert message in err


def test_check_options_names_the_field():
    cfg = load_train_config(QUICKSTART)
    with pytest.raises(ValueError, match="--samples -1"):
        fav.check_options(cfg, per_domain=1, samples=-1)
    with pytest.raises(ValueError, match="--per-domain 0"):
        fav.check_options(cfg, per_domain=0, samples=1)
    fav.check_options(cfg, per_domain=1, samples=1)


# ------------------------------------------------------------------------------ helpers
def row(q: str, reward: float, mode: str = "single", domain: str = "MATH", **kw) -> dict:
    return {"domain": domain, "mode": mode, "sample_id": q, "reward": reward, "r_task": reward,
            "r_eff": 0.0, "cost_usd": 0.0, "clean": True, "declared": mode,
            "workers": ["w"], **kw}


def test_clustered_se_counts_questions_not_episodes():
    # Two questions, two episodes each: identical within a question, so the episodes say
    # nothing beyond their question's mean; the se is that of the two question means.
    rows = [row("a", 1.0), row("a", 1.0), row("b", 0.0), row("b", 0.0)]
    assert fav.clustered_se((rows, 1.0)) == pytest.approx(0.5)
    naive = statistics.stdev(r["reward"] for r in rows) / 2  # episodes as independent
    assert naive < 0.5
    assert math.isnan(fav.clustered_se(([row("a", 1.0), row("a", 0.0)], 1.0)))
    # Paired: a constant per-question difference has no error, whatever the question effect.
    other = [row("a", 0.5, "multi"), row("a", 0.5, "multi"), row("b", -0.5, "multi"),
             row("b", -0.5, "multi")]
    assert fav.clustered_se((rows, 1.0), (other, -1.0)) == pytest.approx(0.0)


def test_summarize_drops_dirty_rows_and_breaks_ties_in_menu_order():
    rows = [row("a", 1.0, "agentic"), row("b", 0.0, "agentic"),
            row("a", 1.0, "multi"), row("b", 0.0, "multi"),
            row("a", 0.0, "single"), row("b", 0.0, "single", clean=False, r_task=0.0),
            row("b", 0.0, "single")]
    cells, _, favourites = fav.summarize(rows)
    single = next(c for c in cells if c.mode == "single")
    assert (single.episodes, single.dropped, single.reward) == (2, 1, 0.0)
    assert single.declared_share == 1.0
    (f,) = favourites
    assert (f.mode, f.runner_up, f.margin, f.significant) == ("multi", "agentic", 0.0, False)


def test_batches_are_even_and_questions_are_the_first_per_domain():
    assert [len(b) for b in fav.batches(list(range(30)), 20)] == [15, 15]
    assert [len(b) for b in fav.batches(list(range(7)), 3)] == [3, 2, 2]
    assert fav.batches([], 4) == []
    cfg = load_train_config(QUICKSTART, FAST)
    records = build_records(cfg, quiet())
    chosen = fav.pick_questions(records, 3)
    assert [str(r.domain) for r in chosen] == [d for d in DOMAINS for _ in range(3)]
    assert chosen[:3] == [r for r in records if str(r.domain) == "MATH"][:3]
    assert fav.episode_reward(1.0, 0.25, 0.0) == 1.0
    assert fav.episode_reward(1.0, 0.25, 0.5) == pytest.approx(0.625)
