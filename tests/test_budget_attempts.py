"""A request's budget against what the workers bill (serving/budget.py, per attempt).

The simulated workers behind real HTTP (`routing.simulated.http_endpoint`), scripted per attempt:
successes, 429/500/503 with and without usage, replies after the client's timeout,
over-reported and implausible usage. The endpoint logs what the provider would bill for
every attempt it received; a request's budget must hold against that log, and its record
must never claim less than it."""

from __future__ import annotations

import asyncio
import itertools
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.pricing import tokens_cost
from jax_routeweaver.routing.pools.workers import Cooldowns, HttpWorkerPool
from jax_routeweaver.routing.simulated.http_endpoint import (
    Fault,
    SimulatedHttpWorkers,
    model_name,
    simulated_channel_file,
)
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks
from jax_routeweaver.serving.budget import OVER_BUDGET, BudgetedPool, WorkerFailed

TIMEOUT_S = 0.25  # the channels' request timeout
LATE_S = 0.4      # a late reply comes this long after the request, past the timeout
WORKERS = [f"worker_{k}" for k in range(1, 7)]
TAG = re.compile(r"^\[([^\]]+)\]")


@pytest.fixture(scope="module")
def tasks():
    return synthetic_tasks(40, seed=3)


@pytest.fixture(scope="module")
def endpoint(tasks, tmp_path_factory):
    sim = SimulatedWorkerPool(tasks, seed=3)
    with SimulatedHttpWorkers(sim) as server:
        server.channels = load_channels(simulated_channel_file(
            tmp_path_factory.mktemp("ch") / "channels.yaml", sim, server.url,
            fallbacks={"worker_3": "worker_1"}, timeout_s=TIMEOUT_S))
        yield server


class Script:
    """Faults handed out per request tag, in the order its attempts arrive; then successes."""

    def __init__(self, faults: dict[str, list[Fault]]):
        self.faults = {tag: list(f) for tag, f in faults.items()}

    def __call__(self, body: dict, sent: int) -> Fault:
        found = TAG.match(body["messages"][0]["content"])
        queue = self.faults.get(found.group(1), []) if found else []
        return queue.pop(0) if queue else Fault()


def provider_usd(endpoint, tag: str) -> float:
    """What the provider bills for the attempts of the request tagged `tag`."""
    prices = endpoint.channels.prices()
    by_model = {model_name(w): w for w in WORKERS}
    return sum(tokens_cost(by_model[b.model], b.usage.prompt_tokens, b.usage.completion_tokens,
                           prices) for b in endpoint.bills if b.prompt.startswith(f"[{tag}]"))


def pool(endpoint) -> HttpWorkerPool:
    async def no_sleep(seconds: float) -> None:  # the retry policy's waits, skipped
        await asyncio.sleep(0)

    return HttpWorkerPool(endpoint.channels, sleep=no_sleep, round_wait_s=0.0,
                          cooldowns=Cooldowns(0.0, 0.0, 0.0, 0.0), total_budget_s=30.0)


async def run_request(budget: BudgetedPool, tag: str, mode: str, workers: list[str],
                      question: str) -> None:
    """The calls a request of `mode` makes: one; three at once; four in a row. A call that
    raises `WorkerFailed` ends the request, as it ends a served one."""
    def prompt(k: int) -> str:
        return f"[{tag}] call {k}: {question}"

    try:
        if mode == "single":
            await budget.call(workers[0], prompt(0))
        elif mode == "multi":
            await asyncio.gather(*(budget.call(w, prompt(k))
                                   for k, w in enumerate(workers[:3])))
        else:
            for k, w in enumerate(workers[:4]):
                await budget.call(w, prompt(k))
    except WorkerFailed:
        pass


# What the provider bills: the reply's true usage (None), or a share of the request's bound.
BILLED = st.sampled_from([None, 0.0, 0.5, 1.0])
FAULTS = st.one_of(
    st.just(Fault()),
    st.builds(Fault, status=st.sampled_from([429, 500, 503]),
              report=st.sampled_from(["true", "none", "over", "implausible"]), billed=BILLED),
    st.builds(Fault, report=st.sampled_from(["true", "none", "over", "implausible"]),
              billed=BILLED),
    st.builds(Fault, status=st.sampled_from([200, 500]), billed=BILLED,
              delay_s=st.just(LATE_S)),
)
REQUEST = st.fixed_dictionaries({
    "mode": st.sampled_from(["single", "multi", "agentic"]),
    "workers": st.permutations(WORKERS),
    "budget": st.floats(0.5, 8.0),
    "faults": st.lists(FAULTS, max_size=6),
})
EXAMPLES = itertools.count()


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(REQUEST, min_size=1, max_size=3),
       max_tokens=st.sampled_from([32, 256, 2048]))
def test_what_the_workers_bill_never_exceeds_max_cost(endpoint, tasks, requests, max_tokens):
    """Drawn worker behaviours, budgets (0.5-8 first-call worst cases), max_tokens, modes and
    1-3 requests at once: per request, the provider's bill <= max_cost, the record's cost >=
    the provider's bill, and nothing stays reserved."""
    n = next(EXAMPLES)
    tags = [f"r{n}x{i}" for i in range(len(requests))]
    endpoint.script = Script({tag: r["faults"] for tag, r in zip(tags, requests, strict=True)})
    prices = endpoint.channels.prices()
    question = tasks[n % len(tasks)].question

    async def go():
        async with pool(endpoint) as workers:
            probe = BudgetedPool(workers, prices, None)
            first = min(probe.worst_case(w, f"[{tags[0]}] call 0: {question}", max_tokens)
                        for w in WORKERS)
            budgets = [BudgetedPool(workers, prices, r["budget"] * first,
                                    {"worker_3": "worker_1"}, default_max_tokens=max_tokens)
                       for r in requests]
            await asyncio.gather(*(run_request(b, tag, r["mode"], list(r["workers"]), question)
                                   for b, tag, r in zip(budgets, tags, requests, strict=True)))
            return budgets

    try:
        budgets = asyncio.run(go())
    finally:
        endpoint.script = None
    for budget, tag in zip(budgets, tags, strict=True):
        billed = provider_usd(endpoint, tag)
        assert billed <= budget.max_cost * (1 + 1e-9), (tag, billed, budget.max_cost)
        assert budget.spent >= billed * (1 - 1e-9), (tag, budget.spent, billed)
        assert budget.within_budget and budget.reserved == pytest.approx(0.0, abs=1e-15)
        assert budget.spent == pytest.approx(sum(e.cost_usd for e in budget.ledger))


def one_call(endpoint, faults: list[Fault], max_cost_in_w: float, tag: str,
             worker: str = "worker_4"):
    """One call of `worker` under a budget of `max_cost_in_w` of its worst case W, its
    attempts scripted by `faults`: (budget, call, W)."""
    endpoint.script = Script({tag: faults})
    prompt = f"[{tag}] call 0: what is 2+2?"

    async def go():
        async with pool(endpoint) as workers:
            prices = endpoint.channels.prices()
            w = BudgetedPool(workers, prices, None).worst_case(worker, prompt, 256)
            budget = BudgetedPool(workers, prices, max_cost_in_w * w, default_max_tokens=256)
            return budget, await budget.call(worker, prompt), w

    try:
        return asyncio.run(go())
    finally:
        endpoint.script = None


def test_a_retry_needs_its_own_reservation(endpoint):
    """The issue's case: a 500 that bills plausible usage, then a success. With max_cost =
    1.01 W the retry does not fit: it is not sent, the call ends over budget, and the
    provider billed only the first attempt (before: both, 2 W in the worst case)."""
    budget, call, w = one_call(endpoint, [Fault(500, "true", 0.6)], 1.01, "retry")
    assert not call.success and call.error.startswith(OVER_BUDGET) and call.attempts == 1
    assert len([b for b in endpoint.bills if b.prompt.startswith("[retry]")]) == 1
    (entry,) = budget.ledger
    assert entry.attempts == 1 and not entry.refused and entry.usage_known
    assert entry.cost_usd == pytest.approx(provider_usd(endpoint, "retry"))
    assert 0 < entry.cost_usd < w


def test_a_timed_out_attempt_keeps_its_worst_case(endpoint):
    """A reply after the client's timeout is billed by the provider; the record keeps the
    attempt's worst case W (not 0), so a budget of 1.5 W has no room for a retry."""
    budget, call, w = one_call(endpoint, [Fault(delay_s=LATE_S)], 1.5, "late")
    assert not call.success and call.error.startswith(OVER_BUDGET)
    (entry,) = budget.ledger
    assert entry.cost_usd == pytest.approx(w) and not entry.usage_known
    assert provider_usd(endpoint, "late") <= entry.cost_usd


def test_with_room_the_retry_is_sent_and_both_attempts_are_billed(endpoint):
    budget, call, w = one_call(endpoint, [Fault(503, "none", 0.0)], 2.5, "room")
    assert call.success and call.attempts == 2
    (entry,) = budget.ledger
    # The 503 reported no usage: its worst case W stands beside the success's usage.
    assert entry.worst_case_usd == pytest.approx(2 * w) and not entry.usage_known
    assert w < entry.cost_usd < 2 * w and budget.spent == entry.cost_usd


def test_implausible_usage_is_billed_at_the_worst_case(endpoint):
    budget, call, w = one_call(endpoint, [Fault(report="implausible")], 3.0, "lie")
    assert call.success and call.usage is None
    assert budget.ledger[0].cost_usd == pytest.approx(w)


def test_an_attempt_that_never_reached_a_worker_is_free(tmp_path, tasks):
    """Connection refused: nothing was sent, so nothing is billed (the call still fails)."""
    sim = SimulatedWorkerPool(tasks, seed=3)
    with SimulatedHttpWorkers(sim) as server:
        url = server.url
    channels = load_channels(simulated_channel_file(tmp_path / "c.yaml", sim, url))

    async def go():
        async with HttpWorkerPool(channels, max_rounds=1) as workers:
            budget = BudgetedPool(workers, channels.prices(), 1.0)
            with pytest.raises(WorkerFailed, match="ConnectError"):
                await budget.call("worker_2", "hello")
            return budget

    budget = asyncio.run(go())
    (entry,) = budget.ledger
    assert entry.attempts >= 1 and not entry.success
    assert budget.spent == 0.0 and entry.cost_usd == 0.0 and budget.reserved == 0.0


def test_a_fallback_outside_the_requests_workers_is_not_called(endpoint):
    endpoint.script = Script({"out": [Fault(500, "none", 0.0)] * 12})

    async def go():
        async with HttpWorkerPool(endpoint.channels, max_rounds=1) as workers:
            budget = BudgetedPool(workers, endpoint.channels.prices(), None,
                                  {"worker_3": "worker_1"}, allowed={"worker_3"})
            with pytest.raises(WorkerFailed) as e:
                await budget.call("worker_3", "[out] call 0: hi")
            return budget, e.value

    try:
        budget, error = asyncio.run(go())
    finally:
        endpoint.script = None
    assert error.outside == "worker_1" and error.fallback is None
    assert "worker_3" in str(error) and "worker_1" in str(error)
    assert [e.worker for e in budget.ledger] == ["worker_3"]
    assert not [b for b in endpoint.bills if b.model == "sim-1" and "[out]" in b.prompt]
