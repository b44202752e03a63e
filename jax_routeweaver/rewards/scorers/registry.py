"""The `scorer_dataset` -> scorer registry (the original's `bench_scoring.score` dispatch).

A scorer is `scorer(prediction, gold, meta) -> ScoreResult`: the extracted answer text, the
accepted gold answers and the row's `meta` (code scorers read their tests there). Dispatch is
an exact dictionary lookup on the name — no aliases, no fallback: an unknown name raises
`UnknownScorerError`, which the reward turns into `sandbox_error` (the row is dropped as infra,
the original's "anything else" case).

Built-in scorers live in sibling modules that register themselves on import (`math_equiv`,
`text`, and `code`, the last written separately); `get_scorer` and `known_scorers` import them
on first use, so importing this module stays cheap and free of import cycles.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "ScoreResult",
    "Scorer",
    "UnknownScorerError",
    "get_scorer",
    "gold_list",
    "known_scorers",
    "register",
    "score",
]


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """One verdict. `correct` drives the reward; `em` / `f1` are reported beside it."""

    correct: bool
    em: float = 0.0
    f1: float = 0.0
    detail: str = ""


Scorer = Callable[[str, Sequence[str], Mapping[str, Any]], ScoreResult]


class UnknownScorerError(KeyError):
    """No scorer is registered under the requested `scorer_dataset` name."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; show the message as written.
        return str(self.args[0]) if self.args else ""


_SCORERS: dict[str, Scorer] = {}
_BUILTIN_MODULES = ("jax_routeweaver.rewards.scorers.math_equiv",
                    "jax_routeweaver.rewards.scorers.text")
_CODE_MODULE = "jax_routeweaver.rewards.scorers.code"


def register(*names: str) -> Callable[[Scorer], Scorer]:
    """Decorator: register a scorer under one or more `scorer_dataset` names.

    A name registered twice is an error (two scorers for one dataset would make the verdict
    depend on import order).
    """
    if not names:
        raise ValueError("register() needs at least one scorer name")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"scorer names must be non-empty strings, got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"register(): a name is repeated in {names!r}")

    def decorate(scorer: Scorer) -> Scorer:
        taken = [name for name in names if name in _SCORERS]
        if taken:
            owners = ", ".join(f"{n!r} by {_qualname(_SCORERS[n])}" for n in taken)
            raise ValueError(f"cannot register {_qualname(scorer)}: already registered: {owners}")
        for name in names:
            _SCORERS[name] = scorer
        return scorer

    return decorate


def _qualname(scorer: Scorer) -> str:
    module = getattr(scorer, "__module__", "?")
    return f"{module}.{getattr(scorer, '__qualname__', repr(scorer))}"


def _load_builtin() -> None:
    """Import the scorer modules (each registers itself once; re-imports are no-ops).

    The code module is written separately: only its absence is tolerated, never an error
    raised while importing it.
    """
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    if importlib.util.find_spec(_CODE_MODULE) is not None:
        importlib.import_module(_CODE_MODULE)


def known_scorers() -> list[str]:
    """Every registered `scorer_dataset` name, sorted."""
    _load_builtin()
    return sorted(_SCORERS)


def get_scorer(name: str) -> Scorer:
    """The scorer registered under `name`; `UnknownScorerError` (a KeyError) if there is none."""
    _load_builtin()
    try:
        return _SCORERS[name]
    except (KeyError, TypeError):
        pass
    hint = ""
    if importlib.util.find_spec(_CODE_MODULE) is None:
        hint = f" (the code scorers module {_CODE_MODULE} is not available)"
    raise UnknownScorerError(
        f"unknown scorer_dataset {name!r}; known scorers: {', '.join(sorted(_SCORERS))}{hint}")


def score(name: str, prediction: str, gold: Sequence[str],
          meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """Score `prediction` against `gold` with the scorer registered under `name`."""
    return get_scorer(name)(prediction, gold, {} if meta is None else meta)


def gold_list(gold: str | Sequence[Any], scorer: str = "scorer") -> list[str]:
    """The gold answers as a list of strings; a bare string is one answer, not its characters.

    An empty list is an error: every non-code row carries at least one answer (records.py), and
    the original fails on an empty list too (`gold[0]`, `max()` of nothing) — the reward then
    drops the row as `sandbox_error` instead of grading it wrong.
    """
    items = [gold] if isinstance(gold, str) else [str(g) for g in gold]
    if not items:
        raise ValueError(f"{scorer}: gold is empty; at least one accepted answer is needed")
    return items
