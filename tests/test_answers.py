"""Worker-reply answer extraction (docs/protocol.md, "Candidate answers of worker replies")."""

import pytest

from jax_routeweaver.routing.protocol.answers import extract_answer, last_boxed


@pytest.mark.parametrize(("reply", "expected"), [
    ("work... <answer>12</answer> then <ANSWER> 13 </ANSWER>", "13"),
    ("so $\\boxed{\\frac{1}{2}}$ and later \\boxed{x^{2}}", "x^{2}"),
    ("steps\nThus the final answer is 42.\n\\]\n", "42"),
    ("**Answer: Paris**", "Paris"),
    ("line one\n---\n", "line one"),
    ("", None),
    ("   \n$$\n", None),
])
def test_extract_answer(reply, expected):
    assert extract_answer(reply) == expected


def test_unbalanced_boxed_falls_back_to_earlier():
    assert last_boxed("\\boxed{1} and \\boxed{2") == "1"
