"""The SIMULATED workers behind real HTTP: an OpenAI-compatible chat endpoint on loopback,
and a channel file pointing workers at it.

A stand-in for the paid worker APIs, which cannot be reached here: model ``sim-K`` answers
as simulated ``worker_K`` (`simulated.SimulatedWorkerPool`), so the real `HttpWorkerPool`,
`routeweaver serve` and their clients run over real sockets without a key. Used by the
tests, `bench/serve.py` and anyone trying the server on the embedded default.

    POST {url}/chat/completions   a chat completion with usage (after `delay_s`; 500 for a
                                  model in `failing`; or as `script` says, below)
    GET  {url}/models             the OpenAI model list (`models`, status `models_status`)

Faults, scripted per attempt. `script(body, n)` (n: how many times this exact body was sent
before) returns a `Fault`: the status to answer with, the usage the reply reports (the
provider's true count, none, an over-report within the request's bound, or an implausible
one beyond it), what the provider bills (the reply's true usage, or a share of the most the
request can be billed: 0 for a plain rejection, 1 for a worker that ran to `max_tokens` on
the longest prompt count the body allows), and a delay before answering (past the client's
timeout: the provider still bills). The endpoint logs what it would bill for every attempt
it received (`bills`, the provider's own count), so a test can hold a budget against the
provider, not against what the client was told.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from jax_routeweaver.routing.pools.http_replies import UsageLimits
from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES
from jax_routeweaver.routing.protocol.calls import Usage
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool


class _Server(ThreadingHTTPServer):
    # Many clients connect at once (the serving benchmark's 32): the default backlog of 5
    # would refuse some of them.
    request_queue_size = 256
    daemon_threads = True


@dataclasses.dataclass(frozen=True)
class Fault:
    """How the endpoint answers one attempt (module docstring). `status`: 200, or an error
    status (429, 500, 503, ...); `report`: the usage the reply carries, ``true`` (what is
    billed), ``none``, ``over`` (above the bill, within the request's bound) or
    ``implausible`` (beyond the bound); `billed`: what the provider bills, None for the
    reply's true usage, else that share in [0, 1] of the request's bound
    (`http_replies.UsageLimits`); `delay_s`: seconds before answering; `content`: the
    reply's text instead of the simulated worker's (a 200 only)."""

    status: int = 200
    report: str = "true"
    billed: float | None = None
    delay_s: float = 0.0
    content: str | None = None


@dataclasses.dataclass(frozen=True)
class Bill:
    """What the provider bills for one attempt it received (its own count)."""

    model: str
    prompt: str
    usage: Usage


def model_name(worker: str) -> str:
    """``worker_K`` -> ``sim-K``, the model name the endpoint serves it as."""
    return f"sim-{worker.split('_', 1)[1]}"


class SimulatedHttpWorkers:
    """The endpoint (module docstring), serving from a thread until `close`. `delay_s`:
    seconds each completion takes; `failing`: models (``sim-K``) that answer 500. It keeps
    every completion body (`bodies`), what it would bill for each (`bills`) and each
    model-list request's Authorization header (`models_auth`); `models` / `models_status` /
    `failing` / `delay_s` / `script` may be changed while it runs."""

    def __init__(self, sim: SimulatedWorkerPool, *, models: Iterable[str] | None = None,
                 delay_s: float = 0.0, failing: Iterable[str] = (), port: int = 0,
                 script: Callable[[dict[str, Any], int], Fault] | None = None):
        self.sim = sim
        self.script = script
        self.bodies: list[dict[str, Any]] = []
        self.bills: list[Bill] = []
        self._sent: dict[str, int] = {}
        self.models = [model_name(w) for w in sim.worker_ids()] if models is None \
            else list(models)
        self.models_status = 200
        self.models_auth: list[str | None] = []
        self.delay_s = float(delay_s)
        self.failing = set(failing)
        self._lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                       name="simulated-http-workers")
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> SimulatedHttpWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def completion(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, reply) of one chat-completion body."""
        key = json.dumps(body, sort_keys=True)
        with self._lock:
            self.bodies.append(body)
            sent = self._sent.get(key, 0)
            self._sent[key] = sent + 1
        fault = self.script(body, sent) if self.script is not None else \
            Fault(500, "none", 0.0) if body.get("model") in self.failing else Fault()
        worker = "worker_" + str(body["model"]).split("-", 1)[1]
        prompt = body["messages"][0]["content"]
        call = self.sim.respond(worker, prompt, max_tokens=body.get("max_tokens"))
        bound = UsageLimits.for_body(body)
        billed = call.usage or Usage(0, 0)
        if fault.billed is not None:
            billed = Usage(int(bound.prompt_tokens * fault.billed),
                           int(bound.completion_tokens * fault.billed))
        with self._lock:  # billed on receipt: a reply the client stops waiting for is paid
            self.bills.append(Bill(str(body["model"]), prompt, billed))
        delay = self.delay_s + fault.delay_s
        if delay > 0:
            time.sleep(delay)
        usage = _reported(fault.report, billed, bound)
        if fault.status != 200:
            reply: dict[str, Any] = {"error": {"message": "simulated upstream failure"}}
            if usage is not None:
                reply["usage"] = usage
            return fault.status, reply
        return 200, {"object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": {
                         "role": "assistant",
                         "content": call.text if fault.content is None else fault.content},
                                  "finish_reason": "stop"}], "usage": usage}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.models_auth.append(self.headers.get("Authorization"))
                found = self.path.rstrip("/").endswith("/models")
                self._reply(outer.models_status if found else 404, {
                    "object": "list", "data": [{"id": m, "object": "model"}
                                               for m in outer.models]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._reply(*outer.completion(body))

            def _reply(self, status: int, data: dict[str, Any]) -> None:
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                # A client that stopped waiting (its timeout) is gone.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(payload)

        return Handler


def _reported(report: str, billed: Usage, bound: UsageLimits) -> dict[str, int] | None:
    """The usage a reply carries under `Fault.report`."""
    if report == "none":
        return None
    if report == "implausible":
        return {"prompt_tokens": bound.prompt_tokens + 1,
                "completion_tokens": bound.completion_tokens + 1}
    if report == "over":
        return {"prompt_tokens": min(bound.prompt_tokens, 2 * billed.prompt_tokens + 1),
                "completion_tokens": min(bound.completion_tokens,
                                         2 * billed.completion_tokens + 1)}
    return {"prompt_tokens": billed.prompt_tokens,
            "completion_tokens": billed.completion_tokens}


def simulated_channel_file(path: Path, sim: SimulatedWorkerPool, url: str, *,
                           prices: Mapping[str, tuple[float, float] | None] | None = None,
                           key_env: Mapping[str, str] | None = None,
                           fallbacks: Mapping[str, str] | None = None,
                           timeout_s: float = 30) -> Path:
    """Write a channel file for every simulated worker at `url` and return its path. Prices:
    the original price table (as the simulated pool bills), or `prices` (worker -> (input, output)
    USD per 1M tokens, None: no price entry). `key_env`: worker -> the variable NAME holding
    its key; `fallbacks`: worker -> fallback worker."""
    workers: dict[str, dict[str, Any]] = {}
    for w in sim.worker_ids():
        entry: dict[str, Any] = {"description": sim.description(w), "base_url": url,
                                 "model": model_name(w), "timeout_s": timeout_s}
        price = (REFERENCE_PRICES[w].input_usd_per_m, REFERENCE_PRICES[w].output_usd_per_m) \
            if prices is None else prices.get(w)
        if price is not None:
            entry["price"] = {"input": price[0], "output": price[1]}
        if key_env and w in key_env:
            entry["api_key_env"] = key_env[w]
        if fallbacks and w in fallbacks:
            entry["fallback"] = fallbacks[w]
        workers[w] = entry
    path.write_text(yaml.safe_dump({"workers": workers}))
    return path
