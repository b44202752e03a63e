"""The model-list check a run makes before its first step: `check_endpoints` asks each distinct
endpoint of a channel pool for its model list (`GET {base_url}/models`) and fails closed unless it
answers with one that includes every checked worker's `model` (see there). No worker is asked
to generate.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from jax_routeweaver.routing.pools.channels import Channel, ChannelConfig
from jax_routeweaver.routing.pools.http_replies import (
    ACCEPT_ENCODING,
    KEY_PATTERN,
    inflate,
    json_or_none,
    reply_decoder,
    scrub_all,
)
from jax_routeweaver.routing.pools.workers import MAX_REPLY_BYTES

# `check_endpoints`: seconds an endpoint has to send its whole model list, and how many of
# the names it serves a failure quotes.
MODELS_TIMEOUT_S = 5.0
SERVED_NAMES_SHOWN = 10


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
    with httpx.Client(headers={"Accept-Encoding": ACCEPT_ENCODING}) as client:
        for channel in chosen:
            key, refusal = _probe_key(channel, env)
            found.append((channel, refusal))
            endpoint = (channel.base_url, channel.api_key_env)
            if refusal is None and endpoint not in answers:
                sent |= {key} if key else set()
                answers[endpoint] = _served_models(client, f"{channel.base_url}/models", key,
                                                   timeout_s, max_reply_bytes)

    def scrub(text: str) -> str:
        return scrub_all(text, sent)

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
    if not KEY_PATTERN.fullmatch(key):
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
            decoder = reply_decoder(response.headers.get("content-encoding"))
            for chunk in response.iter_raw():
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("model list too slow")
                body += inflate(decoder, chunk, cap + 1 - len(body))
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
    data = json_or_none(bytes(body))
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
