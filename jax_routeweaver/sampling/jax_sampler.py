"""`JaxSampler`: batched generation with a `Qwen3` in this process (jitted prefill + decode loop).

Bucketing (so similar calls reuse compiled code): a group of prompts is left-padded to the
smallest `prompt_buckets` entry (empty: `DEFAULT_PROMPT_BUCKETS`) >= its longest prompt (P) and
to the smallest `batch_buckets` entry >= its size (B; filler rows are one-token dummies, done
from the start, whose output is dropped). A call's prompts are sorted by length and cut into
such groups where the padding saved pays for one more group, or for a shape this sampler has
not compiled yet (`length_groups`). The KV cache has P + N slots, N =
`new_token_bucket(max_new_tokens)` (a power of two, at least 16).
Compiled code depends only on (B, P, N, greedy, truncated sampling) and the weights'
shapes/shardings; temperature, top-k, top-p, max_new_tokens, stop tokens (padded to a
power-of-two count) and the RNG key are runtime values. A prompt longer than the largest
prompt bucket pads to a multiple of it. On a mesh only batch buckets divisible by the batch
shards are used. Every row samples from its own stream (the call's key folded with the row's
index in the call), so its tokens depend neither on the other rows nor on the cut.

Prefix reuse (`prefix_cache_mb` > 0): every group's final KV cache is kept (`PrefixStore`,
newest first within the budget, dropped when the weights change), so a later prompt that
extends a stored row (a multi-turn episode's next turn) copies that prefix's keys and values
and prefills only its last `Ps` columns (a prompt bucket >= the longest uncached suffix) on top
of them, instead of all P. The layout is the one a full prefill gives, so decode is unchanged.
The copy is a program keyed on the source cache's shape, the prefill one keyed on (B, P, Ps, N).

Decode runs as one `lax.while_loop` on device that exits once every row hit a stop token or
`max_new_tokens`. Stop strings need the text, so they are checked on the host every
`stop_check_interval` steps between runs of the same compiled loop (rows found are marked done);
the final cut is the token-space `apply_stop_strings`. Logprob contract: see `sampling.base`.

Grammars: when every constrained row's grammar is a finite choice (`Grammar.choice`), the
tries travel to the device as arrays (`choice_tables`) and the loop builds each step's mask and
advances each row's node itself, so a turn runs like an unconstrained one (forced tokens
included); the host matchers replay the tokens afterwards (allowed counts, grammar ends). Other
grammars (xgrammar) take one host round trip per token: the matchers make each step's mask.
Both give the same masks, so the same tokens.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence, Set
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_routeweaver.models.qwen3 import KVCache, Qwen3, init_cache
from jax_routeweaver.models.sharding import (
    SAMPLE_RULES,
    Rules,
    ShardingError,
    logical_to_spec,
    param_specs,
)
from jax_routeweaver.sampling.base import (
    Completion,
    Decode,
    SamplingParams,
    apply_stop_strings,
    check_version,
)
from jax_routeweaver.sampling.constraints import (
    ChoiceMatcher,
    Grammar,
    GrammarConstraints,
    allowed_counts,
    choice_tables,
    unpack_bitmask,
)
from jax_routeweaver.sampling.paged_engine import PagedEngine, PagedOptions
from jax_routeweaver.sampling.prefix_cache import Match, PrefixStore
from jax_routeweaver.sampling.sample_ops import (
    choice_advance,
    choice_mask,
    sample_logits,
    stop_token_mask,
)

# Steps of 1.5x and 2x from 256 on: a prompt pads by at most half its length, not all of it
# (prefill attention grows with the square of the padded length), for a few more compiles.
DEFAULT_PROMPT_BUCKETS = (32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_NEW_TOKEN_BUCKET = 16
# What one more group of a `generate` call costs, in padded prompt tokens: its own prefill and
# decode dispatches.
GROUP_COST = 2048
# What a group of a (batch, prompt) bucket pair not compiled yet costs on top: its prefill and
# decode compiles (~2.4 s for the quickstart's router on 2 cores, about 100k padded tokens of
# prefill). Less than that, since a shape compiled now is reused later: replaying a
# quickstart run's 422 calls, any value from 16k on kept 22 shapes instead of 49, for 54 s of
# compiles instead of 119 s and 14 s more execution (bench/RESULTS.md).
NEW_SHAPE_COST = 16384

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


# ------------------------------------------------------------------------------ pure helpers
def new_token_bucket(max_new_tokens: int) -> int:
    """Static decode length for `max_new_tokens`: the next power of two, at least 16."""
    return max(MIN_NEW_TOKEN_BUCKET, 1 << (max_new_tokens - 1).bit_length())


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; beyond the largest, the next multiple of the largest."""
    for b in buckets:
        if b >= n:
            return b
    return -(-n // buckets[-1]) * buckets[-1]


def length_groups(lengths: Sequence[int], prompt_buckets: Sequence[int],
                  batch_buckets: Sequence[int], group_cost: int = GROUP_COST,
                  compiled: Set[tuple[int, int]] = frozenset(), new_shape_cost: int = 0
                  ) -> list[int]:
    """Cut rows sorted by length (`lengths` ascending) into consecutive groups: the ends of the
    groups (the last is `len(lengths)`).

    The cut minimises sum over groups of B x P + `group_cost` (+ `new_shape_cost` when (B, P)
    is not in `compiled`), B and P the group's batch and prompt buckets (B x P: its padded
    tokens, filler rows included); no group exceeds the largest batch bucket. Dynamic
    programming over the cut points, O(n x largest batch bucket).
    """
    n, largest = len(lengths), max(batch_buckets)
    batch_of = [pick_bucket(k, batch_buckets) for k in range(min(n, largest) + 1)]
    best = [0] + [math.inf] * n  # best[j]: cheapest cut of the first j rows
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        length = pick_bucket(lengths[j - 1], prompt_buckets)
        for i in range(max(0, j - largest), j):
            batch = batch_of[j - i]
            cost = best[i] + batch * length + group_cost
            if (batch, length) not in compiled:
                cost += new_shape_cost
            if cost < best[j]:
                best[j], start[j] = cost, i
    ends = [n]
    while start[ends[-1]] > 0:
        ends.append(start[ends[-1]])
    return ends[::-1]


def left_pad(prompts: Sequence[Sequence[int]], batch: int, length: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Left-pad prompts into `[batch, length]` arrays: tokens, mask, positions, plus lengths [B].

    Rows past `len(prompts)` are one-token dummies (`pad_id`) so every row has a real token.
    Positions count real tokens only (`cumsum(mask) - 1`, 0 on padding), as in HF.
    """
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    lens = np.ones((batch,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p):] = p
        mask[i, length - len(p):] = True
        lens[i] = len(p)
    mask[len(prompts):, -1] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions, lens


# ------------------------------------------------------------------------------ sampler
class JaxSampler:
    """Generates with a `Qwen3` on this process's devices; implements `sampling.base.Sampler`.

    `decode` (token ids -> text) is needed only for stop strings. With `mesh`, parameters are
    placed by `rules` (default SAMPLE_RULES: tensor parallel, replicated over fsdp), the batch
    is split over the `batch` rule and the KV cache over batch and kv heads. The sampler keeps
    its own reference to the weights (aliasing the given model's arrays when no move is needed;
    don't donate them elsewhere); `update_weights` copies. With stop strings the host checks
    the text every `stop_check_interval` decode steps and ends finished rows' work.

    `prefix_cache_mb`: memory for reusing earlier calls' KV caches (see the module docstring;
    0 turns it off; `prefix_store.hits` / `.reused` count prompts and tokens reused).
    `device_choices=False` decodes choice grammars with the host matchers too (one round trip
    per token; same tokens, slower). `group_cost`: the padded prompt tokens one more group is
    worth (`length_groups`); None runs each call in groups of the largest batch bucket.
    `new_shape_cost`: what a group of a (batch, prompt) bucket pair this sampler has not run
    yet costs on top (its compiles), so calls settle on shapes already compiled.

    `kv_cache="paged"` (`paged`: its `PagedOptions`, or a config section with those fields)
    generates through `paged_engine` instead: a page pool of a fixed budget, continuous
    batching over `max_rows` slots, shared prefix pages and an episode's earlier turns kept in
    place (the prefix store is then off). Same tokens and logprobs (up to float summation
    order); the buckets and cuts above do not apply.

    `trace_count` counts traces of the compiled functions (each one a compile): tests and logs
    use it to check that calls within a bucket reuse compiled code.
    """

    def __init__(self, model: Qwen3, *, decode: Decode | None = None, pad_id: int = 0,
                 mesh: Mesh | None = None, rules: Rules = SAMPLE_RULES,
                 prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 cache_dtype: str | None = None, policy_version: int = 0,
                 stop_check_interval: int = 32,
                 constraints: GrammarConstraints | None = None,
                 prefix_cache_mb: float = 0.0, device_choices: bool = True,
                 group_cost: int | None = GROUP_COST,
                 new_shape_cost: int = NEW_SHAPE_COST, kv_cache: str = "dense",
                 paged: PagedOptions | Any = None):
        self.config = model.config
        if kv_cache not in ("dense", "paged"):
            raise ValueError(f"kv_cache={kv_cache!r}: expected 'dense' or 'paged'")
        if not 0 <= pad_id < self.config.vocab_size:
            raise ValueError(f"pad_id={pad_id} outside the vocabulary [0, "
                             f"{self.config.vocab_size})")
        if stop_check_interval < 1:
            raise ValueError(f"stop_check_interval={stop_check_interval} must be >= 1")
        self._decode_text = decode
        self._constraints = constraints
        if constraints is not None and constraints.vocab_size != self.config.vocab_size:
            raise ValueError(f"constraints built for vocab {constraints.vocab_size}, model has "
                             f"{self.config.vocab_size}")
        self._pad_id = pad_id
        self._mesh = mesh
        self._rules = rules
        self._cache_dtype = cache_dtype
        self._stop_check_interval = stop_check_interval
        self._device_choices = device_choices
        if group_cost is not None and group_cost < 0:
            raise ValueError(f"group_cost={group_cost} must be >= 0 (or None: no cuts)")
        if new_shape_cost < 0:
            raise ValueError(f"new_shape_cost={new_shape_cost} must be >= 0")
        self._group_cost = group_cost
        self._new_shape_cost = new_shape_cost
        self._shapes: set[tuple[int, int, int]] = set()  # (B, P, N) groups run so far
        self._prompt_buckets = _check_buckets("prompt_buckets",
                                              prompt_buckets or DEFAULT_PROMPT_BUCKETS)
        self._batch_buckets = self._usable_batch_buckets(_check_buckets("batch_buckets",
                                                                        batch_buckets))
        self._version = int(policy_version)
        self._rng = np.random.default_rng()
        self.trace_count = 0
        self._graphdef, state = nnx.split(model)
        self._specs = param_specs(model, rules, mesh) if mesh is not None else {}
        self._params = self._place({p: v.get_value() for p, v in nnx.to_flat_state(state)})
        # The paged engine shares pages across calls itself: no copy-based prefix store.
        paged_kv = kv_cache == "paged"
        self.prefix_store = PrefixStore(0 if paged_kv else int(prefix_cache_mb * 2**20))
        self.engine = None if not paged_kv else PagedEngine(
            self.config, self._graphdef, PagedOptions.of(paged), pad_id=pad_id, mesh=mesh,
            rules=rules, cache_dtype=cache_dtype, constraints=constraints, decode=decode,
            device_choices=device_choices)
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("new_bucket",))
        self._prefill_on = jax.jit(self._prefill_on_impl, static_argnames=("new_bucket",))
        self._copy_prefix = jax.jit(self._copy_prefix_impl)
        self._decode = jax.jit(self._decode_impl,
                               static_argnames=("greedy", "truncate", "grammar"),
                               donate_argnames=("state",))

    # ------------------------------------------------------------------ protocol
    @property
    def policy_version(self) -> int:
        return self._version

    def model(self) -> Qwen3:
        """A `Qwen3` view of the current weights (shares the sampler's arrays)."""
        return nnx.merge(self._graphdef, nnx.from_flat_state(self._params))

    def reseed(self, seed: int) -> None:
        """Restart the stream of per-call seeds (used when `SamplingParams.seed` is None), so
        a run that reseeds per step samples the same tokens when it is resumed."""
        self._rng = np.random.default_rng(seed)
        self.prefix_store.clear()  # a resumed run starts from an empty store too
        if self.engine is not None:
            self.engine.invalidate()

    def shape_state(self) -> list[list[int]]:
        """The (B, P, N) group shapes run so far, which steer the cuts (`length_groups`): a run
        saves them with its full state, so that a resumed run cuts its calls as the
        uninterrupted one did (the tokens never depend on the cut, its float noise does)."""
        return [list(shape) for shape in sorted(self._shapes)]

    def load_shape_state(self, shapes: Sequence[Sequence[int]]) -> None:
        """Take `shape_state()`'s shapes as run (they compile on first use here)."""
        self._shapes = {(int(b), int(p), int(n)) for b, p, n in shapes}

    def update_weights(self, weights: nnx.Module | nnx.State, version: int) -> None:
        """Replace the weights by those of `weights` (a same-architecture module, or the
        `nnx.State` of its parameters), copied into this sampler's layout; compiled code is
        kept. `version` must exceed `policy_version`; names, shapes and dtypes must match."""
        check_version(self._version, version)
        new = _flat_arrays(weights)
        missing = sorted(set(self._params) - set(new))
        extra = sorted(set(new) - set(self._params))
        if missing or extra:
            raise ValueError(f"update_weights: parameter names differ (missing {missing[:4]}, "
                             f"unexpected {extra[:4]})")
        for path, old in self._params.items():
            got = new[path]
            if tuple(got.shape) != tuple(old.shape) or got.dtype != old.dtype:
                raise ValueError(f"update_weights: {'.'.join(map(str, path))} is "
                                 f"{got.dtype}{list(got.shape)}, expected "
                                 f"{old.dtype}{list(old.shape)}")
        self._params = {p: jax.device_put(new[p], old.sharding, may_alias=False)
                        for p, old in self._params.items()}
        self._version = version
        self.prefix_store.clear()
        if self.engine is not None:
            self.engine.invalidate()  # pages computed by the old weights are not this policy's

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 grammars: Sequence[Grammar | None] | None = None) -> list[Completion]:
        """One Completion per prompt (token ids), in order, all stamped with policy_version.

        `grammars` (one per prompt, None = unconstrained) needs `constraints=` at construction;
        a row whose grammar completes ends with finish_reason "grammar".
        """
        prompts = self._check_prompts(prompts)
        if params.stop_strings and self._decode_text is None:
            raise ValueError("SamplingParams.stop_strings need JaxSampler(decode=...) to "
                             "turn tokens into text")
        if grammars is not None:
            if len(grammars) != len(prompts):
                raise ValueError(f"{len(grammars)} grammars for {len(prompts)} prompts")
            if self._constraints is None and any(g is not None for g in grammars):
                raise ValueError("grammars need JaxSampler(constraints=GrammarConstraints(...))")
        if not prompts:
            return []
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        # jax seeds are 32-bit without x64: fold the high bits in so big seeds stay distinct.
        key = jax.random.fold_in(jax.random.key(seed % 2**32), (seed >> 32) % 2**32)
        version = self._version
        if self.engine is not None:
            return self.engine.generate(self._params, prompts, params, grammars, key, version)
        # Similar lengths together, cut where that saves padding (`length_groups`).
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        lengths = [len(prompts[i]) for i in order]
        if self._group_cost is None:
            ends = list(range(self._batch_buckets[-1], len(order), self._batch_buckets[-1]))
            ends.append(len(order))
        else:
            new_bucket = new_token_bucket(params.max_new_tokens)
            compiled = {(b, p) for b, p, n in self._shapes if n == new_bucket}
            ends = length_groups(lengths, self._prompt_buckets, self._batch_buckets,
                                 self._group_cost, compiled, self._new_shape_cost)
        out: list[Completion | None] = [None] * len(prompts)
        for start, end in itertools.pairwise([0, *ends]):
            idx = order[start:end]
            group_grammars = None if grammars is None else [grammars[i] for i in idx]
            group = self._generate_group([prompts[i] for i in idx], idx, params, key, version,
                                         group_grammars)
            for i, completion in zip(idx, group, strict=True):
                out[i] = completion
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ host side
    def _generate_group(self, prompts: list[list[int]], rows: list[int],
                        params: SamplingParams, key: jax.Array, version: int,
                        grammars: list[Grammar | None] | None) -> list[Completion]:
        """Prompts `rows` (indices in the call, which pick their sampling streams) as one
        padded batch: prefill, decode, completions in order."""
        n = len(prompts)
        batch = pick_bucket(n, self._batch_buckets)
        length = pick_bucket(max(map(len, prompts)), self._prompt_buckets)
        arrays = left_pad(prompts, batch, length, self._pad_id)
        new_bucket = new_token_bucket(params.max_new_tokens)
        self._shapes.add((batch, length, new_bucket))
        state = self._prefill_group(prompts, arrays, batch, length, new_bucket)
        matchers = None
        if grammars is not None and any(g is not None for g in grammars):
            matchers = [None if g is None else self._constraints.matcher(g, params.stop_token_ids)
                        for g in grammars] + [None] * (batch - n)
        row_ids = np.zeros(batch, np.int32)  # filler rows draw nothing: done from the start
        row_ids[:n] = rows
        state, ended, allowed = self._run_decode(state, params, key, row_ids, n, matchers)
        host = jax.device_get((state.tokens, state.logprobs, state.lengths, state.stopped))
        if self.prefix_store.max_bytes:
            tokens_, _, lengths, _ = host
            self.prefix_store.add(
                state.cache.k, state.cache.v,
                [np.concatenate([p, tokens_[i, :lengths[i]]]) for i, p in enumerate(prompts)],
                [length - len(p) for p in prompts])
        return [self._completion(host, i, params, version, ended[i],
                                 None if matchers is None or matchers[i] is None
                                 else allowed[i])
                for i in range(n)]

    def _prefill_group(self, prompts: list[list[int]], arrays: tuple[np.ndarray, ...],
                       batch: int, length: int, new_bucket: int) -> DecodeState:
        """The decode loop's initial state: a full prefill, or (when stored rows hold the
        prompts' prefixes) a prefill of the last Ps columns on top of the copied prefixes."""
        tokens, mask, positions, lens = arrays
        real = np.arange(batch) < len(prompts)
        match = self.prefix_store.match(prompts)  # None when the store is off or empty
        if match is not None:
            suffix = max(len(p) - int(c) for p, c in zip(prompts, match.lengths, strict=True))
            tail = pick_bucket(suffix, self._prompt_buckets)
            if tail < length:
                self.prefix_store.count(match)
                return self._prefill_reusing(match, arrays, real, tail, new_bucket)
        put = self._put_batch
        return self._prefill(self._params, put(tokens), put(mask), put(positions), put(lens),
                             put(real), new_bucket=new_bucket)

    def _prefill_reusing(self, match: Match, arrays: tuple[np.ndarray, ...], real: np.ndarray,
                         tail: int, new_bucket: int) -> DecodeState:
        """Copy each row's prompt columns before the last `tail` from its stored row, then
        prefill those `tail` columns. Row i's prompt sits at columns P - len_i .. P, so column c
        holds its token c - (P - len_i), which the stored row holds at slot start + that."""
        tokens, mask, positions, lens = arrays
        n = len(match.rows)
        batch, length = tokens.shape
        head = length - tail
        rows = np.zeros(batch, np.int32)
        shift = np.zeros(batch, np.int32)
        rows[:n] = match.rows
        shift[:n] = match.starts - (length - lens[:n])
        put = self._put_batch
        head_mask = put(mask[:, :head])
        # Two programs: the copy depends on the source's shape, the prefill only on this
        # group's (fewer compiles than one program keyed on both).
        k, v = self._copy_prefix(match.group.k, match.group.v, put(rows), put(shift), head_mask)
        return self._prefill_on(self._params, k, v, head_mask, put(tokens[:, head:]),
                                put(mask[:, head:]), put(positions[:, head:]), put(lens),
                                put(real), new_bucket=new_bucket)

    def _run_decode(self, state: DecodeState, params: SamplingParams, key: jax.Array,
                    rows: np.ndarray, n: int, matchers: list | None
                    ) -> tuple[DecodeState, np.ndarray, list[list[int]]]:
        """Run the compiled loop to the end; with stop strings, in chunks with host checks;
        with grammars other than choices, one step at a time (the host matchers make each
        step's mask).

        Returns the final state, which rows ended because their grammar completed, and per
        row the number of tokens each step's mask allowed (empty lists when unconstrained)."""
        args = self._sample_args(params, key, rows)
        greedy = params.is_greedy
        truncate = "none" if greedy else "top_k" if params.top_k_enabled \
            else "top_p" if params.top_p_enabled else "none"
        total = params.max_new_tokens
        grammar = "none"
        if matchers is not None:
            grammar = "choice" if self._device_choices and all(
                m is None or isinstance(m, ChoiceMatcher) for m in matchers) else "mask"
        grammar_end = np.zeros(len(state.done), bool)
        allowed: list[list[int]] = [[] for _ in range(len(state.done))]
        if grammar == "mask":
            bitmask = np.empty((len(state.done), self._constraints.words), np.int32)
            chunk = 1
        else:
            chunk = self._stop_check_interval if params.stop_strings else total
        if grammar == "choice":
            tables = choice_tables(matchers)
            put = self._put_replicated
            args = args._replace(choice_token=put(tables.token), choice_child=put(tables.child),
                                 choice_stop=put(tables.stop_ok), choice_end=put(tables.ends))
            state = state._replace(node=self._put_batch(tables.start))
        limit = 0
        while limit < total:
            limit = min(limit + chunk, total)
            if grammar == "mask":
                self._constraints.fill(matchers, bitmask)
                args = args._replace(allowed=self._put_batch(bitmask))
                counts = allowed_counts(bitmask, self.config.vocab_size)
                for row, count in zip(allowed, counts.tolist(), strict=True):
                    row.append(count)
            state = self._decode(self._params, state, np.int32(limit), args, greedy=greedy,
                                 truncate=truncate, grammar=grammar)
            if limit >= total:
                break
            done = np.array(jax.device_get(state.done))
            if grammar == "mask":
                self._advance_matchers(state, matchers, limit - 1, done, grammar_end)
            if params.stop_strings and (limit % self._stop_check_interval == 0
                                        or grammar != "mask"):
                done |= self._stop_string_done(state, params, n)
            if done[:n].all():
                break
            # Same sharding as before, so the next call reuses the compiled loop.
            state = state._replace(done=jax.device_put(done, state.done.sharding))
        if grammar == "choice":
            self._replay_matchers(state, matchers, grammar_end, allowed)
        return state, grammar_end, allowed

    @staticmethod
    def _replay_matchers(state: DecodeState, matchers: list, grammar_end: np.ndarray,
                         allowed: list[list[int]]) -> None:
        """Feed each row's tokens (decoded on device) to its `ChoiceMatcher`: how many tokens
        each step allowed, and which rows ended because their grammar completed (both updated
        in place)."""
        tokens, lengths, stopped = jax.device_get((state.tokens, state.lengths, state.stopped))
        for i, m in enumerate(matchers):
            if m is None:
                continue
            for t in tokens[i, :lengths[i]].tolist():
                allowed[i].append(len(set(m.allowed())))
                if not m.accept_token(t):
                    raise RuntimeError(f"row {i}: token {t} decoded on device is rejected by "
                                       "its choice grammar (tables and matcher disagree)")
            grammar_end[i] = m.is_terminated() and not stopped[i]

    @staticmethod
    def _advance_matchers(state: DecodeState, matchers: list, step: int, done: np.ndarray,
                          grammar_end: np.ndarray) -> None:
        """Feed each live row's token of `step` to its matcher; a completed grammar ends the
        row (`done`, `grammar_end` updated in place)."""
        tokens, lengths, stopped = jax.device_get((state.tokens[:, step], state.lengths,
                                                   state.stopped))
        for i, m in enumerate(matchers):
            if m is None or lengths[i] <= step or m.is_terminated():
                continue
            if not m.accept_token(int(tokens[i])):
                raise RuntimeError(f"row {i}: sampled token {int(tokens[i])} rejected by its "
                                   "grammar (mask and matcher disagree)")
            if m.is_terminated():
                done[i] = True
                grammar_end[i] = not stopped[i]  # ended by a stop token: that is the reason

    def _stop_string_done(self, state: DecodeState, params: SamplingParams,
                          n: int) -> np.ndarray:
        """`state.done` [B] plus the rows whose text so far contains a stop string."""
        tokens, lengths, done = jax.device_get((state.tokens, state.lengths, state.done))
        done = np.array(done)
        for i in range(n):
            if not done[i]:
                text = self._decode_text(tokens[i, :lengths[i]].tolist())
                done[i] = any(s in text for s in params.stop_strings)
        return done

    def _completion(self, host: tuple[np.ndarray, ...], i: int, params: SamplingParams,
                    version: int, grammar_end: bool = False,
                    allowed: list[int] | None = None) -> Completion:
        tokens, logprobs, lengths, stopped = host
        n = int(lengths[i])
        ids = tokens[i, :n].tolist()
        reason = "stop_token" if stopped[i] else "grammar" if grammar_end else "length"
        completion = Completion(ids, logprobs[i, :n].tolist(), reason,
                                ids[-1] if stopped[i] else None, version,
                                None if allowed is None else allowed[:n])
        if params.stop_strings:
            completion = apply_stop_strings(completion, self._decode_text, params.stop_strings)
        return completion

    def _sample_args(self, params: SamplingParams, key: jax.Array,
                     rows: np.ndarray) -> SampleArgs:
        stops = sorted(set(params.stop_token_ids))
        # A power-of-two count (>= 1), padded with -1, so the stop list rarely retraces.
        stop_ids = np.full((1 << max(len(stops) - 1, 0).bit_length(),), -1, np.int32)
        stop_ids[:len(stops)] = stops
        temperature = 1.0 if params.is_greedy else params.temperature
        table, flags = np.zeros((1, 1), np.int32), np.zeros((1,), bool)
        return SampleArgs(np.float32(temperature), np.int32(max(params.top_k, 0)),
                          np.float32(params.top_p), np.int32(params.max_new_tokens), stop_ids,
                          key, self._put_batch(rows), table, table, table, flags, flags)

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        vocab = self.config.vocab_size
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty (need at least one token)")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i}: token ids {bad[:5]} outside [0, {vocab})")
            out.append(p)
        return out

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
        pad = self._pad_id
        V = self.config.vocab_size
        allowed = unpack_bitmask(args.allowed, V) if grammar == "mask" else None
        # Stop tokens as a [V] mask (-1 padding dropped): a complete option may end on one.
        is_stop = stop_token_mask(args.stop_ids, V)

        def cond(s: DecodeState) -> jax.Array:
            return (s.step < jnp.minimum(limit, args.max_new)) & ~jnp.all(s.done)

        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(args.key, args.rows)

        def body(s: DecodeState) -> DecodeState:
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, s.step)
            mask = allowed
            if grammar == "choice":
                mask, kids, at = choice_mask(s.node, args.choice_token, args.choice_stop,
                                             is_stop)
            tok, lp = sample_logits(s.logits, keys, args.temperature, args.top_k, args.top_p,
                                    greedy=greedy, truncate=truncate, allowed=mask)
            active = ~s.done
            tok = jnp.where(active, tok, pad)
            lp = jnp.where(active, lp, 0.0)
            hit = active & jnp.any(tok[:, None] == args.stop_ids[None, :], axis=-1)
            node, ended = s.node, jnp.zeros_like(hit)
            if grammar == "choice":
                node, ended = choice_advance(s.node, tok, active, kids, at, args.choice_child,
                                             args.choice_end)
            hidden, cache = model.hidden_states(
                tok[:, None], (s.prompt_lens + s.step)[:, None],
                jnp.ones((tok.shape[0], 1), bool), s.cache)
            new = DecodeState(
                cache, model.logits(hidden[:, 0]),
                jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step)),
                jax.lax.dynamic_update_slice(s.logprobs, lp[:, None], (0, s.step)),
                s.lengths + active.astype(jnp.int32), s.prompt_lens,
                s.done | hit | ended | (s.step + 1 >= args.max_new), s.stopped | hit, node,
                s.step + 1)
            return self._constrain(new)

        return jax.lax.while_loop(cond, body, state)


def _check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(int(b) for b in buckets)))
    if not out or out[0] < 1:
        raise ValueError(f"{name}={tuple(buckets)} must be a non-empty set of positive ints")
    return out


def _flat_arrays(weights: nnx.Module | nnx.State) -> FlatParams:
    """{path: array} of a module's state or of an `nnx.State` (Variable or array leaves)."""
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights)
    if not isinstance(weights, nnx.State):
        raise TypeError(f"update_weights: expected an nnx.Module or nnx.State, got "
                        f"{type(weights).__name__}")
    return {p: v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(weights)}

