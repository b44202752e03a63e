"""The per-question mode oracle of `eval compare` (`eval.mode_oracle`), on hand-made rows."""

from __future__ import annotations

import math

import pytest

from jax_routeweaver.eval.mode_oracle import mode_oracle, mode_oracle_markdown


def _row(sid: str, mode: str | None, correct: bool) -> dict:
    return {"dataset": "d", "sample_id": sid, "mode": mode, "correct": correct}


# Three questions: q1 only agentic is right; q2 every mode is right (uninformative);
# q3 single and multi are right, agentic wrong.
FORCED = {
    "single": [_row("q1", "single", False), _row("q2", "single", True),
               _row("q3", "single", True)],
    "multi": [_row("q1", "multi", False), _row("q2", "multi", True),
              _row("q3", "multi", True)],
    "agentic": [_row("q1", "agentic", True), _row("q2", "agentic", True),
                _row("q3", "agentic", False)],
}


def test_router_that_picks_each_questions_best_mode_hits_every_question():
    free = [_row("q1", "agentic", True), _row("q2", "multi", True), _row("q3", "single", True)]
    result = mode_oracle(free, FORCED)
    assert (result.questions, result.informative) == (3, 2)
    assert result.router_hit == 1.0 and result.router_hit_informative == 1.0
    assert result.fixed_hit == pytest.approx({"single": 2 / 3, "multi": 2 / 3,
                                              "agentic": 2 / 3})
    assert result.fixed_hit_informative == pytest.approx({"single": 0.5, "multi": 0.5,
                                                          "agentic": 0.5})
    assert result.best_fixed == "single"  # ties: the first in single, multi, agentic
    assert result.oracle_accuracy == 1.0 and result.gap == 0.0
    assert result.oracle_modes == pytest.approx({"single": 2 / 3, "multi": 2 / 3,
                                                 "agentic": 2 / 3})


def test_wrong_choices_and_missing_declarations_are_misses():
    free = [_row("q1", "single", False), _row("q2", None, False), _row("q3", "agentic", False)]
    result = mode_oracle(free, FORCED)
    assert result.router_hit == 0.0 and result.router_hit_informative == 0.0
    assert result.router_accuracy == 0.0 and result.gap == pytest.approx(1.0)
    text = mode_oracle_markdown(result)
    assert "| router (free) | 0.0 % | 0.0 % |" in text
    assert "always single (best fixed)" in text


def test_no_informative_question_gives_undefined_informative_shares():
    forced = {m: [_row("q2", m, True)] for m in FORCED}
    result = mode_oracle([_row("q2", "multi", True)], forced)
    assert result.informative == 0 and math.isnan(result.router_hit_informative)
    assert result.to_json()["router_hit_informative"] is None


def test_missing_forced_rows_name_the_mode_or_question():
    with pytest.raises(ValueError, match=r"mode\(s\) \['agentic'\]"):
        mode_oracle([], {"single": [], "multi": []})
    forced = dict(FORCED, multi=FORCED["multi"][:2])
    with pytest.raises(ValueError, match="q3.*forced to multi"):
        mode_oracle([_row("q3", "single", True)], forced)
