"""Reading an untrusted worker reply: the HTTP pool's (`workers.py`) and the endpoint check's
(`endpoint_check.py`) shared rules for decoding a capped body, parsing a chat completion, judging
reported usage, honouring Retry-After and keeping API keys out of any text a server sent.

Worker replies are untrusted input:

- Usage: reported token counts must be plausible for the request, otherwise the attempt's
  usage is treated as not reported (None: the call's cost is unknown, never a crash or a huge
  bill). A count is plausible if it is an integer-valued finite number >= 0 (a missing field
  is 0), `completion_tokens` <= the request's `max_tokens`, and `prompt_tokens` <= the length
  of the JSON request body plus `PROMPT_TEMPLATE_TOKENS` (1024): a tokenizer never needs more
  than one token per byte of text, plus the chat template's own tokens. Cached tokens are
  clamped to [0, prompt_tokens] (as the original). Implausible usage on a failed attempt is dropped
  like absent usage; a later success is billed on its own (plausible) usage. An attempt
  whose usage is not known (absent, implausible, or a request that timed out after it was
  sent) is billed at its worst case (`Attempt.bill`); one that never reached the worker
  (the connection was refused) is free.
- `message.content: null` is a valid empty reply only when the message carries reasoning
  (`final_content_missing`) or `tool_calls`; otherwise it is an unparseable 200 (retried as
  `workers.py` describes). An empty string `""` stays a successful empty reply.
"""

from __future__ import annotations

import dataclasses
import email.utils
import json
import logging
import math
import re
import zlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import httpx

from jax_routeweaver.routing.protocol.calls import Usage

logger = logging.getLogger(__name__)

# A bearer token must be visible ASCII; anything else would make httpx raise an error that
# quotes the header value, i.e. the key.
KEY_PATTERN = re.compile(r"[\x21-\x7e]+")

# Hostile-reply bounds (module docstring): the longest Retry-After honoured; the chat-template
# tokens a prompt may add to its own bytes.
RETRY_AFTER_MAX_S = 120.0
PROMPT_TEMPLATE_TOKENS = 1024
# The only encodings the pool decodes (itself, under the cap); asked for explicitly so httpx
# never advertises others (br, zstd) that a server could then use.
ACCEPT_ENCODING = "gzip, deflate"

_Kind = Literal["ok", "load_failure", "unparseable", "auth", "fatal"]


@dataclasses.dataclass
class Attempt:
    """What one HTTP request produced."""

    kind: _Kind
    code: str
    cooldown_s: float = 0.0
    text: str = ""
    usage: Usage | None = None
    reasoning_chars: int = 0
    failed_usage: Usage | None = None
    retry_after_s: float | None = None
    # False: the request never reached the worker (no connection), so nothing was billed.
    delivered: bool = True

    def bill(self) -> Usage | None:
        """The usage this attempt is known to be billed, or None when it is not known (it
        is then billed at its worst case, `UsageLimits`): a success's usage, a failure's
        reported usage, nothing for a request that never reached the worker."""
        if not self.delivered:
            return Usage(0, 0)
        if self.kind != "ok":
            return self.failed_usage
        # A reply always has a prompt: 0/0 is usage not reported.
        known = self.usage is not None and (self.usage.prompt_tokens
                                            or self.usage.completion_tokens)
        return self.usage if known else None


@dataclasses.dataclass(frozen=True)
class UsageLimits:
    """The most tokens a request's reply can plausibly report (module docstring)."""

    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def for_body(cls, body: Mapping[str, Any]) -> UsageLimits:
        return cls(len(json.dumps(body)) + PROMPT_TEMPLATE_TOKENS, body["max_tokens"])

    def as_usage(self) -> Usage:
        """The worst case as the usage it bills."""
        return Usage(self.prompt_tokens, self.completion_tokens)


# ---------------------------------------------------------------------------------------------
# Keys in untrusted text


def scrub(text: str, key: str | None) -> str:
    return text.replace(key, "***") if key else text


def scrub_all(text: str, keys: set[str]) -> str:
    for key in sorted(keys, key=len, reverse=True):  # a key inside another goes last
        text = scrub(text, key)
    return text


# ---------------------------------------------------------------------------------------------
# Response parsing


def json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # includes UnicodeDecodeError
        return None


def inflate(decoder: zlib._Decompress | None, chunk: bytes, room: int) -> bytes:
    """`chunk` as it adds to the reply body: decompressed (at most `room` bytes, so a
    compression bomb stops at the cap) when the reply is compressed; httpx.DecodingError on a
    malformed stream."""
    if decoder is None:
        return chunk
    try:
        return decoder.decompress(chunk, room)
    except zlib.error:
        raise httpx.DecodingError("malformed compressed body") from None


def reply_decoder(encoding: str | None) -> zlib._Decompress | None:
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


def retry_after_s(headers: httpx.Headers) -> float | None:
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


def parse_reply(data: Any, limits: UsageLimits) -> Attempt | None:
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
    return Attempt("ok", "ok", text=content.strip(),
                    usage=_parse_usage(data.get("usage"), limits),
                    reasoning_chars=reasoning_chars)


def _parse_usage(raw: Any, limits: UsageLimits) -> Usage | None:
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


def failed_usage(data: Any, limits: UsageLimits) -> Usage | None:
    """Usage reported by a failed attempt (billed too); None if absent, implausible or 0/0."""
    usage = _parse_usage(data.get("usage"), limits) if isinstance(data, dict) else None
    if usage is None or (usage.prompt_tokens == 0 and usage.completion_tokens == 0):
        return None
    return usage
