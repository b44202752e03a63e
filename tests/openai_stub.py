"""The loopback stub the HTTP tests share: the simulated workers behind real HTTP
(`routing.simulated.http_endpoint`), with worker_1's key read from KEY_ENV."""

from pathlib import Path

from jax_routeweaver.routing.simulated.http_endpoint import (
    SimulatedHttpWorkers,
    simulated_channel_file,
)
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool

KEY_ENV, SECRET = "RW_STUB_TEST_KEY", "sk-stub-test-9f8e7d6c5b4a"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
              "all_proxy")

SimServer = SimulatedHttpWorkers


def channel_file(path: Path, sim: SimulatedWorkerPool, url: str,
                 prices: dict | None = None) -> Path:
    """Channels for every simulated worker at `url`; worker_1's key is read from KEY_ENV.
    Each is priced at the reference table (as the simulated pool bills), or at `prices`
    (worker -> (input, output) USD per 1M tokens, or None: no price entry)."""
    return simulated_channel_file(path, sim, url, prices=prices,
                                  key_env={"worker_1": KEY_ENV})
