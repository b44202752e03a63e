"""The price table a run bills at, and the check of its worker pool before step 1.

`run_prices(cfg)`: the table a RouteWeaver run bills worker calls at (training, `eval run`,
`eval favourites`, the baselines): for a channel pool (``workers.pool``: a channel YAML) the
file's ``price`` entries, a worker without one being unpriced (never free); for the simulated
pool `pricing.REFERENCE_PRICES` (its worker_1..6 are the original's workers; its channel file,
configs/channels/reference.yaml, carries the same table). It equals `pricing.pool_prices` of
the pool the run builds. A ``rollout.dialect: router_r1`` run bills with Router-R1's own table
instead (completion tokens x $/1M of the Router-R1 model each worker serves:
`rewards.router_r1_reward.worker_prices`).

`check_run_pool(cfg)` runs before anything of a run is built or written
(`rl.run.builders.build_pool`
calls it; `eval` and `train --dry-run` too) and raises `PoolCheckError`, one line naming each
failing worker, what is wrong and where (the endpoint URL or the channel file; never a key),
unless:

1. every worker the run offers (``workers.offered``, or every worker of the pool; Router-R1:
   the workers its models map onto) is a worker of the pool and is priced in the run's table;
   a price pinned to a ``backend`` must be that of the backend serving the worker
   (`pricing.price_problems`);
2. for a channel pool, with ``network`` (the default; off only where no worker is called,
   e.g. an offline replay): every key variable the file names is set (the HTTP pool needs
   them all), and each offered worker's endpoint answers ``GET {base_url}/models`` within
   `MODELS_TIMEOUT_S` with a model list that includes its configured ``model``
   (`routing.pools.endpoint_check.check_endpoints`: fail closed on an unreachable endpoint,
   any status but 200 — 404/405 included — or a name it does not serve).

Nothing here writes a file; a key is sent only to its own endpoint in the Authorization
header and never logged or shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax_routeweaver.rewards.router_r1_reward import worker_prices
from jax_routeweaver.rl.run import router_r1_run as r1run
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.pools.channels import ChannelConfig, load_channels
from jax_routeweaver.routing.pools.endpoint_check import MODELS_TIMEOUT_S, check_endpoints
from jax_routeweaver.routing.pools.pricing import (
    PRICE_TABLE_VERSION,
    REFERENCE_PRICES,
    Prices,
    WorkerPrice,
    price_problems,
)
from jax_routeweaver.routing.pools.workers import missing_keys
from jax_routeweaver.routing.simulated.profiles import DEFAULT_PROFILES

SIMULATED = "simulated"
REFERENCE_TABLE = "the original price table"
ROUTER_R1_TABLE = "the Router-R1 price table"


class PoolCheckError(ValueError):
    """The run's worker pool failed its check; the message is one line naming each failing
    worker, where (endpoint URL or channel file) and what is wrong. Never holds a key."""


@dataclasses.dataclass(frozen=True)
class WorkerCheck:
    """One checked worker (or, for a bad Router-R1 model map, ``rollout.router_r1.models``):
    `where` is its model-list URL when its endpoint was asked, else the price table's source;
    `ok` False fails the run; `detail` says what was found (one line, never a key)."""

    worker: str
    where: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{self.worker} ({self.where}): {self.detail}"


class _Catalog:
    """The worker ids of a pool not built yet (what `router_r1_run.model_workers` reads)."""

    def __init__(self, ids: Sequence[str]):
        self.ids = list(ids)

    def worker_ids(self) -> list[str]:
        return list(self.ids)


def channels_of(cfg: TrainConfig) -> ChannelConfig | None:
    """The run's channel file, loaded (None for the simulated pool)."""
    return None if cfg.workers.pool == SIMULATED else load_channels(cfg.workers.pool)


def run_prices(cfg: TrainConfig, channels: ChannelConfig | None = None) -> Prices:
    """The table a RouteWeaver run bills worker calls at (module doc): the channel file's
    ``price`` entries, or REFERENCE_PRICES for the simulated pool. `channels`: the run's
    channel file if already loaded."""
    channels = channels or channels_of(cfg)
    return REFERENCE_PRICES if channels is None else channels.prices()


def run_price_table_version(cfg: TrainConfig, channels: ChannelConfig | None = None
                            ) -> str | None:
    """The version label of `run_prices(cfg)`: the channel file's ``price_table_version``
    (None if it has none), or `pricing.PRICE_TABLE_VERSION` for the simulated pool. A
    ``cost_ref.json`` is only meaningful under the table it names (`pricing.load_cost_ref`)."""
    channels = channels or channels_of(cfg)
    return PRICE_TABLE_VERSION if channels is None else channels.price_table_version


def pool_checks(cfg: TrainConfig, *, network: bool = True,
                timeout_s: float = MODELS_TIMEOUT_S,
                env: Mapping[str, str] | None = None) -> list[WorkerCheck]:
    """Every check of `check_run_pool`, passed or not: one `WorkerCheck` per offered worker
    (its price, and with `network` its endpoint and served name), then one per other channel
    whose key variable is unset (with `network`). `env`: where keys are read (default: the
    process environment)."""
    channels = channels_of(cfg)
    ids = list(DEFAULT_PROFILES) if channels is None else channels.worker_ids()
    source = REFERENCE_TABLE if channels is None else channels.path
    if cfg.rollout.dialect == "router_r1":
        try:
            mapping = r1run.model_workers(cfg, _Catalog(ids))
            table = worker_prices(mapping)
        except ValueError as err:  # PricingError too
            return [WorkerCheck("rollout.router_r1.models", ROUTER_R1_TABLE, False, str(err))]
        offered = list(dict.fromkeys(mapping.values()))
        priced = {w: (ROUTER_R1_TABLE, f"priced at {table[w]:g} USD per 1M completion tokens "
                                       "(Router-R1)") for w in offered}
        problems: dict[str, str] = {}
    else:
        offered = list(cfg.workers.offered) or ids
        known = [w for w in offered if w in ids]
        prices = run_prices(cfg, channels)
        problems = {w: f"{what} in {source}" for w, what in price_problems(
            known, prices, None if channels is None else channels.backends())}
        problems |= {w: f"not a worker of the pool (workers: {ids})"
                     for w in offered if w not in ids}
        priced = {w: (source, _price_text(prices[w])) for w in known if w not in problems}
    checks = {w: WorkerCheck(w, source, False, problems[w]) if w in problems
              else WorkerCheck(w, priced[w][0], True, priced[w][1]) for w in offered}
    if channels is not None and network:
        reachable = [w for w in offered if w in ids]
        for found in check_endpoints(channels, reachable, timeout_s=timeout_s, env=env):
            before = checks[found.worker]
            details = [d for d, bad in ((before.detail, not before.ok),
                                        (found.detail, not found.ok)) if bad] \
                or [f"{before.detail}; {found.detail}"]
            checks[found.worker] = WorkerCheck(found.worker, found.url,
                                               before.ok and found.ok, "; ".join(details))
        for name, workers in missing_keys(channels, env).items():
            for worker in workers:
                if worker not in checks:
                    checks[worker] = WorkerCheck(
                        worker, channels.path, False, f"environment variable {name} is not "
                        "set (the worker pool reads every key its channel file names)")
    return list(checks.values())


def check_run_pool(cfg: TrainConfig, *, network: bool = True,
                   timeout_s: float = MODELS_TIMEOUT_S,
                   env: Mapping[str, str] | None = None) -> None:
    """Raise PoolCheckError unless the run's pool passes every check (module doc); the
    message is one line listing each failing worker. `network` False, or the config's
    ``workers.check_endpoints: false``, skips the keys and the endpoints (for runs that call
    no worker, or endpoints that serve no model list)."""
    network = network and cfg.workers.check_endpoints
    failed = [c for c in pool_checks(cfg, network=network, timeout_s=timeout_s, env=env)
              if not c.ok]
    if failed:
        raise PoolCheckError(f"worker pool {cfg.workers.pool} failed its check before step "
                             f"1: {'; '.join(c.line() for c in failed)}")


def _price_text(price: WorkerPrice) -> str:
    return (f"priced at {price.input_usd_per_m:g} in / {price.output_usd_per_m:g} out USD per "
            "1M tokens")
