"""The host side of the dense path: one padded group of prompts, from its prefill to its
completions.

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

import jax
import numpy as np

from jax_routeweaver.sampling.base import Completion, SamplingParams, apply_stop_strings
from jax_routeweaver.sampling.constraints import (
    ChoiceMatcher,
    Grammar,
    allowed_counts,
    choice_tables,
)
from jax_routeweaver.sampling.dense_buckets import left_pad, new_token_bucket, pick_bucket
from jax_routeweaver.sampling.dense_steps import DecodeState, DenseSteps, SampleArgs
from jax_routeweaver.sampling.prefix_cache import Match


class DenseGroups(DenseSteps):
    """Runs one group of a `generate` call on the dense path (a mixin of `JaxSampler`).

    Besides what `DenseSteps` needs, the class that mixes it in sets `_params` (the flat
    weights), `_prefill`, `_prefill_on`, `_copy_prefix` and `_decode` (the jitted steps),
    `_batch_buckets`, `_prompt_buckets`, `_shapes` (the (B, P, N) shapes run), `prefix_store`,
    `_constraints`, `_decode_text`, `_device_choices` and `_stop_check_interval`.
    """

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

