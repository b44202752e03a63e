"""The async OpenAI-compatible HTTP worker pool, over the channels of a channel file
(`routing/pools/channels.py`: the file's schema, secrets and prices).

Prices: a channel pool bills its calls at the file's `price` entries (`HttpWorkerPool.prices`,
`pricing.pool_prices`); a worker without one is unpriced, and a run that offers it refuses to
start (`rl.run.pool_check`). The model-list check a run makes before its first step is
`endpoint_check.py`.

Retry policy (as the original's `llm_client.ChatLLM`), per call: up to `max_rounds` rounds within
`total_budget_s`; in a round at most `attempts_per_round` load failures (429, 5xx, network
errors, timeouts). A load failure puts the channel in a cooldown (429: 30 s, 503: 20 s, other
5xx: 20 s, network: 15 s) shared by all calls to it; a key-less (local) channel is not asked
while cooling, a keyed channel is asked while the round has budget left (the original's
single-key behaviour). An unparseable 200 ends the round. Between rounds the call sleeps
`round_wait_s` (15 s), doubled if the round sent a request. 401/403 retire the credential (no
retry, later calls refused); any other status (402, 404, ...) gives up. A failed call is
`success=False` with empty text, never an exception: the trajectory is flagged infra.

Billing, per attempt: every attempt sent is billed at the usage it reported when that is
plausible, else at its worst case (`http_replies.UsageLimits`: a timeout after the request
was sent, a reply without usage); one that never reached the worker is free. The worst
cases go to `WorkerCall.bound_usage`. A call given an `AttemptMeter` (a request's budget)
asks it before each attempt, retries included, and settles each attempt with it: an attempt
that does not fit is not sent and the call fails with `over_budget`.

Retry-After: a 429 or 503 that carries `Retry-After` (delay-seconds, or an HTTP-date measured
against the reply's own `Date`, else the local wall clock) sets that channel's cooldown to it,
clamped to `RETRY_AFTER_MAX_S` (120 s), and every call to the channel, keyed or not, waits until
then before its next request (a call whose budget ends first gives up: `budget_exhausted`). An
absent, negative, past or malformed value is ignored: the class cooldown above applies.

Hostile replies. Worker replies are untrusted input (the rules for their content and
reported usage are in `http_replies.py`):

- Size: a reply body (any status) is read as a stream and capped at `max_reply_bytes`
  (`MAX_REPLY_BYTES`, 8 MiB; a chat completion is a few hundred KiB at most) both on the wire
  and decoded (`peak_reply_bytes` records the most held). The pool decodes `Content-Encoding`
  itself, never past the cap, so a compression bomb costs at most the cap in memory; it asks
  for and accepts only gzip and (zlib) deflate. An oversized reply gives up the call without
  retry: `gave_up: reply_too_large`. A body that cannot be decoded (corrupt, or another
  encoding) is a network load failure (`network:DecodingError`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from jax_routeweaver.routing.pools.channels import Channel, ChannelConfig
from jax_routeweaver.routing.pools.http_replies import (
    ACCEPT_ENCODING,
    KEY_PATTERN,
    Attempt,
    UsageLimits,
    failed_usage,
    inflate,
    json_or_none,
    parse_reply,
    reply_decoder,
    retry_after_s,
    scrub,
)
from jax_routeweaver.routing.pools.pricing import WorkerPrice
from jax_routeweaver.routing.protocol.calls import OVER_BUDGET, AttemptMeter, Usage, WorkerCall

logger = logging.getLogger(__name__)

SPEND_STOP = "spend_stop"
FINAL_CONTENT_MISSING = "final_content_missing"
REPLY_TOO_LARGE = "reply_too_large"

# Hostile-reply bound (module docstring): the default cap on a reply body, wire and decoded.
MAX_REPLY_BYTES = 8 * 2**20


# HttpWorkerPool's sampling defaults (the original client's temperature 0.2, seed 42;
# docs/paper_configs.md, "configs/paper/base.yaml"), shared with the record/replay cache key so
# the two never drift apart.
DEFAULT_TEMPERATURE = 0.2
DEFAULT_SEED = 42
DEFAULT_MAX_TOKENS = 4096

class MissingApiKeyError(RuntimeError):
    """An environment variable named by `api_key_env` is unset or empty (value never shown)."""


# ---------------------------------------------------------------------------------------------
# The HTTP pool


@dataclasses.dataclass(frozen=True)
class Cooldowns:
    """Seconds a channel rests after a load failure, by class (the original's values; each >= 0)."""

    rate_limit_s: float = 30.0    # after a 429 (unless its Retry-After says otherwise), s
    capacity_s: float = 20.0      # after a 503 (unless its Retry-After says otherwise), s
    server_error_s: float = 20.0  # after any other 5xx, s
    network_s: float = 15.0       # after a connection error or a timeout, s



@dataclasses.dataclass
class _Trace:
    """Per-call bookkeeping across attempts."""

    attempts: int = 0
    codes: list[str] = dataclasses.field(default_factory=list)
    failed_usage: Usage | None = None
    bound_usage: Usage | None = None  # the worst cases of attempts whose bill is unknown

    def add(self, attempt: Attempt, limits: UsageLimits) -> None:
        self.attempts += 1
        if attempt.kind != "ok":
            self.codes.append(attempt.code)
        if attempt.failed_usage is not None:
            self.failed_usage = _plus(self.failed_usage, attempt.failed_usage)
        if attempt.bill() is None:
            self.bound_usage = _plus(self.bound_usage, limits.as_usage())


def _plus(total: Usage | None, usage: Usage) -> Usage:
    return usage if total is None else total + usage


@dataclasses.dataclass
class _GiveUp:
    reason: str


@dataclasses.dataclass
class _ChannelState:
    """Process-local health of one channel (never persisted)."""

    cooldown_until: float = -math.inf
    # Set by a Retry-After; unlike the cooldown it holds back keyed channels too.
    retry_after_until: float = -math.inf
    # SHA-256 digests of keys the server rejected (401/403), so the key value is not kept.
    rejected: set[str] = dataclasses.field(default_factory=set)


class HttpWorkerPool:
    """Workers behind OpenAI-compatible `POST {base_url}/chat/completions` endpoints.

    One shared `httpx.AsyncClient` and one semaphore bound concurrent calls to `concurrency`;
    both are created in, and tied to, the event loop of the first call. Request body:
    `{model, messages: [{role: user, content: prompt}], temperature, seed, max_tokens}` with
    the channel's `extra_body` merged. `sleep` / `clock` are injectable so tests run fast. If
    `spend_stop_file` exists, keyed (paid) channels refuse before sending. `max_reply_bytes`
    caps each reply body, on the wire and decoded; `peak_reply_bytes` is the most any reply
    held. Raises MissingApiKeyError at construction if a named key variable is unset.
    """

    def __init__(self, channels: ChannelConfig, *, concurrency: int = 40,
                 total_budget_s: float = 900.0, max_rounds: int = 6,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 temperature: float = DEFAULT_TEMPERATURE, seed: int = DEFAULT_SEED,
                 spend_stop_file: str | os.PathLike[str] | None = None,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 cooldowns: Cooldowns = Cooldowns(), round_wait_s: float = 15.0,
                 attempts_per_round: int = 2, max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        for name, value in (("concurrency", concurrency), ("max_rounds", max_rounds),
                            ("default_max_tokens", default_max_tokens),
                            ("attempts_per_round", attempts_per_round),
                            ("max_reply_bytes", max_reply_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HttpWorkerPool {name}={value!r} must be an int >= 1")
        if not total_budget_s > 0:
            raise ValueError(f"HttpWorkerPool total_budget_s={total_budget_s!r} must be > 0")
        _require_keys(channels)
        self._config = channels
        self._channels = {c.worker: c for c in channels.channels}
        self._state = {c.worker: _ChannelState() for c in channels.channels}
        self._concurrency = concurrency
        self._total_budget_s = float(total_budget_s)
        self._max_rounds = max_rounds
        self._default_max_tokens = default_max_tokens
        self._temperature = temperature
        self._seed = seed
        self._spend_stop_file = (None if spend_stop_file is None
                                 else Path(spend_stop_file).expanduser())
        self._sleep = sleep
        self._clock = clock
        self._cooldowns = cooldowns
        self._round_wait_s = round_wait_s
        self._attempts_per_round = attempts_per_round
        self._max_reply_bytes = max_reply_bytes
        self._peak_reply_bytes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (f"HttpWorkerPool(channels={self._config.path!r}, workers={self.worker_ids()}, "
                f"concurrency={self._concurrency}, total_budget_s={self._total_budget_s})")

    # -- WorkerPool protocol -----------------------------------------------------------------

    def worker_ids(self) -> list[str]:
        return list(self._channels)

    def description(self, worker: str) -> str:
        return self._channel(worker).description

    def prices(self) -> dict[str, WorkerPrice]:
        """The table this pool's calls are billed at: the channel file's `price` entries
        (`ChannelConfig.prices`; a worker without one is unpriced, never free)."""
        return self._config.prices()

    def usage_bound(self, worker: str, prompt: str, max_tokens: int | None = None
                    ) -> UsageLimits:
        """The most tokens one attempt of this call can be billed for: a reply reporting
        more is implausible and its usage is never taken (`http_replies.UsageLimits`). The
        serving budget prices a call's worst case from it (`serving.budget`)."""
        return UsageLimits.for_body(self._body(self._channel(worker), prompt, max_tokens))

    @property
    def peak_reply_bytes(self) -> int:
        """The most bytes (decoded) the pool has held for one reply body so far."""
        return self._peak_reply_bytes

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None,
                   meter: AttemptMeter | None = None) -> WorkerCall:
        """One worker call with retries; failures come back as `success=False`, never raised.

        `meter`: asked before each attempt and settled after it (module docstring, Billing).
        `total_budget_s` and `latency_s` count from when the call gets its concurrency slot.
        Raises only for caller bugs: unknown worker (KeyError), bad `max_tokens` (ValueError),
        a closed pool or another event loop (RuntimeError).
        """
        channel = self._channel(worker)
        if max_tokens is not None and (isinstance(max_tokens, bool)
                                       or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1 or None")
        client, semaphore = self._bind_loop()
        async with semaphore:
            started = self._clock()
            trace = _Trace()
            try:
                return await self._call_with_retries(client, channel, prompt, max_tokens,
                                                     started, trace, meter)
            except Exception as err:  # a bug here must cost one call, not the whole rollout
                message = scrub(f"{type(err).__name__}: {err}", self._key_or_none(channel))
                logger.error("worker call to %s crashed: %s", worker, message)
                return self._failure(channel, prompt, started, trace,
                                     f"internal_error: {message}")

    async def aclose(self) -> None:
        """Close the HTTP client; the pool cannot be used afterwards."""
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> HttpWorkerPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- internals ---------------------------------------------------------------------------

    def _channel(self, worker: str) -> Channel:
        try:
            return self._channels[worker]
        except KeyError:
            raise KeyError(f"unknown worker {worker!r}; offered: {self.worker_ids()}") from None

    def _bind_loop(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        if self._closed:
            raise RuntimeError("HttpWorkerPool is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            # The semaphore is the one bound; an httpx connection cap below it would queue
            # requests inside httpx, where waiting counts against the request timeout.
            limits = httpx.Limits(max_connections=None,
                                  max_keepalive_connections=self._concurrency)
            self._client = httpx.AsyncClient(limits=limits)
            self._semaphore = asyncio.Semaphore(self._concurrency)
        elif loop is not self._loop:
            raise RuntimeError("HttpWorkerPool is tied to the event loop of its first call; "
                               "create one pool per event loop")
        assert self._client is not None and self._semaphore is not None
        return self._client, self._semaphore

    async def _call_with_retries(self, client: httpx.AsyncClient, channel: Channel,
                                 prompt: str, max_tokens: int | None, started: float,
                                 trace: _Trace, meter: AttemptMeter | None) -> WorkerCall:
        body = self._body(channel, prompt, max_tokens)
        deadline = started + self._total_budget_s
        for round_index in range(self._max_rounds):
            sent_before = trace.attempts
            outcome = await self._round(client, channel, body, deadline, trace, meter)
            if isinstance(outcome, Attempt):
                return self._success(channel, prompt, started, trace, outcome)
            if isinstance(outcome, _GiveUp):
                return self._failure(channel, prompt, started, trace, outcome.reason)
            left = deadline - self._clock()
            if left <= 0:
                return self._failure(channel, prompt, started, trace, "budget_exhausted")
            if round_index < self._max_rounds - 1:
                # A round that sent requests waits longer than one that found the channel
                # cooling: the provider is failing, not just resting.
                factor = 2 if trace.attempts > sent_before else 1
                await self._sleep(min(self._round_wait_s * factor, left))
        return self._failure(channel, prompt, started, trace, "retries_exhausted")

    async def _round(self, client: httpx.AsyncClient, channel: Channel, body: dict[str, Any],
                     deadline: float, trace: _Trace, meter: AttemptMeter | None
                     ) -> Attempt | _GiveUp | None:
        """One round: a successful attempt, a reason to give up, or None (try next round)."""
        state = self._state[channel.worker]
        limits = UsageLimits.for_body(body)
        load_failures = 0
        while load_failures < self._attempts_per_round:
            key, refusal = self._credential(channel)
            if refusal is not None:
                return _GiveUp(refusal)
            wait = state.retry_after_until - self._clock()
            if wait > 0:  # the server said when to come back
                if wait >= deadline - self._clock():
                    return _GiveUp("budget_exhausted")
                await self._sleep(wait)
            if channel.api_key_env is None and state.cooldown_until > self._clock():
                return None
            left = deadline - self._clock()
            if left <= 0:
                return _GiveUp("budget_exhausted")
            attempt = await self._metered_send(client, channel, body, key,
                                               min(channel.timeout_s, left), limits, meter)
            if attempt is None:
                return _GiveUp(OVER_BUDGET)
            trace.add(attempt, limits)
            if attempt.kind == "ok":
                return attempt
            logger.debug("worker %s attempt %d failed: %s", channel.worker, trace.attempts,
                         attempt.code)
            if attempt.kind == "auth":
                state.rejected.add(_digest(key))
                return _GiveUp(f"auth_rejected: {attempt.code}")
            if attempt.kind == "fatal":
                return _GiveUp(f"gave_up: {attempt.code}")
            if attempt.kind == "unparseable":
                return None
            load_failures += 1
            state.cooldown_until = max(state.cooldown_until, self._clock() + attempt.cooldown_s)
            if attempt.retry_after_s is not None:
                state.retry_after_until = max(state.retry_after_until,
                                              self._clock() + attempt.retry_after_s)
        return None

    async def _metered_send(self, client: httpx.AsyncClient, channel: Channel,
                            body: dict[str, Any], key: str | None, timeout_s: float,
                            limits: UsageLimits, meter: AttemptMeter | None
                            ) -> Attempt | None:
        """`_send` within `meter`'s budget: None (nothing sent) if the attempt's worst case
        does not fit. Settled however the attempt ends; cancelled, it keeps its worst case."""
        if meter is None:
            return await self._send(client, channel, body, key, timeout_s)
        worst = limits.as_usage()
        if not meter.reserve(channel.worker, worst):
            return None
        attempt = None
        try:
            attempt = await self._send(client, channel, body, key, timeout_s)
            return attempt
        finally:
            meter.settle(channel.worker, worst, None if attempt is None else attempt.bill())

    def _credential(self, channel: Channel) -> tuple[str | None, str | None]:
        """(key, None), or (None, why this call must not send anything)."""
        if channel.api_key_env is None:
            key = None
        else:
            if self._spend_stop_file is not None and self._spend_stop_file.exists():
                return None, f"{SPEND_STOP}: spend-stop file {self._spend_stop_file} exists"
            key = self._key_or_none(channel)
            if key is None:
                return None, (f"missing_api_key: environment variable {channel.api_key_env} "
                              "is not set")
            if not KEY_PATTERN.fullmatch(key):
                return None, (f"invalid_api_key: the value of {channel.api_key_env} is not a "
                              "valid bearer token (value not shown)")
        if _digest(key) in self._state[channel.worker].rejected:
            source = channel.api_key_env or "no key"
            return None, f"auth_rejected: credential ({source}) was rejected earlier"
        return key, None

    @staticmethod
    def _key_or_none(channel: Channel) -> str | None:
        if channel.api_key_env is None:
            return None
        return os.environ.get(channel.api_key_env, "").strip() or None

    def _body(self, channel: Channel, prompt: str, max_tokens: int | None) -> dict[str, Any]:
        return {
            "model": channel.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self._temperature,
            "seed": self._seed,
            "max_tokens": max_tokens or self._default_max_tokens,
            **copy.deepcopy(dict(channel.extra_body)),
        }

    async def _send(self, client: httpx.AsyncClient, channel: Channel, body: dict[str, Any],
                    key: str | None, timeout_s: float) -> Attempt:
        headers = {"Accept-Encoding": ACCEPT_ENCODING}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            # httpx's timeout is per phase (connect, each read); asyncio.timeout caps the whole
            # request, so a server that trickles bytes cannot outlive the budget.
            async with asyncio.timeout(timeout_s):
                async with client.stream("POST", channel.url, json=body, headers=headers,
                                         timeout=timeout_s) as response:
                    raw = await self._read_capped(response)
        except httpx.ConnectTimeout:  # no connection: the request was never sent
            return Attempt("load_failure", "timeout", self._cooldowns.network_s,
                           delivered=False)
        except (TimeoutError, httpx.TimeoutException):
            return Attempt("load_failure", "timeout", self._cooldowns.network_s)
        except httpx.ConnectError as err:
            logger.debug("worker %s unreachable: %s", channel.worker,
                         scrub(f"{type(err).__name__}: {err}", key))
            return Attempt("load_failure", f"network:{type(err).__name__}",
                           self._cooldowns.network_s, delivered=False)
        except httpx.HTTPError as err:
            logger.debug("worker %s network error: %s", channel.worker,
                         scrub(f"{type(err).__name__}: {err}", key))
            return Attempt("load_failure", f"network:{type(err).__name__}",
                            self._cooldowns.network_s)
        if raw is None:
            return Attempt("fatal", REPLY_TOO_LARGE)
        return self._classify(response, raw, UsageLimits.for_body(body))

    async def _read_capped(self, response: httpx.Response) -> bytes | None:
        """The decoded body, or None once it exceeds `max_reply_bytes` on the wire or decoded.

        Reads raw chunks and inflates them here with zlib's `max_length`, so no more than the
        cap (+1 byte, to detect the overflow) is ever decoded.
        """
        cap = self._max_reply_bytes
        declared = response.headers.get("content-length", "").strip()
        if declared.isascii() and declared.isdigit() and int(declared) > cap:
            return None
        decoder = reply_decoder(response.headers.get("content-encoding"))
        body = bytearray()
        async for chunk in response.aiter_raw():
            if response.num_bytes_downloaded > cap:
                return None
            body += inflate(decoder, chunk, cap + 1 - len(body))
            self._peak_reply_bytes = max(self._peak_reply_bytes, len(body))
            if len(body) > cap:
                return None
        return bytes(body)

    def _classify(self, response: httpx.Response, raw: bytes, limits: UsageLimits
                  ) -> Attempt:
        status = response.status_code
        data = json_or_none(raw)
        if status == 200:
            reply = parse_reply(data, limits)
            if reply is None:
                return Attempt("unparseable", "unparseable_200",
                                failed_usage=failed_usage(data, limits))
            return reply
        code = f"http_{status}"
        failed = failed_usage(data, limits)
        cooldowns = self._cooldowns
        if status in (401, 403):
            return Attempt("auth", code, failed_usage=failed)
        if status in (429, 503):
            retry_after = retry_after_s(response.headers)
            default = cooldowns.rate_limit_s if status == 429 else cooldowns.capacity_s
            return Attempt("load_failure", code,
                            default if retry_after is None else retry_after,
                            failed_usage=failed, retry_after_s=retry_after)
        if status >= 500:
            return Attempt("load_failure", code, cooldowns.server_error_s, failed_usage=failed)
        return Attempt("fatal", code, failed_usage=failed)

    def _success(self, channel: Channel, prompt: str, started: float, trace: _Trace,
                 reply: Attempt) -> WorkerCall:
        error = None
        if not reply.text and reply.reasoning_chars:
            # The worker spent its budget reasoning and gave no answer: an empty observation,
            # billed as usual; the reasoning text itself never leaves this module.
            error = FINAL_CONTENT_MISSING
        return WorkerCall(worker=channel.worker, prompt=prompt, text=reply.text, success=True,
                          usage=reply.usage, failed_usage=trace.failed_usage,
                          bound_usage=trace.bound_usage, latency_s=self._clock() - started,
                          attempts=trace.attempts, error=error,
                          reasoning_chars=reply.reasoning_chars)

    def _failure(self, channel: Channel, prompt: str, started: float, trace: _Trace,
                 reason: str) -> WorkerCall:
        error = reason if not trace.codes else f"{reason} (attempts: {', '.join(trace.codes)})"
        logger.warning("worker %s call failed after %d attempt(s): %s", channel.worker,
                       trace.attempts, error)
        return WorkerCall(worker=channel.worker, prompt=prompt, text="", success=False,
                          failed_usage=trace.failed_usage, bound_usage=trace.bound_usage,
                          latency_s=self._clock() - started, attempts=trace.attempts,
                          error=error)


def missing_keys(config: ChannelConfig, env: Mapping[str, str] | None = None
                 ) -> dict[str, list[str]]:
    """Variable name -> the workers needing it, for every `api_key_env` of `config` that is
    unset or blank in `env` (default: the process environment). Values are never returned."""
    env = os.environ if env is None else env
    missing: dict[str, list[str]] = {}
    for channel in config.channels:
        name = channel.api_key_env
        if name is not None and not env.get(name, "").strip():
            missing.setdefault(name, []).append(channel.worker)
    return missing


def _require_keys(config: ChannelConfig) -> None:
    missing = missing_keys(config)
    if missing:
        listed = "; ".join(f"{name} (needed by {', '.join(ws)})" for name, ws in missing.items())
        raise MissingApiKeyError(f"{config.path}: environment variable(s) not set: {listed}")


def _digest(key: str | None) -> str:
    return hashlib.sha256((key or "").encode()).hexdigest()
