"""Text scorers: letter, SAT/UNSAT, TriviaQA alias EM, short-answer EM / containment.

Each scorer takes the already-extracted answer (router `<answer>` body or `extract_answer` of a
worker reply, docs/protocol.md, "Candidate answers of worker replies") and applies the
original's own normalisation, reproduced exactly:

=====================================  =========================================================
`mc_letter` `supergpqa` `longbench_v2`  uppercase; LAST standalone `\\b[A-J]\\b`; equal to
                                        `gold[0].strip().upper()`
`binary_sat` `satbench`                 SAT/UNSAT by the last mention; YES/TRUE/NO/FALSE as the
                                        whole answer; equal to `gold[0]` (gold not normalised)
`triviaqa`                              SQuAD normalisation; non-empty and equal to an alias
`simpleqa_verified` `musique_100`       `short_norm` equal, or a gold inside the prediction with
`qa_subem` (PopQA)                      alphanumeric boundaries (one direction: gold in answer)
`bbeh_mini`                             `short_norm` equal, no containment
=====================================  =========================================================

Helpers: `normalize_answer` / `squad_em` / `squad_f1` (SQuAD, as Router-R1's reward) and
`short_norm` / `short_f1` (the short-answer normaliser of `bench_scoring._norm`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.rewards.scorers.registry import ScoreResult, gold_list, register

__all__ = [
    "contains_bounded",
    "normalize_answer",
    "pick_letter",
    "pick_sat",
    "score_exact_short",
    "score_letter",
    "score_popqa",
    "score_sat",
    "score_short_answer",
    "score_subem",
    "score_triviaqa",
    "short_f1",
    "short_norm",
    "squad_em",
    "squad_f1",
]

# ------------------------------------------------------------------ SQuAD normalisation

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_STANCE = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """SQuAD: lowercase, drop ASCII punctuation, articles a/an/the -> space, collapse spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_em(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the SQuAD-normalised prediction equals some normalised gold (empty == empty)."""
    norm = normalize_answer(prediction)
    return float(any(normalize_answer(g) == norm for g in golds))


def squad_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 with the stance rule: `yes`/`no`/`noanswer` on either side must match
    the other side exactly, else 0."""
    pred, truth = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _STANCE or truth in _STANCE) and pred != truth:
        return 0.0
    return token_f1(pred.split(), truth.split())


def token_f1(pred: Sequence[str], truth: Sequence[str]) -> float:
    """Harmonic mean of token precision and recall over the multiset intersection."""
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(truth)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------- short-answer normalisation

# No word boundary after "answer": the original strips that prefix from "answers" too. Both
# sides go through the same function, so the quirk is kept for fidelity.
_ANSWER_PREFIX = re.compile(r"^(the\s+)?(final\s+)?answer\s*(is|:)?\s*")
_TRAILING_JUNK = re.compile(r"[*.\s]+$")
_SPACES = re.compile(r"\s+")
_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def short_norm(text: str | None) -> str:
    """The original's `_norm`: lowercase, strip, drop a leading "(the )(final )answer (is|:)", drop
    trailing `*` / `.` / spaces, collapse whitespace."""
    text = str(text or "").strip().lower()
    text = _ANSWER_PREFIX.sub("", text, count=1)
    text = _TRAILING_JUNK.sub("", text)
    return _SPACES.sub(" ", text).strip()


def _short_tokens(text: str | None) -> list[str]:
    return [t for t in _NON_ALNUM.split(short_norm(text)) if t]


def short_f1(prediction: str | None, gold: str) -> float:
    """Token F1 over ASCII-alphanumeric runs of `short_norm` text; two empty sides score 1."""
    pred, truth = _short_tokens(prediction), _short_tokens(gold)
    if not pred or not truth:
        return float(pred == truth)
    return token_f1(pred, truth)


def contains_bounded(haystack: str, needle: str) -> bool:
    """`needle` occurs in `haystack` with no ASCII letter/digit on either side
    ("paris" is in "paris france", not in "parisian")."""
    pattern = rf"(?<![0-9a-z]){re.escape(needle)}(?![0-9a-z])"
    return re.search(pattern, haystack) is not None


# --------------------------------------------------------------------------- scorers

def _text(prediction: str | None) -> str:
    return "" if prediction is None else str(prediction)


_LETTER = re.compile(r"\b([A-J])\b")


def pick_letter(answer: str | None) -> str | None:
    """The LAST standalone letter A-J of the uppercased answer, or None (the original's SuperGPQA
    rule)."""
    hits = _LETTER.findall(_text(answer).upper())
    return hits[-1] if hits else None


@register("mc_letter", "supergpqa", "longbench_v2")
def score_letter(prediction: str, gold: Sequence[str],
                 meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """Correct iff the picked letter equals `gold[0].strip().upper()`; em = f1 = correct."""
    golds = gold_list(gold, "letter scorer")
    picked = pick_letter(prediction)
    ok = picked is not None and picked == golds[0].strip().upper()
    return ScoreResult(ok, float(ok), float(ok), f"picked={picked}")


_UNSAT = re.compile(r"\bUNSAT(ISFIABLE)?\b")
# The look-behind is the original's; `\b` alone already rejects the SAT inside UNSAT.
_SAT = re.compile(r"(?<!UN)\bSAT(ISFIABLE)?\b")
_SAT_WORDS = {"YES": "SAT", "TRUE": "SAT", "NO": "UNSAT", "FALSE": "UNSAT"}


def pick_sat(answer: str | None) -> str | None:
    """The original's SATBench rule: "SAT", "UNSAT" or None.

    Uppercase; if only one of UNSAT(ISFIABLE) / SAT(ISFIABLE) occurs as a word, that one; if
    both, the one whose last occurrence ends later; if neither, the whole answer without a
    trailing `.` read as YES/TRUE -> SAT, NO/FALSE -> UNSAT.
    """
    text = _text(answer).upper()
    unsat_ends = [m.end() for m in _UNSAT.finditer(text)]
    sat_ends = [m.end() for m in _SAT.finditer(text)]
    if unsat_ends and sat_ends:
        return "UNSAT" if max(unsat_ends) > max(sat_ends) else "SAT"
    if unsat_ends:
        return "UNSAT"
    if sat_ends:
        return "SAT"
    return _SAT_WORDS.get(text.strip().rstrip("."))


@register("binary_sat", "satbench")
def score_sat(prediction: str, gold: Sequence[str],
              meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """Correct iff the picked label equals `gold[0]` exactly (the original does not normalise
    the gold: it must be "SAT" or "UNSAT"); em = f1 = correct."""
    golds = gold_list(gold, "SAT scorer")
    picked = pick_sat(prediction)
    ok = picked is not None and picked == golds[0]
    return ScoreResult(ok, float(ok), float(ok), f"picked={picked}")


@register("triviaqa")
def score_triviaqa(prediction: str, gold: Sequence[str],
                   meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """Alias-aware binary EM: the SQuAD-normalised prediction is non-empty and equals some
    normalised alias. No containment ("Paris, Texas" is not "Paris"). f1 = best SQuAD F1."""
    aliases = gold_list(gold, "triviaqa scorer")
    answer = _text(prediction)
    norm = normalize_answer(answer)
    matched = next((a for a in aliases if norm and normalize_answer(a) == norm), None)
    f1 = max(squad_f1(answer, a) for a in aliases)
    detail = f"alias_binary_em matched={matched!r}" if matched is not None else "no match"
    if not answer.strip():
        detail = "not attempted"
    ok = matched is not None
    return ScoreResult(ok, float(ok), f1, detail)


def score_short_answer(prediction: str | None, gold: Sequence[str], *, containment: bool,
                       both_ways: bool = False) -> ScoreResult:
    """The original's `_em_short`. em = `short_norm` equality with some gold. With
    `containment`, a miss is still correct when a non-empty normalised gold occurs in the
    non-empty normalised prediction with alphanumeric boundaries (`contains_bounded`);
    `both_ways` also accepts the prediction inside a gold (implemented by the original,
    enabled by none of its scorers).
    f1 = best `short_f1`.
    """
    golds = gold_list(gold, "short-answer scorer")
    norm = short_norm(prediction)
    norm_golds = [short_norm(g) for g in golds]
    em = any(norm == g for g in norm_golds)
    detail = "em" if em else "no match"
    correct = em
    if not em and containment and norm:
        for g in norm_golds:
            if g and (contains_bounded(norm, g) or (both_ways and contains_bounded(g, norm))):
                correct, detail = True, "sub_em"
                break
    if not _text(prediction).strip():
        detail = "not attempted"
    f1 = max(short_f1(prediction, g) for g in golds)
    return ScoreResult(correct, float(em), f1, detail)


@register("simpleqa_verified", "musique_100")
def score_subem(prediction: str, gold: Sequence[str],
                meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """SimpleQA-Verified / MuSiQue: short-answer EM or boundary-aware containment of a gold."""
    return score_short_answer(prediction, gold, containment=True)


@register("qa_subem")
def score_popqa(prediction: str, gold: Sequence[str],
                meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """PopQA: the same containment, one direction only — a gold inside the prediction
    ("diplomat and statesman" passes "diplomat"; "Catholic" fails "Catholic Church")."""
    return score_short_answer(prediction, gold, containment=True, both_ways=False)


@register("bbeh_mini")
def score_exact_short(prediction: str, gold: Sequence[str],
                      meta: Mapping[str, Any] | None = None) -> ScoreResult:
    """BBEH mini: short-answer exact match after `short_norm`, no containment."""
    return score_short_answer(prediction, gold, containment=False)
