"""Grammar-constrained decoding: EBNF grammars (xgrammar) -> per-step allowed-token bitmasks.

A `Grammar` is plain data (EBNF text + how it ends) so any sampler can take it: `JaxSampler`
applies the masks itself; a vLLM sidecar passes the same text to vLLM's structured outputs.
`GrammarConstraints` compiles grammars for one tokenizer and model vocabulary (cached by text)
and hands out matchers that track each row's progress.

Bitmask layout (xgrammar's): `[B, ceil(V / 32)]` int32; token t is allowed iff bit t % 32 of
word t // 32 is set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

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

    def compile(self, ebnf: str) -> Any:
        """The compiled grammar (cached by text); ValueError naming the grammar if invalid."""
        if ebnf not in self._compiled:
            try:
                self._compiled[ebnf] = self._compiler.compile_grammar(ebnf)
            except RuntimeError as e:
                snippet = ebnf if len(ebnf) < 200 else ebnf[:200] + " ..."
                raise ValueError(f"invalid grammar {snippet!r}: {e}") from e
        return self._compiled[ebnf]

    def matcher(self, grammar: Grammar, stop_token_ids: Sequence[int] = ()) -> Any:
        """A fresh xgrammar matcher for one row."""
        kwargs: dict[str, Any] = {"terminate_without_stop_token": not grammar.end_with_stop_token}
        if grammar.end_with_stop_token:
            if not stop_token_ids:
                raise ValueError("Grammar(end_with_stop_token=True) needs stop_token_ids in the "
                                 "SamplingParams")
            kwargs["override_stop_tokens"] = list(stop_token_ids)
        return self._xgr.GrammarMatcher(self.compile(grammar.ebnf), **kwargs)

    def fill(self, matchers: Sequence[Any | None], out: np.ndarray) -> np.ndarray:
        """Write each row's next-token bitmask into `out` `[B, W]` int32 (rows without a live
        matcher: everything allowed); returns `out`."""
        import torch

        out[...] = -1
        view = torch.from_numpy(out)  # shares memory: xgrammar fills a torch tensor in place
        for i, m in enumerate(matchers):
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(view, i)
        return out


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """`[B, W]` int32 bitmask -> `[B, vocab_size]` bool (True = allowed)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)
