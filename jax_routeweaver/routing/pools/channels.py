"""Channel files: the YAML that names each worker's OpenAI-compatible endpoint.

Channel file (`configs/channels/*.yaml`; unknown keys are errors)::

    price_table_version: fixed-reference-2026-09-20   # optional label
    workers:
      worker_1:                          # anonymous id, worker_<N>
        description: "dense, 8.2B ..."   # shown to the router: never a model name or price
        base_url: http://127.0.0.1:8012/v1   # POST {base_url}/chat/completions
        model: qwen3-8b                  # served model name
        timeout_s: 120                   # per-request timeout
        api_key_env: OPENROUTER_API_KEY  # optional: NAME of the env var holding the key
        extra_body: {...}                # optional: merged into the request body
        price: {input: 0.02, output: 0.05}   # optional: USD per 1M tokens
        backend: qwen3_8b                # optional: label the price is pinned to
        fallback: worker_2               # optional: serving calls this worker instead when
                                         # a call to worker_1 fails after its retries

Secrets: a key is read from its environment variable at call time and sent only in the
`Authorization` header. It is never stored on the pool or the config, never logged, never put in
an error or a `WorkerCall`.

`load_channels` parses and validates one (`ChannelConfigError` naming the file and the field);
the HTTP pool that calls the channels is `routing/pools/workers.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from jax_routeweaver.config import decode_utf8
from jax_routeweaver.routing.pools.pricing import WorkerPrice

WORKER_ID_PATTERN = re.compile(r"worker_[1-9][0-9]*")
_ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOP_REQUIRED = {"workers"}
_TOP_OPTIONAL = {"price_table_version"}
_WORKER_REQUIRED = {"description", "base_url", "model", "timeout_s"}
_WORKER_OPTIONAL = {"api_key_env", "extra_body", "price", "backend", "fallback"}
_PRICE_KEYS = {"input", "output"}
# Set by the pool (as the original's client sets them); an extra_body that changed them would
# silently change the experiment.
_RESERVED_BODY_KEYS = {"model", "messages", "temperature", "seed", "max_tokens", "stream", "n"}
_SECRET_LIKE_KEY = re.compile(r"api_?key|secret|passw|authori[sz]ation|bearer|^key$|^token$")


class ChannelConfigError(ValueError):
    """A channel file is malformed; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Channel:
    """One worker's endpoint. `api_key_env` is a variable NAME; the key itself is never held."""

    worker: str
    description: str
    base_url: str
    model: str
    timeout_s: float
    api_key_env: str | None = None
    extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    price: WorkerPrice | None = None
    backend: str | None = None
    # The worker `routeweaver serve` calls instead when a call to this one fails after its
    # retries (another worker of the same file); None: the request fails. Training and
    # evaluation never substitute a worker (a failed call makes the row infra).
    fallback: str | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"


@dataclasses.dataclass(frozen=True)
class ChannelConfig:
    """A loaded channel file: channels in catalog order (`worker_1`, `worker_2`, ...)."""

    # The file it was loaded from (named in errors); "<channels>" when parsed from memory.
    path: str
    # One `Channel` per worker, sorted by worker number (the catalog order); at least one.
    channels: tuple[Channel, ...]
    # The file's `price_table_version` label; None when it has none.
    price_table_version: str | None = None

    def worker_ids(self) -> list[str]:
        return [c.worker for c in self.channels]

    def channel(self, worker: str) -> Channel:
        for c in self.channels:
            if c.worker == worker:
                return c
        raise KeyError(f"{self.path}: no worker {worker!r} (workers: {self.worker_ids()})")

    def prices(self) -> dict[str, WorkerPrice]:
        """Worker id -> price, for the workers whose entry has one."""
        return {c.worker: c.price for c in self.channels if c.price is not None}

    def backends(self) -> dict[str, str | None]:
        """Worker id -> backend label (for `pricing.verify_pool`)."""
        return {c.worker: c.backend for c in self.channels}


# ---------------------------------------------------------------------------------------------
# Loading and validation


def load_channels(path: str | os.PathLike[str]) -> ChannelConfig:
    """Parse and validate a channel YAML file; raises ChannelConfigError naming file and field."""
    path = str(path)
    try:
        raw = yaml.safe_load(decode_utf8(Path(path).read_bytes(), path))
    except OSError as err:
        raise ChannelConfigError(f"{path}: cannot read channel file ({err.strerror})") from None
    except ValueError as err:  # not UTF-8
        raise ChannelConfigError(str(err)) from None
    except yaml.YAMLError as err:
        raise ChannelConfigError(f"{path}: not valid YAML ({err})") from None
    return parse_channels(raw, path)


def parse_channels(raw: Any, path: str = "<channels>") -> ChannelConfig:
    """Validate an already-parsed channel mapping (see the module docstring for the schema)."""
    _check_keys(raw, path, "", _TOP_REQUIRED, _TOP_OPTIONAL)
    workers = raw["workers"]
    if not isinstance(workers, Mapping) or not workers:
        raise ChannelConfigError(f"{path}: field 'workers' must be a non-empty mapping of "
                                 "worker_<N> -> channel entry")
    channels = [_parse_channel(worker, entry, path) for worker, entry in workers.items()]
    channels.sort(key=lambda c: int(c.worker.split("_")[1]))
    ids = {c.worker for c in channels}
    for c in channels:
        if c.fallback is not None and (c.fallback not in ids or c.fallback == c.worker):
            raise ChannelConfigError(f"{path}: field 'workers.{c.worker}.fallback' must name "
                                     f"another worker of the file, got {c.fallback!r}")
    version = raw.get("price_table_version")
    if version is not None and not isinstance(version, str):
        raise ChannelConfigError(f"{path}: field 'price_table_version' must be a string")
    return ChannelConfig(path=path, channels=tuple(channels), price_table_version=version)


def _check_keys(raw: Any, path: str, where: str, required: set[str], optional: set[str]
                ) -> None:
    label = f"field '{where}'" if where else "the top level"
    if not isinstance(raw, Mapping):
        raise ChannelConfigError(f"{path}: {label} must be a mapping")
    # Only key names are quoted, never values: a misplaced value could be a secret.
    unknown = sorted(str(k) for k in raw if k not in required | optional)
    if unknown:
        hint = ""
        if any(_SECRET_LIKE_KEY.search(k.lower()) for k in unknown):
            hint = "; keys never go in the file: name an environment variable in api_key_env"
        elif _RESERVED_BODY_KEYS & set(unknown):
            hint = "; max_tokens, temperature and seed are pool settings, not channel settings"
        raise ChannelConfigError(f"{path}: unknown field(s) {unknown} in {label} "
                                 f"(allowed: {sorted(required | optional)}){hint}")
    missing = sorted(required - set(raw))
    if missing:
        raise ChannelConfigError(f"{path}: missing field(s) {missing} in {label}")


def _parse_channel(worker: Any, entry: Any, path: str) -> Channel:
    if not isinstance(worker, str) or not WORKER_ID_PATTERN.fullmatch(worker):
        raise ChannelConfigError(f"{path}: worker id {worker!r} under 'workers' must be "
                                 "an anonymous id worker_<N> (N >= 1)")
    where = f"workers.{worker}"
    _check_keys(entry, path, where, _WORKER_REQUIRED, _WORKER_OPTIONAL)
    model = _nonempty_str(entry, "model", path, where)
    description = _nonempty_str(entry, "description", path, where)
    backend = entry.get("backend")
    if backend is not None:
        backend = _nonempty_str(entry, "backend", path, where)
    for name in (model, backend):
        if name is not None and name.lower() in description.lower():
            raise ChannelConfigError(f"{path}: field '{where}.description' names the model "
                                     f"{name!r}; the router must never see model names")
    return Channel(
        worker=worker, description=description, model=model,
        base_url=_base_url(entry["base_url"], path, f"{where}.base_url"),
        timeout_s=_positive_number(entry["timeout_s"], path, f"{where}.timeout_s"),
        api_key_env=_api_key_env(entry.get("api_key_env"), path, f"{where}.api_key_env"),
        extra_body=_extra_body(entry.get("extra_body"), path, f"{where}.extra_body"),
        price=_price(entry.get("price"), backend, path, f"{where}.price"),
        backend=backend,
        fallback=_fallback(entry.get("fallback"), path, f"{where}.fallback"),
    )


def _fallback(value: Any, path: str, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not WORKER_ID_PATTERN.fullmatch(value):
        raise ChannelConfigError(f"{path}: field '{field}' must be a worker id worker_<N>, "
                                 f"got {value!r}")
    return value


def _nonempty_str(entry: Mapping[str, Any], key: str, path: str, where: str) -> str:
    value = entry[key]
    if not isinstance(value, str) or not value.strip():
        raise ChannelConfigError(f"{path}: field '{where}.{key}' must be a non-empty string")
    return value.strip()


def _positive_number(value: Any, path: str, field: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 0):
        raise ChannelConfigError(f"{path}: field '{field}' must be a positive number of "
                                 f"seconds, got {value!r}")
    return float(value)


def _base_url(value: Any, path: str, field: str) -> str:
    if not isinstance(value, str):
        raise ChannelConfigError(f"{path}: field '{field}' must be a URL string")
    parts = urlsplit(value.strip())
    if parts.username is not None or parts.password is not None:
        # Not echoed: credentials embedded in a URL are a secret.
        raise ChannelConfigError(f"{path}: field '{field}' must not embed credentials; "
                                 "name an environment variable in api_key_env")
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ChannelConfigError(f"{path}: field '{field}' must be an http(s) base URL such as "
                                 f"http://127.0.0.1:8000/v1, got {value!r}")
    base = value.strip().rstrip("/")
    if base.endswith("/chat/completions"):
        raise ChannelConfigError(f"{path}: field '{field}' must be the base URL (…/v1); the "
                                 f"pool appends /chat/completions, got {value!r}")
    return base


def _api_key_env(value: Any, path: str, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _ENV_NAME_PATTERN.fullmatch(value):
        # The value is not shown: the usual mistake is pasting the key itself here.
        raise ChannelConfigError(f"{path}: field '{field}' must be the NAME of an environment "
                                 "variable (letters, digits, _), not a key; value not shown")
    return value


def _extra_body(value: Any, path: str, field: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ChannelConfigError(f"{path}: field '{field}' must be a mapping with string keys")
    reserved = sorted(_RESERVED_BODY_KEYS & set(value))
    if reserved:
        raise ChannelConfigError(f"{path}: field '{field}' must not set {reserved}: the pool "
                                 "sets model, messages, temperature, seed and max_tokens")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise ChannelConfigError(f"{path}: field '{field}' must be JSON-serialisable") from None
    return dict(value)


def _price(value: Any, backend: str | None, path: str, field: str) -> WorkerPrice | None:
    if value is None:
        return None
    _check_keys(value, path, field, _PRICE_KEYS, set())
    try:
        return WorkerPrice(value["input"], value["output"], backend)
    except ValueError:
        raise ChannelConfigError(f"{path}: field '{field}' needs input and output as finite "
                                 f"numbers >= 0 (USD per 1M tokens), got {dict(value)}") from None
