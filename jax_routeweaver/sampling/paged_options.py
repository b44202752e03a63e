"""The paged engine's options (`PagedConfig`) and the sizes derived from them: the page pool's
size in pages, the bytes a token's keys and values take, the compiled shapes' floors.

Both the engine (`paged_engine`) and the memory plan of a rollout (which lays out the pool as
the engine does) size things from here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import ATTENTIONS

MIN_WIDTH = 4           # smallest page-table width (pages per row) compiled
MIN_SLOTS = 8           # fewest decode slots one launch runs (fewer compiled sizes)
MIN_CHUNK = 16          # smallest prefill chunk compiled
PREFILL_TOKENS = 8192   # most tokens (rows x chunk) one prefill call runs
# With budget_tokens 0 on the CPU backend: the most the pool takes (bytes). A CPU device's
# "free memory" is the host's, shared with the trainer and every other process, and tiny CPU
# routers need little; a larger pool there takes budget_tokens.
CPU_POOL_BYTES = 512 * 2**20


@dataclasses.dataclass(frozen=True)
class PagedConfig:
    """The paged engine's settings (`rollout.paged` in a train config for the first four).

    Attributes:
        page_size: tokens per page (>= 1).
        budget_tokens: the pool's size in tokens (>= 0); 0: from `memory_fraction` of one
            device's free memory at start-up, capped at `max_rows` rows of the model's
            `max_position_embeddings` (on the CPU backend also at `CPU_POOL_BYTES`).
        memory_fraction: with `budget_tokens` 0, the share of one device's free memory the
            pool takes, in (0, 1].
        max_rows: decode slots: the most rows decoded at once (>= 1).
        steps_per_sync: decode steps on device between host checks (stop strings,
            admissions, retirements) (>= 1; calls with host grammars use 1).
        prefill_chunk: most tokens of one row per prefill call (>= 1).
        attention: the decode attention's path (`models.paged_attention`): "auto" (the
            Pallas kernel on TPU, portable elsewhere), "portable" (every backend), "pallas"
            (JAX's Pallas paged-attention kernel: TPU or GPU).
        pallas_interpret: run the Pallas kernel in Pallas's interpret mode, on any backend
            (slow: for checking the kernel path on CPU).
    """

    page_size: int = 16
    budget_tokens: int = 0
    memory_fraction: float = 0.5
    max_rows: int = 64
    steps_per_sync: int = 8
    prefill_chunk: int = 512
    attention: str = "auto"
    pallas_interpret: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_rows", "steps_per_sync", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"PagedConfig.{name}={getattr(self, name)} must be >= 1")
        if self.budget_tokens < 0:
            raise ValueError(f"PagedConfig.budget_tokens={self.budget_tokens} must be >= 0")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"PagedConfig.attention={self.attention!r} must be one of "
                             f"{', '.join(ATTENTIONS)}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"PagedConfig.memory_fraction={self.memory_fraction} must be in "
                             "(0, 1]")

    @classmethod
    def of(cls, section: Any) -> PagedConfig:
        """Options from None (defaults), a `PagedConfig`, or any object with some of its
        fields as attributes (a train config's `rollout.paged` section), the rest defaults."""
        if section is None or isinstance(section, cls):
            return section or cls()
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)
                      if hasattr(section, f.name)})


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


def kv_bytes_per_token(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of keys and values one token takes in every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(
        dtype or cfg.dtype).itemsize


def device_free_bytes(device: jax.Device) -> int | None:
    """Free memory of `device` (its allocator's limit minus what is in use), or the host's
    available memory for a CPU device without allocator stats; None if unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pool_pages(cfg: ModelConfig, options: PagedConfig, *, dtype: str | None = None,
               kv_shards: int = 1, device: jax.Device | None = None) -> int:
    """How many pages the pool gets: `budget_tokens`, or `memory_fraction` of `device`'s free
    memory (each device holds 1/`kv_shards` of every token; on a CPU device at most
    `CPU_POOL_BYTES`), capped at `max_rows` rows of `max_position_embeddings` tokens.
    ValueError naming the setting when not even one page."""
    if options.budget_tokens:
        tokens = options.budget_tokens
    else:
        device = device or jax.devices()[0]
        free = device_free_bytes(device)
        if free is None:
            raise ValueError("paged KV cache: the device's free memory is unknown; set "
                             "budget_tokens (rollout.paged.budget_tokens)")
        per_token = kv_bytes_per_token(cfg, dtype) / kv_shards
        share = options.memory_fraction * free
        if device.platform == "cpu":
            share = min(share, CPU_POOL_BYTES)
        tokens = min(int(share / per_token),
                     options.max_rows * cfg.max_position_embeddings)
    pages = tokens // options.page_size
    if pages < 1:
        raise ValueError(f"paged KV cache: budget_tokens={options.budget_tokens} (memory_fraction"
                         f"={options.memory_fraction}) gives {tokens} tokens, less than one "
                         f"page of page_size={options.page_size}")
    return pages
