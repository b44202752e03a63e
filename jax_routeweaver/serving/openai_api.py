"""The OpenAI chat-completions wire format: reading a request, writing a completion, its SSE
chunks and errors.

A request is an OpenAI ``POST /v1/chat/completions`` body. The question the router reads is
the text of the last user message; earlier messages (a system prompt, previous turns) are
put before it as context lines (``role: text``). The extension fields (top level, as the
`openai` client's ``extra_body`` sends them):

    max_cost            USD for every worker call of the request, > 0 (default: no budget)
    mode                "single" | "multi" | "agentic": force the mode (default: the router's)
    workers             worker ids the router may call (default: every served worker)

``max_tokens`` / ``max_completion_tokens`` cap each worker call's completion (the answer
comes from the workers); ``n`` must be 1; the sampling fields (temperature, top_p, seed, ...)
are accepted and ignored: the router decodes greedily, as in evaluation. Any other field is
an error naming it, so a misspelt ``max_cost`` is never silently dropped.

The response's message is the final answer; its ``routeweaver`` field is the routing record
(`router.routing_record`); ``usage`` counts the router's own tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator
from typing import Any

from jax_routeweaver.data.records import FORCED_MODES
from jax_routeweaver.serving.router import RouteRequest, RouteResult

EXTENSION_FIELD = "routeweaver"
# Accepted and ignored (module docstring).
IGNORED_FIELDS = frozenset({
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "user",
    "metadata", "store", "logit_bias", "stop", "service_tier", "parallel_tool_calls",
    "reasoning_effort", "prediction", "modalities"})
KNOWN_FIELDS = frozenset({"model", "messages", "stream", "stream_options", "n", "max_tokens",
                          "max_completion_tokens", "logprobs", "top_logprobs", "max_cost",
                          "mode", "workers"}) | IGNORED_FIELDS
ROLES = ("system", "developer", "user", "assistant")
# The answer is streamed in pieces of this many characters.
STREAM_PIECE_CHARS = 32


class RequestError(ValueError):
    """A request the endpoint refuses: HTTP `status`, OpenAI error `code`, the bad `param`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str = "invalid_request"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A parsed request: what to route, and how to answer."""

    route: RouteRequest
    model: str
    stream: bool = False
    include_usage: bool = False


def parse_chat_request(body: bytes, *, model_name: str, max_messages: int) -> ChatRequest:
    """The `ChatRequest` of a request body; RequestError naming the field otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(data) - KNOWN_FIELDS)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (extension fields: max_cost, mode, "
                           "workers)", param=unknown[0])
    model = data.get("model")
    if model != model_name:
        raise RequestError(f"model: {model!r} is not served (served: {model_name!r})",
                           param="model", status=404, code="model_not_found")
    question = _question(data.get("messages"), max_messages)
    if data.get("n", 1) != 1:
        raise RequestError(f"n: {data['n']!r}: only n=1 is supported", param="n")
    if data.get("logprobs") not in (None, False):
        raise RequestError("logprobs: not supported (the answer comes from the workers)",
                           param="logprobs")
    stream = _flag(data, "stream")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise RequestError("stream_options: expected {\"include_usage\": bool}",
                           param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return ChatRequest(RouteRequest(question=question, max_cost=_max_cost(data),
                                    mode=_mode(data), workers=_workers(data),
                                    worker_max_tokens=_max_tokens(data)),
                       model=model_name, stream=stream, include_usage=include_usage)


def _question(messages: Any, max_messages: int) -> str:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list", param="messages")
    if len(messages) > max_messages:
        raise RequestError(f"messages: {len(messages)} messages, at most {max_messages}",
                           param="messages")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role: expected one of {ROLES}",
                               param=f"messages[{i}].role")
        lines.append((message["role"], _text(message.get("content"), i)))
    if lines[-1][0] != "user" or not lines[-1][1].strip():
        raise RequestError("messages: the last message must be a user message with text",
                           param=f"messages[{len(lines) - 1}]")
    question = lines[-1][1]
    context = [f"{role}: {text}" for role, text in lines[:-1] if text.strip()]
    return "\n".join([*context, question]) if context else question


def _text(content: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content[{k}]: only text parts are "
                                   "supported", param=f"messages[{i}].content[{k}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content: expected a string or a list of text parts",
                       param=f"messages[{i}].content")


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name}: expected true or false, got {value!r}", param=name)
    return value


def _max_cost(data: dict[str, Any]) -> float | None:
    value = data.get("max_cost")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise RequestError(f"max_cost: {value!r} must be a positive number of USD",
                           param="max_cost")
    return float(value)


def _mode(data: dict[str, Any]) -> str | None:
    value = data.get("mode")
    if value is not None and value not in FORCED_MODES:
        raise RequestError(f"mode: {value!r} is not one of {', '.join(FORCED_MODES)}",
                           param="mode")
    return value


def _workers(data: dict[str, Any]) -> tuple[str, ...]:
    value = data.get("workers")
    if value is None:
        return ()
    if not isinstance(value, list) or not value or not all(isinstance(w, str) for w in value) \
            or len(set(value)) != len(value):
        raise RequestError("workers: expected a non-empty list of distinct worker ids",
                           param="workers")
    return tuple(value)


def _max_tokens(data: dict[str, Any]) -> int | None:
    name = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name}: {value!r} must be an integer >= 1", param=name)
    return value


# ---------------------------------------------------------------------------- responses
def usage(result: RouteResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def completion(request: ChatRequest, result: RouteResult) -> dict[str, Any]:
    """The ``chat.completion`` object of a routed request."""
    return {"id": f"chatcmpl-{result.record['id']}", "object": "chat.completion",
            "created": int(time.time()), "model": request.model,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": result.answer}}],
            "usage": usage(result), EXTENSION_FIELD: result.record}


def stream_events(request: ChatRequest, result: RouteResult) -> Iterator[bytes]:
    """The SSE events of a routed request: the role, the answer in pieces, the finish (with
    the routing record), the usage chunk if asked for, then ``[DONE]``."""
    base = {"id": f"chatcmpl-{result.record['id']}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": request.model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": None}], **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    yield chunk({"role": "assistant", "content": ""})
    text = result.answer
    for i in range(0, len(text), STREAM_PIECE_CHARS):
        yield chunk({"content": text[i:i + STREAM_PIECE_CHARS]})
    yield chunk({}, "stop", **{EXTENSION_FIELD: result.record})
    if request.include_usage:
        body = {**base, "choices": [], "usage": usage(result)}
        yield f"data: {json.dumps(body)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def error_body(message: str, *, code: str, param: str | None = None,
               kind: str = "invalid_request_error", **extra: Any) -> dict[str, Any]:
    """An OpenAI error object (the `openai` client raises it as `APIStatusError`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code},
            **extra}
