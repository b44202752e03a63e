"""`routeweaver train --dry-run`: what a config would run, checked, without training.

:func:`dry_run` resolves the config and reports, on the machine it runs on:

* the devices JAX sees (this host's and all hosts') and the mesh the config asks for;
* the router's architecture (its HF ``config.json``, or the random-init fields);
* the per-device memory of one update and one logprob pass, compiled for these devices with
  abstract arrays (`planning.memory`) — on a TPU or GPU host this is the real compiler's analysis;
* the worker pool, checked as the run checks it before step 1 (`rl.run.pool_check`): every
  offered worker priced in the run's table (the channel file's prices, the original price table
  for the simulated pool, Router-R1's for a router_r1 run), and for a channel pool each
  offered worker's endpoint reachable (``GET {base_url}/models``) and serving its configured
  model name; an API key named by a channel must be set (its value is never printed or sent
  anywhere but that endpoint). A simulated pool's workers are listed only when one fails;
* an attached vLLM sidecar (``GET /health``);
* the inputs it would read: the data file, the HF model directory, the state
  ``checkpoint.init_from`` starts from.

Nothing is written and no worker is asked to generate.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import httpx
import jax
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.planning.memory import (
    GIB,
    HEADROOM,
    MemoryPlan,
    Target,
    config_shape,
    plan_config,
)
from jax_routeweaver.planning.rollout import RolloutSettings, RolloutShape, replica_dtype
from jax_routeweaver.planning.step import StepPlan, TrainFigures, step_plan
from jax_routeweaver.rl.run.builders import router_architecture
from jax_routeweaver.rl.run.checkpoint import StateCheckpointer
from jax_routeweaver.rl.run.pool_check import pool_checks
from jax_routeweaver.rl.run.train_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Check:
    """One endpoint or precondition: ``ok``, and what was seen."""

    what: str
    target: str
    ok: bool
    detail: str


def input_checks(cfg: TrainConfig) -> list[Check]:
    """The files the run reads before its first step (see the module docstring)."""
    checks = []
    if cfg.data.source != "synthetic":
        ok = Path(cfg.data.source).is_file()
        checks.append(Check("data.source", cfg.data.source, ok, "found" if ok else "no such file"))
    if cfg.model.init == "hf":
        ok = (Path(cfg.model.path) / "config.json").is_file()
        checks.append(Check("model.path", cfg.model.path, ok,
                            "HF directory" if ok else "no config.json there"))
    if cfg.checkpoint.init_from:
        step = None
        if Path(cfg.checkpoint.init_from).is_dir():  # (a manager would create a missing one)
            with StateCheckpointer(cfg.checkpoint.init_from, keep=None) as states:
                step = states.latest_step()
        checks.append(Check("checkpoint.init_from", cfg.checkpoint.init_from, step is not None,
                            f"full state at step {step}" if step is not None
                            else "no full train-state checkpoint (run the earlier arm first)"))
    return checks


def endpoint_checks(cfg: TrainConfig, *, timeout_s: float = 5.0,
                    env: dict[str, str] | None = None) -> list[Check]:
    """The worker pool's checks (`rl.run.pool_check.pool_checks`, the run's own: prices, keys,
    endpoints and served model names; a simulated pool's only when they fail) and the
    reachability of an attached vLLM sidecar (see the module docstring)."""
    env = dict(os.environ) if env is None else env
    simulated = cfg.workers.pool == "simulated"
    checks = [Check(c.worker, c.where, c.ok, c.detail)
              for c in pool_checks(cfg, timeout_s=timeout_s, env=env)
              if not (simulated and c.ok)]
    if cfg.rollout.sampler == "vllm" and cfg.rollout.vllm.url:
        checks.append(_get("vllm sidecar", f"{cfg.rollout.vllm.url.rstrip('/')}/health", {},
                           timeout_s))
    return checks


def _get(what: str, url: str, headers: dict[str, str], timeout_s: float) -> Check:
    try:
        r = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        return Check(what, url, False, f"unreachable ({type(e).__name__}: {e})")
    return Check(what, url, r.status_code < 400, f"HTTP {r.status_code}")


def dry_run(cfg: TrainConfig, console: Console, *, plan: bool = True,
            timeout_s: float = 5.0) -> bool:
    """Print what ``cfg`` would run here; returns whether every check passed."""
    devices = jax.devices()
    local = jax.local_devices()
    console.print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); "
                  f"this host: process {jax.process_index()} of {jax.process_count()}, "
                  f"{len(local)} local")
    mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), devices)
    shape = tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor"))
    console.print(f"mesh (data, fsdp, tensor): {shape}")
    arch, source = router_architecture(cfg)
    console.print(f"router: {arch.num_layers} layers, hidden {arch.hidden_size}, vocab "
                  f"{arch.vocab_size}, tied {arch.tie_word_embeddings} ({source}); params "
                  f"{cfg.model.param_dtype}, compute {cfg.model.dtype}, remat {cfg.model.remat}")
    console.print(f"run: {cfg.steps} steps x {cfg.data.batch_size} queries x "
                  f"{cfg.data.group_size} rollouts, sampler {cfg.rollout.sampler}, workers "
                  f"{cfg.workers.pool}, estimator {cfg.algo.estimator}, out_dir {cfg.out_dir}")
    ok = True
    if plan:
        memory = _device_memory_gib(devices[0])
        target = Target(f"{len(devices)} x {devices[0].device_kind}", len(devices),
                        memory or 0.0, shape,
                        kind="tpu" if devices[0].platform == "tpu" else "gpu",
                        hosts=jax.process_count())
        step = config_shape(cfg, rows_per_device=max(1, cfg.algo.loss.micro_batch_size
                                                     // max(1, shape[0] * shape[1])))
        p = plan_config(cfg, arch, target, step, devices=devices, remat=cfg.model.remat)
        whole = whole_step(cfg, arch, target, p)
        phases = {k: f"{v / GIB:.1f}" for k, v in whole.phases.items()}
        need = (f"{whole.need / GIB:.1f} GiB per device (update {phases['update']}, reference "
                f"pass {phases['reference']}, rollout {phases['rollout']} with "
                f"{cfg.rollout.sampler}: {whole.settings.label()}; programs: update "
                f"{p.update.peak / GIB:.1f}, logprobs {p.logprobs.peak / GIB:.1f})")
        if memory:
            fits = whole.need <= memory * GIB * (1 - HEADROOM) and whole.rollout.holds_a_row
            ok &= fits
            console.print(f"memory: {need} of {memory:.1f} GiB: "
                          f"{'fits' if fits else 'DOES NOT FIT'} (with {HEADROOM:.0%} headroom)")
        else:
            console.print(f"memory: {need} (this backend reports no device memory limit)")
    checks = input_checks(cfg) + endpoint_checks(cfg, timeout_s=timeout_s)
    if checks:
        table = Table("input / endpoint", "where", "ok", "detail")
        for c in checks:
            table.add_row(escape(c.what), escape(c.target), "yes" if c.ok else "NO",
                          escape(c.detail))
        console.print(table)
        for c in checks:  # whole, unwrapped lines: what failed, where, and why
            if not c.ok:
                console.print(f"FAILED {c.what} ({c.target}): {c.detail}", markup=False,
                              highlight=False, soft_wrap=True)
        ok &= all(c.ok for c in checks)
    else:
        console.print("endpoints: none (simulated workers, in-process sampler)")
    console.print("dry run: all checks passed" if ok else "dry run: some checks FAILED")
    return ok


def whole_step(cfg: TrainConfig, arch: ModelConfig, target: Target,
               plan: MemoryPlan) -> StepPlan:
    """The whole step (`planning.step`) of ``plan`` with ``cfg``'s rollout engine."""
    return step_plan(target, TrainFigures.of(plan), RolloutSettings.of_config(cfg),
                     arch.replace(dtype=cfg.model.dtype),
                     RolloutShape.of_config(cfg, target.hosts), replica_dtype(cfg))


def _device_memory_gib(device: Any) -> float | None:
    """The device's memory limit in GiB from its allocator, None where unknown (CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without allocator stats raise
        return None
    limit = stats.get("bytes_limit")
    return limit / GIB if limit else None
