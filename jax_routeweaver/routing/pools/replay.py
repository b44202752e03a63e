"""Record/replay of worker calls: a disk cache keyed by everything that decides a reply.

`ReplayPool` wraps any `WorkerPool`. Each call has a key,

    key = sha256(canonical JSON of {worker id, the exact payload text, backend, sampling})

where *backend* names what serves the worker (model name, endpoint, a digest of the extra
request body; for the simulated pool its seed and settings) and *sampling* holds temperature,
seed and the effective ``max_tokens`` (None resolves to the backend's default, so "default"
and "the default spelled out" share an entry). Modes:

    record  a hit is answered from the cache; a miss calls the pool and appends the result
            (a cached *failed* call is retried, since a failure is no work worth keeping)
    replay  never calls the pool; a miss raises `ReplayMissError` naming the worker and the
            payload's beginning
    off     calls the pool, no cache

Concurrent calls with one key share a single backend call. The reply comes back as the cache
holds it (text, success, error, usage, failed usage, the original latency and attempts), in
record mode too, so a recorded run and its replay see identical `WorkerCall`s; cost is
recomputed from usage by `routing.pools.pricing` as for a live call.

Cache file: JSON Lines, append-only, human-readable. Line 1 is a header
``{"format": "routeweaver-worker-cache", "version": 1}``; every other line is one call::

    {"key": "<sha256>", "worker": "worker_3", "backend": {...}, "sampling": {...},
     "payload": "<the exact text sent>", "reply": {"text": ..., "success": ..., "error": ...,
     "usage": {"prompt_tokens", "completion_tokens", "cached_tokens"} | null,
     "failed_usage": ... | null, "bound_usage": ... | null, "latency_s": ...,
     "attempts": ..., "reasoning_chars": ...},
     "recorded_at": "<UTC ISO time>"}

Each entry is written with one `write` and fsynced, so a crash loses at most the entry being
written; a torn last line is cut off when the cache is next opened. A later line with the
same key wins. Secrets never reach the file: backends carry no keys (`http_identity` hashes
the extra body, and API keys live only in environment variables), and every string written
is scrubbed of the `secrets` given to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from jax_routeweaver.routing.pools.workers import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
)
from jax_routeweaver.routing.protocol.calls import PoolView, Usage, WorkerCall, WorkerPool

ReplayMode = Literal["record", "replay", "off"]
REPLAY_MODES: tuple[str, ...] = ("record", "replay", "off")
CACHE_FORMAT = "routeweaver-worker-cache"
CACHE_VERSION = 1
KEY_VERSION = 1  # part of every key: a change of the key recipe must miss, never collide
PAYLOAD_PREVIEW_CHARS = 120
_SCRUBBED = "***"


class ReplayMissError(ValueError):
    """Replay mode met a call the cache does not hold (the run cannot stay offline)."""


class CacheFileError(ValueError):
    """The cache file is not a worker cache, or a complete line of it is corrupt."""


@dataclasses.dataclass(frozen=True)
class CallIdentity:
    """What besides (worker, payload, max_tokens) decides a worker's reply.

    `backend`: JSON-able description of what serves the worker (never a secret; it is stored
    in the cache file). `sampling`: temperature, seed and other sampling settings the backend
    applies. `default_max_tokens`: what ``max_tokens=None`` means for this backend."""

    backend: Mapping[str, Any]
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_max_tokens: int | None = None


Identify = Callable[[str], CallIdentity]


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def effective_sampling(identity: CallIdentity, max_tokens: int | None) -> dict[str, Any]:
    """The sampling part of a key: the backend's settings plus the resolved max_tokens."""
    resolved = max_tokens if max_tokens is not None else identity.default_max_tokens
    return {**identity.sampling, "max_tokens": resolved}


def cache_key(worker: str, payload: str, identity: CallIdentity,
              max_tokens: int | None = None) -> str:
    """sha256 hex of the canonical JSON of (key version, worker, payload, backend, sampling)."""
    material = {"v": KEY_VERSION, "worker": worker, "payload": payload,
                "backend": dict(identity.backend),
                "sampling": effective_sampling(identity, max_tokens)}
    return hashlib.sha256(canonical_json(material).encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------ identities
def http_identity(channels: Any, *, temperature: float | None = None, seed: int | None = None,
                  default_max_tokens: int | None = None) -> Identify:
    """`CallIdentity` of an `HttpWorkerPool` over `channels` (a `channels.ChannelConfig`).

    Backend: model name, endpoint URL, price label and a sha256 of the channel's
    ``extra_body`` (hashed: it is sent with every request and could hold anything). Sampling:
    the pool's temperature and seed; unset values are `HttpWorkerPool`'s defaults."""
    temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    seed = DEFAULT_SEED if seed is None else seed
    default_max_tokens = DEFAULT_MAX_TOKENS if default_max_tokens is None \
        else default_max_tokens
    by_worker = {c.worker: c for c in channels.channels}

    def identify(worker: str) -> CallIdentity:
        channel = by_worker.get(worker)
        if channel is None:
            raise KeyError(f"unknown worker {worker!r}; offered: {sorted(by_worker)}")
        body = hashlib.sha256(canonical_json(dict(channel.extra_body)).encode()).hexdigest()
        return CallIdentity(
            backend={"kind": "http", "model": channel.model, "url": channel.url,
                     "backend": channel.backend, "extra_body_sha256": body},
            sampling={"temperature": temperature, "seed": seed},
            default_max_tokens=default_max_tokens)

    return identify


def pool_identity(pool: WorkerPool) -> Identify:
    """A default `Identify` for `pool`: a pool that can name its own backend does so
    (``call_identity(views)``, as the simulated pool does with its seed, failure rate and
    profiles digest), also behind views such as `TagFreeReplies`; any other pool is named by
    its class name only (give `ReplayPool` an explicit `identify` for those)."""
    views: list[str] = []
    inner: Any = pool
    # View wrappers (e.g. router_r1_env.TagFreeReplies) keep the wrapped pool in `.pool`.
    while not hasattr(inner, "call_identity") and hasattr(inner, "pool"):
        views.append(type(inner).__name__)
        inner = inner.pool
    if hasattr(inner, "call_identity"):
        identity = inner.call_identity(views)
    else:
        identity = CallIdentity(backend={"kind": type(pool).__name__, "views": views})
    return lambda worker: identity


# ------------------------------------------------------------------------------ the file
def _usage_json(usage: Usage | None) -> dict[str, int] | None:
    return None if usage is None else dataclasses.asdict(usage)


_MAX_TOKENS = 1 << 31  # no single call's count comes near this


def _usage(raw: Any) -> Usage | None:
    """A cached usage; None (cost unknown) if absent or not three counts in [0, 2^31): a
    hand-edited cache must not bring back an overflowing cost sum."""
    if not isinstance(raw, dict):
        return None
    counts = [raw.get("prompt_tokens"), raw.get("completion_tokens"),
              raw.get("cached_tokens", 0)]
    if not all(type(c) is int and 0 <= c < _MAX_TOKENS for c in counts):
        return None
    return Usage(*counts)


def reply_json(call: WorkerCall) -> dict[str, Any]:
    """What the cache keeps of a call (role and node are the episode's, not the reply's)."""
    return {"text": call.text, "success": call.success, "error": call.error,
            "usage": _usage_json(call.usage), "failed_usage": _usage_json(call.failed_usage),
            "bound_usage": _usage_json(call.bound_usage), "latency_s": call.latency_s,
            "attempts": call.attempts, "reasoning_chars": call.reasoning_chars}


def call_from_reply(worker: str, prompt: str, reply: Mapping[str, Any]) -> WorkerCall:
    return WorkerCall(worker=worker, prompt=prompt, text=reply["text"],
                      success=bool(reply["success"]), usage=_usage(reply.get("usage")),
                      failed_usage=_usage(reply.get("failed_usage")),
                      bound_usage=_usage(reply.get("bound_usage")),
                      latency_s=float(reply.get("latency_s", 0.0)),
                      attempts=int(reply.get("attempts", 1)), error=reply.get("error"),
                      reasoning_chars=int(reply.get("reasoning_chars", 0)))


class ReplayCache:
    """The append-only JSONL cache file (see the module doc): key -> entry, last line wins.

    Opening repairs a torn last line (a crash mid-append) by cutting it off; a corrupt
    complete line is a `CacheFileError` naming the file and line."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.entries: dict[str, dict[str, Any]] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._load()
        else:
            self._append(canonical_json({"format": CACHE_FORMAT, "version": CACHE_VERSION}))

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> dict[str, Any] | None:
        return self.entries.get(key)

    def put(self, entry: Mapping[str, Any]) -> None:
        entry = dict(entry)
        self._append(canonical_json(entry))
        self.entries[entry["key"]] = entry

    def _append(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            # One write per entry: with O_APPEND a concurrent reader or a crash never sees
            # half of two entries interleaved, at worst a torn last line (repaired on open).
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _load(self) -> None:
        raw = self.path.read_bytes()
        good = 0  # byte offset just past the last complete, valid line
        lines = raw.split(b"\n")
        for number, line in enumerate(lines, 1):
            last = number == len(lines)
            if last and not line:
                break  # the file ends with a newline
            if not last and not line.strip():
                good += len(line) + 1
                continue
            try:
                value = json.loads(line)
            except ValueError:
                if last:  # torn append (no newline): drop it
                    break
                raise CacheFileError(f"{self.path}:{number}: not valid JSON; the cache is "
                                     "corrupt (delete the line or the file)") from None
            if last:  # a whole entry whose newline was lost: keep it, end the line
                with open(self.path, "ab") as f:
                    f.write(b"\n")
                good = len(raw) + 1
            else:
                good += len(line) + 1
            self._read_line(value, number)
        if good < len(raw):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        if good == 0:  # empty (or only a torn header): start the file afresh
            self._append(canonical_json({"format": CACHE_FORMAT, "version": CACHE_VERSION}))

    def _read_line(self, value: Any, number: int) -> None:
        where = f"{self.path}:{number}"
        if not isinstance(value, dict):
            raise CacheFileError(f"{where}: expected a JSON object")
        if "format" in value:
            if value.get("format") != CACHE_FORMAT or value.get("version") != CACHE_VERSION:
                raise CacheFileError(f"{where}: header {value!r} is not a "
                                     f"{CACHE_FORMAT} version {CACHE_VERSION} file")
            return
        missing = [k for k in ("key", "worker", "reply") if k not in value]
        if missing:
            raise CacheFileError(f"{where}: entry lacks {missing}")
        self.entries[value["key"]] = value


# ------------------------------------------------------------------------------ the pool
@dataclasses.dataclass
class ReplayStats:
    """Counts of one `ReplayPool`: answered from the cache, calls made (recorded), calls that
    waited for an identical call in flight (coalesced), and cached failures retried."""

    hits: int = 0
    recorded: int = 0
    coalesced: int = 0
    retried_failures: int = 0
    passthrough: int = 0


def _scrub(value: Any, secrets: Sequence[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, _SCRUBBED)
        return value
    if isinstance(value, dict):
        return {k: _scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, secrets) for v in value]
    return value


class ReplayPool(PoolView):
    """A `WorkerPool` answering from (and filling) a `ReplayCache`; see the module doc.

    `pool`: the real pool (its `worker_ids` / `description` are the catalog; in replay mode
    its `call` is never used). `cache`: the JSONL file (needed unless mode is "off").
    `identify`: worker -> `CallIdentity` (default `pool_identity(pool)`). `secrets`: strings
    (e.g. API key values) that must never be written; they are replaced by ``***``."""

    def __init__(self, pool: WorkerPool, *, mode: ReplayMode = "record",
                 cache: str | os.PathLike[str] | None = None, identify: Identify | None = None,
                 secrets: Sequence[str] = ()):
        if mode not in REPLAY_MODES:
            raise ValueError(f"ReplayPool mode={mode!r}: expected one of {list(REPLAY_MODES)}")
        if mode != "off" and cache is None:
            raise ValueError(f"ReplayPool mode={mode!r} needs a cache file")
        if mode == "replay" and not Path(cache).is_file():
            raise FileNotFoundError(f"replay: no worker cache {cache} (record one first: "
                                    "--replay record)")
        super().__init__(pool)
        self.mode = mode
        self.identify = identify or pool_identity(pool)
        self.secrets = tuple(s for s in secrets if s)
        self.cache = ReplayCache(cache) if mode != "off" else None
        self.stats = ReplayStats()
        self._inflight: dict[str, asyncio.Future[WorkerCall]] = {}

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        """The cached reply, or (record/off) the pool's; raises `ReplayMissError` on a
        replay-mode miss."""
        if self.cache is None:
            self.stats.passthrough += 1
            return await self.pool.call(worker, prompt, max_tokens=max_tokens)
        identity = self.identify(worker)
        key = cache_key(worker, prompt, identity, max_tokens)
        entry = self.cache.get(key)
        if entry is not None and (entry["reply"]["success"] or self.mode == "replay"):
            self.stats.hits += 1
            return call_from_reply(worker, prompt, entry["reply"])
        task = self._inflight.get(key)
        if task is not None:
            self.stats.coalesced += 1
        else:
            if self.mode == "replay":
                sampling = effective_sampling(identity, max_tokens)
                preview = prompt[:PAYLOAD_PREVIEW_CHARS].replace("\n", "\\n")
                raise ReplayMissError(
                    f"replay: {self.cache.path} holds no reply of {worker} to the payload "
                    f"starting {preview!r} ({len(prompt)} chars) with sampling {sampling} "
                    f"(key {key[:12]}); record it first (--replay record)")
            if entry is not None:
                self.stats.retried_failures += 1
            task = asyncio.ensure_future(self._record(worker, prompt, max_tokens, key,
                                                      identity))
            self._inflight[key] = task
            task.add_done_callback(lambda _, k=key: self._inflight.pop(k, None))
        # Shielded: one waiter being cancelled must not cancel the call the others await.
        return await asyncio.shield(task)

    async def _record(self, worker: str, prompt: str, max_tokens: int | None, key: str,
                      identity: CallIdentity) -> WorkerCall:
        call = await self.pool.call(worker, prompt, max_tokens=max_tokens)
        self.stats.recorded += 1
        entry = {"key": key, "worker": worker, "backend": dict(identity.backend),
                 "sampling": effective_sampling(identity, max_tokens), "payload": prompt,
                 "reply": reply_json(call),
                 "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(
                     timespec="seconds")}
        entry = _scrub(entry, self.secrets)
        entry["key"] = key  # a hash; scrubbing cannot apply to it
        assert self.cache is not None
        self.cache.put(entry)
        # The cached form, so a recorded run and its replay see the same call.
        return call_from_reply(worker, prompt, entry["reply"])
