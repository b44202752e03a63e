"""Qwen3 decoder in flax.nnx, and the architectures that differ from it only in the attention
(`ModelConfig.qk_norm`, `qkv_bias`): Qwen2 (no q/k-norm; biases on q_proj, k_proj and v_proj)
and Llama (no q/k-norm, no biases).

Parameters are stored stacked over layers (leading `layers` axis) whatever `scan_layers` says:
`scan_layers=True` runs them with `lax.scan` (compile time independent of depth), False unrolls a
Python loop over the same arrays. Every parameter carries `logical_axes` metadata that
`models/sharding.py` maps to mesh axes.

Shapes: B batch, T new tokens, S cache slots, D hidden, N query heads, K kv heads, H head_dim,
F intermediate, V vocab, L layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import (
    DecodeKernel,
    PagePool,
    grouped_attention,
    paged_attention,
    write_pages,
)


class KVCache(NamedTuple):
    """Decode cache. k, v `[L, B, S, K, H]`; valid `[B, S]` (slot holds a real token);
    index `[]` int32: the next slot to write (shared by the batch: prompts are left-padded)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    index: jax.Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
    """An empty cache for `batch` sequences of at most `max_len` slots."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return KVCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt),
                   jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))


def _param(init: Callable, key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype,
           axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(init(key, shape, dtype), logical_axes=axes)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading `layers` axis. `q_norm`, `k_norm`
    `[L, H]` exist only with `qk_norm`; `q_bias` `[L, N, H]`, `k_bias`, `v_bias` `[L, K, H]`
    only with `qkv_bias`, each sharded as the output dims of its projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, D, N, K, H, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                            cfg.head_dim, cfg.intermediate_size)
        pd = jnp.dtype(cfg.param_dtype)
        normal = nnx.initializers.normal(0.02)
        ones = nnx.initializers.ones
        self.attn_norm = _param(ones, rngs.params(), (L, D), pd, ("layers", "norm"))
        self.q_proj = _param(normal, rngs.params(), (L, D, N, H), pd,
                             ("layers", "embed", "q_heads", "head_dim"))
        self.k_proj = _param(normal, rngs.params(), (L, D, K, H), pd,
                             ("layers", "embed", "kv_heads", "head_dim"))
        self.v_proj = _param(normal, rngs.params(), (L, D, K, H), pd,
                             ("layers", "embed", "kv_heads", "head_dim"))
        self.o_proj = _param(normal, rngs.params(), (L, N, H, D), pd,
                             ("layers", "q_heads", "head_dim", "embed"))
        if cfg.qk_norm:
            self.q_norm = _param(ones, rngs.params(), (L, H), pd, ("layers", "head_norm"))
            self.k_norm = _param(ones, rngs.params(), (L, H), pd, ("layers", "head_norm"))
        if cfg.qkv_bias:
            zeros = nnx.initializers.zeros
            self.q_bias = _param(zeros, rngs.params(), (L, N, H), pd,
                                 ("layers", "q_heads", "head_dim"))
            self.k_bias = _param(zeros, rngs.params(), (L, K, H), pd,
                                 ("layers", "kv_heads", "head_dim"))
            self.v_bias = _param(zeros, rngs.params(), (L, K, H), pd,
                                 ("layers", "kv_heads", "head_dim"))
        self.mlp_norm = _param(ones, rngs.params(), (L, D), pd, ("layers", "norm"))
        self.gate_proj = _param(normal, rngs.params(), (L, D, F), pd, ("layers", "embed", "mlp"))
        self.up_proj = _param(normal, rngs.params(), (L, D, F), pd, ("layers", "embed", "mlp"))
        self.down_proj = _param(normal, rngs.params(), (L, F, D), pd, ("layers", "mlp", "embed"))

    def arrays(self) -> dict[str, jax.Array]:
        """Current values of the stacked weights, by name (traced under nnx transforms)."""
        return {name: value[...] for name, value in vars(self).items()
                if isinstance(value, nnx.Param)}


class Qwen3(nnx.Module):
    """Causal LM. `__call__` gives fp32 logits; `hidden_states` + `logits` split it so callers
    can compute per-token logprobs in chunks (`token_logprobs`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        pd = jnp.dtype(cfg.param_dtype)
        normal = nnx.initializers.normal(0.02)
        self.embed = _param(normal, rngs.params(), (cfg.vocab_size, cfg.hidden_size), pd,
                            ("vocab", "embed"))
        self.layers = DecoderLayers(cfg, rngs)
        self.final_norm = _param(nnx.initializers.ones, rngs.params(), (cfg.hidden_size,), pd,
                                 ("norm",))
        self.lm_head = nnx.data(None if cfg.tie_word_embeddings else _param(
            normal, rngs.params(), (cfg.hidden_size, cfg.vocab_size), pd, ("embed", "vocab")))

    def __call__(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                 cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions, attention_mask `[B, T]` -> (logits `[B, T, V]` fp32, cache)."""
        hidden, cache = self.hidden_states(tokens, positions, attention_mask, cache)
        return self.logits(hidden), cache

    def head_weight(self) -> jax.Array:
        """The output projection `[D, V]` (the embedding transposed when tied)."""
        if self.lm_head is None:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden `[..., D]` -> logits `[..., V]` in fp32."""
        w = self.head_weight().astype(hidden.dtype)
        return jnp.einsum("...d,dv->...v", hidden, w,
                          preferred_element_type=jnp.float32).astype(jnp.float32)

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                      cache: KVCache | None = None, *,
                      batch_sharding: jax.sharding.Sharding | None = None,
                      empty_cache: bool = False, gather: jax.Array | None = None
                      ) -> tuple[jax.Array, KVCache | None]:
        """Final-normed hidden states `[B, T, D]` (compute dtype) and the updated cache.

        Without a cache, token i attends to tokens j <= i with attention_mask[j] = 1 (left or
        right padding). With a cache, the T tokens are written at slots `index .. index+T` and
        attend to every earlier valid slot; `index` advances by T. `empty_cache`: the caller
        guarantees a fresh cache (index 0, no valid slot), so a prefill attends among its own
        T tokens as without a cache (causal blocks, no reads of empty slots). `batch_sharding`: the
        `[B, T, D]` activations are constrained to it at every layer boundary (rows over the
        batch axes): with FSDP, weights and rows are split over the same mesh axis, and
        without the constraint XLA may gather the rows instead of the weights.

        `gather [B, P]` (indices into T): only the hidden states at those positions,
        `[B, P, D]`. The last layer then runs its queries, output projection and MLP at the P
        positions alone, since the others reach it only through its keys and values (the same
        values as the full pass, up to float summation order): for an RL row whose few
        policy tokens follow long observations, or a prefill that samples from its last
        position, that is a layer's worth of work less. With `remat_groups` > 1 (which
        never divides both L and L - 1) the full pass runs and is gathered after.
        """
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        T = tokens.shape[1]
        attention_mask = attention_mask.astype(bool)
        constrain = (lambda a: a) if batch_sharding is None else (
            lambda a: jax.lax.with_sharding_constraint(a, batch_sharding))
        x = constrain(jnp.take(self.embed[...], tokens, axis=0).astype(dt))
        inv_freq, rope_scale = cfg.rope_inv_freq()
        cos, sin = rope_tables(positions, jnp.asarray(inv_freq), rope_scale)
        self_attention = cache is None or empty_cache
        if cache is None:
            start = None
        else:
            start = cache.index
            valid = jax.lax.dynamic_update_slice(cache.valid, attention_mask, (0, start))
        if self_attention:
            mask = AttentionMask(attention_mask, jnp.arange(T), jnp.arange(T))
        else:
            mask = AttentionMask(valid, start + jnp.arange(T), jnp.arange(cache.k.shape[2]))

        L, groups = cfg.num_layers, cfg.remat_groups

        # The whole cache rides in the carry and each layer updates its slice in place, so a
        # decode step writes T new slots instead of rebuilding the [L, B, S, K, H] cache.
        def layer(carry: tuple, xs: tuple, gather: jax.Array | None = None
                  ) -> tuple[tuple, None]:
            x, ck, cv = carry
            p, index = xs
            x, ck, cv = decoder_layer(cfg, p, x, cos, sin, mask, ck, cv, start, index,
                                      self_attention=self_attention, gather=gather)
            return (constrain(x), ck, cv), None

        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=_REMAT[cfg.remat])
        weights = self.layers.arrays()
        carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
        if gather is not None and groups == 1:
            carry = _run_layers(layer, carry, (jax.tree.map(lambda a: a[:-1], weights),
                                               jnp.arange(L - 1)), L - 1, 1, cfg.scan_layers)
            carry, _ = layer(carry, (jax.tree.map(lambda a: a[-1], weights), L - 1), gather)
        else:
            carry = _run_layers(layer, carry, (weights, jnp.arange(L)), L, groups,
                                cfg.scan_layers)
            if gather is not None:
                carry = (_take_rows(carry[0], gather), *carry[1:])
        x, ks, vs = carry
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        if cache is not None:
            cache = KVCache(ks, vs, valid, start + T)
        return x, cache

    def hidden_states_paged(self, tokens: jax.Array, positions: jax.Array, pool: PagePool,
                            page_table: jax.Array, lengths: jax.Array,
                            valid: jax.Array | None = None, *, gather: jax.Array | None = None,
                            kernel: DecodeKernel | None = None
                            ) -> tuple[jax.Array, PagePool]:
        """The decoder over a paged KV cache (`models.paged_attention`): final-normed hidden
        states `[B, T, D]` (`[B, P, D]` with `gather`) and the updated pool.

        tokens, positions `[B, T]` (each row's own positions, no padding between them);
        pool k, v `[L, K, num_pages, S, H]`; page_table `[B, M]`; lengths `[B]`: each row's
        cache length once these tokens are written (they attend to positions < lengths[b],
        causally). `valid [B, T]` (default all): tokens to write; the others (padding, idle
        rows) write nothing and their outputs are garbage. Same layers, rope and norms as
        `hidden_states` (`layer_qkv`, `layer_output`), so a prompt run here gives the hidden
        states a dense cache gives, up to float summation order. `gather [B, P]`: the last
        layer's queries and MLP only there (see `hidden_states`). `kernel`: the Pallas decode
        attention (`paged_attention.decode_kernel`), or None: the portable path."""
        cfg = self.config
        dt = jnp.dtype(cfg.dtype)
        if valid is None:
            valid = jnp.ones(tokens.shape, bool)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        inv_freq, rope_scale = cfg.rope_inv_freq()
        cos, sin = rope_tables(positions, jnp.asarray(inv_freq), rope_scale)

        def layer(carry: tuple, xs: tuple, gather: jax.Array | None = None
                  ) -> tuple[tuple, None]:
            x, pk, pv = carry
            p, index = xs
            q, k, v, x = layer_qkv(cfg, p, x, cos, sin, gather)
            pk, pv = write_pages(pk, pv, index, k, v, page_table, positions, valid)
            q_pos = positions if gather is None else _take_rows(positions, gather)
            out = paged_attention(q, pk, pv, index, page_table, q_pos, lengths,
                                  block=cfg.attention_block, kernel=kernel)
            return (layer_output(cfg, p, x, out), pk, pv), None

        weights = self.layers.arrays()
        L = cfg.num_layers
        carry = (x, pool.k, pool.v)
        if gather is not None:
            carry = _run_layers(layer, carry, (jax.tree.map(lambda a: a[:-1], weights),
                                               jnp.arange(L - 1)), L - 1, 1, cfg.scan_layers)
            carry, _ = layer(carry, (jax.tree.map(lambda a: a[-1], weights), L - 1), gather)
        else:
            carry = _run_layers(layer, carry, (weights, jnp.arange(L)), L, 1, cfg.scan_layers)
        x, pk, pv = carry
        return rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), PagePool(pk, pv)


def _run_layers(layer: Callable, carry: tuple, xs: tuple, num_layers: int, groups: int,
                scan: bool) -> tuple:
    """Apply `layer(carry, xs[i]) -> (carry, None)` for i < num_layers, as `lax.scan` or an
    unrolled loop. With `groups` G > 1 the layers run as G groups of L/G, each group one
    `jax.checkpoint` that saves only its input: the backward pass recomputes a group's forward
    and then holds that group's L/G layer inputs, so G + L/G residual streams live at once
    instead of L (Levanter's nested scan)."""
    size = num_layers // groups

    def run(carry: tuple, xs: tuple) -> tuple:
        if scan:
            return jax.lax.scan(layer, carry, xs)[0]
        for i in range(size):
            carry, _ = layer(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        return carry

    if groups == 1:
        return run(carry, xs)
    grouped = jax.tree.map(lambda a: a.reshape(groups, size, *a.shape[1:]), xs)
    group = jax.checkpoint(lambda c, g: (run(c, g), None),
                           policy=jax.checkpoint_policies.nothing_saveable)
    return _run_layers(group, carry, grouped, groups, 1, scan)


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) computed in fp32, cast back, then scaled (the HF Qwen3/Llama order)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array,
                scale: float) -> tuple[jax.Array, jax.Array]:
    """positions `[B, T]` -> cos, sin `[B, T, H]` (fp32), HF's half-split layout."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x `[B, T, heads, H]`; rotate pairs (i, i + H/2) by the position angle."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


class AttentionMask(NamedTuple):
    """Query t may attend key s iff ``kv_valid[b, s]`` and ``k_slot[s] <= q_slot[t]``
    (causal over slots, padding from ``kv_valid``). kv_valid `[B, S]`, q_slot `[T]` (or
    `[B, T]`: each row's queries at their own slots), k_slot `[S]`; kept factored so long
    sequences never hold a `[B, T, S]` mask."""

    kv_valid: jax.Array
    q_slot: jax.Array
    k_slot: jax.Array

    def dense(self) -> jax.Array:
        """`[B, T, S]` bool."""
        causal = self.k_slot <= self.q_slot[..., None]
        return self.kv_valid[:, None, :] & (causal if causal.ndim == 3 else causal[None])

    def at_queries(self, gather: jax.Array) -> AttentionMask:
        """The mask of the queries at `gather [B, P]` (indices into T): q_slot `[B, P]`."""
        return self._replace(q_slot=self.q_slot[gather])


def _take_rows(x: jax.Array, gather: jax.Array) -> jax.Array:
    """x `[B, T, ...]` at `gather [B, P]` -> `[B, P, ...]`."""
    index = gather.reshape(*gather.shape, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, index, axis=1)


ATTENTION_BLOCK = 512
"""Default queries per block when a sequence is longer (`ModelConfig.attention_block`):
scores are `[B, N, block, S]` at a time (rematerialised in the backward pass) instead of
`[B, N, T, S]`."""
CAUSAL_PARTS = 1
"""Default `ModelConfig.causal_parts` of self-attention (1: every block reads every key)."""


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask | jax.Array,
              block: int = ATTENTION_BLOCK, *, self_attention: bool = False,
              causal_parts: int = CAUSAL_PARTS) -> jax.Array:
    """Grouped-query attention. q `[B, T, N, H]`, k, v `[B, S, K, H]`, mask an
    `AttentionMask` (or a dense `[B, T, S]` bool). Query head n uses kv head n // (N/K), as
    HF's `repeat_kv`. Softmax in fp32. Longer than `block` queries, it runs block by block
    under `jax.checkpoint`, so memory is linear in T for a fixed S.

    `self_attention`: the caller guarantees q and k are the same T positions in order
    (`q_slot = k_slot = arange(T)`, no cache), so with `causal_parts` P > 1 a query reads no
    key past its own part of the sequence (`_causal_blocks`): (P + 1) / 2P of the score FLOPs
    and softmax work (0.56 for 8 parts)."""
    T = q.shape[1]
    if not isinstance(mask, AttentionMask):
        return grouped_attention(q, k, v, mask)
    if block >= T:
        return grouped_attention(q, k, v, mask.dense())
    if self_attention and causal_parts > 1:
        return _causal_blocks(q, k, v, mask, block, causal_parts)
    return _mapped_blocks(q, k, v, mask, block)


def _mapped_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                   block: int) -> jax.Array:
    """Query blocks one after another (`lax.map`), each reading every key in k, v, each
    rematerialised in the backward pass."""
    T = q.shape[1]
    pad = (-T) % block
    qs = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    # Padded queries get slot -1: they see no key, and are cut off below.
    slots = jnp.pad(mask.q_slot, [(0, 0)] * (mask.q_slot.ndim - 1) + [(0, pad)],
                    constant_values=-1)
    n = (T + pad) // block
    qs = qs.reshape(q.shape[0], n, block, *q.shape[2:]).swapaxes(0, 1)
    slots = slots.reshape(*slots.shape[:-1], n, block)
    slots = slots if slots.ndim == 2 else slots.swapaxes(0, 1)  # [n, (B,) block]

    @jax.checkpoint
    def one(q_blk: jax.Array, slot_blk: jax.Array) -> jax.Array:
        block_mask = AttentionMask(mask.kv_valid, slot_blk, mask.k_slot).dense()
        return grouped_attention(q_blk, k, v, block_mask)

    out = jax.lax.map(lambda xs: one(*xs), (qs, slots))
    return out.swapaxes(0, 1).reshape(q.shape[0], n * block, *q.shape[2:])[:, :T]


def _causal_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                   block: int, causal_parts: int) -> jax.Array:
    """Self-attention with the query blocks split into up to `causal_parts` consecutive parts;
    each part is a `_mapped_blocks` over the key prefix its last query can see. XLA gives
    each part's loop its own buffers, so one block's scores are held once per part (about
    (P + 1) / 2 times the memory of one loop over all blocks); unrolled block by block
    instead, it overlaps every block's scores."""
    T = q.shape[1]
    n = -(-T // block)
    parts = min(n, causal_parts)
    bounds = [round(i * n / parts) * block for i in range(parts + 1)]
    outs = []
    for start, end in itertools.pairwise(bounds):
        end = min(end, T)
        part = AttentionMask(mask.kv_valid[:, :end], mask.q_slot[start:end], mask.k_slot[:end])
        outs.append(_mapped_blocks(q[:, start:end], k[:, :end], v[:, :end], part, block))
    return jnp.concatenate(outs, axis=1)


def decoder_layer(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
                  sin: jax.Array, mask: AttentionMask | jax.Array, cache_k: jax.Array | None,
                  cache_v: jax.Array | None, start: jax.Array | None, layer: jax.Array | int = 0,
                  *, self_attention: bool = False, gather: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """One pre-norm block on x `[B, T, D]`; p holds one layer's weights (no `layers` axis).

    With a cache (all layers, `[L, B, S, K, H]`), k/v are written at `[layer, :, start:start+T]`
    and attention reads that layer's slots, unless `self_attention` (no cache, or a fresh
    one): then the T tokens attend among themselves under `mask`'s causal order.
    `gather [B, P]`: keys and values at all T positions, everything else (queries, attention,
    MLP) only at these; returns x `[B, P, D]` there (`mask` must be an `AttentionMask`).
    """
    dt = x.dtype
    q, k, v, x = layer_qkv(cfg, p, x, cos, sin, gather)
    if gather is not None:
        mask = mask.at_queries(gather)
    if cache_k is not None:
        at = (layer, 0, start, 0, 0)
        cache_k = jax.lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), at)
        cache_v = jax.lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), at)
        if not self_attention:
            k = jax.lax.dynamic_index_in_dim(cache_k, layer, keepdims=False).astype(dt)
            v = jax.lax.dynamic_index_in_dim(cache_v, layer, keepdims=False).astype(dt)
    out = attention(q, k, v, mask, cfg.attention_block,
                    self_attention=self_attention and gather is None,
                    causal_parts=cfg.causal_parts)
    return layer_output(cfg, p, x, out), cache_k, cache_v


def layer_qkv(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array, cos: jax.Array,
              sin: jax.Array, gather: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A layer's attention inputs from x `[B, T, D]`: q `[B, P, N, H]`, k, v `[B, T, K, H]`
    (biased with `qkv_bias`, then normed with `qk_norm`, then rotated by `cos`, `sin`
    `[B, T, H]`) and the residual x `[B, P, D]`; P = T, or the positions `gather [B, P]` picks
    (queries and residual only there). Shared by the dense and the paged decoder."""
    dt = x.dtype  # the weights' compute dtype: the residual stream's, not the norm's output
    eps = cfg.rms_norm_eps
    h = rms_norm(x, p["attn_norm"], eps)
    k = _project(h, p, "k", cfg.qkv_bias, dt)
    v = _project(h, p, "v", cfg.qkv_bias, dt)
    if gather is not None:
        h, x = _take_rows(h, gather), _take_rows(x, gather)
        q_cos, q_sin = _take_rows(cos, gather), _take_rows(sin, gather)
    else:
        q_cos, q_sin = cos, sin
    q = _project(h, p, "q", cfg.qkv_bias, dt)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], eps)
        k = rms_norm(k, p["k_norm"], eps)
    q, k = apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin)
    return q, k, v, x


def _project(h: jax.Array, p: dict[str, jax.Array], name: str, bias: bool,
             dt: jnp.dtype) -> jax.Array:
    """h `[B, T, D]` through `p[name + "_proj"]` `[D, heads, H]` (cast to `dt`) ->
    `[B, T, heads, H]`, plus `p[name + "_bias"]` `[heads, H]` when `bias` (HF's Linear:
    x W^T + b)."""
    out = jnp.einsum("btd,dnh->btnh", h, p[f"{name}_proj"].astype(dt))
    return out + p[f"{name}_bias"].astype(dt) if bias else out


def layer_output(cfg: ModelConfig, p: dict[str, jax.Array], x: jax.Array,
                 out: jax.Array) -> jax.Array:
    """The rest of a layer: residual x `[B, P, D]` + o_proj(attention `out` `[B, P, N, H]`),
    then the MLP block."""
    dt = x.dtype
    x = x + jnp.einsum("btnh,nhd->btd", out, p["o_proj"].astype(dt))
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", h, p["gate_proj"].astype(dt))
    up = jnp.einsum("btd,df->btf", h, p["up_proj"].astype(dt))
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["down_proj"].astype(dt))


def token_logprobs(model: Qwen3, tokens: jax.Array, positions: jax.Array,
                   attention_mask: jax.Array, *, temperature: float = 1.0,
                   chunk_size: int | None = None, with_entropy: bool = False,
                   batch_sharding: jax.sharding.Sharding | None = None
                   ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-token logprobs `[B, T]` fp32: out[:, t] = log softmax(logits[:, t-1] / temperature)
    [tokens[:, t]], out[:, 0] = 0. Never materialises `[B, T, V]` (see `chunked_logprobs`).
    `with_entropy`: also the entropy `[B, T]` of the distribution token t was drawn from
    (same alignment, 0 at t = 0). `batch_sharding`: see `Qwen3.hidden_states`."""
    hidden, _ = model.hidden_states(tokens, positions, attention_mask,
                                    batch_sharding=batch_sharding)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    out = chunked_logprobs(hidden, model.head_weight(), targets, temperature=temperature,
                           chunk_size=chunk_size or model.config.logprob_chunk,
                           with_entropy=with_entropy,
                           batch_shards=_row_shards(batch_sharding, hidden.shape))
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    return tuple(shift(x) for x in out) if with_entropy else shift(out)


def gathered_logprobs(model: Qwen3, tokens: jax.Array, positions: jax.Array,
                      attention_mask: jax.Array, index: jax.Array, *, temperature: float = 1.0,
                      chunk_size: int | None = None, with_entropy: bool = False,
                      batch_sharding: jax.sharding.Sharding | None = None
                      ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Logprobs `[B, P]` of the tokens at `index [B, P]` (each >= 1): out[b, j] =
    log softmax(logits[b, index[b, j] - 1] / temperature)[tokens[b, index[b, j]]].

    The head, and the last layer's queries and MLP (`Qwen3.hidden_states`' `gather`), run
    only at the gathered positions: an RL row's policy tokens are a small part of its
    prompt + observations, and the `[*, V]` head dominates a small model's cost.
    `with_entropy`: also the entropies `[B, P]` of those distributions. `batch_sharding`: see
    `Qwen3.hidden_states`."""
    prev = jnp.maximum(index - 1, 0)
    h, _ = model.hidden_states(tokens, positions, attention_mask,
                               batch_sharding=batch_sharding, gather=prev)
    targets = jnp.take_along_axis(tokens, index, axis=1)
    return chunked_logprobs(h, model.head_weight(), targets, temperature=temperature,
                            chunk_size=chunk_size or model.config.logprob_chunk,
                            with_entropy=with_entropy,
                            batch_shards=_row_shards(batch_sharding, h.shape))


def choice_logprobs(model: Qwen3, tokens: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, index: jax.Array, options: jax.Array, *,
                    temperature: float = 1.0,
                    batch_sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """Logprobs `[B, P]` of the tokens at `index [B, P]` when the sampler could only pick among
    `options [B, P, A]` (token ids, -1 = no option; the target must be one of them):
    out[b, j] = l[target] - logsumexp(l[options]), l = logits at `index - 1` / temperature.

    This is the distribution a grammar-constrained sampler draws from (the full-vocabulary
    log-sum-exp cancels); a position with one option (a forced token) gets 0. Only the `A`
    option columns of the head are used, never `[*, V]` logits."""
    prev = jnp.maximum(index - 1, 0)
    h, _ = model.hidden_states(tokens, positions, attention_mask,
                               batch_sharding=batch_sharding, gather=prev)  # [B, P, D]
    w = model.head_weight().astype(h.dtype)  # [D, V]
    targets = jnp.take_along_axis(tokens, index, axis=1)
    picked = jnp.einsum("bpd,dbp->bp", h, jnp.take(w, targets, axis=1),
                        preferred_element_type=jnp.float32) / temperature
    logits = jnp.einsum("bpd,dbpa->bpa", h, jnp.take(w, jnp.maximum(options, 0), axis=1),
                        preferred_element_type=jnp.float32) / temperature
    logits = jnp.where(options >= 0, logits, -jnp.inf)
    return picked - jax.nn.logsumexp(logits, axis=-1)


def _row_shards(sharding: jax.sharding.Sharding | None, shape: tuple[int, ...]) -> int:
    """How many pieces `sharding` cuts the row axis of `shape` into (1 without one)."""
    return 1 if sharding is None else shape[0] // sharding.shard_shape(shape)[0]


def chunked_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *,
                     temperature: float = 1.0, chunk_size: int = 512,
                     with_entropy: bool = False, batch_shards: int = 1
                     ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log softmax(hidden @ head / temperature)[targets], `[B, T]` fp32, chunk by chunk,
    as (h . head[:, target]) / temperature - logsumexp(h @ head / temperature).
    `with_entropy`: also the entropy `-Σ p log p` of each position's distribution.

    hidden `[B, T, D]`, head `[D, V]`, targets `[B, T]`. Chunks run along T with every row
    at once (`[B, c, V]` logits, c = `chunk_size` / rows per shard), so rows split over
    `batch_shards` devices stay split and each device holds about `chunk_size` positions'
    logits. Each chunk is rematerialised in the backward pass.
    """
    B, T, D = hidden.shape
    rows_per_shard = max(1, B // max(1, batch_shards))
    c = max(1, min(T, chunk_size // rows_per_shard))
    pad = (-T) % c
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    n = (T + pad) // c
    hs = hidden.reshape(B, n, c, D).swapaxes(0, 1)  # [n, B, c, D]
    ts = targets.reshape(B, n, c).swapaxes(0, 1)  # [n, B, c]
    w = head.astype(hidden.dtype)

    @jax.checkpoint
    def one(h: jax.Array, t: jax.Array) -> jax.Array | tuple[jax.Array, jax.Array]:
        logits = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=jnp.float32)
        # The target logit straight from its weight column: the backward pass then needs no
        # scatter into a [B, c, V] one-hot (measured 1.5x faster on CPU than take_along_axis).
        picked = jnp.einsum("bcd,dbc->bc", h, jnp.take(w, t, axis=1),
                            preferred_element_type=jnp.float32)
        scaled = logits / temperature
        lse = jax.nn.logsumexp(scaled, axis=-1)
        if not with_entropy:
            return picked / temperature - lse
        probs = jnp.exp(scaled - lse[..., None])
        return picked / temperature - lse, lse - (probs * scaled).sum(-1)

    out = jax.lax.map(lambda ht: one(*ht), (hs, ts))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * c)[:, :T]
    return tuple(unchunk(x) for x in out) if with_entropy else unchunk(out)
