"""Candidate answers from worker replies (docs/protocol.md, "Candidate answers of worker
replies"; the original's `worker_client.extract_answer`).

Last `<answer>` block (case-insensitive) -> last brace-matched `\\boxed{}` -> last non-empty line
that is not a bare delimiter, with `*` stripped, a leading connective ("so", "thus", "the final
answer is", ...) removed, and a trailing `.` removed.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_DELIMITER = re.compile(r"^(\\\]|\\\[|\$\$|-{3,}|={3,}|\*\*|\\begin\{[^}]*\}|\\end\{[^}]*\})$")
_CONNECTIVE = re.compile(
    r"^(?:(?:so|thus|therefore|hence|then|we get|which gives|giving)\b[,:]?\s*)?"
    r"(?:the\s+)?(?:final\s+)?(?:answer|result|value)?\s*(?:is|:|=)?\s*", re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The candidate answer of a worker reply, or None if the reply is empty."""
    blocks = _ANSWER.findall(text)
    if blocks:
        return blocks[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line or _DELIMITER.match(line):
            continue
        line = _CONNECTIVE.sub("", line.replace("*", "").strip(), count=1)
        return line.rstrip(".").strip() or None
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1:j]
        start = text.rfind("\\boxed{", 0, start)
    return None
