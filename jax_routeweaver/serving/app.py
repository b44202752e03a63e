"""The ASGI application (Starlette, run by uvicorn): an OpenAI-compatible router endpoint.

    POST /v1/chat/completions   route one request (JSON, or SSE with ``"stream": true``)
    GET  /v1/models             the one served model id
    GET  /healthz               liveness (no token needed)
    GET  /metrics               Prometheus text (`serving.metrics`)

Clients authenticate with ``Authorization: Bearer <token>`` when the server has a token
(`ServeConfig.token_env`); the token is compared in constant time and never logged. A body
over `max_body_bytes` is refused (413) while it is read, a question over
`max_question_tokens` router tokens with 400, a request beyond `max_inflight` running ones
with 503, and one that runs past `request_timeout_s` with 504: a request always ends. A
client that disconnects ends its request too (its worker calls are cancelled). Every
ending after routing began keeps the routing record, with what was billed and reserved so
far: in the error body (402, 502, 504, 500) or, for a client gone, in the server log; its
cost is counted in `/metrics` (`routeweaver_error_cost_usd_total{kind}` too). Errors are
OpenAI error objects whose ``code`` names the kind (README, "Serving").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jax_routeweaver.serving import openai_api as api
from jax_routeweaver.serving.budget import WorkerFailed
from jax_routeweaver.serving.config import ServeConfig
from jax_routeweaver.serving.metrics import ServeMetrics
from jax_routeweaver.serving.router import (
    BudgetExhausted,
    BudgetTooSmall,
    RouteJob,
    RouterService,
)

log = logging.getLogger(__name__)

# The status logged (never sent: nobody reads it) for a request whose client left; nginx's.
CLIENT_CLOSED = 499


def warm_up_batches(limit: int) -> list[int]:
    """Episodes run at once by each round of the warm-up: 1, 2, 4, ... below `limit` (the
    sampler's batch buckets), then `limit` itself; [] for 0."""
    rows, n = [], 1
    while n < limit:
        rows.append(n)
        n *= 2
    return [*rows, limit] if limit else []


class _App:
    """The endpoint's state: the service, its limits, its metrics, the running requests."""

    def __init__(self, service: RouterService, config: ServeConfig, token: str | None,
                 metrics: ServeMetrics):
        self.service, self.config, self.metrics = service, config, metrics
        self._token = None if not token else token.encode()
        self.inflight = 0

    # -- routes ------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.config.model_name,
                             "inflight": self.inflight})

    async def models(self, request: Request) -> Response:
        return self._denied(request) or JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0,
             "owned_by": "routeweaver"}]})

    async def prometheus(self, request: Request) -> Response:
        return self._denied(request) or Response(self.metrics.exposition(),
                                                 media_type=self.metrics.content_type)

    async def chat(self, request: Request) -> Response:
        start = time.perf_counter()
        denied = self._denied(request)
        if denied is not None:
            return self._finish(denied, start, "invalid_api_key")
        if self.inflight >= self.config.max_inflight:
            return self._finish(_error(503, f"{self.inflight} requests running (limit "
                                       f"{self.config.max_inflight}); retry later",
                                       "overloaded", kind="server_error"), start, "overloaded")
        self.inflight += 1
        self.metrics.inflight.inc()
        try:
            return await self._chat(request, start)
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()

    # -- the chat route ----------------------------------------------------------------------
    async def _chat(self, request: Request, start: float) -> Response:
        try:
            body = await self._body(request)
            chat = api.parse_chat_request(body, model_name=self.config.model_name,
                                          max_messages=self.config.max_messages)
            self._check_length(chat.route.question)
            self.service.check(chat.route)
        except api.RequestError as e:
            return self._finish(_error(e.status, str(e), e.code, e.param), start, e.code)
        except ValueError as e:  # the service's check names the field first
            param = str(e).split(":", 1)[0]
            return self._finish(_error(400, str(e), "invalid_request", param), start,
                                "invalid_request")
        try:
            job = self.service.start(chat.route)
        except BudgetTooSmall as e:
            return self._finish(_error(400, str(e), "max_cost_too_low", "max_cost"), start,
                                "max_cost_too_low")
        try:
            result = await self._run(job, request)
        except BudgetExhausted as e:
            return self._failed(402, e, "budget_exhausted", start, e.record, param="max_cost")
        except WorkerFailed as e:
            return self._failed(502, e, "worker_failed", start, e.record, kind="server_error")
        except TimeoutError:
            message = f"the request ran past {self.config.request_timeout_s:g} s"
            return self._failed(504, message, "timeout", start, job.record(),
                                kind="server_error")
        except _ClientGone:
            record = job.record()
            self.metrics.routed(record, "client_disconnected")
            log.warning("request %s: the client disconnected; record %s",
                        chat.route.request_id, json.dumps(record))
            return self._finish(Response(status_code=CLIENT_CLOSED), start,
                                "client_disconnected")
        except Exception as e:  # a bug costs this request, not the server
            log.exception("request %s failed", chat.route.request_id)
            return self._failed(500, f"internal error ({type(e).__name__}); see the server "
                                "log", "internal_error", start, job.record(),
                                kind="server_error")
        self.metrics.routed(result.record)
        log.info("request %s: mode %s, %d calls, %.6f USD, %.2f s", chat.route.request_id,
                 result.record["mode"], len(result.record["calls"]),
                 result.record["total_cost_usd"], result.record["latency_s"])
        if chat.stream:
            response: Response = StreamingResponse(api.stream_events(chat, result),
                                                   media_type="text/event-stream")
        else:
            response = JSONResponse(api.completion(chat, result))
        return self._finish(response, start)

    async def _run(self, job: RouteJob, request: Request) -> Any:
        """`job.run()`, cancelled (its attempts in flight keep their worst case) when it
        runs past `request_timeout_s` (TimeoutError) or its client disconnects
        (`_ClientGone`)."""
        task = asyncio.ensure_future(job.run())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=self.config.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task  # its attempts settle before the record is read
        raise _ClientGone() if gone in done else TimeoutError()

    def _failed(self, status: int, error: Exception | str, code: str, start: float,
                record: dict[str, Any] | None, *, param: str | None = None,
                kind: str = "invalid_request_error") -> Response:
        """An error response carrying the routing record so far, counted in the metrics."""
        extra = {}
        if record is not None:
            self.metrics.routed(record, code)
            extra[api.EXTENSION_FIELD] = record
        return self._finish(_error(status, str(error), code, param, kind=kind, **extra),
                            start, code)

    async def _body(self, request: Request) -> bytes:
        """The body, read no further than `max_body_bytes` (413 above it)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise api.RequestError(f"the body has {declared} bytes, at most {limit}",
                                   status=413, code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise api.RequestError(f"the body exceeds {limit} bytes", status=413,
                                       code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_length(self, question: str) -> None:
        limit = self.config.max_question_tokens
        # A question over the limit by characters needs no tokenizing to be refused.
        n = len(question) if len(question) > 16 * limit else \
            len(self.service.tokenizer.encode(question, add_special_tokens=False))
        if n > limit:
            raise api.RequestError(f"messages: the question has {n} router tokens, at most "
                                   f"{limit}", param="messages",
                                   code="context_length_exceeded")

    def _denied(self, request: Request) -> Response | None:
        """401 unless the request carries the server's bearer token (if it has one)."""
        if self._token is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              self._token):
            return None
        return _error(401, "missing or wrong bearer token", "invalid_api_key",
                      kind="authentication_error")

    def _finish(self, response: Response, start: float, error: str | None = None) -> Response:
        self.metrics.finished(response.status_code, time.perf_counter() - start, error)
        return response


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body is read by then, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # an empty body message: never spin on it


def _error(status: int, message: str, code: str, param: str | None = None, *,
           kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse(api.error_body(message, code=code, param=param, kind=kind, **extra),
                        status_code=status)


def create_app(service: RouterService, config: ServeConfig, *, token: str | None = None,
               metrics: ServeMetrics | None = None,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> Starlette:
    """The endpoint over `service`. `token`: the clients' bearer token (None: none needed);
    `on_shutdown`: awaited once the server has finished its accepted requests. With
    `config.warmup_limit`, the router's shapes are compiled (`RouterService.warm_up`) before
    the server listens."""
    state = _App(service, config, token, metrics or ServeMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if config.warmup_limit:
            start = time.perf_counter()
            rows = warm_up_batches(config.warmup_limit)
            episodes = await service.warm_up(rows)
            log.warning("warmed up: %d episodes in batches of %s, %.1f s", episodes, rows,
                        time.perf_counter() - start)
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = Starlette(routes=[
        Route("/v1/chat/completions", state.chat, methods=["POST"]),
        Route("/v1/models", state.models, methods=["GET"]),
        Route("/healthz", state.healthz, methods=["GET"]),
        Route("/metrics", state.prometheus, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.routeweaver = state
    return app
