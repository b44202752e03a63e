"""The sampling protocol shared by every generator: `SamplingParams`, `Completion`, `Sampler`.

Log-prob contract (all samplers): `Completion.logprobs[i]` is
`log_softmax(logits_i / temperature)[token_ids[i]]` in fp32, where `logits_i` are the model's
raw logits for that step and the temperature is applied but top-k / top-p truncation is NOT
(vLLM's "processed logprobs" with temperature only). Greedy decoding uses temperature 1.

Stop strings are matched in token space: the completion is cut after the shortest token prefix
whose decoded text contains a stop string (`find_stop_string`), the string's tokens kept and
never re-tokenised (RouteWeaver: vLLM `include_stop_str_in_output=True`, then this cut).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop_token", "stop_string", "grammar", "length"]
FINISH_REASONS: tuple[str, ...] = ("stop_token", "stop_string", "grammar", "length")

Decode = Callable[[Sequence[int]], str]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. `temperature == 0` or `greedy=True` means argmax decoding.

    `top_k` 0 or -1 disables top-k; `top_p == 1` disables nucleus sampling. `seed` makes a call
    reproducible (same prompts + params + weights => same completions); None draws a fresh key.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):
            raise ValueError(f"SamplingParams.stop_strings={self.stop_strings!r} must be a "
                             "sequence of strings, not one string")
        # Accept lists for convenience but store tuples so the dataclass stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if (not isinstance(self.temperature, int | float) or not self.temperature >= 0
                or not math.isfinite(self.temperature)):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be a finite "
                             "number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 1, "
                             "or 0 / -1 for no top-k")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an "
                             "int >= 1")
        bad_ids = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad_ids:
            raise ValueError(f"SamplingParams.stop_token_ids: {bad_ids} are not token ids "
                             "(ints >= 0)")
        bad_strs = [s for s in self.stop_strings if not isinstance(s, str) or not s]
        if bad_strs:
            raise ValueError(f"SamplingParams.stop_strings: {bad_strs!r} must be non-empty "
                             "strings")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be an int or None")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def top_p_enabled(self) -> bool:
        return self.top_p < 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class Completion:
    """One generated continuation.

    `token_ids` exactly as sampled (the stop token included when one ended it; a stop string's
    tokens included when one did); `logprobs[i]` is the log-prob of `token_ids[i]` (see the
    module docstring for which distribution); `stop` is the token id or string that stopped it
    (None for "length"); `policy_version` the sampler's weights version that produced it.
    `allowed[i]`: how many tokens a grammar admitted at step i (None: unconstrained, or a
    sampler that does not report it); 1 means the grammar forced `token_ids[i]`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop: int | str | None = None
    policy_version: int = 0
    allowed: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Completion: {len(self.token_ids)} token_ids but "
                             f"{len(self.logprobs)} logprobs")
        if self.allowed is not None and len(self.allowed) != len(self.token_ids):
            raise ValueError(f"Completion: {len(self.token_ids)} token_ids but "
                             f"{len(self.allowed)} allowed counts")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason={self.finish_reason!r}: expected one of "
                             f"{FINISH_REASONS}")


@runtime_checkable
class Sampler(Protocol):
    """Anything that turns prompts (token ids) into `Completion`s with versioned weights."""

    @property
    def policy_version(self) -> int:
        """Version of the weights currently used (stamped on every Completion)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 grammars: Sequence[Any] | None = None) -> list[Completion]:
        """One Completion per prompt, in order. `grammars`: one `constraints.Grammar` (or
        None) per prompt; a sampler that cannot constrain raises ValueError if any is set."""
        ...

    def update_weights(self, weights: Any, version: int) -> None:
        """Swap in new weights; `version` must be > policy_version, else ValueError."""
        ...


def check_version(current: int, new: int) -> None:
    """Raise ValueError unless `new` is an int strictly greater than `current`."""
    if not _is_int(new) or new <= current:
        raise ValueError(f"policy version must strictly increase: current {current}, got {new!r}")


# ------------------------------------------------------------------------------ stop strings
def find_stop_string(token_ids: Sequence[int], decode: Decode,
                     stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """Shortest prefix of `token_ids` whose decoded text contains a stop string.

    Returns `(n, s)`: keep `token_ids[:n]` (the tokens spelling `s` included), `s` being the
    stop string found in `decode(token_ids[:n])` (the one starting first there; ties go to the
    earlier entry of `stop_strings`); None when the full text contains none. Binary search with
    O(log len) decode calls, assuming "decode(prefix) contains s" is monotone in the prefix
    length (true for detokenisers whose prefix texts extend each other).
    """
    if not stop_strings or not token_ids:
        return None

    def hit(n: int) -> bool:
        text = decode(token_ids[:n])
        return any(s in text for s in stop_strings)

    if not hit(len(token_ids)):
        return None
    lo, hi = 1, len(token_ids)  # invariant: hit(hi), and no prefix shorter than lo hits
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    text = decode(token_ids[:hi])
    found = [(text.find(s), i) for i, s in enumerate(stop_strings) if s in text]
    return hi, stop_strings[min(found)[1]]


def apply_stop_strings(completion: Completion, decode: Decode,
                       stop_strings: Sequence[str]) -> Completion:
    """`completion` cut after its first stop string (ids and logprobs together), or unchanged.

    A stop string completed only by the final stop token leaves the reason "stop_token".
    """
    found = find_stop_string(completion.token_ids, decode, stop_strings)
    if found is None:
        return completion
    n, s = found
    if n == len(completion.token_ids) and completion.finish_reason == "stop_token":
        return completion
    return dataclasses.replace(completion, token_ids=completion.token_ids[:n],
                               logprobs=completion.logprobs[:n], finish_reason="stop_string",
                               allowed=None if completion.allowed is None
                               else completion.allowed[:n],
                               stop=s)
