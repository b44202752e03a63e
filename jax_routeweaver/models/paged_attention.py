"""Attention over a pool of fixed-size KV pages: the paged KV cache of `sampling.paged_engine`.

Keys and values of every sequence live in one pool of pages of `page_size` token slots. A
row's page table lists its pages in order: token position `pos` of row b sits in page
`page_table[b, pos // page_size]`, slot `pos % page_size`. Two rows may list the same page
(a shared prefix); only the host decides which pages a row owns, these functions only read
and write where the tables say.

Layout: `PagePool.k`, `.v` `[L, K, num_pages, page_size, H]`, kv heads before pages so that
one layer's pool `[K, num_pages, page_size, H]` is the layout of the Pallas TPU decode kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`) without a transpose. Shapes: B rows, T new
tokens per row, M pages per row (page-table width), S page size, N query heads, K kv heads,
H head_dim, L layers.

Two paths (`ATTENTIONS`, chosen by `attention_path`; `rollout.paged.attention`):

    portable  every backend, decode and prefill: gather the row's M pages, `[B, M * S, K,
              H]`, and run grouped-query attention with a mask built from positions (causal)
              and lengths (valid slots), the same arithmetic as `qwen3.attention` (fp32
              softmax, masked scores -1e30).
    pallas    decode (one query per row) through JAX's Pallas paged-attention kernel, which
              reads the pages in place (`decode_kernel`): the TPU kernel on TPU, the GPU
              kernel (Triton) on GPU; prefill stays portable (neither kernel takes more than
              one query per row). With `interpret`, the kernel runs in Pallas's interpret
              mode on any backend (the TPU kernel under `force_tpu_interpret_mode`): slow,
              for checking the kernel path on CPU.

"auto" is pallas on TPU and portable elsewhere. The TPU kernel (and its interpret mode)
multiplies in one bf16 pass, as TPU matrix units do at default precision: with fp32 pages it
differs from the portable path by about 5e-3; with bf16 pages (the engine's pool dtype on an
accelerator) by fp32 rounding only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jax_routeweaver.models.config import ModelConfig

_MASKED = -1e30  # a masked score: finite, so a row with no valid key stays NaN-free
ATTENTIONS = ("auto", "portable", "pallas")
Attention = Literal["auto", "portable", "pallas"]


class PagePool(NamedTuple):
    """k, v `[L, K, num_pages, page_size, H]`."""

    k: jax.Array
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The shape of `PagePool.k` (and `.v`) for `cfg`."""
    return (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


def init_pool(cfg: ModelConfig, num_pages: int, page_size: int,
              dtype: str | None = None) -> PagePool:
    """A zeroed pool of `num_pages` pages of `page_size` slots (dtype: `cfg.dtype` if None)."""
    shape = pool_shape(cfg, num_pages, page_size)
    dt = jnp.dtype(dtype or cfg.dtype)
    return PagePool(jnp.zeros(shape, dt), jnp.zeros(shape, dt))


def write_pages(pool_k: jax.Array, pool_v: jax.Array, layer: jax.Array | int, k: jax.Array,
                v: jax.Array, page_table: jax.Array, positions: jax.Array,
                valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new keys and values into the pool.

    pool_k, pool_v `[L, K, P, S, H]`; k, v `[B, T, K, H]`; page_table `[B, M]` int32;
    positions `[B, T]` int32 (each < M * S); valid `[B, T]` bool. Token (b, t) is written at
    `[layer, :, page_table[b, positions[b, t] // S], positions[b, t] % S]`; tokens not `valid`
    are dropped (no write at all). Returns the updated pools (in place under donation).
    """
    num_pages, size = pool_k.shape[2], pool_k.shape[3]
    page = jnp.take_along_axis(page_table, positions // size, axis=1)
    page = jnp.where(valid, page, num_pages)  # out of range: the scatter drops it
    slot = positions % size
    # layer, page, slot are advanced indices split by a slice: the update is [B, T, K, H].
    pool_k = pool_k.at[layer, :, page, slot].set(k.astype(pool_k.dtype), mode="drop")
    pool_v = pool_v.at[layer, :, page, slot].set(v.astype(pool_v.dtype), mode="drop")
    return pool_k, pool_v


def gather_pages(pool: jax.Array, layer: jax.Array | int, page_table: jax.Array) -> jax.Array:
    """One layer's keys (or values) of each row, in position order: pool `[L, K, P, S, H]`,
    page_table `[B, M]` -> `[B, M * S, K, H]` (slot i = position i of the row)."""
    pages = pool[layer, :, page_table]  # [B, M, K, S, H]
    B, M, K, S, H = pages.shape
    return pages.transpose(0, 1, 3, 2, 4).reshape(B, M * S, K, H)


def paged_attention(q: jax.Array, pool_k: jax.Array, pool_v: jax.Array,
                    layer: jax.Array | int, page_table: jax.Array, q_positions: jax.Array,
                    lengths: jax.Array, *, block: int = 512,
                    kernel: DecodeKernel | None = None) -> jax.Array:
    """Causal grouped-query attention of queries over their rows' pages.

    q `[B, T, N, H]` at `q_positions` `[B, T]`; pool_k, pool_v `[L, K, P, S, H]`; page_table
    `[B, M]`; lengths `[B]`: row b's keys are its positions `0 .. lengths[b] - 1` (written
    already, the queries' own included). Query (b, t) attends to row b's positions
    `<= q_positions[b, t]` and `< lengths[b]`; query head n uses kv head n // (N / K). Returns
    `[B, T, N, H]` in q's dtype. More than `block` queries run block by block (`lax.map`), so
    scores are `[B, N, block, M * S]` at a time. `kernel` (`decode_kernel`): with one query
    per row, attend through it instead (the pallas path).
    """
    B, T, N, H = q.shape
    if kernel is not None and T == 1:
        return kernel(q, pool_k[layer], pool_v[layer], page_table, lengths)
    k = gather_pages(pool_k, layer, page_table).astype(q.dtype)
    v = gather_pages(pool_v, layer, page_table).astype(q.dtype)
    key_pos = jnp.arange(k.shape[1])
    key_ok = key_pos[None, :] < lengths[:, None]  # [B, M * S]

    def attend(q_blk: jax.Array, pos_blk: jax.Array) -> jax.Array:
        mask = key_ok[:, None, :] & (key_pos[None, None, :] <= pos_blk[:, :, None])
        return grouped_attention(q_blk, k, v, mask)

    if block >= T:
        return attend(q, q_positions)
    pad = (-T) % block
    n = (T + pad) // block
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    ps = jnp.pad(q_positions, ((0, 0), (0, pad)), constant_values=-1)  # padding sees nothing
    qs = qs.reshape(B, n, block, N, H).swapaxes(0, 1)
    ps = ps.reshape(B, n, block).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: attend(*xs), (qs, ps))
    return out.swapaxes(0, 1).reshape(B, n * block, N, H)[:, :T]


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
                      ) -> jax.Array:
    """Masked grouped-query attention, the one arithmetic of the dense decoder
    (`qwen3.attention`) and the paged one: q `[B, T, N, H]`, k, v `[B, S, K, H]`, mask
    `[B, T, S]` -> `[B, T, N, H]`; scores `q k / sqrt(H)` in fp32, softmax, then in v's
    dtype."""
    B, T, N, H = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * H**-0.5, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(B, T, N, H)


DecodeKernel = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def attention_path(choice: str, backend: str, *, interpret: bool = False
                   ) -> Literal["portable", "pallas"]:
    """The path `choice` ("auto", "portable", "pallas") takes on `backend` ("cpu", "gpu",
    "tpu"): "auto" is pallas on TPU, portable elsewhere. ValueError for an unknown choice, or
    for pallas on a backend without a Pallas kernel (CPU) unless `interpret`."""
    if choice not in ATTENTIONS:
        raise ValueError(f"paged attention {choice!r} is not one of {', '.join(ATTENTIONS)}")
    if choice == "auto":
        return "pallas" if backend == "tpu" else "portable"
    if choice == "pallas" and backend not in ("tpu", "gpu") and not interpret:
        raise ValueError(f"paged attention 'pallas' needs a TPU or GPU backend (this one is "
                         f"{backend!r}); 'portable' runs everywhere")
    return choice  # type: ignore[return-value]


def decode_kernel(backend: str, *, interpret: bool = False) -> DecodeKernel:
    """Decode attention through JAX's Pallas paged-attention kernel: `(q [B, 1, N, H],
    k_pages, v_pages [K, P, S, H], page_table [B, M], lengths [B]) -> [B, 1, N, H]` in q's
    dtype. The GPU kernel on "gpu", else the TPU kernel; `interpret`: in Pallas's interpret
    mode (any backend). Neither kernel scales the scores, so q is scaled first; the TPU
    kernel processes `pages_per_compute_block` pages per step, the GPU kernel as many per block
    (the largest power of two <= 8 dividing M; its head blocks padded to 16)."""
    if backend == "gpu":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu

        def run(q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array,
                lengths: jax.Array) -> jax.Array:
            return gpu(q, k, v, table, lengths, pages_per_compute_block=_per_block(table),
                       k_splits=1, interpret=interpret)
    else:
        from jax.experimental.pallas import tpu as pltpu
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu

        def run(q: jax.Array, k: jax.Array, v: jax.Array, table: jax.Array,
                lengths: jax.Array) -> jax.Array:
            mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
            with mode:  # acts where the kernel is traced
                return tpu(q, k, v, lengths, table, pages_per_compute_block=_per_block(table))

    def decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
               lengths: jax.Array) -> jax.Array:
        scaled = (q[:, 0].astype(jnp.float32) * q.shape[-1] ** -0.5).astype(q.dtype)
        out = run(scaled, k_pages, v_pages, page_table.astype(jnp.int32),
                  lengths.astype(jnp.int32))
        return out[:, None].astype(q.dtype)

    return decode


def _per_block(page_table: jax.Array) -> int:
    """Pages per compute block: the largest power of two <= 8 dividing the table's width."""
    return max(b for b in (1, 2, 4, 8) if page_table.shape[1] % b == 0)
