"""`PagedEngine`: continuous batching over a paged KV cache (`JaxSampler(kv_cache="paged")`).

Memory: one pool of pages (`models.paged_attention`, `[L, K, num_pages, page_size, H]` for
keys and the same for values) sized once by a token budget, instead of a dense
`[L, B, P + N, K, H]` cache per call group. The host (`PageCache`) hands pages to rows as they
grow, shares full pages of a common prefix (the rulebook every row of a call starts with) and
keeps a finished row's pages, matchable by their tokens, for an episode's next turn until the
room is needed (LRU). `invalidate` (new weights) forgets them.

Scheduling: `max_rows` decode slots. A row is admitted into a free slot when the pool has
pages for its tokens plus one sync's worth of new ones; its tokens not found in the cache are
prefilled (several rows at once, in chunks of at most `prefill_chunk` tokens) and the logits of
its last token land in its slot. Decode runs `steps_per_sync` steps on device (a
`lax.while_loop` that exits early when every slot is done), then the host reads the new tokens,
checks stop strings and host grammars, retires finished rows (pages released), grows the live
rows' pages for the next steps (when the pool is short, the newest row is preempted: its pages
are released, hashed, so it usually finds them again, and it is requeued with the tokens it
has), and admits waiting rows. A row that waits for pages another row of the same round is
computing (a shared prefix) is deferred one round and then shares them.

Same sampling as the dense path: `sample_ops.sample_logits`, row r's draw at its step t keyed
`fold_in(fold_in(key, r), t)` (so a row's tokens depend neither on the other rows nor on the
schedule), stop tokens, stop strings (token-space cut, `base.apply_stop_strings`),
`max_new_tokens`, finite choice grammars decoded on device from their tries, other grammars
(xgrammar) with one host round trip per step (`steps_per_sync` is then 1), the logprob
contract of `sampling.base`, `allowed` counts and finish reasons. Logprobs equal the dense
path's up to float summation order.

Compiled shapes: decode depends on (max_rows, page-table width M, steps, greedy, truncation,
grammar mode); prefill on (rows R, chunk C, width M). M, R and C are powers of two (M at least
`MIN_WIDTH`), so a run compiles a handful of programs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import PagePool, init_pool, pool_shape
from jax_routeweaver.models.sharding import SAMPLE_RULES, Rules, ShardingError, logical_to_spec
from jax_routeweaver.sampling.base import Completion, Decode, SamplingParams, apply_stop_strings
from jax_routeweaver.sampling.constraints import (
    ChoiceMatcher,
    Grammar,
    GrammarConstraints,
    allowed_counts,
    choice_tables,
    unpack_bitmask,
)
from jax_routeweaver.sampling.paged_cache import PageCache
from jax_routeweaver.sampling.sample_ops import (
    choice_advance,
    choice_mask,
    sample_logits,
    stop_token_mask,
)

FlatParams = dict[tuple[Any, ...], jax.Array]
MIN_WIDTH = 4           # smallest page-table width (pages per row) compiled
MIN_CHUNK = 16          # smallest prefill chunk compiled
PREFILL_TOKENS = 8192   # most tokens (rows x chunk) one prefill call runs


@dataclasses.dataclass(frozen=True)
class PagedOptions:
    """The paged engine's settings (`rollout.paged` in a train config for the first four).

    `page_size`: tokens per page. `budget_tokens`: the pool's size in tokens (0: from
    `memory_fraction` of one device's free memory at start-up, capped at `max_rows` rows of
    the model's `max_position_embeddings`). `max_rows`: decode slots. `steps_per_sync`: decode
    steps on device between host checks (stop strings, admissions, retirements). `prefill_chunk`:
    most tokens of one row per prefill call. `tpu_kernel`: on TPU, decode attention through the
    Pallas paged-attention kernel (untested here; off by default)."""

    page_size: int = 16
    budget_tokens: int = 0
    memory_fraction: float = 0.5
    max_rows: int = 64
    steps_per_sync: int = 8
    prefill_chunk: int = 512
    tpu_kernel: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_rows", "steps_per_sync", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"PagedOptions.{name}={getattr(self, name)} must be >= 1")
        if self.budget_tokens < 0:
            raise ValueError(f"PagedOptions.budget_tokens={self.budget_tokens} must be >= 0")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"PagedOptions.memory_fraction={self.memory_fraction} must be in "
                             "(0, 1]")

    @classmethod
    def of(cls, section: Any) -> PagedOptions:
        """Options from None (defaults), a `PagedOptions`, or any object with some of its
        fields as attributes (a train config's `rollout.paged` section), the rest defaults."""
        if section is None or isinstance(section, cls):
            return section or cls()
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)
                      if hasattr(section, f.name)})


class Slots(NamedTuple):
    """Per decode slot, `[B]` each (B = max_rows; empty slots are done)."""

    lengths: jax.Array  # int32: tokens in the slot's cache = position of the next token
    steps: jax.Array    # int32: tokens generated so far (the row's RNG step)
    rows: jax.Array     # int32: the row's index in the call (its RNG stream)
    done: jax.Array     # bool
    stopped: jax.Array  # bool: ended by a stop token
    node: jax.Array     # int32: choice trie node (-1: none)


class StepArgs(NamedTuple):
    """Runtime sampling knobs of one call (traced, not static)."""

    temperature: jax.Array   # [] fp32 (> 0; greedy is static)
    top_k: jax.Array         # [] int32, <= 0 = off
    top_p: jax.Array         # [] fp32
    max_new: jax.Array       # [] int32
    stop_ids: jax.Array      # [S] int32, padded with -1
    key: jax.Array           # PRNG key of the call
    allowed: jax.Array       # [B, W] int32 host grammar bitmask ([1, 1] unless "mask")
    choice_token: jax.Array  # [S, C] int32 (`ChoiceTables`; [1, 1] unless "choice")
    choice_child: jax.Array  # [S, C] int32
    choice_stop: jax.Array   # [S] bool
    choice_end: jax.Array    # [S] bool


@dataclasses.dataclass
class CallStats:
    """What one `generate` call did (`PagedEngine.last_call`)."""

    prefill_tokens: int = 0   # tokens run through prefill (not found in the cache)
    reused_tokens: int = 0    # prompt tokens found in the cache instead
    peak_pages: int = 0       # most pages in use at once
    allocated_pages: int = 0  # pages computed into
    preemptions: int = 0
    decode_launches: int = 0
    prefill_launches: int = 0


@dataclasses.dataclass(eq=False)
class _Row:
    """Host state of one row of a call."""

    index: int
    prompt: list[int]
    matcher: Any = None
    node: int = -1
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    allowed: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    stopped: bool = False
    grammar_end: bool = False
    slot: int = -1
    admitted: int = -1  # admission order: the newest row is preempted first

    def seq(self) -> list[int]:
        """Prompt + generated tokens: what its pages hold while it runs."""
        return self.prompt + self.tokens


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


def pool_pages(cfg: ModelConfig, options: PagedOptions, *, dtype: str | None = None,
               kv_shards: int = 1, device: jax.Device | None = None) -> int:
    """How many pages the pool gets: `budget_tokens`, or `memory_fraction` of `device`'s free
    memory (each device holds 1/`kv_shards` of every token), capped at `max_rows` rows of
    `max_position_embeddings` tokens. ValueError naming the setting when not even one page."""
    if options.budget_tokens:
        tokens = options.budget_tokens
    else:
        free = device_free_bytes(device or jax.devices()[0])
        if free is None:
            raise ValueError("paged KV cache: the device's free memory is unknown; set "
                             "budget_tokens (rollout.paged.budget_tokens)")
        per_token = kv_bytes_per_token(cfg, dtype) / kv_shards
        tokens = min(int(options.memory_fraction * free / per_token),
                     options.max_rows * cfg.max_position_embeddings)
    pages = tokens // options.page_size
    if pages < 1:
        raise ValueError(f"paged KV cache: budget_tokens={options.budget_tokens} (memory_fraction"
                         f"={options.memory_fraction}) gives {tokens} tokens, less than one "
                         f"page of page_size={options.page_size}")
    return pages


# ------------------------------------------------------------------------------ engine
class PagedEngine:
    """Generation over a page pool with continuous batching (see the module docstring).

    `graphdef` is the model's `nnx` graph (`nnx.split`); `generate` takes the flat params.
    With `mesh`, the pool's kv heads are split over the `kv_heads` rule's axes when they
    divide (else replicated) and everything else is replicated: rows are not split over the
    batch axes (one copy of the schedule on every device). `decode` (ids -> text) is needed
    for stop strings, `constraints` for grammars.
    """

    def __init__(self, config: ModelConfig, graphdef: Any, options: PagedOptions, *,
                 pad_id: int = 0, mesh: Mesh | None = None, rules: Rules = SAMPLE_RULES,
                 cache_dtype: str | None = None, constraints: GrammarConstraints | None = None,
                 decode: Decode | None = None, device_choices: bool = True):
        self.config, self.options = config, options
        self._graphdef = graphdef
        self.pad_id, self._mesh, self._rules = pad_id, mesh, rules
        self._cache_dtype = cache_dtype
        self.constraints, self.decode_text = constraints, decode
        self.device_choices = device_choices
        self._kernel = options.tpu_kernel and jax.default_backend() == "tpu"
        self._pool_sharding, kv_shards = self._make_pool_sharding(options)
        device = None if mesh is None else mesh.devices.flat[0]
        num_pages = pool_pages(config, options, dtype=cache_dtype, kv_shards=kv_shards,
                               device=device)
        self.cache = PageCache(num_pages, options.page_size)
        self._pool = self._new_pool()
        self._logits = self.put(np.zeros((options.max_rows, config.vocab_size), np.float32))
        self.trace_count = 0
        self.last_call = CallStats()
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

    def invalidate(self) -> None:
        """The weights changed: no page computed so far may be reused."""
        self.cache.invalidate()

    def generate(self, params: FlatParams, prompts: Sequence[list[int]],
                 sampling: SamplingParams, grammars: Sequence[Grammar | None] | None,
                 key: jax.Array, version: int) -> list[Completion]:
        """One Completion per prompt (checked token ids), in order, stamped `version`;
        `key` is the call's PRNG key (row r's stream is `fold_in(key, r)`)."""
        self._check_budget(prompts, sampling)
        call = _Call(self, params, prompts, sampling, grammars, key)
        self.cache.reset_stats()
        call.run()
        self.last_call = call.stats
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
    def _make_pool_sharding(self, options: PagedOptions) -> tuple[NamedSharding | None, int]:
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
        """Up to `steps` decode steps of every live slot (exits when all are done). logits
        `[B, V]`: each slot's next-token logits; table `[B, M]` covers each live slot's
        `lengths + steps` positions. Returns the pool, logits, slots and the sampled tokens
        and logprobs `[B, steps]` (pad / 0 where a slot did not sample)."""
        self.trace_count += 1
        model = self._merge(params)
        B, V = logits.shape
        pad = self.pad_id
        allowed = unpack_bitmask(args.allowed, V) if grammar == "mask" else None
        is_stop = stop_token_mask(args.stop_ids, V)
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(args.key, slots.rows)

        def cond(c: tuple) -> jax.Array:
            return (c[0] < steps) & ~jnp.all(c[3].done)

        def body(c: tuple) -> tuple:
            i, pool, logits, s, toks, lps = c
            keys = jax.vmap(jax.random.fold_in)(row_keys, s.steps)
            mask = allowed
            if grammar == "choice":
                mask, kids, at = choice_mask(s.node, args.choice_token, args.choice_stop,
                                             is_stop)
            tok, lp = sample_logits(logits, keys, args.temperature, args.top_k, args.top_p,
                                    greedy=greedy, truncate=truncate, allowed=mask)
            active = ~s.done
            tok = jnp.where(active, tok, pad)
            lp = jnp.where(active, lp, 0.0)
            hit = active & jnp.any(tok[:, None] == args.stop_ids[None, :], axis=-1)
            node, ended = s.node, jnp.zeros_like(hit)
            if grammar == "choice":
                node, ended = choice_advance(s.node, tok, active, kids, at, args.choice_child,
                                             args.choice_end)
            hidden, pool = model.hidden_states_paged(
                tok[:, None], s.lengths[:, None], pool, table, s.lengths + 1, active[:, None],
                kernel=self._kernel)
            n = s.steps + active.astype(jnp.int32)
            s = Slots(s.lengths + active.astype(jnp.int32), n, s.rows,
                      s.done | hit | ended | (n >= args.max_new), s.stopped | hit, node)
            return (i + 1, self._constrain(pool), model.logits(hidden[:, 0]), s,
                    toks.at[:, i].set(tok), lps.at[:, i].set(lp))

        init = (jnp.zeros((), jnp.int32), pool, logits, slots,
                jnp.full((B, steps), pad, jnp.int32), jnp.zeros((B, steps), jnp.float32))
        _, pool, logits, slots, toks, lps = jax.lax.while_loop(cond, body, init)
        return pool, logits, slots, toks, lps


# ------------------------------------------------------------------------------ one call
class _Call:
    """The host side of one `generate` call: queue, slots, admissions, retirements."""

    def __init__(self, engine: PagedEngine, params: FlatParams, prompts: Sequence[list[int]],
                 sampling: SamplingParams, grammars: Sequence[Grammar | None] | None,
                 key: jax.Array):
        self.e, self.cache, self.params, self.sp = engine, engine.cache, params, sampling
        self.B = engine.options.max_rows
        self.rows = [_Row(i, list(p)) for i, p in enumerate(prompts)]
        self.queue: collections.deque[_Row] = collections.deque(self.rows)
        self.slots: list[_Row | None] = [None] * self.B
        self.order = itertools.count()
        self.stats = CallStats()
        self.greedy = sampling.is_greedy
        self.truncate = "none" if self.greedy else "top_k" if sampling.top_k_enabled \
            else "top_p" if sampling.top_p_enabled else "none"
        self.grammar = self._set_matchers(grammars)
        self.steps = 1 if self.grammar == "mask" else engine.options.steps_per_sync
        self.args = self._args(key)

    # ------------------------------------------------------------------ setup
    def _set_matchers(self, grammars: Sequence[Grammar | None] | None) -> str:
        """Give each constrained row its matcher; the call's grammar mode."""
        if grammars is None or all(g is None for g in grammars):
            return "none"
        constraints = self.e.constraints
        for row, g in zip(self.rows, grammars, strict=True):
            if g is not None:
                row.matcher = constraints.matcher(g, self.sp.stop_token_ids)
        matchers = [row.matcher for row in self.rows]
        if self.e.device_choices and all(m is None or isinstance(m, ChoiceMatcher)
                                          for m in matchers):
            return "choice"
        return "mask"

    def _args(self, key: jax.Array) -> StepArgs:
        sp, put = self.sp, self.e.put
        stops = sorted(set(sp.stop_token_ids))
        stop_ids = np.full((pow2(len(stops)),), -1, np.int32)
        stop_ids[:len(stops)] = stops
        table, flags = np.zeros((1, 1), np.int32), np.zeros((1,), bool)
        args = StepArgs(np.float32(1.0 if sp.is_greedy else sp.temperature),
                        np.int32(max(sp.top_k, 0)), np.float32(sp.top_p),
                        np.int32(sp.max_new_tokens), put(stop_ids), key, put(table),
                        put(table), put(table), put(flags), put(flags))
        if self.grammar == "choice":
            tables = choice_tables([row.matcher for row in self.rows])
            for row, start in zip(self.rows, tables.start.tolist(), strict=True):
                row.node = start
            args = args._replace(choice_token=put(tables.token), choice_child=put(tables.child),
                                 choice_stop=put(tables.stop_ok), choice_end=put(tables.ends))
        return args

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        while self.queue or self.live():
            self._grow()
            self._admit_all()
            if not self.live():
                raise RuntimeError("paged engine: no row could be admitted (pool too small?)")
            self._decode()
            self._check_and_retire()

    def live(self) -> list[_Row]:
        """Rows in slots, oldest admission first."""
        return sorted((r for r in self.slots if r is not None), key=lambda r: r.admitted)

    def _ahead(self, row: _Row) -> int:
        """Tokens the next decode launch may write for `row`."""
        return min(self.steps, self.sp.max_new_tokens - len(row.tokens))

    def _grow(self) -> None:
        """Pages for every live row's next launch; when short, preempt the newest rows."""
        for row in self.live():
            if row.slot < 0:
                continue  # preempted just now
            while not self.cache.grow(row.index, len(row.seq()) + self._ahead(row)):
                victim = self.live()[-1]
                self._preempt(victim)
                if victim is row:
                    break

    def _preempt(self, row: _Row) -> None:
        """Release `row`'s pages (hashed: readmission usually finds them) and requeue it."""
        self.cache.release(row.index, row.seq())
        self.slots[row.slot] = None
        row.slot = -1
        self.queue.appendleft(row)
        self.stats.preemptions += 1

    def _admit_all(self) -> None:
        while batch := self._admit_round():
            self._prefill(batch)

    def _admit_round(self) -> list[tuple[_Row, int]]:
        """Admit queued rows (in order) into free slots while pages allow: (row, tokens
        found in the cache). Rows waiting on pages this round computes are deferred."""
        free = [i for i, r in enumerate(self.slots) if r is None]
        live = len(self.slots) - len(free)
        batch: list[tuple[_Row, int]] = []
        deferred: list[_Row] = []
        while free and self.queue:
            row = self.queue[0]
            seq = row.seq()
            match = self.cache.match(seq, len(seq) - 1)  # the last token must run
            if match.blocked:
                deferred.append(self.queue.popleft())
                continue
            reserve = len(seq) + self._ahead(row)
            need = self.cache.pages_for(reserve) - len(match.pages)
            # Keep a page per live row for its growth (none needed when nothing runs).
            if need + live > self.cache.available(match):
                break
            self.queue.popleft()
            self.cache.admit(row.index, seq, match, reserve)
            row.slot, row.admitted = free.pop(0), next(self.order)
            self.slots[row.slot] = row
            live += 1
            batch.append((row, len(match.pages) * self.cache.page_size))
        self.queue.extendleft(reversed(deferred))
        return batch

    def _prefill(self, batch: list[tuple[_Row, int]]) -> None:
        """Run each admitted row's uncached tokens, chunk by chunk; its last token's logits
        go to its slot. Rows go in calls by their chunk (the power of two >= what is left,
        at most `prefill_chunk`), so a row with a few tokens left is not padded to a long one's
        chunk."""
        todo = [(row, row.seq(), start) for row, start in batch]
        self.stats.prefill_tokens += sum(len(seq) - start for _, seq, start in todo)
        self.stats.reused_tokens += sum(start for _, _, start in todo)
        limit = self.e.options.prefill_chunk
        while todo:
            sized = sorted(((min(limit, pow2(len(seq) - start, MIN_CHUNK)), row, seq, start)
                            for row, seq, start in todo), key=lambda t: t[0])
            for chunk, group in itertools.groupby(sized, key=lambda t: t[0]):
                part = [(row, seq, start) for _, row, seq, start in group]
                cap = max(1, PREFILL_TOKENS // chunk)
                for i in range(0, len(part), cap):
                    self._prefill_chunk(part[i:i + cap], chunk)
            todo = [(row, seq, start + chunk) for chunk, row, seq, start in sized
                    if start + chunk < len(seq)]
        for row, _ in batch:
            self.cache.ready(row.index)

    def _prefill_chunk(self, part: list[tuple[_Row, list[int], int]], chunk: int) -> None:
        R = pow2(len(part))
        # Only the pages up to the chunk's end: a long prompt's first chunks read fewer keys.
        width = pow2(max(self.cache.pages_for(min(start + chunk, len(seq)))
                         for _, seq, start in part), MIN_WIDTH)
        tokens = np.full((R, chunk), self.e.pad_id, np.int32)
        positions = np.zeros((R, chunk), np.int32)
        valid = np.zeros((R, chunk), bool)
        lengths, last = np.zeros(R, np.int32), np.zeros(R, np.int32)
        dest = np.full(R, self.B, np.int32)  # >= B: dropped
        for i, (row, seq, start) in enumerate(part):
            end = min(start + chunk, len(seq))
            tokens[i, :end - start] = seq[start:end]
            positions[i] = start + np.arange(chunk)
            valid[i, :end - start] = True
            lengths[i], last[i] = end, end - start - 1
            if end == len(seq):
                dest[i] = row.slot
        positions = np.minimum(positions, width * self.cache.page_size - 1)
        table = self.cache.table([row.index for row, _, _ in part] + [None] * (R - len(part)),
                                 width)
        self.e.run_prefill(self.params, tokens, positions, valid, table, lengths, last, dest)
        self.stats.prefill_launches += 1

    def _decode(self) -> None:
        """One launch of up to `steps` decode steps; the rows take their new tokens."""
        rows = self.slots
        width = pow2(max(len(self.cache.rows[r.index]) for r in rows if r is not None),
                     MIN_WIDTH)
        table = self.cache.table([None if r is None else r.index for r in rows], width)
        args = self.args
        if self.grammar == "mask":
            args = args._replace(allowed=self.e.put(self._host_masks()))
        out, toks, lps = self.e.run_decode(
            self.params, table, self._slot_arrays(), args, steps=self.steps, greedy=self.greedy,
            truncate=self.truncate, grammar=self.grammar)
        self.stats.decode_launches += 1
        for i, r in enumerate(rows):
            if r is None:
                continue
            n = int(out.steps[i]) - len(r.tokens)
            r.tokens.extend(toks[i, :n].tolist())
            r.logprobs.extend(lps[i, :n].tolist())
            r.done, r.stopped, r.node = bool(out.done[i]), bool(out.stopped[i]), int(out.node[i])

    def _slot_arrays(self) -> Slots:
        """The slots' host state as numpy `Slots` (empty slots: done, nothing cached)."""
        B = self.B
        lengths, steps, rows = (np.zeros(B, np.int32) for _ in range(3))
        done, stopped = np.ones(B, bool), np.zeros(B, bool)
        node = np.full(B, -1, np.int32)
        for i, r in enumerate(self.slots):
            if r is not None:
                lengths[i], steps[i], rows[i] = len(r.prompt) + len(r.tokens), len(r.tokens), \
                    r.index
                done[i], stopped[i], node[i] = r.done, r.stopped, r.node
        return Slots(lengths, steps, rows, done, stopped, node)

    def _host_masks(self) -> np.ndarray:
        """The slots' grammar bitmasks `[B, W]` for the next token (xgrammar or choice
        matchers on the host); each live constrained row records its allowed count."""
        constraints = self.e.constraints
        matchers = [None if r is None else r.matcher for r in self.slots]
        bitmask = constraints.fill(matchers, np.empty((self.B, constraints.words), np.int32))
        counts = allowed_counts(bitmask, self.e.config.vocab_size)
        for r, count in zip(self.slots, counts.tolist(), strict=True):
            if r is not None and r.matcher is not None:
                r.allowed.append(count)
        return bitmask

    def _check_and_retire(self) -> None:
        """Host checks on the new tokens (grammar matchers, stop strings); done rows leave."""
        for row in self.live():
            if self.grammar == "mask" and row.matcher is not None:
                self._advance_matcher(row)
            if self.sp.stop_strings and not row.done:
                text = self.e.decode_text(row.tokens)
                row.done = any(s in text for s in self.sp.stop_strings)
            if row.done:
                self.cache.release(row.index, row.seq())
                self.slots[row.slot] = None
                row.slot = -1

    @staticmethod
    def _advance_matcher(row: _Row) -> None:
        """Feed the row's newest token (one step per launch in "mask" mode) to its matcher;
        a completed grammar ends the row."""
        m = row.matcher
        if m.is_terminated() or len(row.allowed) != len(row.tokens):
            return
        token = row.tokens[-1]
        if not m.accept_token(token):
            raise RuntimeError(f"row {row.index}: sampled token {token} rejected by its grammar "
                               "(mask and matcher disagree)")
        if m.is_terminated():
            row.done = True
            row.grammar_end = not row.stopped

    # ------------------------------------------------------------------ results
    def completion(self, row: _Row, version: int) -> Completion:
        if self.grammar == "choice" and row.matcher is not None:
            self._replay(row)
        n = len(row.tokens)
        reason = "stop_token" if row.stopped else "grammar" if row.grammar_end else "length"
        completion = Completion(list(row.tokens), list(row.logprobs), reason,
                                row.tokens[-1] if row.stopped else None, version,
                                None if row.matcher is None else row.allowed[:n])
        if self.sp.stop_strings:
            completion = apply_stop_strings(completion, self.e.decode_text,
                                            self.sp.stop_strings)
        return completion

    @staticmethod
    def _replay(row: _Row) -> None:
        """Feed a choice row's tokens (decoded on device) to its matcher: allowed counts and
        whether its grammar ended it."""
        m = row.matcher
        for t in row.tokens:
            row.allowed.append(len(set(m.allowed())))
            if not m.accept_token(t):
                raise RuntimeError(f"row {row.index}: token {t} decoded on device is rejected "
                                   "by its choice grammar (tables and matcher disagree)")
        row.grammar_end = m.is_terminated() and not row.stopped
