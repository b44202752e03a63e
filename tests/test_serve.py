"""`routeweaver serve` end to end: the official `openai` client against the endpoint on
127.0.0.1, the router from a quickstart checkpoint (random-init), the simulated workers
behind real HTTP (`routing.simulated.http_endpoint`). One server (uvicorn in a thread) serves the
module; `test_serve_cli_*` start the real command as a process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import PROXY_VARS, Served, tiny_run

from jax_routeweaver.cli.app import main
from jax_routeweaver.routing.simulated.http_endpoint import (
    SimulatedHttpWorkers,
    simulated_channel_file,
)
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.serving.config import ServeConfig

TOKEN = "rw-serve-test-token-5e4d3c"
pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module", autouse=True)
def no_proxy():
    saved = {k: os.environ.pop(k) for k in PROXY_VARS if k in os.environ}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list]:
    """A quickstart run directory holding a random-init router as policy step 1, and its
    questions."""
    return tiny_run(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def workers(run, tmp_path_factory):
    """The simulated workers on loopback; worker_3 falls back to worker_1, worker_2 has no
    fallback."""
    records = run[1]
    sim = SimulatedWorkerPool(records, seed=0)
    with SimulatedHttpWorkers(sim) as stub:
        stub.channels = simulated_channel_file(
            tmp_path_factory.mktemp("ch") / "channels.yaml", sim, stub.url,
            fallbacks={"worker_3": "worker_1"})
        yield stub


@pytest.fixture(scope="module")
def served(run, workers):
    sent = len(workers.bodies)
    s = Served(run[0], workers.channels, ServeConfig(port=0, worker_budget_s=1.0,
                                                     max_body_bytes=4096, warmup_rows=2,
                                                     max_question_tokens=300), TOKEN)
    s.warm_calls = len(workers.bodies) - sent
    yield s
    s.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture
def options(served):
    """Change the running server's limits for one test."""
    original = served.state.config

    def change(**kw):
        served.state.config = dataclasses.replace(original, **kw)

    yield change
    served.state.config = original


def ask(client, question: str, **extra):
    return client.chat.completions.create(
        model="routeweaver", messages=[{"role": "user", "content": question}],
        extra_body=extra or None)


# ------------------------------------------------------------------------------ the happy path
def test_a_request_is_routed_and_answered_with_its_routing_record(client, run):
    question = run[1][0].question
    c = ask(client, question, max_cost=0.05)
    assert c.object == "chat.completion" and c.model == "routeweaver"
    answer = c.choices[0].message.content
    assert c.choices[0].finish_reason == "stop" and answer
    rec = c.routeweaver
    assert rec["mode"] in ("single", "multi", "agentic") and rec["forced"] is False
    assert rec["answer_source"] in ("router", "last_reply", "cheapest_worker")
    assert rec["calls"], "a RouteWeaver episode calls at least one worker"
    for call in rec["calls"]:
        assert call["cost_usd"] <= call["worst_case_usd"]
        if call["success"]:
            assert call["prompt_tokens"] > 0 and call["completion_tokens"] > 0
    total = sum(call["cost_usd"] for call in rec["calls"])
    assert rec["total_cost_usd"] == pytest.approx(total) and 0 < total <= 0.05
    assert rec["within_budget"] and rec["max_cost_usd"] == 0.05
    assert rec["latency_s"] >= rec["worker_s"] > 0
    assert rec["router_s"] == pytest.approx(rec["latency_s"] - rec["worker_s"], abs=1e-3)
    assert c.usage.completion_tokens > 0 and c.usage.prompt_tokens > 0


def test_streaming_sends_the_same_answer_then_the_record_and_usage(client, run):
    question = run[1][1].question
    whole = ask(client, question)
    chunks = list(client.chat.completions.create(
        model="routeweaver", messages=[{"role": "user", "content": question}], stream=True,
        stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # Greedy router, deterministic workers: the same answer as the non-streamed request.
    assert text == whole.choices[0].message.content
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert finish[0].routeweaver["mode"] == whole.routeweaver["mode"]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_a_forced_mode_and_a_worker_list_are_honoured(client, run):
    for question in (r.question for r in run[1][2:5]):
        rec = ask(client, question, mode="agentic", workers=["worker_2", "worker_4"]).routeweaver
        assert rec["mode"] == "agentic" and rec["forced"] is True
        assert rec["offered"] == ["worker_2", "worker_4"]
        assert {c["worker"] for c in rec["calls"]} <= {"worker_2", "worker_4"}


def test_the_warm_up_sampled_batches_before_listening_and_called_no_worker(served):
    from jax_routeweaver.routing.protocol import prompts
    from jax_routeweaver.serving.router import WARM_UP_QUESTION, warm_up_reply

    service = served.runtime.service
    lengths = service.warm_up_lengths()  # 1/4, 1/2 and all of the longest observation
    assert lengths == (96, 192, 384)  # the quickstart's obs_budget_cap, 384
    for n in lengths:  # the canned replies are about as long as asked, in router tokens
        ids = service.tokenizer.encode(warm_up_reply(service.tokenizer, n),
                                       add_special_tokens=False)
        assert abs(len(ids) - n) <= 0.05 * n, (n, len(ids))
    # Episodes in batches of 1 and 2 (warmup_rows=2), once per reply length: at least one
    # turn each, and no worker called.
    assert served.warm_rows >= 3 * (1 + 2) and served.warm_batches >= 6
    assert served.warm_calls == 0
    # The replies reached the router: it compiled a context holding the longest one.
    selector = len(prompts.selector_prompt_ids(service.tokenizer, WARM_UP_QUESTION))
    longest = max(p for _, p, _ in served.runtime.sampler.sampler.shape_state())
    assert longest >= selector + lengths[-1], (longest, selector)


def test_the_warm_up_batches_double_up_to_the_limit():
    from jax_routeweaver.serving.app import warm_up_batches

    assert warm_up_batches(64) == [1, 2, 4, 8, 16, 32, 64]
    assert warm_up_batches(48) == [1, 2, 4, 8, 16, 32, 48]
    assert warm_up_batches(1) == [1] and warm_up_batches(0) == []
    assert ServeConfig().warmup_limit == ServeConfig().max_batch == 64  # the default
    assert ServeConfig(max_batch=16).warmup_limit == 16
    assert ServeConfig(warmup_rows=0).warmup_limit == 0
    with pytest.raises(ValueError, match="warmup_rows=-1"):
        ServeConfig(warmup_rows=-1)


def test_the_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["routeweaver"]


# ------------------------------------------------------------------------------ the budget
def test_max_cost_holds_by_construction_and_the_record_says_how(client, served, run):
    """Budgets from just above one worst-case call up: every request ends within its
    max_cost, calls that would not fit are refused, and the answer still comes."""
    probe = served.runtime.service
    question = run[1][5].question
    from jax_routeweaver.routing.protocol import prompts
    from jax_routeweaver.serving.budget import BudgetedPool
    from jax_routeweaver.serving.router import DIRECT_TASK

    pool = BudgetedPool(probe.pool, probe.prices, None)
    payload = prompts.single_multi_payload(question, DIRECT_TASK)
    cheapest = min(pool.worst_case(w, payload, 4096) for w in probe.served)
    refused = 0
    for k, record in enumerate(run[1][5:17]):
        budget = cheapest * (1.01 + 0.5 * (k % 4))
        rec = ask(client, record.question, max_cost=budget, mode=("multi", "agentic")[k % 2]
                  ).routeweaver
        assert rec["total_cost_usd"] <= budget and rec["within_budget"]
        assert all(c["worst_case_usd"] <= budget for c in rec["calls"] if not c["refused"])
        refused += rec["refused_calls"]
        assert all(c["error"] == "over_budget" and c["cost_usd"] == 0
                   for c in rec["calls"] if c["refused"])
    assert refused > 0, "tight budgets never refused a call: the test checks nothing"


def test_worst_case_prices_the_body_bound_and_in_flight_calls_hold_their_reservation(
        workers):
    """W = ((len(JSON body) + 1024) x in + max_tokens x out) / 1e6, by hand; two calls at
    once under a budget of one worst case: the second is refused while the first is in
    flight, though the first bills far less."""
    from jax_routeweaver.routing.pools.channels import load_channels
    from jax_routeweaver.routing.pools.workers import HttpWorkerPool
    from jax_routeweaver.serving.budget import BudgetedPool

    channels = load_channels(workers.channels)
    prompt = "Solve the task: what is 2+2?"
    body = {"model": "sim-4", "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.2, "seed": 42, "max_tokens": 256}
    price = channels.prices()["worker_4"]
    expected = ((len(json.dumps(body)) + 1024) * price.input_usd_per_m
                + 256 * price.output_usd_per_m) / 1e6

    async def go():
        async with HttpWorkerPool(channels) as pool:
            budget = BudgetedPool(pool, channels.prices(), expected * 1.5)
            assert budget.worst_case("worker_4", prompt, 256) == pytest.approx(expected)
            first, second = await asyncio.gather(
                budget.call("worker_4", prompt, max_tokens=256),
                budget.call("worker_4", prompt + " ", max_tokens=256))
            return budget, first, second

    workers.delay_s = 0.3
    try:
        budget, first, second = asyncio.run(go())
    finally:
        workers.delay_s = 0.0
    assert first.success and not second.success and second.error == "over_budget"
    assert [e.refused for e in budget.ledger] == [True, False]  # refused before the reply
    assert 0 < budget.spent < expected / 10 and budget.reserved == 0
    assert budget.remaining == pytest.approx(expected * 1.5 - budget.spent)


def test_a_budget_below_every_call_is_refused_naming_max_cost(client, run):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, run[1][0].question, max_cost=1e-9)
    assert e.value.code == "max_cost_too_low" and e.value.param == "max_cost"
    assert "worst case" in e.value.message


@pytest.fixture
def patient_pool(served):
    """The served pool's per-call budget raised for one test, so a stalled worker call is
    still in flight when the request ends (the fixture's 1 s would fail it first)."""
    pool = served.runtime.pool
    original = pool._total_budget_s
    pool._total_budget_s = 60.0
    yield pool
    pool._total_budget_s = original


def metric(served, pattern: str) -> float:
    text = httpx.get(served.base + "/metrics", headers=_auth()).text
    found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def cancelled_calls_keep_their_worst_case(rec: dict) -> None:
    """A record of a request that ended with a call in flight: that call was cancelled and
    is billed at its worst case (the provider may bill it); nothing stays reserved."""
    cancelled = [c for c in rec["calls"] if c["error"] == "cancelled"]
    assert cancelled, rec["calls"]
    for c in cancelled:
        assert c["cost_usd"] == pytest.approx(c["worst_case_usd"]) and c["cost_usd"] > 0
        assert c["attempts"] == 1 and not c["usage_known"]
    assert rec["total_cost_usd"] == pytest.approx(sum(c["cost_usd"] for c in rec["calls"]))
    assert rec["reserved_usd"] == 0 and rec["mode"] is None


def test_a_request_past_its_timeout_ends_with_504_and_keeps_its_record(client, workers,
                                                                       options, run, served,
                                                                       patient_pool):
    options(request_timeout_s=2.0)
    before = metric(served, r'routeweaver_error_cost_usd_total\{kind="timeout"\}')
    workers.delay_s = 4.0
    try:
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, run[1][22].question)
    finally:
        workers.delay_s = 0.0
    assert e.value.status_code == 504 and e.value.code == "timeout"
    rec = e.value.response.json()["routeweaver"]
    cancelled_calls_keep_their_worst_case(rec)
    after = metric(served, r'routeweaver_error_cost_usd_total\{kind="timeout"\}')
    assert after - before == pytest.approx(rec["total_cost_usd"])
    options(request_timeout_s=300.0)
    time.sleep(4.0)  # the abandoned call's reply arrives and is dropped
    assert ask(client, run[1][22].question).choices[0].message.content


def test_a_client_that_disconnects_ends_its_request_and_the_record_is_logged(
        served, workers, run, patient_pool, caplog):
    """The client gives up after 1.5 s while a worker stalls: the server cancels the
    request's calls, logs its record and counts its cost."""
    impatient = openai.OpenAI(base_url=served.url, api_key=TOKEN, max_retries=0, timeout=1.5)
    before = metric(served, r'routeweaver_errors_total\{kind="client_disconnected"\}')
    workers.delay_s = 6.0
    try:
        with caplog.at_level("WARNING", logger="jax_routeweaver.serving.app"), \
                pytest.raises(openai.APITimeoutError):
            ask(impatient, run[1][23].question)
        deadline = time.time() + 10
        while metric(served, r'routeweaver_errors_total\{kind="client_disconnected"\}') \
                == before:
            assert time.time() < deadline, "the server did not notice the client leave"
            time.sleep(0.1)
    finally:
        workers.delay_s = 0.0
    logged = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(logged) == 1
    rec = json.loads(logged[0].split("record ", 1)[1])
    cancelled_calls_keep_their_worst_case(rec)
    assert metric(served, r'routeweaver_error_cost_usd_total\{kind="client_disconnected"\}'
                  ) >= rec["total_cost_usd"] > 0
    time.sleep(6.0)  # the abandoned call's reply arrives and is dropped


# ------------------------------------------------------------------------------ concurrency
def test_concurrent_requests_share_sampler_batches(served, workers, run, patient_pool):
    """Sixteen clients at once: their router turns are sampled in batches of several rows
    (one row per request turn), not one request at a time. The pool is patient: on a loaded
    machine sixteen calls of 0.2 s can outlast the fixture's 1 s budget, and this test is
    about batching, not budgets."""
    sampler = served.runtime.sampler
    batches, rows = sampler.batches, sampler.rows
    workers.delay_s = 0.2

    async def go():
        client = openai.AsyncOpenAI(base_url=served.url, api_key=TOKEN, max_retries=0,
                                    timeout=120)
        out = await asyncio.gather(*(client.chat.completions.create(
            model="routeweaver", messages=[{"role": "user", "content": r.question}])
            for r in run[1][:16]))
        await client.close()
        return out

    try:
        out = asyncio.run(go())
    finally:
        workers.delay_s = 0.0
    assert len(out) == 16 and all(c.choices[0].message.content for c in out)
    turns = sum(c.routeweaver["turns"] for c in out)
    assert sampler.rows - rows == turns
    assert sampler.batches - batches < turns / 2, "turns were sampled one request at a time"


def test_more_requests_than_max_inflight_get_503(served, workers, options, run, patient_pool):
    options(max_inflight=1)
    workers.delay_s = 0.5  # the first request is still in flight when the second arrives

    def post():
        return httpx.post(served.url + "/chat/completions", headers=_auth(), timeout=60,
                          json={"model": "routeweaver",
                                "messages": [{"role": "user", "content": run[1][3].question}]})

    try:
        first = threading.Thread(target=post)
        first.start()
        time.sleep(0.2)
        second = post()
        first.join()
    finally:
        workers.delay_s = 0.0
    assert second.status_code == 503 and second.json()["error"]["code"] == "overloaded"


# ------------------------------------------------------------------------------ auth and input
def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_wrong_or_missing_token_is_refused_and_healthz_is_open(served, run):
    bad = openai.OpenAI(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        ask(bad, run[1][0].question)
    assert httpx.get(served.url + "/models").status_code == 401
    assert httpx.get(served.base + "/metrics").status_code == 401
    health = httpx.get(served.base + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "q"}], "max_cots": 1},
     400, "invalid_request", "max_cots"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "q"}], "max_cost": -1},
     400, "invalid_request", "max_cost"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "q"}], "mode": "solo"},
     400, "invalid_request", "mode"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "q"}],
      "workers": ["worker_9"]}, 400, "invalid_request", "workers"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "q"}], "n": 2},
     400, "invalid_request", "n"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}]},
     404, "model_not_found", "model"),
    ({"model": "routeweaver", "messages": [{"role": "assistant", "content": "q"}]},
     400, "invalid_request", "messages[0]"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "word " * 400}]},
     400, "context_length_exceeded", "messages"),
    ({"model": "routeweaver", "messages": [{"role": "user", "content": "x" * 5000}]},
     413, "body_too_large", None),
])
def test_bad_requests_get_one_error_naming_the_field(served, body, status, code, param):
    reply = httpx.post(served.url + "/chat/completions", headers=_auth(), json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"]


def test_metrics_count_requests_modes_calls_cost_and_errors(client, served, run):
    ask(client, run[1][0].question, max_cost=0.05)
    with pytest.raises(openai.BadRequestError):
        ask(client, run[1][0].question, max_cost=1e-9)
    text = httpx.get(served.base + "/metrics", headers=_auth()).text

    def value(pattern: str) -> float:
        found = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
        assert found, pattern
        return float(found.group(1))

    assert value(r'routeweaver_requests_total\{status="200"\}') >= 1
    assert value(r'routeweaver_errors_total\{kind="max_cost_too_low"\}') >= 1
    assert value("routeweaver_request_latency_seconds_count") >= 2
    assert value("routeweaver_cost_usd_total") > 0
    assert sum(float(v) for v in re.findall(
        r'^routeweaver_mode_total\{[^}]*\} (\S+)$', text, re.MULTILINE)) >= 1
    assert re.search(r'^routeweaver_worker_calls_total\{outcome="ok",worker="worker_\d"\} ',
                     text, re.MULTILINE)
    assert TOKEN not in text


# ------------------------------------------------------------------------------ worker failures
# Last of the in-process tests: a failed channel cools down (the pool's retry policy), so a
# later request routed to it would fail too.
def test_a_fallback_outside_the_requests_workers_is_not_called(client, workers, run):
    """worker_3 falls back to worker_1, but the request allows worker_3 only: worker_1 is
    never called and the request fails naming both (before: worker_1 was called)."""
    question = run[1][20].question
    workers.failing = {"sim-3"}
    try:
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, question, mode="single", workers=["worker_3"])
    finally:
        workers.failing = set()
    assert e.value.status_code == 502 and e.value.code == "worker_failed"
    assert "worker_3" in e.value.message and "worker_1" in e.value.message
    rec = e.value.response.json()["routeweaver"]
    assert {c["worker"] for c in rec["calls"]} == {"worker_3"} and rec["fallback_calls"] == 0
    assert not [b for b in workers.bodies
                if b["model"] == "sim-1" and question in b["messages"][0]["content"]]


def test_a_failed_worker_without_fallback_fails_the_request_with_a_code(client, workers, run):
    workers.failing = {"sim-2"}
    try:
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, run[1][21].question, mode="single", workers=["worker_2"])
    finally:
        workers.failing = set()
    assert e.value.status_code == 502 and e.value.code == "worker_failed"
    assert "worker_2" in e.value.message
    rec = e.value.response.json()["routeweaver"]  # what was called (and billed) before
    assert [(c["worker"], c["success"]) for c in rec["calls"]] == [("worker_2", False)]
    assert rec["mode"] is None and rec["within_budget"]


def test_a_request_out_of_budget_ends_with_402_and_keeps_what_it_billed(client, served,
                                                                        workers, run,
                                                                        monkeypatch):
    """worker_5 replies with no usage: its call is billed at its worst case W, and then
    nothing fits a budget of 1.5 W. The random-init router always answers, so its answer
    (and the last reply) is dropped here to reach the ending where nothing is left to pay
    for one: 402, with the record of what was billed."""
    from jax_routeweaver.routing.protocol import prompts
    from jax_routeweaver.routing.simulated.http_endpoint import Fault
    from jax_routeweaver.serving.budget import BudgetedPool
    from jax_routeweaver.serving.router import DIRECT_TASK

    question = run[1][24].question
    service = served.runtime.service
    payload = prompts.single_multi_payload(question, DIRECT_TASK)
    w = BudgetedPool(service.pool, service.prices, None).worst_case("worker_5", payload, 4096)
    answer = service._answer

    async def no_answer(traj, budget, request, max_tokens):
        traj = dataclasses.replace(traj, answer=None, calls=[])
        return await answer(traj, budget, request, max_tokens)

    monkeypatch.setattr(service, "_answer", no_answer)
    workers.script = lambda body, n: Fault(report="none") \
        if question in body["messages"][0]["content"] else Fault()
    try:
        with pytest.raises(openai.APIStatusError) as e:
            ask(client, question, mode="single", workers=["worker_5"], max_cost=1.5 * w)
    finally:
        workers.script = None
    assert e.value.status_code == 402 and e.value.code == "budget_exhausted"
    rec = e.value.response.json()["routeweaver"]
    sent = [c for c in rec["calls"] if not c["refused"]]
    assert sent and all(c["success"] and not c["usage_known"] for c in sent)
    assert rec["total_cost_usd"] == pytest.approx(sum(c["worst_case_usd"] for c in sent))
    assert rec["within_budget"] and rec["total_cost_usd"] <= 1.5 * w
    assert rec["budget_left_usd"] < w and rec["answer_source"] is None
    assert metric(served, r'routeweaver_error_cost_usd_total\{kind="budget_exhausted"\}'
                  ) >= rec["total_cost_usd"]


# ------------------------------------------------------------------------------ the command
def test_serve_cli_refuses_a_public_address_without_a_token(run, workers, capsys,
                                                            monkeypatch):
    monkeypatch.delenv("ROUTEWEAVER_SERVE_TOKEN", raising=False)
    code = main(["serve", "--checkpoint", str(run[0]), "--channels", str(workers.channels),
                 "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert code == 2 and "--host 0.0.0.0" in err and "ROUTEWEAVER_SERVE_TOKEN" in err


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    env.pop("ROUTEWEAVER_SERVE_TOKEN", None)
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "jax_routeweaver.cli", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_for(pattern: str, log: Path, proc: subprocess.Popen) -> re.Match:
    deadline = time.time() + 300
    while not (found := re.search(pattern, log.read_text())):
        assert proc.poll() is None and time.time() < deadline, log.read_text()
        time.sleep(0.2)
    return found


def test_serve_cli_finishes_accepted_requests_on_sigterm(run, tmp_path):
    """The real commands: `simulate-workers` (1.5 s a completion) and `serve` on it; a
    SIGTERM while a request runs lets that request finish (200) before serve exits 0;
    afterwards nothing listens."""
    channels = tmp_path / "sim.yaml"
    sim = _start(["simulate-workers", "--config", str(run[0] / "config.yaml"),
                  "--channels-out", str(channels), "--delay", "1.5"], tmp_path / "sim.log")
    serve = None
    try:
        _wait_for(r"SIMULATED workers .* at http://127\.0\.0\.1:\d+/v1", tmp_path / "sim.log",
                  sim)
        log = tmp_path / "serve.log"
        serve = _start(["serve", "--checkpoint", str(run[0]), "--channels", str(channels),
                        "--port", "0", "--warmup", "0"], log)
        base = _wait_for(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log, serve).group(1)
        assert httpx.get(base + "/healthz").status_code == 200
        result: dict = {}

        def request():
            result["reply"] = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "model": "routeweaver", "mode": "single",
                "messages": [{"role": "user", "content": run[1][7].question}]})

        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(1.0)  # accepted, waiting for its worker
        serve.send_signal(signal.SIGTERM)
        thread.join(120)
        assert serve.wait(120) == 0, log.read_text()
        sim.send_signal(signal.SIGTERM)
        assert sim.wait(30) == 0
    finally:
        for proc in (serve, sim):
            if proc is not None and proc.poll() is None:
                proc.kill()
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert reply.json()["routeweaver"]["mode"] == "single"
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/healthz")
