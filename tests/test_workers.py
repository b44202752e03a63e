"""The channel file and the HTTP worker pool, against a scripted OpenAI-compatible server.

The server is the standard library's `ThreadingHTTPServer` on 127.0.0.1. Each scenario has its
own URL prefix (`/s/<name>/v1`) and replays a script of responses (the last one repeats).
Retry sleeps go through a fake clock, so reference cooldowns (15-30 s) cost no wall time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from jax_routeweaver.routing.pools.channels import ChannelConfigError, load_channels, parse_channels
from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES, verify_pool
from jax_routeweaver.routing.pools.workers import HttpWorkerPool, MissingApiKeyError
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall, WorkerPool

REPO = Path(__file__).resolve().parents[1]
KEY_ENV = "RW_TEST_WORKER_KEY"
SECRET = "sk-test-S3CRET-7f3a9c1e5b2d4086"


# ---------------------------------------------------------------------------------------------
# Scripted server


def reply(text="  the answer  ", prompt_tokens=11, completion_tokens=4, usage_extra=None,
          **message_extra):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens, **(usage_extra or {})}
    message = {"role": "assistant", "content": text, **message_extra}
    return {"status": 200, "body": {"choices": [{"index": 0, "message": message}],
                                    "usage": usage}}


def status(code, body=None, delay=0.0):
    return {"status": code, "body": body if body is not None else {"error": f"status {code}"},
            "delay": delay}


class ScriptedServer:
    """Loopback chat-completions server; records requests and the peak of in-flight requests."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[dict]] = {}
        self.requests: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,),
                                       daemon=True)
        self.thread.start()

    def script(self, scenario: str, *steps: dict) -> str:
        """Register a scenario; returns its base URL."""
        self.scripts[scenario] = list(steps)
        return f"http://127.0.0.1:{self.httpd.server_port}/s/{scenario}/v1"

    def requests_for(self, scenario: str) -> list[dict]:
        return [r for r in self.requests if r["scenario"] == scenario]

    def next_step(self, scenario: str) -> dict:
        with self.lock:
            steps = self.scripts[scenario]
            return steps.pop(0) if len(steps) > 1 else steps[0]

    def close(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _handler_for(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_POST(self) -> None:
            parts = self.path.split("/")  # ['', 's', scenario, 'v1', 'chat', 'completions']
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if len(parts) != 6 or parts[3:] != ["v1", "chat", "completions"]:
                self._send(404, b"{}")
                return
            scenario = parts[2]
            with server.lock:
                server.requests.append({"scenario": scenario, "headers": dict(self.headers),
                                        "body": json.loads(raw)})
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
            try:
                step = server.next_step(scenario)
                if step.get("delay"):
                    server.stopping.wait(step["delay"])
                body = step["body"]
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
                self._send(step["status"], payload)
            finally:
                with server.lock:
                    server.in_flight -= 1

        def _send(self, code: int, payload: bytes) -> None:
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out first
                pass

    return Handler


@pytest.fixture
def server():
    srv = ScriptedServer()
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def _loopback_env(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_ENV, SECRET)


class FakeTime:
    """Real monotonic time plus whatever the pool 'slept'."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return time.monotonic() + self.offset

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.offset += seconds
        await asyncio.sleep(0)


def entry(base_url, *, keyed=False, timeout_s=5.0, **extra):
    out = {"description": "a test worker", "base_url": base_url, "model": "test-model",
           "timeout_s": timeout_s, **extra}
    if keyed:
        out["api_key_env"] = KEY_ENV
    return out


def config(**workers):
    return parse_channels({"workers": workers}, "test-channels.yaml")


def run_calls(channels, calls, fake=None, **pool_kwargs):
    """Run `calls` [(worker, prompt, kwargs)] concurrently on a fresh pool; returns WorkerCalls."""
    fake = fake or FakeTime()

    async def main():
        async with HttpWorkerPool(channels, sleep=fake.sleep, clock=fake.clock,
                                  **pool_kwargs) as pool:
            return await asyncio.gather(*(pool.call(w, p, **kw) for w, p, kw in calls))

    return asyncio.run(main())


def run_one(channels, worker="worker_1", prompt="What is 2+2?", fake=None, **pool_kwargs):
    return run_calls(channels, [(worker, prompt, {})], fake, **pool_kwargs)[0]


def free_closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Successful calls: body, headers, usage, observation


def test_success_request_body_auth_and_usage(server):
    url = server.script("ok", reply(usage_extra={"prompt_cache_hit_tokens": 6}))
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "provider": {"order": ["X"]}}
    call = run_one(config(worker_1=entry(url, keyed=True, extra_body=extra)),
                   prompt="Solve x+1=3.")
    assert call == WorkerCall("worker_1", "Solve x+1=3.", "the answer", True,
                              usage=Usage(11, 4, 6), latency_s=call.latency_s, attempts=1)
    assert 0 < call.latency_s < 5
    (request,) = server.requests_for("ok")
    assert request["body"] == {
        "model": "test-model", "messages": [{"role": "user", "content": "Solve x+1=3."}],
        "temperature": 0.2, "seed": 42, "max_tokens": 4096,
        "chat_template_kwargs": {"enable_thinking": False}, "provider": {"order": ["X"]}}
    assert request["headers"]["Authorization"] == f"Bearer {SECRET}"


def test_pool_settings_and_max_tokens_override_keyless_sends_no_auth(server):
    url = server.script("ok", reply())
    channels = config(worker_1=entry(url))
    calls = run_calls(channels, [("worker_1", "a", {}), ("worker_1", "b", {"max_tokens": 17})],
                      temperature=0.7, seed=7, default_max_tokens=99)
    assert all(c.success for c in calls)
    bodies = sorted((r["body"] for r in server.requests_for("ok")),
                    key=lambda b: b["messages"][0]["content"])
    assert [(b["temperature"], b["seed"], b["max_tokens"]) for b in bodies] == [
        (0.7, 7, 99), (0.7, 7, 17)]
    assert not any("Authorization" in r["headers"] for r in server.requests_for("ok"))


@pytest.mark.parametrize("usage, expected", [
    ({"prompt_tokens": 20, "completion_tokens": 3,
      "prompt_tokens_details": {"cached_tokens": 8}}, Usage(20, 3, 8)),
    ({"prompt_tokens": 20, "completion_tokens": 3, "prompt_cache_hit_tokens": 50,
      "prompt_tokens_details": {"cached_tokens": 1}}, Usage(20, 3, 20)),   # clamped to prompt
    ({"prompt_tokens": 20, "completion_tokens": 3, "prompt_cache_hit_tokens": -4},
     Usage(20, 3, 0)),
    ({"prompt_tokens": 20, "completion_tokens": 3, "prompt_tokens_details": None},
     Usage(20, 3, 0)),
    ({"prompt_tokens": "many", "completion_tokens": 3}, None),
    (None, None),
])
def test_usage_parsing(server, usage, expected):
    body = reply()["body"]
    if usage is None:
        del body["usage"]
    else:
        body["usage"] = usage
    call = run_one(config(worker_1=entry(server.script("u", {"status": 200, "body": body}))))
    assert call.success and call.usage == expected


def test_reasoning_is_recorded_never_returned(server):
    url = server.script("r", reply(text="", reasoning_content="long thoughts"),
                        reply(text=" 42 ", reasoning="hmm"))
    channels = config(worker_1=entry(url))
    missing, answered = run_calls(channels, [("worker_1", "a", {})]) + run_calls(
        channels, [("worker_1", "b", {})])
    assert (missing.success, missing.text, missing.error, missing.reasoning_chars) == (
        True, "", "final_content_missing", len("long thoughts"))
    assert missing.usage == Usage(11, 4)
    assert (answered.text, answered.error, answered.reasoning_chars) == ("42", None, 3)


# ---------------------------------------------------------------------------------------------
# Retries


def test_429_keyed_channel_retries_within_the_round(server):
    url = server.script("rl", status(429), reply())
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url, keyed=True)), fake=fake)
    assert call.success and call.attempts == 2 and call.error is None
    assert fake.sleeps == []


def test_429_keyless_channel_waits_out_its_cooldown(server):
    url = server.script("rl", status(429), reply())
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url)), fake=fake)
    assert call.success and call.attempts == 2
    assert fake.sleeps == [30.0]  # one round wait (2 × 15 s) covers the 30 s cooldown


def test_5xx_then_200_bills_failed_usage(server):
    failed_body = {"error": "boom", "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    url = server.script("5xx", status(500, failed_body), status(503), status(502), reply())
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url)), fake=fake)
    assert call.success and call.attempts == 4 and call.text == "the answer"
    assert call.failed_usage == Usage(7, 3)
    assert call.usage == Usage(11, 4)
    assert fake.sleeps == [30.0, 30.0, 30.0]


def test_cooling_keyless_channel_is_not_asked(server):
    url = server.script("cool", status(429), reply())
    fake = FakeTime()
    channels = config(worker_1=entry(url))

    async def main():
        async with HttpWorkerPool(channels, sleep=fake.sleep, clock=fake.clock, max_rounds=2,
                                  round_wait_s=5.0) as pool:
            first = await pool.call("worker_1", "a")
            sleeps_first = list(fake.sleeps)
            second = await pool.call("worker_1", "b")  # channel still cooling: no request
            fake.offset += 30.0
            third = await pool.call("worker_1", "c")
            return first, sleeps_first, second, third

    first, sleeps_first, second, third = asyncio.run(main())
    assert (first.success, first.attempts) == (False, 1)
    assert first.error == "retries_exhausted (attempts: http_429)"
    assert sleeps_first == [10.0]           # a round that sent a request waits 2 × 5 s
    assert (second.success, second.attempts) == (False, 0)
    assert fake.sleeps[len(sleeps_first):] == [5.0]  # an idle round waits 1 × 5 s
    assert third.success and third.attempts == 1
    assert len(server.requests_for("cool")) == 2


@pytest.mark.parametrize("code", [401, 403])
def test_auth_failure_not_retried_and_credential_retired(server, code):
    url = server.script("auth", status(code), reply())
    fake = FakeTime()
    channels = config(worker_1=entry(url, keyed=True))

    async def main():
        async with HttpWorkerPool(channels, sleep=fake.sleep, clock=fake.clock) as pool:
            return await pool.call("worker_1", "a"), await pool.call("worker_1", "b")

    first, second = asyncio.run(main())
    assert (first.success, first.attempts, first.text) == (False, 1, "")
    assert f"http_{code}" in first.error and first.error.startswith("auth_rejected")
    assert (second.success, second.attempts) == (False, 0)
    assert "rejected earlier" in second.error and KEY_ENV in second.error
    assert fake.sleeps == []
    assert len(server.requests_for("auth")) == 1


@pytest.mark.parametrize("code", [402, 404, 400])
def test_other_statuses_give_up(server, code):
    url = server.script("fatal", status(code), reply())
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url, keyed=True)), fake=fake)
    assert (call.success, call.attempts, fake.sleeps) == (False, 1, [])
    assert call.error == f"gave_up: http_{code} (attempts: http_{code})"


@pytest.mark.parametrize("garbage", [
    {"status": 200, "body": b"<html>not json</html>"},
    {"status": 200, "body": {"choices": []}},
    {"status": 200, "body": {"choices": [{"message": {"content": ["a", "list"]}}]}},
    {"status": 200, "body": {"result": "ok", "usage": {"prompt_tokens": 5,
                                                       "completion_tokens": 1}}},
])
def test_unparseable_200_is_retried(server, garbage):
    url = server.script("garbage", garbage, reply())
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url, keyed=True)), fake=fake)
    assert call.success and call.attempts == 2 and call.text == "the answer"
    assert fake.sleeps == [30.0]  # unparseable ends the round
    body = garbage["body"]
    has_usage = isinstance(body, dict) and "usage" in body
    assert call.failed_usage == (Usage(5, 1) if has_usage else None)


def test_slow_response_times_out_then_retries(server):
    url = server.script("slow", status(200, reply()["body"], delay=3.0), reply(text="fast"))
    fake = FakeTime()
    started = time.monotonic()
    call = run_one(config(worker_1=entry(url, timeout_s=0.3)), fake=fake)
    assert call.success and call.text == "fast" and call.attempts == 2
    assert time.monotonic() - started < 2.5
    assert fake.sleeps == [30.0]


def test_every_attempt_times_out_gives_infra_failure(server):
    url = server.script("hang", status(200, reply()["body"], delay=3.0))
    call = run_one(config(worker_1=entry(url, timeout_s=0.2)), max_rounds=2)
    assert (call.success, call.text, call.attempts) == (False, "", 2)
    assert call.error == "retries_exhausted (attempts: timeout, timeout)"


@pytest.mark.parametrize("keyed, attempts", [(False, 6), (True, 12)])
def test_closed_port_network_error_retried_then_failure(keyed, attempts):
    url = f"http://127.0.0.1:{free_closed_port()}/v1"
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url, keyed=keyed)), fake=fake)
    assert (call.success, call.text, call.usage, call.attempts) == (False, "", None, attempts)
    assert call.error.startswith("retries_exhausted (attempts: network:ConnectError")
    assert fake.sleeps == [30.0] * 5


def test_total_budget_bounds_the_call():
    url = f"http://127.0.0.1:{free_closed_port()}/v1"
    fake = FakeTime()
    call = run_one(config(worker_1=entry(url)), fake=fake, total_budget_s=70.0)
    assert not call.success and call.error.startswith("budget_exhausted")
    assert call.attempts == 3
    assert sum(fake.sleeps) <= 70.0 and fake.sleeps[:2] == [30.0, 30.0]
    assert call.latency_s >= 70.0  # latency is measured on the pool's clock


def test_concurrency_bound_is_respected(server):
    url = server.script("busy", {**reply(), "delay": 0.15})
    calls = run_calls(config(worker_1=entry(url)),
                      [("worker_1", f"q{i}", {}) for i in range(10)], concurrency=3)
    assert all(c.success for c in calls)
    assert server.max_in_flight == 3


# ---------------------------------------------------------------------------------------------
# Spend stop, keys and secrets


def test_spend_stop_refuses_paid_channels_before_sending(server, tmp_path):
    paid = server.script("paid", reply())
    local = server.script("local", reply())
    stop = tmp_path / "openrouter.STOP"
    stop.write_text("")
    channels = config(worker_1=entry(local), worker_2=entry(paid, keyed=True))
    free_call, paid_call = run_calls(channels, [("worker_1", "a", {}), ("worker_2", "b", {})],
                                     spend_stop_file=stop)
    assert free_call.success
    assert (paid_call.success, paid_call.attempts, paid_call.text) == (False, 0, "")
    assert paid_call.error.startswith("spend_stop") and "spend-stop" in paid_call.error
    assert server.requests_for("paid") == []
    stop.unlink()
    assert run_calls(channels, [("worker_2", "b", {})], spend_stop_file=stop)[0].success


def test_missing_key_variable_named_at_start(server, monkeypatch):
    channels = config(worker_3=entry(server.script("k", reply()), keyed=True))
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(MissingApiKeyError, match=rf"{KEY_ENV} \(needed by worker_3\)"):
        HttpWorkerPool(channels)
    monkeypatch.setenv(KEY_ENV, "   ")
    with pytest.raises(MissingApiKeyError, match=KEY_ENV):
        HttpWorkerPool(channels)


def test_key_removed_after_start_fails_the_call_without_sending(server, monkeypatch):
    channels = config(worker_1=entry(server.script("k", reply()), keyed=True))

    async def main():
        async with HttpWorkerPool(channels) as pool:
            monkeypatch.delenv(KEY_ENV)
            return await pool.call("worker_1", "a")

    call = asyncio.run(main())
    assert (call.success, call.attempts) == (False, 0)
    assert call.error == f"missing_api_key: environment variable {KEY_ENV} is not set"
    assert server.requests_for("k") == []


def test_key_is_read_at_call_time(server, monkeypatch):
    url = server.script("rot", reply())
    channels = config(worker_1=entry(url, keyed=True))

    async def main():
        async with HttpWorkerPool(channels) as pool:
            await pool.call("worker_1", "a")
            monkeypatch.setenv(KEY_ENV, "sk-rotated-key")
            await pool.call("worker_1", "b")

    asyncio.run(main())
    assert [r["headers"]["Authorization"] for r in server.requests_for("rot")] == [
        f"Bearer {SECRET}", "Bearer sk-rotated-key"]


def test_malformed_key_is_neither_sent_nor_shown(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-abc def\x01ghi")
    call = run_one(config(worker_1=entry(server.script("bad", reply()), keyed=True)))
    assert (call.success, call.attempts) == (False, 0)
    assert call.error.startswith("invalid_api_key") and "sk-abc" not in call.error
    assert server.requests_for("bad") == []


def test_secret_never_in_logs_records_or_reprs(server, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    good = server.script("good", reply())
    flaky = server.script("flaky", status(500), status(503, {"detail": "busy"}), reply())
    denied = server.script("denied", status(401))
    closed = f"http://127.0.0.1:{free_closed_port()}/v1"
    channels = config(worker_1=entry(good, keyed=True), worker_2=entry(flaky, keyed=True),
                      worker_3=entry(denied, keyed=True), worker_4=entry(closed, keyed=True))
    fake = FakeTime()

    async def main():
        async with HttpWorkerPool(channels, sleep=fake.sleep, clock=fake.clock,
                                  max_rounds=2) as pool:
            calls = await asyncio.gather(*(pool.call(w, "q") for w in pool.worker_ids()))
            return calls, repr(pool)

    calls, pool_repr = asyncio.run(main())
    assert [c.success for c in calls] == [True, True, False, False]
    # The key did go over the wire, and httpx/httpcore did log at DEBUG, so the checks below
    # could fail.
    assert all(r["headers"]["Authorization"] == f"Bearer {SECRET}" for r in server.requests)
    assert "HTTP Request: POST" in caplog.text
    assert {"httpx", "httpcore.connection", "httpcore.http11"} <= {r.name for r in caplog.records}
    assert any(r.name == "jax_routeweaver.routing.pools.workers" for r in caplog.records)
    assert SECRET not in caplog.text
    assert all(SECRET not in str(r.args) + r.getMessage() for r in caplog.records)
    for text in [pool_repr, repr(channels), *map(repr, calls)]:
        assert SECRET not in text
    assert KEY_ENV in repr(channels)  # the variable NAME is fine to show


# ---------------------------------------------------------------------------------------------
# Protocol surface


def test_pool_protocol_surface(server):
    channels = config(worker_2=entry(server.script("p", reply()), description="two"),
                      worker_10=entry(server.script("p", reply()), description="ten"),
                      worker_1=entry(server.script("p", reply()), description="one"))

    async def main():
        pool = HttpWorkerPool(channels)
        assert isinstance(pool, WorkerPool)
        assert pool.worker_ids() == ["worker_1", "worker_2", "worker_10"]
        assert pool.description("worker_10") == "ten"
        with pytest.raises(KeyError, match="worker_7"):
            await pool.call("worker_7", "a")
        with pytest.raises(ValueError, match="max_tokens"):
            await pool.call("worker_1", "a", max_tokens=0)
        await pool.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await pool.call("worker_1", "a")

    asyncio.run(main())


def test_pool_is_tied_to_one_event_loop(server):
    pool = HttpWorkerPool(config(worker_1=entry(server.script("loop", reply()))))
    assert asyncio.run(pool.call("worker_1", "a")).success
    with pytest.raises(RuntimeError, match="event loop"):
        asyncio.run(pool.call("worker_1", "b"))


# ---------------------------------------------------------------------------------------------
# Channel files


def write_yaml(tmp_path, data) -> Path:
    path = tmp_path / "channels.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


GOOD = {"description": "d", "base_url": "http://127.0.0.1:9/v1", "model": "m", "timeout_s": 5}


@pytest.mark.parametrize("data, field", [
    ({"workers": {"worker_1": GOOD}, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ({}, r"missing field\(s\) \['workers'\]"),
    ({"workers": {}}, "field 'workers'"),
    ({"workers": {"qwen3_8b": GOOD}}, "worker id 'qwen3_8b'"),
    ({"workers": {"worker_0": GOOD}}, "worker id 'worker_0'"),
    ({"workers": {"worker_1": {**GOOD, "temperature": 0.2}}},
     r"unknown field\(s\) \['temperature'\] in field 'workers.worker_1'.*pool settings"),
    ({"workers": {"worker_1": {**GOOD, "model": "x-1", "backend": "big_b",
                               "description": "A BIG_B thing"}}}, "names the model 'big_b'"),
    ({"workers": {"worker_1": {k: v for k, v in GOOD.items() if k != "model"}}},
     r"missing field\(s\) \['model'\] in field 'workers.worker_1'"),
    ({"workers": {"worker_1": {**GOOD, "timeout_s": 0}}}, "'workers.worker_1.timeout_s'"),
    ({"workers": {"worker_1": {**GOOD, "timeout_s": "120"}}}, "'workers.worker_1.timeout_s'"),
    ({"workers": {"worker_1": {**GOOD, "base_url": "127.0.0.1:8000/v1"}}},
     "'workers.worker_1.base_url'"),
    ({"workers": {"worker_1": {**GOOD, "base_url": "http://h/v1/chat/completions"}}},
     "appends /chat/completions"),
    ({"workers": {"worker_1": {**GOOD, "extra_body": {"max_tokens": 10}}}},
     r"'workers.worker_1.extra_body' must not set \['max_tokens'\]"),
    ({"workers": {"worker_1": {**GOOD, "extra_body": ["a"]}}}, "'workers.worker_1.extra_body'"),
    ({"workers": {"worker_1": {**GOOD, "price": {"input": 1}}}},
     r"missing field\(s\) \['output'\] in field 'workers.worker_1.price'"),
    ({"workers": {"worker_1": {**GOOD, "price": {"input": -1, "output": 1}}}},
     "'workers.worker_1.price'"),
    ({"workers": {"worker_1": {**GOOD, "description": "Runs m-large", "model": "m-large"}}},
     "names the model"),
    ({"workers": {"worker_1": {**GOOD, "description": ""}}}, "'workers.worker_1.description'"),
    ({"workers": {"worker_1": {**GOOD, "fallback": "worker_2"}}},
     "'workers.worker_1.fallback' must name another worker of the file, got 'worker_2'"),
    ({"workers": {"worker_1": {**GOOD, "fallback": "worker_1"}}},
     "'workers.worker_1.fallback' must name another worker"),
    ({"workers": {"worker_1": {**GOOD, "fallback": "big"}}},
     "'workers.worker_1.fallback' must be a worker id"),
])
def test_channel_file_errors_name_file_and_field(tmp_path, data, field):
    path = write_yaml(tmp_path, data)
    with pytest.raises(ChannelConfigError, match=field) as info:
        load_channels(path)
    assert str(info.value).startswith(f"{path}: ")


def test_a_fallback_worker_is_read_from_the_channel_file(tmp_path):
    path = write_yaml(tmp_path, {"workers": {"worker_1": {**GOOD, "fallback": "worker_2"},
                                             "worker_2": GOOD}})
    config = load_channels(path)
    assert config.channel("worker_1").fallback == "worker_2"
    assert config.channel("worker_2").fallback is None


def test_secrets_in_channel_file_are_rejected_without_echo(tmp_path):
    key_as_name = write_yaml(tmp_path, {"workers": {"worker_1": {**GOOD,
                                                                  "api_key_env": SECRET}}})
    with pytest.raises(ChannelConfigError, match="api_key_env") as info:
        load_channels(key_as_name)
    assert SECRET not in str(info.value)
    inline_key = write_yaml(tmp_path, {"workers": {"worker_1": {**GOOD, "api_key": SECRET}}})
    with pytest.raises(ChannelConfigError, match="environment variable") as info:
        load_channels(inline_key)
    assert SECRET not in str(info.value)
    in_url = write_yaml(tmp_path, {"workers": {"worker_1": {
        **GOOD, "base_url": f"https://user:{SECRET}@example.com/v1"}}})
    with pytest.raises(ChannelConfigError, match="credentials") as info:
        load_channels(in_url)
    assert SECRET not in str(info.value)


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ChannelConfigError, match="cannot read"):
        load_channels(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [unclosed")
    with pytest.raises(ChannelConfigError, match="not valid YAML"):
        load_channels(bad)


def test_reference_channel_file(monkeypatch):
    channels = load_channels(REPO / "configs/channels/reference.yaml")
    assert channels.worker_ids() == [f"worker_{i}" for i in range(1, 7)]
    assert channels.prices() == dict(REFERENCE_PRICES)
    verify_pool(channels.worker_ids(), channels.prices(), channels.backends())
    verify_pool(channels.worker_ids(), REFERENCE_PRICES, channels.backends())
    local = [c for c in channels.channels if c.api_key_env is None]
    assert [(c.worker, c.base_url, c.model, c.timeout_s) for c in local] == [
        ("worker_1", "http://127.0.0.1:8012/v1", "qwen3-8b", 120.0),
        ("worker_2", "http://127.0.0.1:8010/v1", "llama3.1-8b", 120.0)]
    assert local[0].extra_body == {"chat_template_kwargs": {"enable_thinking": False}}
    hosted = [c for c in channels.channels if c.api_key_env is not None]
    assert {c.api_key_env for c in hosted} == {"OPENROUTER_API_KEY"}
    assert {c.timeout_s for c in hosted} == {180.0}
    assert all(c.extra_body["provider"]["allow_fallbacks"] is False
               and c.extra_body["reasoning"] == {"enabled": False}
               and c.extra_body["usage"] == {"include": True} for c in hosted)
    assert channels.channel("worker_3").extra_body["provider"] == {
        "order": ["Nebius"], "allow_fallbacks": False, "quantizations": ["fp8"]}
    for c in channels.channels:  # the router sees descriptions: no model or backend names
        assert c.model.lower() not in c.description.lower()
        assert c.backend.lower() not in c.description.lower()
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(MissingApiKeyError, match="OPENROUTER_API_KEY"):
        HttpWorkerPool(channels)


def test_local_vllm_channel_file_needs_no_key(monkeypatch):
    local = load_channels(REPO / "configs/channels/local_vllm.yaml")
    reference = load_channels(REPO / "configs/channels/reference.yaml")
    assert local.channels == reference.channels[:2]
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    HttpWorkerPool(local)  # no key variable needed
