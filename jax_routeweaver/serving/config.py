"""`ServeConfig`: the settings of `routeweaver serve` (its command-line flags)."""

from __future__ import annotations

import dataclasses
import ipaddress

LOOPBACK_NAMES = ("localhost",)
DEFAULT_TOKEN_ENV = "ROUTEWEAVER_SERVE_TOKEN"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the endpoint listens, whom it serves and what it accepts."""

    # Address to bind. Without a bearer token (`token_env` unset) only a loopback address
    # (127.0.0.0/8, ::1, localhost) is allowed.
    host: str = "127.0.0.1"
    # TCP port, [0, 65535]; 0 = any free port (the bound one is logged).
    port: int = 8000
    # The model id clients send and `GET /v1/models` lists; non-empty.
    model_name: str = "routeweaver"
    # NAME of the environment variable holding the clients' bearer token (never the token).
    token_env: str = DEFAULT_TOKEN_ENV
    # Largest request body accepted, bytes, >= 1024 (413 above).
    max_body_bytes: int = 1 << 20
    # Most messages in one request, >= 1.
    max_messages: int = 64
    # Longest question the router reads, router tokens, >= 1 (400 above): the selector prompt
    # and the episode must fit the router's context.
    max_question_tokens: int = 2048
    # Requests running at once, >= 1; more are answered 503 (`overloaded`) at once.
    max_inflight: int = 256
    # Wall-clock limit of one request, seconds, > 0 (504 `timeout` after it).
    request_timeout_s: float = 300.0
    # Seconds one worker call may spend on its retries (the pool's `total_budget_s`), > 0;
    # then it fails (and its fallback, if any, is asked).
    worker_budget_s: float = 60.0
    # Rows the shared sampler takes per batch, >= 1.
    max_batch: int = 64
    # Before listening, compile the router's shapes with episodes in batches of 1, 2, 4, ...
    # up to this many rows (no worker is called; `RouterService.warm_up`). Rows, >= 0;
    # 0 = off; None = `max_batch` (a fresh server then meets its overhead goal from its first
    # requests: bench/serve.py --cold, bench/RESULTS.md).
    warmup_rows: int | None = None
    # Seconds a shutdown waits for accepted requests before closing them, > 0.
    shutdown_grace_s: float = 330.0

    @property
    def warmup_limit(self) -> int:
        """The rows of the warm-up's largest batch (0: no warm-up)."""
        return self.max_batch if self.warmup_rows is None else self.warmup_rows

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if not self.model_name.strip():
            raise ValueError("model_name must be non-empty")
        if self.warmup_rows is not None and self.warmup_rows < 0:
            raise ValueError(f"warmup_rows={self.warmup_rows} must be >= 0")
        for name, low in (("max_body_bytes", 1024), ("max_messages", 1),
                          ("max_question_tokens", 1), ("max_inflight", 1), ("max_batch", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")
        for name in ("request_timeout_s", "shutdown_grace_s", "worker_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
