"""Worker pricing, trajectory cost, S_cost and the C_ref statistic, on hand-computed examples."""

from types import SimpleNamespace

import pytest

from jax_routeweaver.routing.pools.pricing import (
    C_REF_USD,
    PRICE_TABLE_VERSION,
    REFERENCE_PRICES,
    CostSummary,
    PricingError,
    WorkerPrice,
    c_ref_from_costs,
    call_cost,
    cost_score,
    percentile_linear,
    pool_prices,
    price_problems,
    trajectory_cost,
    usage_unknown,
    verify_pool,
)
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall


def ok(worker, prompt_tokens, completion_tokens, cached=0, failed=None):
    return WorkerCall(worker, "p", "answer", True, usage=Usage(prompt_tokens, completion_tokens,
                                                               cached), failed_usage=failed)


def test_reference_table_and_constants():
    table = {w: (p.input_usd_per_m, p.output_usd_per_m, p.backend)
             for w, p in REFERENCE_PRICES.items()}
    assert table == {
        "worker_1": (0.02, 0.05, "qwen3_8b"),
        "worker_2": (0.02, 0.05, "llama31_8b"),
        "worker_3": (0.10, 0.30, "qwen3_30b_a3b"),
        "worker_4": (0.119, 0.20, "gemma3_27b_it"),
        "worker_5": (0.10, 0.32, "llama33_70b"),
        "worker_6": (0.10, 0.40, "gemini25_flash_lite"),
    }
    assert PRICE_TABLE_VERSION == "fixed-reference-2026-09-20"
    assert C_REF_USD == 0.007071665299999997
    with pytest.raises(TypeError):
        REFERENCE_PRICES["worker_7"] = WorkerPrice(0, 0)  # frozen table


def test_call_cost_bills_failed_usage_and_ignores_cached_split():
    # worker_3: input (1000 + 100) × 0.10 + output (500 + 20) × 0.30 = 110 + 156 = 266 µUSD.
    call = ok("worker_3", 1000, 500, cached=200, failed=Usage(100, 20))
    assert call_cost(call, REFERENCE_PRICES) == pytest.approx(266e-6, rel=1e-12)
    # Cached input is billed at the normal price: moving tokens into the cache changes nothing.
    uncached = ok("worker_3", 1000, 500, cached=0, failed=Usage(100, 20))
    assert call_cost(uncached, REFERENCE_PRICES) == call_cost(call, REFERENCE_PRICES)
    # worker_4: 2000 × 0.119 + 1000 × 0.20 = 238 + 200 = 438 µUSD.
    assert call_cost(ok("worker_4", 2000, 1000), REFERENCE_PRICES) == pytest.approx(438e-6)


def test_failed_call_with_reported_usage_is_billed():
    failed = WorkerCall("worker_6", "p", "", False, failed_usage=Usage(300, 50))
    # 300 × 0.10 + 50 × 0.40 = 30 + 20 = 50 µUSD.
    assert call_cost(failed, REFERENCE_PRICES) == pytest.approx(50e-6)
    summary = trajectory_cost([failed], REFERENCE_PRICES)
    assert summary.complete and summary.cost_usd == pytest.approx(50e-6)


def test_trajectory_cost_sums_all_calls():
    calls = [ok("worker_3", 1000, 500, failed=Usage(100, 20)), ok("worker_4", 2000, 1000),
             ok("worker_1", 10_000, 2_000)]  # 200 + 100 = 300 µUSD
    summary = trajectory_cost(calls, REFERENCE_PRICES)
    assert summary == CostSummary(pytest.approx(1004e-6, rel=1e-12), True, ())
    assert trajectory_cost([], REFERENCE_PRICES) == CostSummary(0.0, True, ())


@pytest.mark.parametrize("call, unknown", [
    (WorkerCall("worker_1", "p", "x", True, usage=None), True),
    (WorkerCall("worker_1", "p", "x", True, usage=Usage(0, 0)), True),
    # The successful attempt's usage is missing: failed usage alone cannot price the call.
    (WorkerCall("worker_1", "p", "x", True, failed_usage=Usage(5, 5)), True),
    (WorkerCall("worker_1", "p", "", False), True),
    (WorkerCall("worker_1", "p", "", False, failed_usage=Usage(5, 0)), False),
    (WorkerCall("worker_1", "p", "x", True, usage=Usage(3, 0)), False),
])
def test_usage_unknown_cases(call, unknown):
    assert usage_unknown(call) is unknown


def test_incomplete_reasons_and_partial_cost():
    calls = [ok("worker_2", 1_000_000, 0),                        # 0.02 USD
             WorkerCall("worker_1", "p", "x", True, usage=None),  # usage_unknown
             ok("worker_9", 1_000_000, 1_000_000),                # unpriced: not added
             WorkerCall("worker_3", "p", "x", True, usage=Usage(0, 0))]
    summary = trajectory_cost(calls, REFERENCE_PRICES)
    assert summary.cost_usd == pytest.approx(0.02)
    assert not summary.complete
    assert summary.reasons == ("usage_unknown", "unpriced")
    only_unpriced = trajectory_cost([ok("worker_9", 1, 1)], REFERENCE_PRICES)
    assert only_unpriced == CostSummary(0.0, False, ("unpriced",))


def test_call_cost_raises_for_unpriced_worker():
    with pytest.raises(PricingError, match="worker_9"):
        call_cost(ok("worker_9", 1, 1), REFERENCE_PRICES)


def test_cost_score():
    assert cost_score(0.0) == 1.0
    assert cost_score(C_REF_USD) == 0.5
    assert cost_score(3 * 0.01, 0.01) == pytest.approx(0.25)
    assert cost_score(0.002, 0.004) > cost_score(0.003, 0.004)
    with pytest.raises(ValueError, match="C_ref"):
        cost_score(0.1, 0.0)
    with pytest.raises(ValueError, match="cost"):
        cost_score(-1.0)


def test_verify_pool():
    verify_pool([f"worker_{i}" for i in range(1, 7)], REFERENCE_PRICES)
    with pytest.raises(PricingError, match=r"\['worker_7'\]"):
        verify_pool(["worker_1", "worker_7"], REFERENCE_PRICES)
    backends = {"worker_1": "qwen3_8b", "worker_2": "llama31_8b"}
    verify_pool(["worker_1", "worker_2"], REFERENCE_PRICES, backends)
    with pytest.raises(PricingError, match="worker_2.*llama31_8b.*qwen3_8b"):
        verify_pool(["worker_2"], REFERENCE_PRICES, {"worker_2": "qwen3_8b"})
    with pytest.raises(PricingError, match="None"):
        verify_pool(["worker_2"], REFERENCE_PRICES, {})
    # A price not pinned to a backend is not checked against one.
    verify_pool(["worker_1"], {"worker_1": WorkerPrice(1.0, 2.0)}, {"worker_1": "anything"})


def test_price_problems_name_each_unbillable_worker_and_pool_prices():
    backends = {"worker_1": "qwen3_8b", "worker_2": "qwen3_8b", "worker_7": "x"}
    assert price_problems(["worker_7", "worker_1", "worker_2"], REFERENCE_PRICES, backends) == [
        ("worker_7", "has no price"),
        ("worker_2", "its price was set for backend 'llama31_8b' but it is served by "
                     "'qwen3_8b'")]
    assert price_problems(["worker_2"], REFERENCE_PRICES) == []  # no backends: not pinned
    # A pool bills at the table it declares (a channel pool's prices()), through wrappers;
    # a pool declaring none (the simulated pool) at the reference table.
    table = {"worker_7": WorkerPrice(3.0, 4.0)}
    declaring = SimpleNamespace(prices=lambda: table)
    assert pool_prices(SimpleNamespace(pool=SimpleNamespace(pool=declaring))) is table
    assert pool_prices(SimpleNamespace(pool=None)) is REFERENCE_PRICES


def test_worker_price_validation():
    with pytest.raises(ValueError, match="input_usd_per_m"):
        WorkerPrice(-0.1, 1.0)
    with pytest.raises(ValueError, match="output_usd_per_m"):
        WorkerPrice(0.1, float("nan"))


@pytest.mark.parametrize("values, expected", [
    ([3.0, 1.0, 5.0, 2.0, 4.0], 4.8),                    # pos 3.8: 4 + 0.8 × (5 − 4)
    ([0.1, 0.5, 0.2, 0.9, 0.3, 0.7, 1.3], 1.18),         # pos 5.7: 0.9 + 0.7 × 0.4
    ([0.0, 10.0], 9.5),                                  # pos 0.95
    ([float(v) for v in range(21)], 19.0),               # pos 19 exactly
    ([2.5], 2.5),
])
def test_p95_linear_interpolation(values, expected):
    assert percentile_linear(values, 0.95) == pytest.approx(expected, rel=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile_linear([], 0.95)
    with pytest.raises(ValueError, match="q="):
        percentile_linear([1.0], 95)


def test_c_ref_keeps_clean_complete_rows_only():
    rows = [{"cost_usd": c, "infra_failed": 0, "cost_complete": 1}
            for c in (0.003, 0.001, 0.005, 0.002, 0.004)]
    rows += [{"cost_usd": 9.0, "infra_failed": 1, "cost_complete": 1},
             {"cost_usd": 8.0, "infra_failed": 0, "cost_complete": 0},
             {"cost_usd": 7.0, "infra_failed": 1, "cost_complete": 0}]
    result = c_ref_from_costs(rows)
    assert result.c_ref_usd == pytest.approx(0.0048, rel=1e-12)
    assert (result.n_reference_rollouts, result.n_skipped_infra_failed,
            result.n_skipped_cost_incomplete) == (5, 2, 1)
    record = result.to_record()
    assert record["price_table_version"] == PRICE_TABLE_VERSION
    assert record["n_reference_rollouts"] == 5
    assert record["prices"]["worker_4"] == {"model": "gemma3_27b_it", "in": 0.119, "out": 0.2}
    # Objects with attributes work too (e.g. trajectory summaries).
    objs = [SimpleNamespace(cost_usd=c, infra_failed=False, cost_complete=True)
            for c in (1.0, 2.0)]
    assert c_ref_from_costs(objs).c_ref_usd == pytest.approx(1.95)


def test_c_ref_errors():
    with pytest.raises(ValueError, match="row 1 has no field 'cost_complete'"):
        c_ref_from_costs([{"cost_usd": 1.0, "infra_failed": 0, "cost_complete": 1},
                          {"cost_usd": 1.0, "infra_failed": 0}])
    with pytest.raises(ValueError, match="no reference rollouts"):
        c_ref_from_costs([{"cost_usd": 1.0, "infra_failed": 1, "cost_complete": 1}])
    with pytest.raises(ValueError, match="cost_usd"):
        c_ref_from_costs([{"cost_usd": None, "infra_failed": 0, "cost_complete": 1}])


def test_shipped_cost_ref_is_the_paper_value():
    from pathlib import Path

    from jax_routeweaver.routing.pools.pricing import C_REF_USD, load_cost_ref

    shipped = Path(__file__).resolve().parents[1] / "configs" / "cost_ref.json"
    assert load_cost_ref(shipped) == C_REF_USD == 0.007071665299999997


def test_load_cost_ref_errors(tmp_path):
    import json

    from jax_routeweaver.routing.pools.pricing import load_cost_ref

    with pytest.raises(FileNotFoundError, match="no cost-reference file"):
        load_cost_ref(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"c_ref_usd": -1, "price_table_version": "x"}))
    with pytest.raises(ValueError, match="c_ref_usd=-1 must be a positive number"):
        load_cost_ref(bad)
    bad.write_text(json.dumps({"c_ref_usd": 0.01, "price_table_version": "other"}))
    with pytest.raises(ValueError, match="price_table_version='other'"):
        load_cost_ref(bad)
    assert load_cost_ref(bad, price_table_version=None) == 0.01
