"""`PagedEngine`: continuous batching over a paged KV cache (`JaxSampler(kv_cache="paged")`).

Memory: one pool of pages (`models.paged_attention`, `[L, K, num_pages, page_size, H]` for
keys and the same for values) sized once by a token budget, instead of a dense
`[L, B, P + N, K, H]` cache per call group. The host (`PageCache`) hands pages to rows as they
grow, shares full pages of a common prefix (the rulebook every row of a call starts with) and
keeps a finished row's pages, matchable by their tokens, for an episode's next turn until the
room is needed (LRU). `invalidate` (new weights) forgets them.

One call's schedule (slots, admissions, preemptions, host checks) lives in `paged_scheduler`;
the options and the pool's sizing in `paged_options`. This module holds the engine: the pool,
its placement on the mesh, and the compiled prefill and decode steps.

Same sampling as the dense path: `sample_ops.sample_logits`, row r's draw at its step t keyed
`fold_in(fold_in(key, r), t)` (so a row's tokens depend neither on the other rows nor on the
schedule), stop tokens, stop strings (token-space cut, `base.apply_stop_strings`),
`max_new_tokens`, finite choice grammars decoded on device from their tries, other grammars
(xgrammar) with one host round trip per step (`steps_per_sync` is then 1), the logprob
contract of `sampling.base`, `allowed` counts and finish reasons. Logprobs equal the dense
path's up to float summation order.

Compiled shapes: decode depends on (slots S, page-table width M, steps, greedy, truncation,
grammar mode), S the power of two past the highest live slot (at least `MIN_SLOTS`, at most
`max_rows`: a call with few rows does not decode the idle slots); prefill on (rows R, chunk
C, width M). S, M, R and C are powers of two (M at least `MIN_WIDTH`), so a run compiles a
handful of programs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import (
    PagePool,
    attention_path,
    decode_kernel,
    init_pool,
    pool_shape,
)
from jax_routeweaver.models.sharding import SAMPLE_RULES, Rules, ShardingError, logical_to_spec
from jax_routeweaver.sampling.base import Completion, Decode, SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, GrammarConstraints
from jax_routeweaver.sampling.decode_step import pick_next, step_masks
from jax_routeweaver.sampling.paged_cache import PageCache
from jax_routeweaver.sampling.paged_options import PagedConfig, kv_bytes_per_token, pool_pages
from jax_routeweaver.sampling.paged_scheduler import CallStats, PagedCall, Slots, StepArgs

FlatParams = dict[tuple[Any, ...], jax.Array]


# ------------------------------------------------------------------------------ engine
class PagedEngine:
    """Generation over a page pool with continuous batching (see the module docstring).

    `graphdef` is the model's `nnx` graph (`nnx.split`); `generate` takes the flat params.
    With `mesh`, the pool's kv heads are split over the `kv_heads` rule's axes when they
    divide (else replicated) and everything else is replicated: rows are not split over the
    batch axes (one copy of the schedule on every device). `decode` (ids -> text) is needed
    for stop strings, `constraints` for grammars.
    """

    def __init__(self, config: ModelConfig, graphdef: Any, options: PagedConfig, *,
                 pad_id: int = 0, mesh: Mesh | None = None, rules: Rules = SAMPLE_RULES,
                 cache_dtype: str | None = None, constraints: GrammarConstraints | None = None,
                 decode: Decode | None = None, device_choices: bool = True):
        self.config, self.options = config, options
        self._graphdef = graphdef
        self.pad_id, self._mesh, self._rules = pad_id, mesh, rules
        self._cache_dtype = cache_dtype
        self.constraints, self.decode_text = constraints, decode
        self.device_choices = device_choices
        backend = jax.default_backend()
        path = attention_path(options.attention, backend, interpret=options.pallas_interpret)
        self.attention = path  # the decode attention's path, as chosen
        self._kernel = decode_kernel(backend, interpret=options.pallas_interpret) \
            if path == "pallas" else None
        self._pool_sharding, kv_shards = self._make_pool_sharding(options)
        device = None if mesh is None else mesh.devices.flat[0]
        num_pages = pool_pages(config, options, dtype=cache_dtype, kv_shards=kv_shards,
                               device=device)
        self.cache = PageCache(num_pages, options.page_size)
        self._pool = self._new_pool()
        self._logits = self.put(np.zeros((options.max_rows, config.vocab_size), np.float32))
        self.trace_count = 0
        self.last_call = CallStats()
        self.hits = self.reused = 0  # since `take_counts`: admissions and tokens from cache
        self._decode = jax.jit(self._decode_impl,
                               static_argnames=("steps", "greedy", "truncate", "grammar"),
                               donate_argnames=("pool", "logits"))
        self._prefill = jax.jit(self._prefill_impl, donate_argnames=("pool", "logits"))

    # ------------------------------------------------------------------ public
    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool (keys and values, all devices' shards together)."""
        return self.cache.num_pages * self.options.page_size * kv_bytes_per_token(
            self.config, self._cache_dtype)

    def take_counts(self) -> tuple[int, int]:
        """(admissions whose prompt reused cached pages, prompt tokens reused) since the last
        call of this; the counters restart."""
        counts, self.hits, self.reused = (self.hits, self.reused), 0, 0
        return counts

    def invalidate(self) -> None:
        """The weights changed: no page computed so far may be reused."""
        self.cache.invalidate()

    def generate(self, params: FlatParams, prompts: Sequence[list[int]],
                 sampling: SamplingParams, grammars: Sequence[Grammar | None] | None,
                 key: jax.Array, version: int) -> list[Completion]:
        """One Completion per prompt (checked token ids), in order, stamped `version`;
        `key` is the call's PRNG key (row r's stream is `fold_in(key, r)`)."""
        self._check_budget(prompts, sampling)
        call = PagedCall(self, params, prompts, sampling, grammars, key)
        self.cache.reset_stats()
        call.run()
        self.last_call = call.stats
        self.hits += call.stats.prefix_hits
        self.reused += call.stats.reused_tokens
        call.stats.peak_pages = self.cache.peak_used
        call.stats.allocated_pages = self.cache.allocated
        return [call.completion(row, version) for row in call.rows]

    def run_prefill(self, params: FlatParams, *arrays: np.ndarray) -> None:
        """One prefill call (`_prefill_impl`'s arrays after the logits, as numpy); the pool
        and the slots' logits are updated in place."""
        self._pool, self._logits = self._prefill(params, self._pool, self._logits,
                                                 *map(self.put, arrays))

    def run_decode(self, params: FlatParams, table: np.ndarray, slots: Slots, args: StepArgs,
                   **static: Any) -> tuple[Slots, np.ndarray, np.ndarray]:
        """One decode launch (`_decode_impl`; `static`: its static arguments) from the
        slots' host state: the slots after it, the tokens and logprobs `[B, steps]`, on the
        host."""
        self._pool, self._logits, out, toks, lps = self._decode(
            params, self._pool, self._logits, self.put(table), Slots(*map(self.put, slots)),
            args, **static)
        return jax.device_get((out, toks, lps))

    # ------------------------------------------------------------------ placement
    def _make_pool_sharding(self, options: PagedConfig) -> tuple[NamedSharding | None, int]:
        """Pool `[L, K, P, S, H]`: K over the kv_heads rule's axes if they divide it (else
        replicated); and how many pieces that cuts K into."""
        if self._mesh is None:
            return None, 1
        shape = pool_shape(self.config, 1, options.page_size)
        try:
            spec = logical_to_spec((None, "kv_heads", None, None, None), self._rules,
                                   mesh=self._mesh, shape=shape, name="page pool")
        except ShardingError:
            return NamedSharding(self._mesh, PartitionSpec()), 1
        axes = self._rules.get("kv_heads")
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return NamedSharding(self._mesh, spec), math.prod(self._mesh.shape[a] for a in axes)

    def _new_pool(self) -> PagePool:
        pool = init_pool(self.config, self.cache.num_pages, self.options.page_size,
                         self._cache_dtype)
        if self._pool_sharding is None:
            return pool
        return PagePool(*(jax.device_put(a, self._pool_sharding) for a in pool))

    def put(self, a: np.ndarray) -> jax.Array:
        """A host array on the device(s), replicated over the mesh if there is one."""
        if self._mesh is None:
            return jnp.asarray(a)
        return jax.device_put(a, NamedSharding(self._mesh, PartitionSpec()))

    def _constrain(self, pool: PagePool) -> PagePool:
        if self._pool_sharding is None:
            return pool
        return jax.lax.with_sharding_constraint(pool, PagePool(self._pool_sharding,
                                                               self._pool_sharding))

    def _check_budget(self, prompts: Sequence[list[int]], sampling: SamplingParams) -> None:
        longest = max(map(len, prompts))
        need = self.cache.pages_for(longest + sampling.max_new_tokens)
        if need > self.cache.num_pages:
            size = self.options.page_size
            raise ValueError(
                f"paged KV cache too small for one row: budget_tokens="
                f"{self.options.budget_tokens} (memory_fraction={self.options.memory_fraction}) "
                f"gives {self.cache.num_pages} pages of {size} tokens, but a prompt of {longest} "
                f"tokens + max_new_tokens={sampling.max_new_tokens} needs {need} pages; raise "
                "budget_tokens (rollout.paged.budget_tokens)")

    # ------------------------------------------------------------------ device side
    def _merge(self, params: FlatParams) -> Any:
        return nnx.merge(self._graphdef, nnx.from_flat_state(params))

    def _prefill_impl(self, params: FlatParams, pool: PagePool, logits: jax.Array,
                      tokens: jax.Array, positions: jax.Array, valid: jax.Array,
                      table: jax.Array, lengths: jax.Array, last: jax.Array,
                      dest: jax.Array) -> tuple[PagePool, jax.Array]:
        """Run a chunk of R rows: tokens, positions, valid `[R, C]` written into the pages of
        `table` `[R, M]` (cache lengths `[R]` once written); the logits at each row's `last`
        `[R]` index are stored in slot `dest` `[R]` of `logits` `[B, V]` (dest >= B: not
        stored, the row's prompt goes on in a later chunk)."""
        self.trace_count += 1
        model = self._merge(params)
        hidden, pool = model.hidden_states_paged(tokens, positions, pool, table, lengths, valid,
                                                 gather=last[:, None])
        new = model.logits(hidden[:, 0])
        return self._constrain(pool), logits.at[dest].set(new, mode="drop")

    def _decode_impl(self, params: FlatParams, pool: PagePool, logits: jax.Array,
                     table: jax.Array, slots: Slots, args: StepArgs, *, steps: int,
                     greedy: bool, truncate: str, grammar: str
                     ) -> tuple[PagePool, jax.Array, Slots, jax.Array, jax.Array]:
        """Up to `steps` decode steps of the first S slots (S = the table's rows; exits when
        all are done). logits `[max_rows, V]`: each slot's next-token logits (rows past S
        untouched); table `[S, M]` covers each live slot's `lengths + steps` positions.
        Returns the pool, logits, slots and the sampled tokens and logprobs `[S, steps]`
        (pad / 0 where a slot did not sample)."""
        self.trace_count += 1
        model = self._merge(params)
        every = logits
        B, V = table.shape[0], logits.shape[1]
        logits = every[:B]
        pad = self.pad_id
        masks = step_masks(args, V, grammar)
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(args.key, slots.rows)

        def cond(c: tuple) -> jax.Array:
            return (c[0] < steps) & ~jnp.all(c[3].done)

        def body(c: tuple) -> tuple:
            i, pool, logits, s, toks, lps = c
            keys = jax.vmap(jax.random.fold_in)(row_keys, s.steps)
            p = pick_next(logits, keys, s.done, s.node, args, masks, pad=pad, greedy=greedy,
                          truncate=truncate, grammar=grammar)
            tok, lp, active, hit = p.token, p.logprob, ~s.done, p.stopped
            hidden, pool = model.hidden_states_paged(
                tok[:, None], s.lengths[:, None], pool, table, s.lengths + 1, active[:, None],
                kernel=self._kernel)
            n = s.steps + active.astype(jnp.int32)
            s = Slots(s.lengths + active.astype(jnp.int32), n, s.rows,
                      s.done | hit | p.ended | (n >= args.max_new), s.stopped | hit, p.node)
            return (i + 1, self._constrain(pool), model.logits(hidden[:, 0]), s,
                    toks.at[:, i].set(tok), lps.at[:, i].set(lp))

        init = (jnp.zeros((), jnp.int32), pool, logits, slots,
                jnp.full((B, steps), pad, jnp.int32), jnp.zeros((B, steps), jnp.float32))
        _, pool, logits, slots, toks, lps = jax.lax.while_loop(cond, body, init)
        return pool, every.at[:B].set(logits), slots, toks, lps
