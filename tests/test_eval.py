"""`routeweaver eval`: a tiny random router evaluated end to end with the simulated pool
(rows, summary, tables, plots), resume, offline replay, forced modes, Router-R1, the
comparison report, the one-command comparison (`eval compare`: router, forced modes,
Router-R1, baselines, one worker cache), and the summary numbers against hand-computed
values."""

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest
from openai_stub import KEY_ENV, PROXY_VARS, SECRET, SimServer, channel_file
from rich.console import Console

from jax_routeweaver.cli import app, eval_cmd
from jax_routeweaver.cli.app import main
from jax_routeweaver.config import dump_config
from jax_routeweaver.eval import evaluate as evaluate_module
from jax_routeweaver.eval import report
from jax_routeweaver.eval.baselines import BASELINE_NAMES
from jax_routeweaver.eval.compare import (
    BaselineConfig,
    CompareConfig,
    load_train_records,
    run_baselines,
)
from jax_routeweaver.eval.evaluate import (
    CatalogOnlyPool,
    EvalConfig,
    build_eval_pool,
    evaluate,
    load_sets,
)
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rl.run.builders import build_policy, build_pool, build_records, build_tokenizer
from jax_routeweaver.rl.run.checkpoint import save_policy
from jax_routeweaver.rl.run.router_checkpoint import resolve_checkpoint
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.routing.pools.workers import HttpWorkerPool, MissingApiKeyError
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
R1_QUICKSTART = ROOT / "configs" / "router_r1_quickstart.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SETS = "synthetic:10"  # two questions per domain
BATCH = 5
# Router-R1 scaled down as in test_router_r1_train: one routed turn, then the answer.
R1_TINY = ["rollout.max_new_tokens=128", "rollout.router_r1.max_turns=1",
           "rollout.router_r1.start_max_tokens=128",
           "rollout.router_r1.trajectory_max_tokens=768"]



@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A training run directory holding a random-init quickstart router as policy step 1
    (its pruned tokenizer and config.yaml included), as `routeweaver train` leaves one."""
    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    cfg = load_train_config(QUICKSTART, [f"out_dir={run}", "model.init=random",
                                         "data.synthetic_queries=20",
                                         "data.group_size=1", "logging.progress=false"])
    console = Console(file=io.StringIO())
    records = build_records(cfg, console)
    tokenizer = build_tokenizer(cfg, records, build_pool(cfg, records))
    tokenizer.save_pretrained(str(root / "tokenizer"))
    model = build_policy(cfg, make_mesh((1, -1, 1)), tokenizer)
    save_policy(model, run / "checkpoints" / "policy", 1, tokenizer_dir=root / "tokenizer")
    dump_config(cfg, run / "config.yaml")
    return run


@pytest.fixture(scope="module")
def whole(tiny_run) -> Path:
    """One uninterrupted evaluation through the CLI (config and step found from the run)."""
    out = tiny_run.parent / "whole"
    assert main(["eval", "run", "--checkpoint", str(tiny_run), "--sets", SETS, "--out",
                 str(out), "--batch-size", str(BATCH), "--no-progress"]) == 0
    return out


def run_cfg(run: Path, *overrides: str):
    return load_train_config(run / "config.yaml", list(overrides))


def quiet() -> Console:
    return Console(file=io.StringIO())


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    height, width, channels = imread(path).shape
    assert height > 100 and width > 100 and channels in (3, 4)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_cli_eval_writes_rows_summary_tables_and_plots(whole):
    rows = report.read_rows(whole / "rows.jsonl")
    assert len(rows) == 10
    assert {r["domain"] for r in rows} == {"MATH", "CODE", "KNOWLEDGE", "REASON", "RECALL"}
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r)
        assert r["router"] == "quickstart@step1" and r["set"] == SETS
        assert r["mode"] in report.MODES and not r["forced"]  # the router chose (greedy)
        assert r["calls"] == len(r["workers"]) and r["calls"] >= 1
        assert r["cost_usd"] > 0 and r["tokens"]["worker_prompt"] > 0
        assert r["tokens"]["router"] > 0 and not r["infra"]
    summary = json.loads((whole / "summary.json").read_text())
    expected = report.summarize(rows, alpha=0.0)
    assert summary == json.loads(json.dumps(expected.to_json()))
    assert summary["n"] == 10 and len(summary["datasets"]) == 5
    assert math.isclose(sum(summary["mode_shares"].values()), 1.0)
    md = (whole / "summary.md").read_text()
    assert "quickstart@step1" in md and "MATH / sim_math" in md and "MATH avg" in md
    assert "## Mode shares (%)" in md and "| All |" in md
    for name in ("mode_shares.png", "accuracy_vs_cost.png"):
        assert_png(whole / name)
    meta = json.loads((whole / "eval.json").read_text())
    assert meta["step"] == 1 and meta["force_mode"] is None and meta["sets"] == [SETS]
    cache = (whole / "worker_cache.jsonl").read_text().splitlines()
    assert json.loads(cache[0])["format"] == "routeweaver-worker-cache"
    assert len(cache) - 1 <= sum(r["calls"] for r in rows)  # identical calls made once


@pytest.mark.slow
def test_resume_evaluates_only_the_rest_and_equals_the_uninterrupted_run(tiny_run, whole,
                                                                         tmp_path):
    cfg = run_cfg(tiny_run)
    options = EvalConfig(checkpoint=str(tiny_run), sets=(SETS,), out_dir=str(tmp_path),
                          batch_size=BATCH, progress=False)
    first = evaluate(cfg, dataclasses.replace(options, limit=BATCH), console=quiet())
    assert first.evaluated == BATCH and len(first.rows) == BATCH
    rest = evaluate(cfg, options, console=quiet())
    assert rest.evaluated == 10 - BATCH
    assert (tmp_path / "rows.jsonl").read_bytes() == (whole / "rows.jsonl").read_bytes()
    again = evaluate(cfg, options, console=quiet())  # complete: nothing left, no model load
    assert again.evaluated == 0 and again.replay is None
    assert again.summary == rest.summary


class NoCalls(SimulatedWorkerPool):
    """The simulated pool's catalog and identity, but any call is a test failure."""

    async def call(self, worker, prompt, *, max_tokens=None):
        raise AssertionError(f"replay called {worker}")


@pytest.mark.slow
def test_replay_is_offline_and_reproduces_the_dump(tiny_run, whole, tmp_path):
    cfg = run_cfg(tiny_run)
    result = evaluate(cfg, EvalConfig(
        checkpoint=str(tiny_run), sets=(SETS,), out_dir=str(tmp_path), replay="replay",
        cache=str(whole / "worker_cache.jsonl"), batch_size=BATCH, progress=False),
        pool=NoCalls([], seed=cfg.workers.seed), console=quiet())
    assert result.replay.recorded == 0 and result.replay.hits > 0
    assert (tmp_path / "rows.jsonl").read_bytes() == (whole / "rows.jsonl").read_bytes()


@pytest.fixture(scope="module")
def forced(tiny_run) -> Path:
    out = tiny_run.parent / "forced"
    evaluate(run_cfg(tiny_run), EvalConfig(
        checkpoint=str(tiny_run / "checkpoints" / "policy" / "1"), sets=(SETS,),
        out_dir=str(out), force_mode="agentic", limit=BATCH, batch_size=BATCH,
        progress=False), console=quiet())
    return out


@pytest.mark.slow
def test_forced_mode_is_honoured(forced):
    rows = report.read_rows(forced / "rows.jsonl")
    assert len(rows) == BATCH
    assert {r["router"] for r in rows} == {"quickstart@step1+forced-agentic"}
    assert all(r["mode"] == "agentic" and r["forced"] for r in rows)
    summary = json.loads((forced / "summary.json").read_text())
    assert summary["mode_shares"]["agentic"] == 1.0


@pytest.mark.slow
def test_report_compares_runs(whole, forced, tmp_path):
    assert main(["eval", "report", "--runs", str(whole), str(forced), "--out",
                 str(tmp_path)]) == 0
    table = (tmp_path / "comparison.md").read_text()
    assert "| quickstart@step1 |" in table and "| quickstart@step1+forced-agentic |" in table
    assert table.count("## Mode shares (%)") == 2
    data = json.loads((tmp_path / "comparison.json").read_text())
    assert set(data) == {"quickstart@step1", "quickstart@step1+forced-agentic"}
    assert data["quickstart@step1"]["alpha"] == 0.0
    for name in ("mode_shares.png", "accuracy_vs_cost.png"):
        assert_png(tmp_path / name)


@pytest.mark.slow
def test_setup_mismatch_and_bad_inputs_are_errors(tiny_run, whole, tmp_path, capsys):
    cfg = run_cfg(tiny_run)
    with pytest.raises(ValueError, match="force_mode: None -> 'single'.*another --out"):
        evaluate(cfg, EvalConfig(checkpoint=str(tiny_run), sets=(SETS,), out_dir=str(whole),
                                  force_mode="single", progress=False), console=quiet())
    with pytest.raises(ValueError, match="synthetic"):
        evaluate(cfg, EvalConfig(checkpoint=str(tiny_run), sets=("synthetic:x",),
                                  out_dir=str(tmp_path / "a")), console=quiet())
    with pytest.raises(ValueError, match="is in both"):
        evaluate(cfg, EvalConfig(checkpoint=str(tiny_run), sets=(SETS, SETS),
                                  out_dir=str(tmp_path / "b")), console=quiet())
    r1 = load_train_config(R1_QUICKSTART, R1_TINY)
    with pytest.raises(ValueError, match="no modes to force"):
        evaluate(r1, EvalConfig(checkpoint=str(tiny_run), sets=(SETS,), force_mode="multi",
                                 out_dir=str(tmp_path / "c")), console=quiet())
    # A bare policy directory is not inside a run: the CLI needs --config then.
    assert main(["eval", "run", "--checkpoint", str(tmp_path), "--sets", SETS, "--out",
                 str(tmp_path / "d")]) == 2
    assert "not a Hugging Face directory" in capsys.readouterr().err


def test_resolve_checkpoint_forms(tiny_run, tiny_hf_dir):
    policy = tiny_run / "checkpoints" / "policy"
    for given in (tiny_run, policy, policy / "1"):
        ckpt = resolve_checkpoint(given)
        assert (ckpt.kind, ckpt.path, ckpt.step) == ("policy", policy.absolute(), 1)
        assert ckpt.tokenizer_dir == (policy / "tokenizer").absolute()
        assert ckpt.config_file == (tiny_run / "config.yaml").absolute()
    hf = resolve_checkpoint(tiny_hf_dir)
    assert hf.kind == "hf" and hf.step is None and hf.config_file is None


@pytest.mark.slow
def test_router_r1_dialect(tiny_run, tmp_path):
    cfg = load_train_config(R1_QUICKSTART, R1_TINY)
    result = evaluate(cfg, EvalConfig(checkpoint=str(tiny_run), sets=("synthetic:3",),
                                       out_dir=str(tmp_path), batch_size=3, progress=False),
                      console=quiet())
    rows = result.rows
    assert [r["domain"] for r in rows] == ["MATH", "REASON", "RECALL"]  # the run's quotas
    for r in rows:
        assert r["mode"] is None and r["calls"] <= 1
        assert set(r["workers"]) <= {f"worker_{i}" for i in range(1, 7)}
        assert r["verdict"] in ("correct", "genuine_incorrect", "parser_error")
    assert result.summary.mode_shares["none"] == 1.0 and result.summary.alpha == 0.3


# ------------------------------------------------------------------------------ compare
TRAIN_SETS = "synthetic:20"  # the run's own training questions (seed data.synthetic_seed)
COMPARED = ("router", "forced_single", "forced_multi", "forced_agentic", "router_r1",
            "random", "largest", "oracle", "knn", "mlp")


def compare_args(run: Path, out: Path, r1_config: Path, *extra: str) -> list[str]:
    return ["eval", "compare", "--checkpoint", str(run), "--train-sets", TRAIN_SETS,
            "--sets", SETS, "--out", str(out), "--router-r1", str(run), "--router-r1-config",
            str(r1_config), "--batch-size", str(BATCH), "--no-progress", *extra]


@pytest.mark.slow
def test_cli_compare_builds_the_whole_table_and_replays_it_offline(tiny_run, tmp_path,
                                                                   monkeypatch):
    r1_config = tmp_path / "router_r1.yaml"  # the tiny router read as a Router-R1 one
    dump_config(load_train_config(R1_QUICKSTART, R1_TINY), r1_config)
    first = tmp_path / "first"
    assert main(compare_args(tiny_run, first, r1_config)) == 0

    data = json.loads((first / "comparison.json").read_text())
    assert tuple(data) == COMPARED
    table = (first / "comparison.md").read_text()
    assert all(f"| {name} |" in table for name in COMPARED)
    for name in ("mode_shares.png", "accuracy_vs_cost.png"):
        assert_png(first / name)
    questions = sorted((r.dataset, r.sample_id)
                       for r in load_sets([SETS], run_cfg(tiny_run))[0].records)
    for name in COMPARED:
        rows = report.read_rows(first / name / "rows.jsonl")
        assert sorted(report.row_key(r) for r in rows) == questions, name  # same questions
        assert {r["router"] for r in rows} == {name} and data[name]["n"] == len(questions)
        assert (first / name / "summary.json").is_file()
        assert not (first / name / "worker_cache.jsonl").exists()  # one cache for all
        modes = {r["mode"] for r in rows}
        if name.startswith("forced_"):
            assert modes == {name.removeprefix("forced_")}, name
            assert all(r["forced"] for r in rows)
        elif name == "router_r1":
            assert modes == {None}
        elif name != "router":
            assert modes == {"single"} and all(r["calls"] == 1 for r in rows)
    for name, summary in data.items():
        for key in ("avg", "dataset_avg"):
            assert summary[key] <= data["oracle"][key], (name, key)
    # The per-question mode oracle, recomputed from the rows written above.
    oracle = json.loads((first / "mode_oracle.json").read_text())
    rows = {n: {report.row_key(r): r for r in report.read_rows(first / n / "rows.jsonl")}
            for n in ("router", "forced_single", "forced_multi", "forced_agentic")}
    best = {k: {m for m in ("single", "multi", "agentic")
                if rows[f"forced_{m}"][k]["correct"] == max(
                    rows[f"forced_{x}"][k]["correct"] for x in ("single", "multi", "agentic"))}
            for k in rows["router"]}
    assert oracle["questions"] == len(questions)
    assert oracle["router_hit"] == pytest.approx(
        sum(rows["router"][k]["mode"] in b for k, b in best.items()) / len(best))
    assert oracle["fixed_hit"]["multi"] == pytest.approx(
        sum("multi" in b for b in best.values()) / len(best))
    assert "mode oracle" in (first / "mode_oracle.md").read_text()
    assert data["router"]["alpha"] == 0.0 and data["router_r1"]["alpha"] == 0.3
    assert data["knn"]["alpha"] is None
    # `eval report` takes the directories as they are and gives the same table.
    assert main(["eval", "report", "--runs", *(str(first / n) for n in COMPARED), "--out",
                 str(tmp_path / "report")]) == 0
    assert json.loads((tmp_path / "report" / "comparison.json").read_text()) == data

    # Offline: every row from the one cache, no worker called, the same comparison.
    cache = first / "worker_cache.jsonl"
    recorded = cache.read_bytes()
    monkeypatch.setattr(evaluate_module, "build_pool",
                        lambda cfg, records: NoCalls(records, seed=cfg.workers.seed))
    second = tmp_path / "second"
    assert main(compare_args(tiny_run, second, r1_config, "--replay", "replay", "--cache",
                             str(cache))) == 0
    assert (second / "comparison.json").read_bytes() == \
        (first / "comparison.json").read_bytes()
    assert cache.read_bytes() == recorded and not (second / "worker_cache.jsonl").exists()


@pytest.mark.slow
def test_cli_baselines_write_directories_eval_report_reads(tmp_path):
    run = tmp_path / "run"  # --config takes a run directory (its config.yaml) too
    dump_config(load_train_config(QUICKSTART), run / "config.yaml")
    out = tmp_path / "baselines"
    args = ["eval", "baselines", "--config", str(run), "--sets", SETS, "--out", str(out),
            "--routers", "random,largest,oracle", "--largest-worker", "worker_3"]
    assert main(args) == 0
    for name in ("random", "largest", "oracle"):
        rows = report.read_rows(out / name / "rows.jsonl")
        assert len(rows) == 10 and {r["router"] for r in rows} == {name}
        assert {r["set"] for r in rows} == {SETS}
        assert json.loads((out / name / "eval.json").read_text())["kind"] == "baseline"
        for png in ("mode_shares.png", "accuracy_vs_cost.png"):
            assert_png(out / name / png)
    assert {r["workers"][0] for r in report.read_rows(out / "largest" / "rows.jsonl")} == \
        {"worker_3"}
    calls = len((out / "worker_cache.jsonl").read_text().splitlines()) - 1
    assert calls == 10 * 6  # one call per question and worker
    assert main(args) == 0  # a rerun: answered from the cache, the same rows
    assert len((out / "worker_cache.jsonl").read_text().splitlines()) - 1 == calls
    assert main(["eval", "report", "--runs", *(str(out / n) for n in ("random", "oracle")),
                 "--out", str(tmp_path / "report")]) == 0
    assert set(json.loads((tmp_path / "report" / "comparison.json").read_text())) == \
        {"random", "oracle"}
    (out / "mlp").mkdir()
    (out / "mlp" / "eval.json").write_text(json.dumps({"router": "x", "kind": "policy"}))
    with pytest.raises(ValueError, match="holds another evaluation"):
        run_baselines(load_train_config(QUICKSTART), BaselineConfig(
            sets=(SETS,), out_dir=str(out), routers=("mlp",), train_sets=("synthetic:5",)),
            console=quiet())


def test_train_questions_never_include_evaluation_questions():
    cfg = load_train_config(QUICKSTART)
    evaluation = load_sets(["synthetic:10"], cfg)[0].records  # seed synthetic_seed + 1
    train = load_train_records(["synthetic:20"], cfg, evaluation)  # seed synthetic_seed
    assert len(train) == 20 and {r.sample_id for r in train}.isdisjoint(
        {r.sample_id for r in evaluation})
    same_seed = f"synthetic:15:{cfg.data.synthetic_seed + 1}"  # its first 10 are evaluation
    kept = load_train_records([same_seed], cfg, evaluation)
    assert [r.sample_id for r in kept] == [f"sim-1-{i:05d}" for i in range(10, 15)]
    with pytest.raises(ValueError, match="no question outside"):
        load_train_records(["synthetic:10:1"], cfg, evaluation)
    with pytest.raises(ValueError, match="--train-sets"):
        BaselineConfig(sets=(SETS,), out_dir="x", routers=("random", "knn"))
    # The comparison checks its baselines' options before it evaluates any router.
    with pytest.raises(ValueError, match="--train-sets"):
        CompareConfig(checkpoint="c", sets=(SETS,), out_dir="x", routers=("knn",))
    with pytest.raises(ValueError, match="replay='offline'"):
        CompareConfig(checkpoint="c", sets=(SETS,), out_dir="x", replay="offline")
    with pytest.raises(ValueError, match="limit=-1"):
        EvalConfig(checkpoint="c", sets=(SETS,), out_dir="x", limit=-1)
    assert eval_cmd.BASELINES == BASELINE_NAMES
    assert app.main(["eval", "baselines", "--config", str(QUICKSTART), "--sets", SETS,
                     "--out", "x", "--routers", "random,best"]) == 2


# ------------------------------------------------------------------------------ HTTP workers


@pytest.fixture
def loopback(monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.mark.slow
def test_http_workers_at_temperature_0_2_record_then_replay_without_keys(
        tiny_run, whole, tmp_path, loopback, monkeypatch):
    base = run_cfg(tiny_run)
    sim = SimulatedWorkerPool(load_sets([SETS], base)[0].records, seed=base.workers.seed)
    server = SimServer(sim)
    try:
        channels = channel_file(tmp_path / "ch.yaml", sim, server.url)
        cfg = run_cfg(tiny_run, f"workers.pool={channels}")
        options = EvalConfig(checkpoint=str(tiny_run), sets=(SETS,),
                              out_dir=str(tmp_path / "rec"), batch_size=BATCH, progress=False)
        recorded = evaluate(cfg, options, console=quiet())  # two batches on one event loop
    finally:
        server.close()
    assert recorded.replay.recorded == len(server.bodies) > 0
    assert {(b["temperature"], b["seed"]) for b in server.bodies} == {(0.2, 42)}
    # The same episodes as with the in-process simulated pool: the HTTP path adds nothing.
    assert (tmp_path / "rec" / "rows.jsonl").read_bytes() == (whole / "rows.jsonl").read_bytes()
    assert SECRET not in (tmp_path / "rec" / "worker_cache.jsonl").read_text()

    monkeypatch.delenv(KEY_ENV)  # offline: no server, no key
    offline = {"out_dir": str(tmp_path / "rep"), "replay": "replay",
               "cache": str(tmp_path / "rec" / "worker_cache.jsonl")}
    replayed = evaluate(cfg, dataclasses.replace(options, **offline), console=quiet())
    assert replayed.replay.recorded == 0
    assert (tmp_path / "rep" / "rows.jsonl").read_bytes() == \
        (tmp_path / "rec" / "rows.jsonl").read_bytes()


@pytest.mark.slow
def test_eval_bills_worker_calls_at_the_channel_files_prices(tiny_run, tmp_path, loopback):
    base = run_cfg(tiny_run)
    sim = SimulatedWorkerPool(load_sets([SETS], base)[0].records, seed=base.workers.seed)
    server = SimServer(sim)
    price = (1.0, 2.0)  # USD per 1M input / output tokens, every worker: not the reference's
    try:
        channels = channel_file(tmp_path / "ch.yaml", sim, server.url,
                                prices=dict.fromkeys(sim.worker_ids(), price))
        cfg = run_cfg(tiny_run, f"workers.pool={channels}")
        result = evaluate(cfg, EvalConfig(checkpoint=str(tiny_run), sets=(SETS,),
                                           out_dir=str(tmp_path / "out"), batch_size=BATCH,
                                           replay="off", progress=False), console=quiet())
    finally:
        server.close()
    assert server.bodies and all(r["cost_complete"] for r in result.rows)
    for r in result.rows:
        tokens = r["tokens"]
        assert r["cost_usd"] == pytest.approx(
            (tokens["worker_prompt"] * price[0] + tokens["worker_completion"] * price[1])
            / 1e6, rel=1e-12, abs=1e-15)
    assert sum(r["cost_usd"] for r in result.rows) > 0


def test_channel_pool_is_built_at_the_eval_temperature(tmp_path, loopback, monkeypatch):
    channels = ROOT / "configs" / "channels" / "reference.yaml"
    cfg = load_train_config(QUICKSTART, [f"workers.pool={channels}"])
    monkeypatch.setenv("OPENROUTER_API_KEY", SECRET)
    options = EvalConfig(checkpoint="x", sets=(SETS,), out_dir=str(tmp_path))
    # check=False: these endpoints are not up here (the pool check is test_pool_check's).
    live = build_eval_pool(cfg, [], options, check=False)
    assert isinstance(live.pool, HttpWorkerPool) and live.pool._temperature == 0.2
    assert SECRET in live.secrets and live.identify("worker_3").sampling["temperature"] == 0.2
    hot = build_eval_pool(cfg, [], dataclasses.replace(options, worker_temperature=0.7),
                          check=False)
    assert hot.identify("worker_3").sampling["temperature"] == 0.7
    monkeypatch.delenv("OPENROUTER_API_KEY")
    with pytest.raises(MissingApiKeyError, match="OPENROUTER_API_KEY"):
        build_eval_pool(cfg, [], options, check=False)
    offline = build_eval_pool(cfg, [], dataclasses.replace(options, replay="replay"))
    assert isinstance(offline.pool, CatalogOnlyPool)
    assert offline.worker_ids() == [f"worker_{i}" for i in range(1, 7)]


# ------------------------------------------------------------------------------ numbers
def row(sample, dataset, domain, correct, mode, cost, calls, verdict=None, router="r"):
    return {"sample_id": sample, "dataset": dataset, "domain": domain, "router": router,
            "mode": mode, "workers": ["worker_1"] * calls, "answer": "x", "correct": correct,
            "verdict": verdict or ("correct" if correct else "genuine_incorrect"),
            "cost_usd": cost, "calls": calls,
            "tokens": {"router": 10, "worker_prompt": 100 * calls, "worker_completion": 20}}


HAND = [
    row("1", "m1", "MATH", True, "single", 0.001, 1),
    row("2", "m1", "MATH", False, "multi", 0.003, 3),
    row("3", "m2", "MATH", True, "agentic", 0.004, 4),
    row("4", "m2", "MATH", True, "agentic", 0.002, 2),
    row("5", "m2", "MATH", False, None, 0.0, 0, verdict="parser_error"),
    row("6", "k1", "KNOWLEDGE", False, "single", 0.0, 1, verdict="provider_error"),
]


def test_summary_numbers_match_hand_computed_values():
    s = report.summarize(HAND, alpha=0.1)
    acc = {d.dataset: d.accuracy for d in s.datasets}
    assert [d.dataset for d in s.datasets] == ["m1", "m2", "k1"]  # domain order, then name
    assert acc == {"m1": 0.5, "m2": pytest.approx(2 / 3), "k1": 0.0}
    assert s.domains == {"MATH": pytest.approx((0.5 + 2 / 3) / 2), "KNOWLEDGE": 0.0}
    assert s.avg == pytest.approx((0.5 + 2 / 3) / 2 / 2)       # mean over domains
    assert s.dataset_avg == pytest.approx((0.5 + 2 / 3 + 0) / 3)  # mean over datasets
    assert s.mode_shares == {"single": pytest.approx(2 / 6), "multi": pytest.approx(1 / 6),
                             "agentic": pytest.approx(2 / 6), "none": pytest.approx(1 / 6)}
    assert s.mode_shares_by_domain["MATH"] == {"single": 0.2, "multi": 0.2, "agentic": 0.4,
                                               "none": 0.2}
    assert s.mode_shares_by_domain["KNOWLEDGE"]["single"] == 1.0
    assert s.mean_cost_usd == pytest.approx(0.010 / 6)
    assert s.mean_calls == pytest.approx(11 / 6)
    assert s.mean_tokens["worker_prompt"] == pytest.approx(1100 / 6)
    assert s.infra == 1 and s.dataset("k1").infra == 1 and s.n == 6
    assert s.dataset("m2").mean_cost_usd == pytest.approx(0.002)
    table = report.accuracy_table({"r": s})
    # ± the binomial standard error: m1 sqrt(.5 .5 / 2) = 35.4, m2 sqrt(2/3 1/3 / 3) = 27.2;
    # a mean of k estimates: sqrt(sum se^2) / k (MATH 22.3, Avg 22.3 / 2, datasets 44.6 / 3)
    assert ("| r | 50.0 ± 35.4 | 66.7 ± 27.2 | 58.3 ± 22.3 | 0.0 ± 0.0 | 0.0 ± 0.0 | "
            "29.2 ± 11.2 | 38.9 ± 14.9 | 0.00167 | 1.83 |") in table
    assert s.dataset("m2").accuracy_se == pytest.approx(math.sqrt(2 / 27))
    assert s.domains_n == {"MATH": 5, "KNOWLEDGE": 1}
    shares = report.mode_share_table(s)
    assert "| MATH | 20.0 | 20.0 | 40.0 | 20.0 |" in shares
    assert "| All | 33.3 | 16.7 | 33.3 | 16.7 |" in shares


def test_table1_average_covers_the_nine_benchmarks_only():
    """As the reference's evaluation: PopQA and the set600 copies of SuperGPQA / SATBench are
    left out of the domain averages and Avg, not out of the per-dataset table."""
    def at(set_name, *args):
        return {**row(*args), "set": f"data/eval/{set_name}.parquet"}

    rows = [at("eval_600_free", "1", "math", "MATH", True, "single", 0.0, 1),
            at("eval_600_free", "2", "supergpqa", "KNOWLEDGE", False, "single", 0.0, 1),
            at("eval_600_free", "3", "satbench", "REASON", False, "single", 0.0, 1),
            at("eval_600_free", "4", "popqa", "RECALL", False, "single", 0.0, 1),
            at("eval_700_free", "5", "supergpqa", "KNOWLEDGE", True, "single", 0.0, 1),
            at("eval_700_free", "6", "satbench", "REASON", True, "single", 0.0, 1),
            at("eval_triviaqa120_free", "7", "triviaqa", "RECALL", False, "single", 0.0, 1)]
    s = report.summarize(rows)
    assert {d.dataset: (d.n, d.accuracy) for d in s.datasets} == {
        "math": (1, 1.0), "supergpqa": (2, 0.5), "satbench": (2, 0.5), "popqa": (1, 0.0),
        "triviaqa": (1, 0.0)}
    assert s.domains == {"MATH": 1.0, "KNOWLEDGE": 1.0, "REASON": 1.0, "RECALL": 0.0}
    assert s.avg == 0.75 and s.dataset_avg == 0.75 and s.avg_excluded == 3
    assert s.avg_covers == ("eval_600_free/math", "eval_700_free/satbench",
                            "eval_700_free/supergpqa", "eval_triviaqa120_free/triviaqa")
    assert "eval_700_free/supergpqa" in report.compare({"r": s})
    assert report.summarize(HAND).avg_excluded == 0  # other sets are covered whole


def test_summarize_rejects_mixed_routers_duplicates_and_bad_rows():
    mixed = [*HAND, row("9", "m1", "MATH", True, "single", 0.0, 1, router="other")]
    with pytest.raises(ValueError, match="several routers"):
        report.summarize(mixed)
    assert report.summarize(mixed, router="other").n == 1
    with pytest.raises(ValueError, match="appears twice"):
        report.summarize([*HAND, HAND[0]])
    bad = {**HAND[0], "mode": "solo"}
    with pytest.raises(report.RowError, match="mode='solo'"):
        report.summarize([bad])
    with pytest.raises(report.RowError, match=r"lacks \['tokens'\]"):
        report.check_row({k: v for k, v in HAND[0].items() if k != "tokens"}, "x")


def test_read_rows_repairs_only_a_torn_last_line(tmp_path):
    dump = tmp_path / "rows.jsonl"
    report.append_rows(dump, HAND[:2])
    with open(dump, "a") as f:
        f.write('{"sample_id": "3", "data')
    with pytest.raises(report.RowError, match="torn last line"):
        report.read_rows(dump)
    assert report.read_rows(dump, repair=True) == HAND[:2]
    report.append_rows(dump, HAND[2:3])
    assert report.read_rows(dump) == HAND[:3]


def test_comparison_writers_and_plots(tmp_path):
    a = report.summarize(HAND, alpha=0.0)
    b = report.summarize([{**r, "router": "cheap"} for r in HAND[:4]], alpha=0.3)
    paths = report.write_comparison({"r": a, "cheap": b}, tmp_path)
    assert [p.name for p in paths] == ["comparison.json", "comparison.md", "mode_shares.png",
                                       "accuracy_vs_cost.png"]
    md = (tmp_path / "comparison.md").read_text()
    assert "| cheap |" in md and "| – |" in md  # cheap was not evaluated on k1
    for p in paths[2:]:
        assert_png(p)
