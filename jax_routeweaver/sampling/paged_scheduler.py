"""The host side of one paged `generate` call (`PagedCall`): its rows' queue, the decode slots,
admissions, preemptions, host checks and retirements, and the arrays it hands the engine's
compiled steps (`Slots`, `StepArgs`).

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
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from jax_routeweaver.sampling.base import Completion, SamplingParams, apply_stop_strings
from jax_routeweaver.sampling.constraints import (
    ChoiceMatcher,
    Grammar,
    allowed_counts,
    choice_tables,
)
from jax_routeweaver.sampling.paged_options import (
    MIN_CHUNK,
    MIN_SLOTS,
    MIN_WIDTH,
    PREFILL_TOKENS,
    pow2,
)

if TYPE_CHECKING:
    from jax_routeweaver.sampling.paged_engine import FlatParams, PagedEngine


class Slots(NamedTuple):
    """Per decode slot of a launch, `[S]` each (S <= max_rows: the first S slots; empty
    slots are done)."""

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
    prefix_hits: int = 0      # admissions whose prompt started with cached pages
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


# ------------------------------------------------------------------------------ one call
class PagedCall:
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
        self.stats.prefix_hits += sum(start > 0 for _, _, start in todo)
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
        """One launch of up to `steps` decode steps over the first S slots (S: the power of
        two past the highest live slot; rows take the lowest free slots, so the live ones stay
        packed and a call with few rows decodes few); the rows take their new tokens."""
        last = max(i for i, r in enumerate(self.slots) if r is not None)
        rows = self.slots[:min(self.B, pow2(last + 1, MIN_SLOTS))]
        width = pow2(max(len(self.cache.rows[r.index]) for r in rows if r is not None),
                     MIN_WIDTH)
        table = self.cache.table([None if r is None else r.index for r in rows], width)
        args = self.args
        if self.grammar == "mask":
            args = args._replace(allowed=self.e.put(self._host_masks(rows)))
        out, toks, lps = self.e.run_decode(
            self.params, table, self._slot_arrays(rows), args, steps=self.steps,
            greedy=self.greedy, truncate=self.truncate, grammar=self.grammar)
        self.stats.decode_launches += 1
        for i, r in enumerate(rows):
            if r is None:
                continue
            n = int(out.steps[i]) - len(r.tokens)
            r.tokens.extend(toks[i, :n].tolist())
            r.logprobs.extend(lps[i, :n].tolist())
            r.done, r.stopped, r.node = bool(out.done[i]), bool(out.stopped[i]), int(out.node[i])

    @staticmethod
    def _slot_arrays(slots: list[_Row | None]) -> Slots:
        """These slots' host state as numpy `Slots` (empty slots: done, nothing cached)."""
        B = len(slots)
        lengths, steps, rows = (np.zeros(B, np.int32) for _ in range(3))
        done, stopped = np.ones(B, bool), np.zeros(B, bool)
        node = np.full(B, -1, np.int32)
        for i, r in enumerate(slots):
            if r is not None:
                lengths[i], steps[i], rows[i] = len(r.prompt) + len(r.tokens), len(r.tokens), \
                    r.index
                done[i], stopped[i], node[i] = r.done, r.stopped, r.node
        return Slots(lengths, steps, rows, done, stopped, node)

    def _host_masks(self, slots: list[_Row | None]) -> np.ndarray:
        """These slots' grammar bitmasks `[S, W]` for the next token (xgrammar or choice
        matchers on the host); each live constrained row records its allowed count."""
        constraints = self.e.constraints
        matchers = [None if r is None else r.matcher for r in slots]
        bitmask = constraints.fill(matchers, np.empty((len(slots), constraints.words),
                                                      np.int32))
        counts = allowed_counts(bitmask, self.e.config.vocab_size)
        for r, count in zip(slots, counts.tolist(), strict=True):
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
