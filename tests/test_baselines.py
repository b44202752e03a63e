"""Single-round baselines (eval/baselines.py) and MiniLM embeddings (models/sentence_encoder.py).

Setup: 250 synthetic tasks on the simulated pool (50 per domain, balanced difficulties), split
60/40 into train/eval by a seeded shuffle. The simulated workers are specialists per domain
(simulated_profiles.py's profile table), so a router that recognises the domain of a query from its
embedding beats a random pick. Measured with this setup (split seed 0, eval n = 100):
random 0.50 (expected over picks 0.53), largest (worker_6) 0.63, kNN (k=10) 0.70, MLP 0.70,
oracle 0.93. Over split seeds 0-9 kNN and MLP beat the random router's rows by 0.10-0.27, so
the asserted 0.08 margin is meaningful but robust.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from jax_routeweaver.data.records import Domain
from jax_routeweaver.eval.baselines import (
    BASELINE_NAMES,
    LargestWorkerRouter,
    OracleRouter,
    RandomRouter,
    evaluate_baselines,
    priciest_worker,
    route_rows,
    write_rows,
)
from jax_routeweaver.eval.learned_routers import KNNRouter, MLPRouter
from jax_routeweaver.eval.worker_outcomes import ROW_KEYS, collect_worker_outcomes, single_payload
from jax_routeweaver.models.sentence_encoder import EMBEDDING_DIM, Embedder
from jax_routeweaver.rewards.scorers.registry import score
from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES, PricingError
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.routing.protocol.prompts import single_multi_payload
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

N_TASKS = 250
TASK_SEED = 0
SPLIT_SEED = 0
TRAIN_SHARE = 0.6
MARGIN_OVER_RANDOM = 0.08


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tasks():
    return synthetic_tasks(N_TASKS, seed=TASK_SEED)


@pytest.fixture(scope="module")
def pool(tasks):
    return SimulatedWorkerPool(tasks, seed=TASK_SEED)


@pytest.fixture(scope="module")
def split(tasks):
    order = list(tasks)
    random.Random(SPLIT_SEED).shuffle(order)
    cut = int(TRAIN_SHARE * len(order))
    return order[:cut], order[cut:]


@pytest.fixture(scope="module")
def outcomes(tasks, pool):
    return collect_worker_outcomes(tasks, pool)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return Embedder(cache_dir=tmp_path_factory.mktemp("embedding_cache"))


@pytest.fixture(scope="module")
def table(split, pool, outcomes, embedder):
    train, evaluation = split
    return evaluate_baselines(train, evaluation, pool, outcomes=outcomes, embedder=embedder,
                              seed=SPLIT_SEED)


def accuracy(rows) -> float:
    return float(np.mean([row["correct"] for row in rows]))


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---------------------------------------------------------------------------- embeddings
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The stock market crashed today.", "How do I bake bread at home?",
             "What is a good recipe for homemade bread?", "Interest rates rose again this year."]


def test_embedder_shape_norm_and_reference_value(embedder):
    vectors = embedder.embed(SENTENCES)
    assert vectors.shape == (len(SENTENCES), EMBEDDING_DIM) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # all-MiniLM-L6-v2's published similarity for this pair (sentence-transformers gives the
    # same vectors: mean pooling + L2 normalisation, max_seq_length 256).
    assert cosine(vectors[0], vectors[1]) == pytest.approx(0.7553, abs=2e-3)
    assert embedder.embed([]).shape == (0, EMBEDDING_DIM)
    with pytest.raises(TypeError):
        embedder.embed("one string")


def test_embedder_semantics(embedder):
    eat, bread, crash, bake, recipe, rates = embedder.embed(SENTENCES)
    assert cosine(eat, bread) > max(cosine(eat, crash), cosine(eat, rates))
    assert cosine(bake, recipe) > max(cosine(bake, crash), cosine(bake, rates))
    assert cosine(crash, rates) > max(cosine(crash, eat), cosine(crash, bake))


def test_embedder_deterministic_across_instances_and_batches(embedder):
    fresh = Embedder(batch_size=2)  # other batching, no cache, own model load
    np.testing.assert_allclose(fresh.embed(SENTENCES), embedder.embed(SENTENCES), atol=1e-5)
    again = fresh.embed(list(reversed(SENTENCES)))
    np.testing.assert_array_equal(again[::-1], fresh.embed(SENTENCES))


def test_embedder_disk_cache(embedder, monkeypatch):
    import hashlib

    texts = ["a sentence only this test embeds", "and a second one"]
    first = embedder.embed(texts)
    for text, vector in zip(texts, first, strict=True):
        digest = hashlib.sha256(text.encode()).hexdigest()
        path = embedder.cache_dir / digest[:2] / f"{digest}.npy"
        np.testing.assert_array_equal(np.load(path), vector)
    embedder._memo.clear()  # forget in memory: the vectors must come back from disk

    def no_model(_texts):
        raise AssertionError("cache miss: the model ran")

    monkeypatch.setattr(embedder, "_encode", no_model)
    np.testing.assert_array_equal(embedder.embed(texts), first)


# ---------------------------------------------------------------------------- outcomes
@pytest.mark.slow
def test_collected_outcomes_equal_direct_pool_calls(tasks, pool, outcomes):
    assert outcomes.workers == tuple(pool.worker_ids())
    assert [r.sample_id for r in outcomes.records] == [r.sample_id for r in tasks]
    sample = [r for d in Domain for r in [t for t in tasks if t.domain is d][:2]]
    for record in sample:
        i = outcomes.positions[record.sample_id]
        for j, worker in enumerate(outcomes.workers):
            payload = single_multi_payload(record.question, record.question)
            assert single_payload(record) == payload
            direct = pool.respond(worker, payload)
            got = outcomes.calls[i][j]
            assert (got.prompt, got.text, got.usage) == (payload, direct.text, direct.usage)
            # Graded with the real scorer on the reply's answer, priced by the table.
            verdict = score(record.scorer_dataset, extract_answer(direct.text), record.gold,
                            record.meta)
            assert bool(outcomes.correct[i, j]) == verdict.correct
            assert outcomes.verdicts[i][j] == ("correct" if verdict.correct
                                               else "genuine_incorrect")
            price = REFERENCE_PRICES[worker]
            expected = (direct.usage.prompt_tokens * price.input_usd_per_m
                        + direct.usage.completion_tokens * price.output_usd_per_m) / 1e6
            assert outcomes.cost_usd[i, j] == pytest.approx(expected, rel=1e-12)
    assert not outcomes.infra.any() and outcomes.cost_complete.all()


def test_failed_calls_are_infra_not_wrong(tasks):
    small = [t for t in tasks if t.domain is not Domain.CODE][:8]
    flaky = SimulatedWorkerPool(small, seed=TASK_SEED, failure_rate=0.5)
    out = collect_worker_outcomes(small, flaky)
    failed = np.array([[not c.success for c in row] for row in out.calls])
    assert failed.any() and (~failed).any()
    assert (out.infra == failed).all() and not out.correct[failed].any()
    assert {out.verdicts[i][j] for i, j in zip(*np.nonzero(failed), strict=True)} == \
        {"provider_error"}


def test_unpriced_worker_is_an_error(tasks, pool):
    prices = {w: p for w, p in REFERENCE_PRICES.items() if w != "worker_3"}
    with pytest.raises(PricingError, match="worker_3"):
        collect_worker_outcomes(tasks[:2], pool, prices=prices)


# ---------------------------------------------------------------------------- the table
@pytest.mark.slow
def test_rows_follow_the_schema(table, split, outcomes, tmp_path):
    _, evaluation = split
    assert tuple(table) == BASELINE_NAMES
    eval_out = outcomes.select(evaluation)
    for name, rows in table.items():
        assert [row["sample_id"] for row in rows] == [r.sample_id for r in evaluation]
        for record, row in zip(evaluation, rows, strict=True):
            assert tuple(row) == ROW_KEYS
            assert (row["router"], row["mode"], row["calls"]) == (name, "single", 1)
            assert (row["dataset"], row["domain"]) == (record.dataset, str(record.domain))
            assert len(row["workers"]) == 1 and row["workers"][0] in outcomes.workers
            i, j = eval_out.positions[record.sample_id], outcomes.column(row["workers"][0])
            call = eval_out.calls[i][j]
            assert row["correct"] is bool(eval_out.correct[i, j])
            assert row["verdict"] == ("correct" if row["correct"] else "genuine_incorrect")
            assert row["cost_usd"] == eval_out.cost_usd[i, j] > 0
            assert row["answer"] == extract_answer(call.text)
            assert row["tokens"] == {"router": 0,
                                     "worker_prompt": call.usage.prompt_tokens,
                                     "worker_completion": call.usage.completion_tokens}
    path = write_rows(table["knn"], tmp_path / "sub" / "knn.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == table["knn"]
    with pytest.raises(ValueError, match="lacks"):
        write_rows([{"sample_id": "x"}], tmp_path / "bad.jsonl")


def test_oracle_is_an_upper_bound(table, split, outcomes):
    _, evaluation = split
    eval_out = outcomes.select(evaluation)
    oracle = accuracy(table["oracle"])
    assert oracle == pytest.approx(eval_out.correct.any(axis=1).mean())
    for name, rows in table.items():
        assert accuracy(rows) <= oracle, name
    # Cheapest correct worker when there is one.
    for i, row in enumerate(table["oracle"]):
        if eval_out.correct[i].any():
            assert row["cost_usd"] == eval_out.cost_usd[i][eval_out.correct[i]].min()


def test_learned_routers_beat_random(table, split, outcomes):
    _, evaluation = split
    random_rows = accuracy(table["random"])
    random_expected = float(outcomes.select(evaluation).correct.mean())
    for name in ("knn", "mlp"):
        acc = accuracy(table[name])
        assert acc >= random_rows + MARGIN_OVER_RANDOM, (name, acc, random_rows)
        assert acc >= random_expected + MARGIN_OVER_RANDOM, (name, acc, random_expected)


def test_largest_worker_is_the_configured_one(table, split, pool, outcomes):
    assert priciest_worker(pool.worker_ids()) == "worker_6"  # in + out = 0.10 + 0.40
    assert {row["workers"][0] for row in table["largest"]} == {"worker_6"}
    _, evaluation = split
    rows = evaluate_baselines([], evaluation, pool, outcomes=outcomes, routers=["largest"],
                              largest_worker="worker_5")["largest"]
    assert len(rows) == len(evaluation) and all(r["workers"] == ["worker_5"] for r in rows)
    with pytest.raises(ValueError, match="not offered"):
        LargestWorkerRouter(pool.worker_ids(), "worker_9")


def test_random_is_reproducible_by_seed(split, pool):
    _, evaluation = split
    workers = pool.worker_ids()
    picks = RandomRouter(workers, seed=7).choose(evaluation)
    assert RandomRouter(workers, seed=7).choose(evaluation) == picks
    assert RandomRouter(workers, seed=7).choose(evaluation[::-1]) == picks[::-1]
    assert RandomRouter(workers, seed=8).choose(evaluation) != picks
    assert set(picks) == set(workers)


def test_learned_routers_never_see_eval_records(split, outcomes, embedder, pool):
    train, evaluation = split
    eval_ids = {r.sample_id for r in evaluation}
    train_out = outcomes.select(train)
    for router in (KNNRouter(embedder, k=5), MLPRouter(embedder, steps=50)):
        router.fit(train_out)
        assert router.trained_on == {r.sample_id for r in train}
        assert router.trained_on.isdisjoint(eval_ids)
    with pytest.raises(ValueError, match="overlap"):
        evaluate_baselines(train, [*evaluation, train[0]], pool, outcomes=outcomes,
                           embedder=embedder, routers=["knn"])
    renamed = dataclasses.replace(train[0], sample_id="same-question-new-id")
    with pytest.raises(ValueError, match="question texts"):
        evaluate_baselines(train, [renamed], pool, outcomes=outcomes, embedder=embedder,
                           routers=["mlp"])


def test_mlp_is_deterministic_and_cost_penalty_routes_cheap(split, outcomes, embedder):
    train, evaluation = split
    train_out, eval_out = outcomes.select(train), outcomes.select(evaluation)
    first = MLPRouter(embedder, steps=100, seed=3).fit(train_out)
    second = MLPRouter(embedder, steps=100, seed=3).fit(train_out)
    assert first.final_loss == second.final_loss
    assert first.choose(evaluation) == second.choose(evaluation)
    # A huge price on cost: only the cheapest workers (0.02/0.05 per 1M tokens) are chosen.
    cheap = route_rows(KNNRouter(embedder, lambda_cost=1e9).fit(train_out), eval_out)
    assert {row["workers"][0] for row in cheap} <= {"worker_1", "worker_2"}
    assert OracleRouter(eval_out).choose(evaluation[:3]) == \
        [r["workers"][0] for r in route_rows(OracleRouter(eval_out), eval_out)[:3]]
