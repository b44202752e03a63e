"""`JaxSampler`: batched generation with a `Qwen3` in this process (jitted prefill + decode loop).

This module holds the sampler itself: its construction, the `Sampler` protocol (weights,
versions, seeds, shape state) and `generate`, which checks a call and hands it to one of two
engines. The default, `kv_cache="paged"`, is `paged_engine` (continuous batching over a page
pool). `kv_cache="dense"` sorts the prompts by length and cuts them into groups, each with
its own dense cache; that path is spread over:

    dense_buckets  the shape buckets a group pads to, and where a call is cut into groups
    dense_groups   one group on the host: its prefill (reusing stored prefixes), the decode
                   loop's host checks (stop strings, grammars), its completions
    dense_steps    the compiled prefill, prefix copy and decode loop, and the layout of their
                   arrays on a mesh

The dense path is faster only where every row of a call has the same prompt and completion
length, and it splits a call's rows over the mesh's batch axes (the paged engine replicates
them); docs/paged_sampler.md, "Which engine", has the figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, Rules, param_specs
from jax_routeweaver.sampling.base import Completion, Decode, SamplingParams, check_version
from jax_routeweaver.sampling.constraints import Grammar, GrammarConstraints
from jax_routeweaver.sampling.dense_buckets import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_PROMPT_BUCKETS,
    GROUP_COST,
    NEW_SHAPE_COST,
    check_buckets,
    length_groups,
    new_token_bucket,
)
from jax_routeweaver.sampling.dense_groups import DenseGroups
from jax_routeweaver.sampling.dense_steps import FlatParams
from jax_routeweaver.sampling.paged_engine import PagedEngine
from jax_routeweaver.sampling.paged_options import PagedConfig
from jax_routeweaver.sampling.prefix_cache import PrefixStore


# ------------------------------------------------------------------------------ sampler
class JaxSampler(DenseGroups):
    """Generates with a `Qwen3` on this process's devices; implements `sampling.base.Sampler`.

    `decode` (token ids -> text) is needed only for stop strings. With `mesh`, parameters are
    placed by `rules` (default SAMPLE_RULES: tensor parallel, replicated over fsdp); the dense
    path splits the batch over the `batch` rule and its KV cache over batch and kv heads, the
    paged engine its pool over kv heads (see `paged_engine`). The sampler keeps
    its own reference to the weights (aliasing the given model's arrays when no move is needed;
    don't donate them elsewhere); `update_weights` copies. With stop strings the host checks
    the text every `stop_check_interval` decode steps and ends finished rows' work.

    `kv_cache="paged"` (the default; `paged`: its `PagedConfig`, or a config section with
    those fields) generates through `paged_engine`: a page pool of a fixed budget, continuous
    batching over `max_rows` slots, shared prefix pages and an episode's earlier turns kept in
    place. `kv_cache="dense"` runs the groups of `dense_groups`; the options below down to
    `new_shape_cost` apply to it only. Both give the same tokens and logprobs (up to float
    summation order).

    `prefix_cache_mb`: memory for reusing earlier calls' KV caches (see `dense_groups`;
    0 turns it off; `prefix_store.hits` / `.reused` count prompts and tokens reused).
    `device_choices=False` decodes choice grammars with the host matchers too (one round trip
    per token; same tokens, slower). `group_cost`: the padded prompt tokens one more group is
    worth (`length_groups`); None runs each call in groups of the largest batch bucket.
    `new_shape_cost`: what a group of a (batch, prompt) bucket pair this sampler has not run
    yet costs on top (its compiles), so calls settle on shapes already compiled.

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
                 new_shape_cost: int = NEW_SHAPE_COST, kv_cache: str = "paged",
                 paged: PagedConfig | Any = None):
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
        self._prompt_buckets = check_buckets("prompt_buckets",
                                             prompt_buckets or DEFAULT_PROMPT_BUCKETS)
        self._batch_buckets = self._usable_batch_buckets(check_buckets("batch_buckets",
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
            self.config, self._graphdef, PagedConfig.of(paged), pad_id=pad_id, mesh=mesh,
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

    def take_prefix_counts(self) -> tuple[int, int]:
        """(prompts that reused cached keys and values, the tokens reused) since the last call
        of this. The dense path's stored caches are dropped too (they would otherwise stay in
        device memory through the update); the paged pool is allocated once and kept."""
        if self.engine is not None:
            return self.engine.take_counts()
        counts = self.prefix_store.hits, self.prefix_store.reused
        self.prefix_store.clear()
        return counts

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


def _flat_arrays(weights: nnx.Module | nnx.State) -> FlatParams:
    """{path: array} of a module's state or of an `nnx.State` (Variable or array leaves)."""
    if isinstance(weights, nnx.Module):
        weights = nnx.state(weights)
    if not isinstance(weights, nnx.State):
        raise TypeError(f"update_weights: expected an nnx.Module or nnx.State, got "
                        f"{type(weights).__name__}")
    return {p: v.get_value() if isinstance(v, nnx.Variable) else v
            for p, v in nnx.to_flat_state(weights)}

