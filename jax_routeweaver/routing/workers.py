"""The async OpenAI-compatible HTTP worker pool, over the channels of a channel file
(`routing/channels.py`: the file's schema, secrets and prices).

Prices: a channel pool bills its calls at the file's `price` entries (`HttpWorkerPool.prices`,
`pricing.pool_prices`); a worker without one is unpriced, and a run that offers it refuses to
start (`rl.pool_check`). Before a run's first step, `check_endpoints` asks each distinct
endpoint for its model list (`GET {base_url}/models`) and fails closed unless it answers
with one that includes every checked worker's `model` (see there).

Retry policy (as the reference's `llm_client.ChatLLM`), per call: up to `max_rounds` rounds within
`total_budget_s`; in a round at most `attempts_per_round` load failures (429, 5xx, network
errors, timeouts). A load failure puts the channel in a cooldown (429: 30 s, 503: 20 s, other
5xx: 20 s, network: 15 s) shared by all calls to it; a key-less (local) channel is not asked
while cooling, a keyed channel is asked while the round has budget left (the reference's
single-key behaviour). An unparseable 200 ends the round. Between rounds the call sleeps
`round_wait_s` (15 s), doubled if the round sent a request. 401/403 retire the credential (no
retry, later calls refused); any other status (402, 404, ...) gives up. A failed call is
`success=False` with empty text, never an exception: the trajectory is flagged infra.

Retry-After: a 429 or 503 that carries `Retry-After` (delay-seconds, or an HTTP-date measured
against the reply's own `Date`, else the local wall clock) sets that channel's cooldown to it,
clamped to `RETRY_AFTER_MAX_S` (120 s), and every call to the channel, keyed or not, waits until
then before its next request (a call whose budget ends first gives up: `budget_exhausted`). An
absent, negative, past or malformed value is ignored: the class cooldown above applies.

Hostile replies. Worker replies are untrusted input:

- Size: a reply body (any status) is read as a stream and capped at `max_reply_bytes`
  (`MAX_REPLY_BYTES`, 8 MiB; a chat completion is a few hundred KiB at most) both on the wire
  and decoded (`peak_reply_bytes` records the most held). The pool decodes `Content-Encoding`
  itself, never past the cap, so a compression bomb costs at most the cap in memory; it asks
  for and accepts only gzip and (zlib) deflate. An oversized reply gives up the call without
  retry: `gave_up: reply_too_large`. A body that cannot be decoded (corrupt, or another
  encoding) is a network load failure (`network:DecodingError`).
- Usage: reported token counts must be plausible for the request, otherwise the attempt's
  usage is treated as not reported (None: the call's cost is unknown, never a crash or a huge
  bill). A count is plausible if it is an integer-valued finite number >= 0 (a missing field
  is 0), `completion_tokens` <= the request's `max_tokens`, and `prompt_tokens` <= the length
  of the JSON request body plus `PROMPT_TEMPLATE_TOKENS` (1024): a tokenizer never needs more
  than one token per byte of text, plus the chat template's own tokens. Cached tokens are
  clamped to [0, prompt_tokens] (reference). Implausible usage on a failed attempt is dropped
  like absent usage; a later success is billed on its own (plausible) usage, as when a
  timed-out attempt reported nothing.
- `message.content: null` is a valid empty reply only when the message carries reasoning
  (`final_content_missing`) or `tool_calls`; otherwise it is an unparseable 200 (retried as
  above). An empty string `""` stays a successful empty reply.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import email.utils
import hashlib
import json
import logging
import math
import os
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx

from jax_routeweaver.routing.calls import Usage, WorkerCall
from jax_routeweaver.routing.channels import Channel, ChannelConfig
from jax_routeweaver.routing.pricing import WorkerPrice

logger = logging.getLogger(__name__)

# A bearer token must be visible ASCII; anything else would make httpx raise an error that
# quotes the header value, i.e. the key.
_KEY_PATTERN = re.compile(r"[\x21-\x7e]+")

SPEND_STOP = "spend_stop"
FINAL_CONTENT_MISSING = "final_content_missing"
REPLY_TOO_LARGE = "reply_too_large"

# Hostile-reply bounds (module docstring): the default cap on a reply body, wire and decoded;
# the longest Retry-After honoured; the chat-template tokens a prompt may add to its own bytes.
MAX_REPLY_BYTES = 8 * 2**20
RETRY_AFTER_MAX_S = 120.0
PROMPT_TEMPLATE_TOKENS = 1024
# `check_endpoints`: seconds an endpoint has to send its whole model list, and how many of
# the names it serves a failure quotes.
MODELS_TIMEOUT_S = 5.0
SERVED_NAMES_SHOWN = 10
# The only encodings the pool decodes (itself, under the cap); asked for explicitly so httpx
# never advertises others (br, zstd) that a server could then use.
_ACCEPT_ENCODING = "gzip, deflate"


# HttpWorkerPool's sampling defaults (the reference client's temperature 0.2, seed 42;
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
    """Seconds a channel rests after a load failure, by class (reference values)."""

    rate_limit_s: float = 30.0    # 429
    capacity_s: float = 20.0      # 503
    server_error_s: float = 20.0  # other 5xx
    network_s: float = 15.0       # connection errors and timeouts


_Kind = Literal["ok", "load_failure", "unparseable", "auth", "fatal"]


@dataclasses.dataclass
class _Attempt:
    """What one HTTP request produced."""

    kind: _Kind
    code: str
    cooldown_s: float = 0.0
    text: str = ""
    usage: Usage | None = None
    reasoning_chars: int = 0
    failed_usage: Usage | None = None
    retry_after_s: float | None = None


@dataclasses.dataclass(frozen=True)
class _UsageLimits:
    """The most tokens a request's reply can plausibly report (module docstring)."""

    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def for_body(cls, body: Mapping[str, Any]) -> _UsageLimits:
        return cls(len(json.dumps(body)) + PROMPT_TEMPLATE_TOKENS, body["max_tokens"])


@dataclasses.dataclass
class _Trace:
    """Per-call bookkeeping across attempts."""

    attempts: int = 0
    codes: list[str] = dataclasses.field(default_factory=list)
    failed_usage: Usage | None = None

    def add(self, attempt: _Attempt) -> None:
        self.attempts += 1
        if attempt.kind != "ok":
            self.codes.append(attempt.code)
        if attempt.failed_usage is not None:
            self.failed_usage = (attempt.failed_usage if self.failed_usage is None
                                 else self.failed_usage + attempt.failed_usage)


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

    @property
    def peak_reply_bytes(self) -> int:
        """The most bytes (decoded) the pool has held for one reply body so far."""
        return self._peak_reply_bytes

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        """One worker call with retries; failures come back as `success=False`, never raised.

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
                                                     started, trace)
            except Exception as err:  # a bug here must cost one call, not the whole rollout
                message = _scrub(f"{type(err).__name__}: {err}", self._key_or_none(channel))
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
                                 trace: _Trace) -> WorkerCall:
        body = self._body(channel, prompt, max_tokens)
        deadline = started + self._total_budget_s
        for round_index in range(self._max_rounds):
            sent_before = trace.attempts
            outcome = await self._round(client, channel, body, deadline, trace)
            if isinstance(outcome, _Attempt):
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
                     deadline: float, trace: _Trace) -> _Attempt | _GiveUp | None:
        """One round: a successful attempt, a reason to give up, or None (try next round)."""
        state = self._state[channel.worker]
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
            attempt = await self._send(client, channel, body, key, min(channel.timeout_s, left))
            trace.add(attempt)
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
            if not _KEY_PATTERN.fullmatch(key):
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
                    key: str | None, timeout_s: float) -> _Attempt:
        headers = {"Accept-Encoding": _ACCEPT_ENCODING}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            # httpx's timeout is per phase (connect, each read); asyncio.timeout caps the whole
            # request, so a server that trickles bytes cannot outlive the budget.
            async with asyncio.timeout(timeout_s):
                async with client.stream("POST", channel.url, json=body, headers=headers,
                                         timeout=timeout_s) as response:
                    raw = await self._read_capped(response)
        except (TimeoutError, httpx.TimeoutException):
            return _Attempt("load_failure", "timeout", self._cooldowns.network_s)
        except httpx.HTTPError as err:
            logger.debug("worker %s network error: %s", channel.worker,
                         _scrub(f"{type(err).__name__}: {err}", key))
            return _Attempt("load_failure", f"network:{type(err).__name__}",
                            self._cooldowns.network_s)
        if raw is None:
            return _Attempt("fatal", REPLY_TOO_LARGE)
        return self._classify(response, raw, _UsageLimits.for_body(body))

    async def _read_capped(self, response: httpx.Response) -> bytes | None:
        """The decoded body, or None once it exceeds `max_reply_bytes` on the wire or decoded.

        Reads raw chunks and inflates them here with zlib's `max_length`, so no more than the
        cap (+1 byte, to detect the overflow) is ever decoded.
        """
        cap = self._max_reply_bytes
        declared = response.headers.get("content-length", "").strip()
        if declared.isascii() and declared.isdigit() and int(declared) > cap:
            return None
        decoder = _decoder(response.headers.get("content-encoding"))
        body = bytearray()
        async for chunk in response.aiter_raw():
            if response.num_bytes_downloaded > cap:
                return None
            body += _inflate(decoder, chunk, cap + 1 - len(body))
            self._peak_reply_bytes = max(self._peak_reply_bytes, len(body))
            if len(body) > cap:
                return None
        return bytes(body)

    def _classify(self, response: httpx.Response, raw: bytes, limits: _UsageLimits
                  ) -> _Attempt:
        status = response.status_code
        data = _json_or_none(raw)
        if status == 200:
            reply = _parse_reply(data, limits)
            if reply is None:
                return _Attempt("unparseable", "unparseable_200",
                                failed_usage=_failed_usage(data, limits))
            return reply
        code = f"http_{status}"
        failed = _failed_usage(data, limits)
        cooldowns = self._cooldowns
        if status in (401, 403):
            return _Attempt("auth", code, failed_usage=failed)
        if status in (429, 503):
            retry_after = _retry_after_s(response.headers)
            default = cooldowns.rate_limit_s if status == 429 else cooldowns.capacity_s
            return _Attempt("load_failure", code,
                            default if retry_after is None else retry_after,
                            failed_usage=failed, retry_after_s=retry_after)
        if status >= 500:
            return _Attempt("load_failure", code, cooldowns.server_error_s, failed_usage=failed)
        return _Attempt("fatal", code, failed_usage=failed)

    def _success(self, channel: Channel, prompt: str, started: float, trace: _Trace,
                 reply: _Attempt) -> WorkerCall:
        error = None
        if not reply.text and reply.reasoning_chars:
            # The worker spent its budget reasoning and gave no answer: an empty observation,
            # billed as usual; the reasoning text itself never leaves this module.
            error = FINAL_CONTENT_MISSING
        return WorkerCall(worker=channel.worker, prompt=prompt, text=reply.text, success=True,
                          usage=reply.usage, failed_usage=trace.failed_usage,
                          latency_s=self._clock() - started, attempts=trace.attempts,
                          error=error, reasoning_chars=reply.reasoning_chars)

    def _failure(self, channel: Channel, prompt: str, started: float, trace: _Trace,
                 reason: str) -> WorkerCall:
        error = reason if not trace.codes else f"{reason} (attempts: {', '.join(trace.codes)})"
        logger.warning("worker %s call failed after %d attempt(s): %s", channel.worker,
                       trace.attempts, error)
        return WorkerCall(worker=channel.worker, prompt=prompt, text="", success=False,
                          failed_usage=trace.failed_usage, latency_s=self._clock() - started,
                          attempts=trace.attempts, error=error)


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


def _scrub(text: str, key: str | None) -> str:
    return text.replace(key, "***") if key else text


def _scrub_all(text: str, keys: set[str]) -> str:
    for key in sorted(keys, key=len, reverse=True):  # a key inside another goes last
        text = _scrub(text, key)
    return text


# ---------------------------------------------------------------------------------------------
# Endpoint check (before a run's first step)


@dataclasses.dataclass(frozen=True)
class EndpointCheck:
    """What `check_endpoints` found for one worker. `url`: the model-list URL asked
    (``{base_url}/models``; never carries a key). `ok` False: the run must not start.
    `detail`: what was seen, one line, never a key value."""

    worker: str
    url: str
    ok: bool
    detail: str


def check_endpoints(config: ChannelConfig, workers: Sequence[str] | None = None, *,
                    timeout_s: float = MODELS_TIMEOUT_S, env: Mapping[str, str] | None = None,
                    max_reply_bytes: int = MAX_REPLY_BYTES) -> list[EndpointCheck]:
    """Check that each of `workers` (default: every worker of `config`) is reachable and
    serves its configured `model`, without asking any worker to generate.

    Each distinct endpoint (base_url and key variable) is asked once,
    ``GET {base_url}/models`` (OpenAI-compatible: ``{"data": [{"id": name}, ...]}``), with
    the key from `env` (default: the process environment) in the `Authorization` header
    when the channel names one, within `timeout_s` seconds for the whole reply, whose body
    is capped at `max_reply_bytes` (wire and decoded). A worker passes only if its endpoint
    answered 200 with a model list that includes its `model`. It fails (fail closed) when
    its key variable is unset or not a bearer token, the endpoint is unreachable or slower
    than `timeout_s`, answers any other status (401/403: the key was rejected; 404/405 too:
    every OpenAI-compatible server this project targets (vLLM, OpenRouter, NVIDIA NIM)
    serves the list there, so a 404 almost always means a wrong base_url, whose chat calls
    would 404 as well), or sends something that is not a model list. Served names in a
    failure are the endpoint's own (untrusted: quoted, truncated, any key removed). One
    `EndpointCheck` per worker, in `workers` order.
    """
    env = os.environ if env is None else env
    chosen = [config.channel(w) for w in (config.worker_ids() if workers is None else workers)]
    answers: dict[tuple[str, str | None], tuple[list[str] | None, str]] = {}
    sent: set[str] = set()  # every key sent: any endpoint may echo any of them back
    found: list[tuple[Channel, str | None]] = []  # (channel, why nothing was asked)
    with httpx.Client(headers={"Accept-Encoding": _ACCEPT_ENCODING}) as client:
        for channel in chosen:
            key, refusal = _probe_key(channel, env)
            found.append((channel, refusal))
            endpoint = (channel.base_url, channel.api_key_env)
            if refusal is None and endpoint not in answers:
                sent |= {key} if key else set()
                answers[endpoint] = _served_models(client, f"{channel.base_url}/models", key,
                                                   timeout_s, max_reply_bytes)

    def scrub(text: str) -> str:
        return _scrub_all(text, sent)

    return [EndpointCheck(c.worker, f"{c.base_url}/models", False, refusal)
            if refusal is not None else
            _served_check(c, *answers[(c.base_url, c.api_key_env)], scrub)
            for c, refusal in found]


def _probe_key(channel: Channel, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(key or None, None), or (None, why no request may be sent)."""
    if channel.api_key_env is None:
        return None, None
    key = env.get(channel.api_key_env, "").strip()
    if not key:
        return None, f"environment variable {channel.api_key_env} is not set"
    if not _KEY_PATTERN.fullmatch(key):
        return None, (f"the value of {channel.api_key_env} is not a valid bearer token "
                      "(value not shown)")
    return key, None


def _served_models(client: httpx.Client, url: str, key: str | None, timeout_s: float,
                   cap: int) -> tuple[list[str] | None, str]:
    """(the model ids served, "") or (None, what went wrong)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout_s
    try:
        with client.stream("GET", url, headers=headers, timeout=timeout_s) as response:
            body = bytearray()
            decoder = _decoder(response.headers.get("content-encoding"))
            for chunk in response.iter_raw():
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("model list too slow")
                body += _inflate(decoder, chunk, cap + 1 - len(body))
                if response.num_bytes_downloaded > cap or len(body) > cap:
                    return None, f"the model list is larger than {cap} bytes"
            status = response.status_code
    except httpx.TimeoutException:
        return None, f"no answer within {timeout_s:g} s"
    except httpx.DecodingError:
        return None, "the reply could not be decoded"
    except httpx.HTTPError as err:
        return None, f"unreachable ({type(err).__name__}: {err})"
    if status in (401, 403):
        return None, (f"HTTP {status}: the key was rejected" if key
                      else f"HTTP {status}: the endpoint wants a key (name one in api_key_env)")
    if status != 200:
        hint = (": no OpenAI model list there (is base_url right, e.g. ending in /v1?)"
                if status in (404, 405) else "")
        return None, f"HTTP {status}{hint}"
    data = _json_or_none(bytes(body))
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
        return None, 'HTTP 200 without an OpenAI model list ({"data": [{"id": ...}]})'
    return [e["id"] for e in entries], ""


def _served_check(channel: Channel, served: list[str] | None, problem: str,
                  scrub: Callable[[str], str]) -> EndpointCheck:
    """The worker's check from its endpoint's answer; `scrub` removes keys from untrusted
    text (before any truncation, so no part of a key survives)."""
    url = f"{channel.base_url}/models"
    if served is None:
        return EndpointCheck(channel.worker, url, False, scrub(problem))
    if channel.model in served:
        return EndpointCheck(channel.worker, url, True, f"serves {channel.model!r}")
    shown = ", ".join(repr(scrub(name)[:80]) for name in served[:SERVED_NAMES_SHOWN])
    more = f" and {len(served) - SERVED_NAMES_SHOWN} more" \
        if len(served) > SERVED_NAMES_SHOWN else ""
    listing = f"it serves {shown}{more}" if served else "it serves no model"
    return EndpointCheck(channel.worker, url, False,
                         f"does not serve the configured model {channel.model!r} ({listing})")


# ---------------------------------------------------------------------------------------------
# Response parsing


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # includes UnicodeDecodeError
        return None


def _inflate(decoder: zlib._Decompress | None, chunk: bytes, room: int) -> bytes:
    """`chunk` as it adds to the reply body: decompressed (at most `room` bytes, so a
    compression bomb stops at the cap) when the reply is compressed; httpx.DecodingError on a
    malformed stream."""
    if decoder is None:
        return chunk
    try:
        return decoder.decompress(chunk, room)
    except zlib.error:
        raise httpx.DecodingError("malformed compressed body") from None


def _decoder(encoding: str | None) -> zlib._Decompress | None:
    """A zlib decompressor for the reply's Content-Encoding (None: identity)."""
    name = (encoding or "identity").strip().lower()
    if name == "identity":
        return None
    if name in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if name == "deflate":
        return zlib.decompressobj()
    # The value is not shown: a hostile server could echo the key back in it.
    raise httpx.DecodingError("unsupported content-encoding")


def _retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds a reply's Retry-After asks for, at most RETRY_AFTER_MAX_S; None if absent,
    negative, in the past or malformed. An HTTP-date is measured against the reply's Date."""
    value = headers.get("retry-after", "").strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
        return min(float(value), RETRY_AFTER_MAX_S)
    when, now = _http_date(value), _http_date(headers.get("date", ""))
    if when is None:
        return None
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return min(seconds, RETRY_AFTER_MAX_S) if seconds >= 0 else None


def _http_date(value: str) -> datetime | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _parse_reply(data: Any, limits: _UsageLimits) -> _Attempt | None:
    """The observation is `choices[0].message.content` stripped, only; None if malformed.

    `content: null` is an empty reply only beside reasoning or tool calls; alone it is
    malformed."""
    if not isinstance(data, dict):
        return None
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return None
    # vLLM and OpenRouter name it `reasoning`, DeepSeek-style APIs `reasoning_content`.
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    reasoning_chars = len(reasoning) if isinstance(reasoning, str) else 0
    content = message.get("content")
    if content is None and (reasoning_chars or message.get("tool_calls")):
        content = ""
    if not isinstance(content, str):
        return None
    return _Attempt("ok", "ok", text=content.strip(),
                    usage=_parse_usage(data.get("usage"), limits),
                    reasoning_chars=reasoning_chars)


def _parse_usage(raw: Any, limits: _UsageLimits) -> Usage | None:
    """Usage from an OpenAI-style `usage` object; None if absent, malformed or implausible
    (a count above `limits`, negative, non-finite or fractional: module docstring).

    Cached tokens come from `prompt_cache_hit_tokens` or `prompt_tokens_details.cached_tokens`
    (providers that send both report the same number twice), clamped to [0, prompt_tokens].
    """
    if not isinstance(raw, dict) or not ({"prompt_tokens", "completion_tokens"} & set(raw)):
        return None
    prompt = _token_count(raw.get("prompt_tokens"), limits.prompt_tokens)
    completion = _token_count(raw.get("completion_tokens"), limits.completion_tokens)
    if prompt is None or completion is None:
        # The values are not shown: a hostile server could echo the key back in them.
        logger.warning("worker reported implausible usage (limits: %d prompt, %d completion "
                       "tokens); its cost is unknown", limits.prompt_tokens,
                       limits.completion_tokens)
        return None
    cached_raw = raw.get("prompt_cache_hit_tokens")
    if cached_raw is None:
        details = raw.get("prompt_tokens_details")
        cached_raw = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached_raw if _is_finite_number(cached_raw) else 0
    return Usage(prompt, completion, min(max(0, int(cached)), prompt))


def _token_count(value: Any, limit: int) -> int | None:
    """A reported token count: missing -> 0; an integer-valued number in [0, limit] -> itself;
    anything else -> None."""
    if value is None:
        return 0
    if not _is_finite_number(value) or value != int(value) or not 0 <= value <= limit:
        return None
    return int(value)


def _is_finite_number(value: Any) -> bool:
    # An int is finite whatever its size (math.isfinite would overflow converting it).
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _failed_usage(data: Any, limits: _UsageLimits) -> Usage | None:
    """Usage reported by a failed attempt (billed too); None if absent, implausible or 0/0."""
    usage = _parse_usage(data.get("usage"), limits) if isinstance(data, dict) else None
    if usage is None or (usage.prompt_tokens == 0 and usage.completion_tokens == 0):
        return None
    return usage
