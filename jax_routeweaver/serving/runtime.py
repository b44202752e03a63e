"""Building a `RouterService` from a router checkpoint and a channel file.

The router is the checkpoint's (`eval.evaluate.resolve_checkpoint`: a run directory, a
policy checkpoint or step, or a Hugging Face directory), decoded greedily as in evaluation,
with the RouteWeaver environment of its run's config. Its sampler is the config's: the
in-process JAX sampler, or the vLLM sidecar (``rollout.sampler: vllm``); either sits behind
one `BatchingSampler`. The workers are the channel file's endpoints (`HttpWorkerPool`),
checked as a training run checks them (keys set, every served worker priced, endpoints up
and serving their model names), billed at the file's prices, with its `fallback` entries.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax_routeweaver.rl.run.pool_check import check_run_pool
from jax_routeweaver.rl.run.router_checkpoint import (
    checkpoint_config,
    greedy_config,
    load_router_sampler,
    resolve_checkpoint,
)
from jax_routeweaver.rl.run.routeweaver_run import env_config
from jax_routeweaver.rl.run.train_config import TrainConfig, load_train_config
from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.workers import HttpWorkerPool
from jax_routeweaver.serving.batcher import BatchingSampler
from jax_routeweaver.serving.config import ServeConfig
from jax_routeweaver.serving.metrics import ServeMetrics
from jax_routeweaver.serving.router import RouterService


@dataclasses.dataclass
class Runtime:
    """A built service and what must be closed with it."""

    service: RouterService
    sampler: BatchingSampler
    pool: HttpWorkerPool
    sidecar: Any = None

    async def aclose(self) -> None:
        """Stop the sampler, close the worker pool and the sidecar (after the last request)."""
        try:
            await self.sampler.aclose()
            await self.pool.aclose()
        finally:
            if self.sidecar is not None:
                self.sidecar.close()


def serve_config(checkpoint: str | os.PathLike[str], channels: str | os.PathLike[str],
                 config: str | os.PathLike[str] | None = None,
                 overrides: Sequence[str] = ()) -> tuple[TrainConfig, Any]:
    """(the run config with the channel file as its pool, greedy; the resolved checkpoint).
    `config`: a training config to use instead of the checkpoint's run ``config.yaml``."""
    ckpt = resolve_checkpoint(checkpoint)
    cfg = load_train_config(checkpoint_config(checkpoint, config),
                            [*overrides, f"workers.pool={channels}"])
    if cfg.rollout.dialect != "routeweaver":
        raise ValueError(f"rollout.dialect={cfg.rollout.dialect!r}: serving runs RouteWeaver "
                         "routers (single, multi or agentic per request)")
    return greedy_config(cfg), ckpt


def build_runtime(cfg: TrainConfig, ckpt: Any, options: ServeConfig, *,
                  metrics: ServeMetrics | None = None, work_dir: Path | None = None,
                  check: bool = True) -> Runtime:
    """The service of `serve_config`'s result. `check`: check the pool first
    (`rl.run.pool_check.check_run_pool`, PoolCheckError naming the worker); `work_dir`: where a
    sidecar keeps its files (default: a ``serve`` directory next to the checkpoint)."""
    if check:
        check_run_pool(cfg)
    channels = load_channels(cfg.workers.pool)
    pool = HttpWorkerPool(channels, concurrency=cfg.workers.concurrency,
                          total_budget_s=options.worker_budget_s)
    router = load_router_sampler(cfg, ckpt, [], pool, options.max_batch,
                                 work_dir or Path(ckpt.path).parent / "serve")
    sampler = BatchingSampler(router.sampler, max_batch=options.max_batch,
                              on_batch=None if metrics is None else metrics.sampled)
    fallbacks = {c.worker: c.fallback for c in channels.channels if c.fallback is not None}
    service = RouterService(router.tokenizer, sampler, pool, env_config(cfg, router.eos),
                            channels.prices(), fallbacks=fallbacks)
    return Runtime(service, sampler, pool, router.sidecar)
