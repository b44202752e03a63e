"""The dense path's compiled programs and the layout of their arrays on a mesh.

`DenseSteps` (mixed into `JaxSampler`) holds the programs `JaxSampler` jits: a prefill of
padded prompts into a fresh `[L, B, P + N, K, H]` cache, a copy of stored rows' prefix columns
(`prefix_cache`), a prefill of the last columns on top of copied ones, and the decode loop
(one `lax.while_loop` on device that exits once every row is done). Each counts its traces in
`trace_count`. Around them, the placement helpers put parameters, batch arrays and the loop's
carry where the sharding rules say (everything unsharded without a mesh).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jax_routeweaver.models.qwen3 import KVCache, Qwen3, init_cache
from jax_routeweaver.models.sharding import ShardingError, logical_to_spec
from jax_routeweaver.sampling.decode_step import pick_next, step_masks

FlatParams = dict[tuple[Any, ...], jax.Array]


class DecodeState(NamedTuple):
    """Carry of the decode loop (B batch bucket, N new-token bucket, V vocab)."""

    cache: KVCache
    logits: jax.Array       # [B, V] fp32: the model's logits for the next token
    tokens: jax.Array       # [B, N] int32: sampled tokens (pad_id once a row is done)
    logprobs: jax.Array     # [B, N] fp32 (0 once a row is done)
    lengths: jax.Array      # [B] int32: tokens generated so far per row
    prompt_lens: jax.Array  # [B] int32: real prompt tokens = position of generated token 0
    done: jax.Array         # [B] bool
    stopped: jax.Array      # [B] bool: ended by a stop token
    node: jax.Array         # [B] int32: each row's trie node (choice decoding; -1 = none)
    step: jax.Array         # [] int32: sampling steps taken (rows advance in lockstep)


class SampleArgs(NamedTuple):
    """Runtime (traced, not static) sampling knobs."""

    temperature: jax.Array  # [] fp32, > 0 (greedy is a static flag instead)
    top_k: jax.Array        # [] int32, <= 0 = off
    top_p: jax.Array        # [] fp32 in (0, 1]
    max_new: jax.Array      # [] int32
    stop_ids: jax.Array     # [S] int32, padded with -1
    key: jax.Array          # PRNG key of the call
    rows: jax.Array         # [B] int32: each row's index in the call; row r's draw at step t
                            # uses fold_in(fold_in(key, r), t), whatever its group or slot
    allowed: jax.Array      # [B, W] int32 grammar bitmask ([1, 1] dummy unless "mask")
    choice_token: jax.Array  # [S, C] int32 `ChoiceTables.token` ([1, 1] dummy unless "choice")
    choice_child: jax.Array  # [S, C] int32 `ChoiceTables.child`
    choice_stop: jax.Array   # [S] bool `ChoiceTables.stop_ok`
    choice_end: jax.Array    # [S] bool `ChoiceTables.ends`


class DenseSteps:
    """The compiled steps and the placement helpers of `JaxSampler`'s dense path (a mixin).

    The class that mixes it in sets `config` (the model's), `trace_count`, `_graphdef`,
    `_pad_id`, `_cache_dtype`, `_mesh` (None: one device), `_rules` and `_specs` (the
    parameters' partition specs on the mesh), and jits the `_*_impl` methods.
    """

    # ------------------------------------------------------------------ placement
    def _usable_batch_buckets(self, buckets: tuple[int, ...]) -> tuple[int, ...]:
        shards = self._batch_shards()
        usable = tuple(b for b in buckets if b % shards == 0)
        if not usable:
            raise ValueError(f"batch_buckets={buckets}: none is a multiple of the {shards} "
                             "batch shards of the mesh")
        return usable

    def _batch_axes(self) -> Any:
        return logical_to_spec(("batch",), self._rules)[0]

    def _batch_shards(self) -> int:
        if self._mesh is None:
            return 1
        axes = self._batch_axes()
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return math.prod(self._mesh.shape[a] for a in axes)

    def _sharding(self, *spec: Any) -> NamedSharding | None:
        return None if self._mesh is None else NamedSharding(self._mesh, PartitionSpec(*spec))

    def _put_batch(self, a: np.ndarray) -> jax.Array:
        if self._mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, self._sharding(self._batch_axes(), *(None,) * (a.ndim - 1)))

    def _put_replicated(self, a: np.ndarray) -> jax.Array:
        return jnp.asarray(a) if self._mesh is None else jax.device_put(a, self._sharding())

    def _place(self, flat: FlatParams) -> FlatParams:
        """Parameters laid out by `rules` on the mesh (unchanged without one)."""
        if self._mesh is None:
            return flat
        replicated = PartitionSpec()
        return {p: jax.device_put(v, NamedSharding(self._mesh, self._specs.get(p, replicated)))
                for p, v in flat.items()}

    def _constrain(self, state: DecodeState) -> DecodeState:
        """Pin the loop carry's layout: batch over the batch rule, kv heads over theirs."""
        if self._mesh is None:
            return state
        b = self._batch_axes()
        rows, vec = self._sharding(b, None), self._sharding(b)
        shardings = DecodeState(self._cache_shardings(state.cache.k.shape), rows, rows, rows,
                                vec, vec, vec, vec, vec, self._sharding())
        return jax.lax.with_sharding_constraint(state, shardings)

    def _constrain_cache(self, cache: KVCache) -> KVCache:
        if self._mesh is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self._cache_shardings(cache.k.shape))

    def _cache_shardings(self, shape: tuple[int, ...]) -> KVCache:
        """k, v `[L, B, S, K, H]`: batch over the batch rule, K over kv_heads' (if it divides);
        valid `[B, S]` over batch; index replicated."""
        axes = (None, "batch", None, "kv_heads", None)
        try:
            spec = logical_to_spec(axes, self._rules, mesh=self._mesh, shape=shape, name="cache")
        except ShardingError:
            # kv heads not divisible by the tensor axis: keep them whole on every shard.
            spec = logical_to_spec((*axes[:3], None, None), self._rules)
        kv = NamedSharding(self._mesh, spec)
        return KVCache(kv, kv, self._sharding(self._batch_axes(), None), self._sharding())

    # ------------------------------------------------------------------ device side
    def _merge(self, params: FlatParams) -> Qwen3:
        return nnx.merge(self._graphdef, nnx.from_flat_state(params))

    def _prefill_impl(self, params: FlatParams, tokens: jax.Array, mask: jax.Array,
                      positions: jax.Array, prompt_lens: jax.Array, real: jax.Array, *,
                      new_bucket: int) -> DecodeState:
        """Run the padded prompts `[B, P]` through the model into a fresh `P + new_bucket`
        cache; the initial loop state (dummy rows already done)."""
        self.trace_count += 1
        model = self._merge(params)
        B, P = tokens.shape
        cache = init_cache(self.config, B, P + new_bucket, self._cache_dtype)
        cache = self._constrain_cache(cache)
        # Left padding: the last slot is real in every row, and the next token is sampled
        # from it alone (the last layer runs only there: `gather`).
        last = jnp.full((B, 1), P - 1, jnp.int32)
        hidden, cache = model.hidden_states(tokens, positions, mask, cache, empty_cache=True,
                                            gather=last)
        logits = model.logits(hidden[:, 0])
        return self._constrain(self._initial_state(cache, logits, prompt_lens, real, new_bucket))

    def _copy_prefix_impl(self, src_k: jax.Array, src_v: jax.Array, rows: jax.Array,
                          shift: jax.Array, head_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values `[L, B, W, K, H]` (W = `head_mask`'s width): row b's column c is
        `src[:, rows[b], c + shift[b]]` where `head_mask[b, c]` is set, else 0."""
        self.trace_count += 1
        W = head_mask.shape[1]
        cols = jnp.clip(jnp.arange(W)[None, :] + shift[:, None], 0, src_k.shape[2] - 1)
        keep = head_mask[None, :, :, None, None]
        return tuple(jnp.where(keep, src[:, rows[:, None], cols], 0)  # type: ignore[return-value]
                     for src in (src_k, src_v))

    def _prefill_on_impl(self, params: FlatParams, k: jax.Array, v: jax.Array,
                         head_mask: jax.Array, tokens: jax.Array, mask: jax.Array,
                         positions: jax.Array, prompt_lens: jax.Array, real: jax.Array, *,
                         new_bucket: int) -> DecodeState:
        """A cache whose columns `[0, W)` hold `k`, `v` (valid where `head_mask`), then the
        `[B, Ps]` tail run on top of them: the state a full prefill of the `W + Ps` columns
        gives."""
        self.trace_count += 1
        model = self._merge(params)
        B, W = head_mask.shape
        Ps = tokens.shape[1]
        cache = init_cache(self.config, B, W + Ps + new_bucket, self._cache_dtype)
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        cache = KVCache(jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0, 0)),
                        jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, 0, 0)),
                        jax.lax.dynamic_update_slice(cache.valid, head_mask, (0, 0)),
                        jnp.asarray(W, jnp.int32))
        cache = self._constrain_cache(cache)
        last = jnp.full((B, 1), Ps - 1, jnp.int32)
        hidden, cache = model.hidden_states(tokens, positions, mask, cache, gather=last)
        logits = model.logits(hidden[:, 0])
        return self._constrain(self._initial_state(cache, logits, prompt_lens, real, new_bucket))

    def _initial_state(self, cache: KVCache, logits: jax.Array, prompt_lens: jax.Array,
                       real: jax.Array, new_bucket: int) -> DecodeState:
        B = logits.shape[0]
        return DecodeState(
            cache, logits, jnp.full((B, new_bucket), self._pad_id, jnp.int32),
            jnp.zeros((B, new_bucket), jnp.float32), jnp.zeros((B,), jnp.int32),
            prompt_lens.astype(jnp.int32), ~real, jnp.zeros((B,), bool),
            jnp.full((B,), -1, jnp.int32), jnp.zeros((), jnp.int32))

    def _decode_impl(self, params: FlatParams, state: DecodeState, limit: jax.Array,
                     args: SampleArgs, *, greedy: bool, truncate: str,
                     grammar: str) -> DecodeState:
        """Sample until step == min(limit, max_new) or every row is done. `grammar`: "none",
        "mask" (`args.allowed` for this step) or "choice" (masks from the tries in `args`)."""
        self.trace_count += 1
        model = self._merge(params)
        masks = step_masks(args, self.config.vocab_size, grammar)

        def cond(s: DecodeState) -> jax.Array:
            return (s.step < jnp.minimum(limit, args.max_new)) & ~jnp.all(s.done)

        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(args.key, args.rows)

        def body(s: DecodeState) -> DecodeState:
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, s.step)
            p = pick_next(s.logits, keys, s.done, s.node, args, masks, pad=self._pad_id,
                          greedy=greedy, truncate=truncate, grammar=grammar)
            tok, lp, active, hit = p.token, p.logprob, ~s.done, p.stopped
            hidden, cache = model.hidden_states(
                tok[:, None], (s.prompt_lens + s.step)[:, None],
                jnp.ones((tok.shape[0], 1), bool), s.cache)
            new = DecodeState(
                cache, model.logits(hidden[:, 0]),
                jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step)),
                jax.lax.dynamic_update_slice(s.logprobs, lp[:, None], (0, s.step)),
                s.lengths + active.astype(jnp.int32), s.prompt_lens,
                s.done | hit | p.ended | (s.step + 1 >= args.max_new), s.stopped | hit, p.node,
                s.step + 1)
            return self._constrain(new)

        return jax.lax.while_loop(cond, body, state)

