"""How a SIMULATED worker reads its prompt: the role its brief asks for, the referenced outputs
after the question (`[nK] (from ROLE)` blocks) and what they hold (answers, programs, PASS /
FAIL verdicts, `[execution]` feedback). Used by `SimulatedWorkerPool` (`pool.py`).
"""

from __future__ import annotations

import dataclasses
import re

# ============================================================================ prompts
_ROLE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("verifier", re.compile(r"\bverif(?:y|ier|ies|ication)\b|\bPASS\b[\s\S]*\bFAIL\b",
                            re.IGNORECASE)),
    ("summarizer", re.compile(r"\bsummari[sz]|\breconcil", re.IGNORECASE)),
    ("planner", re.compile(r"\bplann(?:er|ing)\b|\bbreak (?:it|the problem|this problem)"
                           r"(?: down)? into\b|\bsub-?tasks\b", re.IGNORECASE)),
    ("executor", re.compile(r"\bexecut(?:or|e)\b|\bcarry out\b", re.IGNORECASE)),
)
_STRONG_ROLE = re.compile(r"\byou are (?:the|a|an) (planner|executor|verifier|summari[sz]er)\b",
                          re.IGNORECASE)
_REF_HEADER = re.compile(r"^\[([^\]\n]+)\][ \t]*\(from ([A-Za-z_]+)\)[ \t]*$", re.MULTILINE)
_TAIL_SECTION = re.compile(r"\n\s*\n(?:Your task|Current sub-task):", re.IGNORECASE)
ANSWER_TAG = re.compile(r"<answer>([\s\S]*?)</answer>", re.IGNORECASE)
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n([\s\S]*?)```", re.IGNORECASE)
EXEC_PASS = re.compile(r"\[execution\] all \d+ hidden tests PASSED", re.IGNORECASE)
EXEC_FAIL = re.compile(r"\[execution\] (?:\d+/\d+ hidden tests passed|no runnable code)",
                        re.IGNORECASE)
LOCATION = re.compile(r"^\s*Location:(.*)$", re.MULTILINE | re.IGNORECASE)


def detect_role(brief: str, prompt: str) -> str | None:
    """Role from the brief (text before the question): 'You are the X' first, then keywords;
    else 'You are the X' anywhere in the prompt; else None (a plain single/multi answer)."""
    strong = _STRONG_ROLE.search(brief)
    if strong is None:
        for role, pattern in _ROLE_PATTERNS:
            if pattern.search(brief):
                return role
        strong = _STRONG_ROLE.search(prompt)
    if strong is None:
        return None
    word = strong.group(1).lower()
    return "summarizer" if word.startswith("summari") else word


@dataclasses.dataclass(frozen=True)
class Block:
    node: str | None
    role: str | None
    text: str


@dataclasses.dataclass(frozen=True)
class Candidate:
    index: int  # position among the blocks
    node: str | None
    answer: str  # the answer text (the program for CODE)
    key: str  # normalised, for voting
    correct: bool
    executed: str | None  # 'pass' | 'fail' | None, from [execution] feedback


def split_blocks(after: str) -> list[Block]:
    """Referenced outputs after the question: `[nK] (from ROLE)` blocks, else one block."""
    tail = _TAIL_SECTION.search(after)
    headers = list(_REF_HEADER.finditer(after))
    if not headers:
        body = after[: tail.start()] if tail else after
        return [Block(None, None, body)] if body.strip() else []
    blocks = []
    for k, header in enumerate(headers):
        end = headers[k + 1].start() if k + 1 < len(headers) else len(after)
        if k + 1 == len(headers):
            last_tail = None
            for match in _TAIL_SECTION.finditer(after, header.end()):
                last_tail = match
            end = last_tail.start() if last_tail else end
        blocks.append(Block(header.group(1).strip(), header.group(2).lower(),
                             after[header.end():end].strip()))
    return blocks


def verdict(block: Block) -> str | None:
    first = block.text.lstrip()[:4].upper()
    return first if first in ("PASS", "FAIL") else None
