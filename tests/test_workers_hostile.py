"""The HTTP worker pool against hostile replies: implausible usage, oversized and compressed
bodies (a gzip bomb), Retry-After, and `content: null`.

The server is the standard library's `ThreadingHTTPServer` on 127.0.0.1 and sends raw bytes
and headers exactly as scripted (a scenario per URL prefix `/s/<name>/v1`; the last step
repeats). The pool's clock is frozen and its sleeps are recorded, so waits cost no wall time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_workers import KEY_ENV, SECRET, config, entry

from jax_routeweaver.routing.pools import workers
from jax_routeweaver.routing.pools.pricing import (
    REFERENCE_PRICES,
    USAGE_UNKNOWN,
    call_cost,
    trajectory_cost,
    usage_unknown,
)
from jax_routeweaver.routing.pools.workers import HttpWorkerPool
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall

MiB = 2**20


@dataclasses.dataclass
class Raw:
    """One scripted reply. `length=False`: no Content-Length, the body ends when the server
    closes the connection."""

    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    length: bool = True


def chat(content: str | None = "the answer", usage: object = None, **message: object) -> bytes:
    usage = {"prompt_tokens": 11, "completion_tokens": 4} if usage is None else usage
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content,
                                                **message}}],
                       "usage": usage}).encode()


OK = Raw(body=chat())


class _Httpd(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # The pool hangs up on an oversized reply; the reset is expected, not worth a trace.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HostileServer:
    def __init__(self) -> None:
        self.scripts: dict[str, list[Raw]] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = _Httpd(("127.0.0.1", 0), _handler_for(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,),
                                       daemon=True)
        self.thread.start()

    def script(self, scenario: str, *steps: Raw) -> str:
        self.scripts[scenario] = list(steps)
        return f"http://127.0.0.1:{self.httpd.server_port}/s/{scenario}/v1"

    def next_step(self, scenario: str) -> Raw:
        with self.lock:
            steps = self.scripts[scenario]
            return steps.pop(0) if len(steps) > 1 else steps[0]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _handler_for(server: HostileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with server.lock:
                server.requests.append(dict(self.headers))
            step = server.next_step(self.path.split("/")[2])
            try:
                # No automatic Date/Server headers: a step's headers are all the client sees.
                self.send_response_only(step.status)
                self.send_header("Content-Type", "application/json")
                for name, value in step.headers.items():
                    self.send_header(name, value)
                if step.length:
                    self.send_header("Content-Length", str(len(step.body)))
                else:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(step.body)
            except (BrokenPipeError, ConnectionResetError):  # the client stopped reading
                self.close_connection = True

    return Handler


@pytest.fixture
def server():
    srv = HostileServer()
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def _loopback_env(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                 "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_ENV, SECRET)


class FrozenTime:
    """A clock that moves only when the pool sleeps; every sleep is recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


def run_one(url: str, *, keyed: bool = False, fake: FrozenTime | None = None,
            max_tokens: int | None = None, **pool_kwargs) -> tuple[WorkerCall, HttpWorkerPool]:
    fake = fake or FrozenTime()
    pool = HttpWorkerPool(config(worker_1=entry(url, keyed=keyed)), sleep=fake.sleep,
                          clock=fake.clock, **pool_kwargs)

    async def main() -> WorkerCall:
        async with pool:
            return await pool.call("worker_1", "What is 2+2?", max_tokens=max_tokens)

    return asyncio.run(main()), pool


# ---------------------------------------------------------------------------------------------
# 1. Implausible usage: cost unknown, billed at the attempt's worst case, never a crash


def test_huge_usage_on_failure_then_success_leaves_cost_unknown_and_summable(server):
    huge = {"prompt_tokens": 1e308, "completion_tokens": 1e308}
    url = server.script("huge", Raw(500, json.dumps({"error": "x", "usage": huge}).encode()),
                        Raw(body=chat(usage=huge)))
    call, pool = run_one(url)
    assert (call.success, call.text, call.attempts) == (True, "the answer", 2)
    assert (call.usage, call.failed_usage) == (None, None)
    assert usage_unknown(call)
    # Both attempts billed at their worst case: the same body twice.
    bound = pool_bound(pool)
    assert call.bound_usage == Usage(2 * bound.prompt_tokens, 2 * bound.completion_tokens)
    # A batch's cost sum with this call in it: finite, flagged incomplete, no OverflowError.
    good = WorkerCall("worker_1", "p", "a", True, usage=Usage(100, 20))
    summary = trajectory_cost([good, call, good], REFERENCE_PRICES)
    assert (summary.complete, summary.reasons) == (False, (USAGE_UNKNOWN,))
    assert math.isfinite(summary.cost_usd)
    assert summary.cost_usd == pytest.approx(2 * call_cost(good, REFERENCE_PRICES)
                                             + call_cost(call, REFERENCE_PRICES))


def test_huge_usage_on_a_failed_call_is_billed_at_its_worst_case(server):
    huge = json.dumps({"error": "x", "usage": {"prompt_tokens": 1e308,
                                               "completion_tokens": 1e308}}).encode()
    call, pool = run_one(server.script("fail", Raw(500, huge)), max_rounds=1)
    assert (call.success, call.failed_usage, call.usage) == (False, None, None)
    bound = pool_bound(pool)
    assert call.bound_usage == Usage(bound.prompt_tokens, bound.completion_tokens)
    summary = trajectory_cost([call], REFERENCE_PRICES)
    price = REFERENCE_PRICES["worker_1"]
    assert summary.reasons == (USAGE_UNKNOWN,)
    assert summary.cost_usd == pytest.approx((bound.prompt_tokens * price.input_usd_per_m
                                              + bound.completion_tokens
                                              * price.output_usd_per_m) / 1e6)


def pool_bound(pool: HttpWorkerPool):
    """The worst case of one attempt of `run_one`'s call."""
    return pool.usage_bound("worker_1", "What is 2+2?")


@pytest.mark.parametrize("usage_json", [
    b'{"prompt_tokens": -5, "completion_tokens": 4}',
    b'{"prompt_tokens": 11, "completion_tokens": -1}',
    b'{"prompt_tokens": 11.5, "completion_tokens": 4}',
    b'{"prompt_tokens": 11, "completion_tokens": NaN}',
    b'{"prompt_tokens": Infinity, "completion_tokens": 4}',
    b'{"prompt_tokens": 11, "completion_tokens": 18}',          # above max_tokens=17
    b'{"prompt_tokens": 10000000, "completion_tokens": 4}',     # a 12-character prompt
    b'{"prompt_tokens": 1' + b"0" * 400 + b', "completion_tokens": 4}',
    b'{"prompt_tokens": true, "completion_tokens": 4}',
])
def test_implausible_usage_is_unknown(server, usage_json):
    body = b'{"choices": [{"message": {"content": "hi"}}], "usage": ' + usage_json + b"}"
    call, _ = run_one(server.script("u", Raw(body=body)), max_tokens=17)
    assert (call.success, call.text, call.attempts, call.error) == (True, "hi", 1, None)
    assert call.usage is None and usage_unknown(call)


@pytest.mark.parametrize("usage, expected", [
    ({"prompt_tokens": 40, "completion_tokens": 17}, Usage(40, 17)),      # == max_tokens
    ({"prompt_tokens": 12.0, "completion_tokens": 5}, Usage(12, 5)),      # integer-valued
    ({"prompt_tokens": 12}, Usage(12, 0)),                                # missing -> 0
    ({"prompt_tokens": 12, "completion_tokens": 3,
      "prompt_cache_hit_tokens": 1e308}, Usage(12, 3, 12)),                # cached: clamped
])
def test_plausible_usage_is_kept(server, usage, expected):
    call, _ = run_one(server.script("u", Raw(body=chat(usage=usage))), max_tokens=17)
    assert call.success and call.usage == expected


# ---------------------------------------------------------------------------------------------
# 2. Reply size: capped on the wire and decoded


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """~254 KiB of gzip that decodes to a 256 MiB chat reply."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS, 9, zlib.Z_RLE)
    chunk = b"a" * MiB
    parts = [packer.compress(b'{"choices": [{"message": {"content": "')]
    parts += [packer.compress(chunk) for _ in range(256)]
    parts += [packer.compress(b'"}}]}'), packer.flush()]
    bomb = b"".join(parts)
    assert len(bomb) < 256 * 1024
    return bomb


@pytest.mark.parametrize("status", [200, 503])
def test_gzip_bomb_fails_the_call_with_bounded_memory(server, gzip_bomb, status):
    url = server.script("bomb", Raw(status, gzip_bomb, {"Content-Encoding": "gzip"}), OK)
    call, pool = run_one(url)
    assert (call.success, call.text, call.attempts) == (False, "", 1)
    assert call.error == "gave_up: reply_too_large (attempts: reply_too_large)"
    assert 0 < pool.peak_reply_bytes <= workers.MAX_REPLY_BYTES + 1


@pytest.mark.parametrize("declared", [True, False])
def test_huge_plain_body_fails_the_call_with_bounded_memory(server, declared):
    huge = chat(content="a" * (9 * MiB))
    call, pool = run_one(server.script("huge", Raw(body=huge, length=declared), OK))
    assert (call.success, call.attempts) == (False, 1)
    assert call.error == "gave_up: reply_too_large (attempts: reply_too_large)"
    # Declared too long: refused before reading a byte; undeclared: stopped at the cap.
    if declared:
        assert pool.peak_reply_bytes == 0
    else:
        assert 0 < pool.peak_reply_bytes <= workers.MAX_REPLY_BYTES


def test_reply_cap_is_a_pool_parameter(server):
    url = server.script("cap", Raw(body=chat(content="a" * 2000)))
    small, _ = run_one(url, max_reply_bytes=1000)
    large, pool = run_one(url, max_reply_bytes=3000)
    assert (small.success, small.error) == (
        False, "gave_up: reply_too_large (attempts: reply_too_large)")
    assert large.success and large.text == "a" * 2000
    assert pool.peak_reply_bytes == len(chat(content="a" * 2000))
    with pytest.raises(ValueError, match="max_reply_bytes"):
        HttpWorkerPool(config(worker_1=entry(url)), max_reply_bytes=0)


@pytest.mark.parametrize("encoding, pack", [
    ("gzip", lambda b: zlib.compress(b, wbits=16 + zlib.MAX_WBITS)),
    ("deflate", zlib.compress),
])
def test_compressed_replies_still_decode(server, encoding, pack):
    url = server.script("z", Raw(body=pack(chat(content=" compressed ")),
                                 headers={"Content-Encoding": encoding}))
    call, _ = run_one(url)
    assert call.success and call.text == "compressed" and call.usage == Usage(11, 4)
    assert server.requests[0]["Accept-Encoding"] == "gzip, deflate"


@pytest.mark.parametrize("encoding, body", [("gzip", b"not gzip at all"), ("br", b"\x8bjunk")])
def test_undecodable_body_is_a_load_failure(server, encoding, body):
    url = server.script("bad", Raw(body=body, headers={"Content-Encoding": encoding}), OK)
    call, _ = run_one(url, keyed=True)
    assert call.success and call.attempts == 2
    assert len(server.requests) == 2


# ---------------------------------------------------------------------------------------------
# 3. Retry-After


DATE = "Wed, 21 Oct 2015 07:28:00 GMT"


def rate_limited(retry_after: str, **headers: str) -> Raw:
    return Raw(429, b'{"error": "slow down"}', {"Retry-After": retry_after, **headers})


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("step, wait", [
    (rate_limited("7"), 7.0),
    (rate_limited("0"), 0.0),
    (rate_limited("Wed, 21 Oct 2015 07:28:45 GMT", Date=DATE), 45.0),
    (rate_limited("99999"), 120.0),  # clamped to http_replies.RETRY_AFTER_MAX_S
])
def test_retry_after_is_honoured(server, keyed, step, wait):
    fake = FrozenTime()
    call, _ = run_one(server.script("ra", step, OK), keyed=keyed, fake=fake)
    assert call.success and call.attempts == 2 and call.text == "the answer"
    assert fake.sleeps == ([wait] if wait else [])


def test_retry_after_503_is_honoured(server):
    fake = FrozenTime()
    step = Raw(503, b"{}", {"Retry-After": "3"})
    call, _ = run_one(server.script("ra", step, OK), keyed=True, fake=fake)
    assert call.success and fake.sleeps == [3.0]


def test_retry_after_beyond_the_budget_gives_up(server):
    fake = FrozenTime()
    call, _ = run_one(server.script("ra", rate_limited("100"), OK), keyed=True, fake=fake,
                      total_budget_s=60.0)
    assert (call.success, call.attempts) == (False, 1)
    assert call.error == "budget_exhausted (attempts: http_429)"
    assert fake.sleeps == [] and len(server.requests) == 1


@pytest.mark.parametrize("keyed, sleeps", [(False, [30.0]), (True, [])])
@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", "1e3", "",
                                   "Wed, 21 Oct 2015 07:27:00 GMT"])  # before the Date
def test_garbage_retry_after_falls_back_to_the_cooldown(server, keyed, sleeps, value):
    fake = FrozenTime()
    url = server.script("ra", rate_limited(value, Date=DATE), OK)
    call, _ = run_one(url, keyed=keyed, fake=fake)
    assert call.success and call.attempts == 2
    assert fake.sleeps == sleeps


# ---------------------------------------------------------------------------------------------
# 4. content: null


def test_null_content_alone_is_an_unparseable_200(server):
    fake = FrozenTime()
    call, _ = run_one(server.script("null", Raw(body=chat(content=None)), OK), fake=fake)
    assert (call.success, call.text, call.attempts) == (True, "the answer", 2)
    assert call.failed_usage == Usage(11, 4)  # the malformed reply's usage is billed
    assert fake.sleeps == [30.0]              # unparseable ends the round


@pytest.mark.parametrize("message, error, reasoning_chars", [
    ({"reasoning_content": "long thoughts"}, "final_content_missing", 13),
    ({"tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "f", "arguments": "{}"}}]}, None, 0),
])
def test_null_content_beside_reasoning_or_tool_calls_is_an_empty_reply(
        server, message, error, reasoning_chars):
    call, _ = run_one(server.script("null", Raw(body=chat(content=None, **message)), OK))
    assert (call.success, call.text, call.attempts) == (True, "", 1)
    assert (call.error, call.reasoning_chars) == (error, reasoning_chars)


def test_empty_string_content_stays_a_successful_empty_reply(server):
    call, _ = run_one(server.script("empty", Raw(body=chat(content="")), OK))
    assert (call.success, call.text, call.attempts, call.error) == (True, "", 1, None)


# ---------------------------------------------------------------------------------------------
# Secrets


def test_hostile_replies_never_show_the_key(server, gzip_bomb, caplog):
    caplog.set_level(logging.DEBUG)
    huge = {"prompt_tokens": 1e308, "completion_tokens": 1e308}
    echoed = {"prompt_tokens": SECRET, "completion_tokens": 1}  # the server knows the key
    url = server.script("all", Raw(body=gzip_bomb, headers={"Content-Encoding": "gzip"}),
                        rate_limited("1"),
                        Raw(body=b"junk", headers={"Content-Encoding": "br"}),
                        Raw(body=chat(content=None, usage=huge)), Raw(body=chat(usage=echoed)))
    calls = [run_one(url, keyed=True)[0] for _ in range(2)]
    assert [c.success for c in calls] == [False, True]
    assert calls[1].attempts == 4 and calls[1].usage is None
    assert "implausible usage" in caplog.text and "DecodingError" in caplog.text
    assert SECRET not in caplog.text
    assert all(SECRET not in repr(c) for c in calls)


def test_non_utf8_channel_and_cost_ref_files_name_file_and_line(tmp_path):
    from jax_routeweaver.routing.pools.channels import ChannelConfigError, load_channels
    from jax_routeweaver.routing.pools.pricing import load_cost_ref

    channels = tmp_path / "channels.yaml"
    channels.write_bytes(b"workers:\n  worker_1:\n    description: caf\xe9\n")
    with pytest.raises(ChannelConfigError, match=r"channels\.yaml:3: not valid UTF-8 "
                                                 r"\(byte 0xe9 at column 21\)"):
        load_channels(channels)
    cost_ref = tmp_path / "cost_ref.json"
    cost_ref.write_bytes(b'{"c_ref_usd": 0.1,\n "note": "\xff"}')
    with pytest.raises(ValueError, match=r"cost_ref\.json:2: not valid UTF-8 \(byte 0xff"):
        load_cost_ref(cost_ref)
