"""Grammar-constrained decoding: EBNF grammars (xgrammar) -> per-step allowed-token bitmasks.

A `Grammar` is plain data (EBNF text + how it ends) so any sampler can take it: `JaxSampler`
applies the masks itself; a vLLM sidecar passes the same text to vLLM's structured outputs.
`GrammarConstraints` compiles grammars for one tokenizer and model vocabulary (cached by text)
and hands out matchers that track each row's progress.

A grammar over text admits every tokenization of a string: after `<mode>`, xgrammar allows
`a`, `ag` and `age` as first tokens of `agentic` but only `single` for single, so a
near-uniform (random-init) policy declares agentic ~3x as often as it should, by paths a
real tokenizer never produces. A finite choice (`Grammar.choice`) is therefore matched over
token ids instead: each option's canonical tokenization in a trie (`ChoiceMatcher`), so the
policy chooses among exactly the sequences a model (and the support loss) scores.

Bitmask layout (xgrammar's): `[B, ceil(V / 32)]` int32; token t is allowed iff bit t % 32 of
word t // 32 is set. A batch whose grammars are all choices can instead be decoded on device
from its tries as arrays (`choice_tables`), without a host round trip per token.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What one row may generate. `ebnf`: xgrammar EBNF with a `root` rule.

    `end_with_stop_token=False`: the row ends as soon as the grammar is complete (turns cut at
    a closing tag, like the RouteWeaver route turn). True: once complete, only the sampling
    call's stop tokens are allowed, and the row ends on one (turns that end with EOS).
    """

    ebnf: str
    end_with_stop_token: bool = False
    choices: tuple[str, ...] = ()

    @classmethod
    def choice(cls, options: Sequence[str], end_with_stop_token: bool = False) -> Grammar:
        """Exactly one of `options`, each in its canonical tokenization (`ChoiceMatcher`);
        `ebnf` is the same language as text, for samplers that only take EBNF."""
        if not options:
            raise ValueError("Grammar.choice needs at least one option")
        ebnf = "root ::= " + " | ".join(ebnf_literal(o) for o in options)
        return cls(ebnf, end_with_stop_token, tuple(options))


def ebnf_literal(text: str) -> str:
    """`text` as an xgrammar EBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class ChoiceMatcher:
    """Matches one of a finite set of token sequences (a trie), with xgrammar's matcher
    interface as `JaxSampler` uses it (`accept_token`, `is_terminated`) plus `fill_row`.

    Without `stop_token_ids` the row ends when a sequence completes, so no sequence may be a
    prefix of another; with them, a completed sequence may only be followed by a stop token
    (or continue into a longer one) and the row ends on the stop token.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], stop_token_ids: Sequence[int] = ()):
        self._stops = tuple(int(t) for t in stop_token_ids)
        # Identifies the trie: `choice_tables` lays out each distinct one once per batch.
        self.key = (tuple(tuple(int(t) for t in s) for s in sequences), self._stops)
        self._root: dict = {}
        for seq in sequences:
            if not seq:
                raise ValueError("ChoiceMatcher: an option encodes to no tokens")
            node = self._root
            for t in seq:
                node = node.setdefault(int(t), {})
            node[None] = True  # terminal marker
        if not self._stops:
            for seq in sequences:
                node = self._root
                for t in seq:
                    node = node[int(t)]
                if len(node) > 1:
                    raise ValueError(f"ChoiceMatcher: option {list(seq)} is a prefix of another "
                                     "and nothing (no stop token) ends the shorter one")
        self._node = self._root
        self._done = False

    def allowed(self) -> list[int]:
        """Token ids the next step may take (none once terminated)."""
        if self._done:
            return []
        ids = [t for t in self._node if t is not None]
        return ids + list(self._stops) if None in self._node else ids

    def fill_row(self, row: np.ndarray) -> None:
        """Write the next-token bitmask into `row` `[W]` int32 (xgrammar's bit layout)."""
        bits = np.zeros(row.shape[0] * 32, bool)
        bits[self.allowed()] = True
        row[:] = np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(
            np.uint32).view(np.int32).ravel()

    def accept_token(self, token: int) -> bool:
        token = int(token)
        if self._done:
            return False
        if None in self._node and token in self._stops:
            self._done = True
            return True
        if token not in self._node:
            return False
        self._node = self._node[token]
        self._done = not self._stops and self._node.keys() == {None}  # a leaf
        return True

    def is_terminated(self) -> bool:
        return self._done

    @property
    def fresh(self) -> bool:
        """Nothing accepted yet."""
        return self._node is self._root and not self._done

    def trie(self) -> tuple[dict, bool]:
        """The root node (token id -> child node; a `None` key marks a complete option) and
        whether stop tokens end the options (else a complete option ends the row)."""
        return self._root, bool(self._stops)


class ChoiceTables(NamedTuple):
    """A batch's `ChoiceMatcher` tries as arrays, for decoding on device (S nodes, C children
    per node, both padded). A row at node s may take `token[s, c]` (moving to `child[s, c]`),
    or a stop token where `stop_ok[s]`; entering a node with `ends` completes its grammar."""

    token: np.ndarray    # [S, C] int32 child token ids, -1 = no child
    child: np.ndarray    # [S, C] int32 child node ids
    stop_ok: np.ndarray  # [S] bool: an option is complete here and stop tokens may follow
    ends: np.ndarray     # [S] bool: a leaf of a trie without stop tokens (the row ends)
    start: np.ndarray    # [B] int32 each row's root node; -1 = an unconstrained row


def choice_tables(matchers: Sequence[ChoiceMatcher | None], *, min_nodes: int = 1024,
                  min_children: int = 8) -> ChoiceTables:
    """Lay out the fresh `matchers`' tries (each distinct trie once) as `ChoiceTables`, S and
    C padded to powers of two (at least `min_nodes`, `min_children`) so batches reuse
    compiled code."""
    nodes: list[dict] = []
    stops: list[bool] = []
    roots: dict[Any, int] = {}
    start = np.full(len(matchers), -1, np.int32)
    for i, m in enumerate(matchers):
        if m is None:
            continue
        if not m.fresh:
            raise ValueError(f"choice_tables: row {i}'s matcher has already accepted tokens")
        if m.key not in roots:
            roots[m.key] = len(nodes)
            root, has_stops = m.trie()
            queue = collections.deque([root])
            while queue:  # breadth first: a node's id is its position in `nodes`
                node = queue.popleft()
                nodes.append(node)
                stops.append(has_stops)
                queue.extend(c for t, c in node.items() if t is not None)
        start[i] = roots[m.key]
    width = max((sum(t is not None for t in n) for n in nodes), default=1)
    S = max(min_nodes, 1 << (len(nodes) - 1).bit_length())
    C = max(min_children, 1 << (width - 1).bit_length())
    token = np.full((S, C), -1, np.int32)
    child = np.zeros((S, C), np.int32)
    stop_ok = np.zeros(S, bool)
    ends = np.zeros(S, bool)
    ids = {id(n): k for k, n in enumerate(nodes)}
    for k, (node, has_stops) in enumerate(zip(nodes, stops, strict=True)):
        kids = [(t, c) for t, c in node.items() if t is not None]
        for c, (t, kid) in enumerate(kids):
            token[k, c] = t
            child[k, c] = ids[id(kid)]
        stop_ok[k] = None in node and has_stops
        ends[k] = not has_stops and not kids
    return ChoiceTables(token, child, stop_ok, ends, start)


class GrammarConstraints:
    """Compiles `Grammar`s for `tokenizer` with a model vocabulary of `vocab_size` ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_threads: int = 2):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._compiled: dict[str, Any] = {}
        self._tokenizer = tokenizer
        self._encoded: dict[str, tuple[int, ...]] = {}

    def compile(self, ebnf: str) -> Any:
        """The compiled grammar (cached by text); ValueError naming the grammar if invalid."""
        if ebnf not in self._compiled:
            try:
                self._compiled[ebnf] = self._compiler.compile_grammar(ebnf)
            except RuntimeError as e:
                snippet = ebnf if len(ebnf) < 200 else ebnf[:200] + " ..."
                raise ValueError(f"invalid grammar {snippet!r}: {e}") from e
        return self._compiled[ebnf]

    def encode(self, text: str) -> tuple[int, ...]:
        """`text`'s canonical token ids (cached); ValueError if one is outside the vocab."""
        if text not in self._encoded:
            ids = tuple(self._tokenizer.encode(text, add_special_tokens=False))
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"choice {text!r} encodes to ids {ids} beyond the model "
                                 f"vocabulary ({self.vocab_size})")
            self._encoded[text] = ids
        return self._encoded[text]

    def matcher(self, grammar: Grammar, stop_token_ids: Sequence[int] = ()) -> Any:
        """A fresh matcher for one row: a `ChoiceMatcher` for `Grammar.choice`, else
        xgrammar's."""
        if grammar.end_with_stop_token and not stop_token_ids:
            raise ValueError("Grammar(end_with_stop_token=True) needs stop_token_ids in the "
                             "SamplingParams")
        stops = list(stop_token_ids) if grammar.end_with_stop_token else []
        if grammar.choices:
            return ChoiceMatcher([self.encode(c) for c in grammar.choices], stops)
        kwargs: dict[str, Any] = {"terminate_without_stop_token": not grammar.end_with_stop_token}
        if stops:
            kwargs["override_stop_tokens"] = stops
        return self._xgr.GrammarMatcher(self.compile(grammar.ebnf), **kwargs)

    def fill(self, matchers: Sequence[Any | None], out: np.ndarray) -> np.ndarray:
        """Write each row's next-token bitmask into `out` `[B, W]` int32 (rows without a live
        matcher: everything allowed); returns `out`."""
        import torch

        out[...] = -1
        view = torch.from_numpy(out)  # shares memory: xgrammar fills a torch tensor in place
        for i, m in enumerate(matchers):
            if m is None or m.is_terminated():
                continue
            if isinstance(m, ChoiceMatcher):
                m.fill_row(out[i])
            else:
                m.fill_next_token_bitmask(view, i)
        return out


def allowed_counts(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """`[B, W]` int32 bitmask -> `[B]` how many ids below `vocab_size` each row allows."""
    bits = np.bitwise_count(bitmask.view(np.uint32)).astype(np.int64)
    full, rest = divmod(vocab_size, 32)
    count = bits[:, :full].sum(1)
    if rest:
        tail = bitmask[:, full].view(np.uint32) & np.uint32((1 << rest) - 1)
        count += np.bitwise_count(tail)
    return count


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """`[B, W]` int32 bitmask -> `[B, vocab_size]` bool (True = allowed)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)
