"""The RouteWeaver action language: modes and roles, tags and stop strings, the protocol's
limits (`ProtocolConfig`), the parsers of router turns and the writers of the environment's own
protocol text (docs/protocol.md: "Tags", "Limits").

Pure and I/O-free; the episode runner owns the tokenizer, the sampler and the worker pool.

* Turn 1 (selector) writes `<mode>single|multi|agentic</mode>`; single/multi action turns write
  one `<route model="worker_K">TASK</route>` each; an agentic action turn writes one layer of
  `<route model=… role=… refs=…>` members; `<answer>…</answer>` ends the episode.
* Every parse gives a typed action or a `Rejected` carrying exactly one `Violation` (`code`,
  see `violations.py`); selector and agentic turns keep all their codes in `Rejected.codes`,
  sorted, and the recorded code is the alphabetically first one, as the original does.
* Turn validation against the episode so far lives in `turns.py`, observation framing and the
  observation token budget in `observations.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Literal

from jax_routeweaver.config import bounded
from jax_routeweaver.routing.protocol.violations import Violation

ForcedDeclaration = Literal["user_turn", "assistant_text"]


# ------------------------------------------------------------------------------------ modes
class Mode(enum.StrEnum):
    SINGLE = "single"
    MULTI = "multi"
    AGENTIC = "agentic"


MODES: tuple[Mode, ...] = (Mode.SINGLE, Mode.MULTI, Mode.AGENTIC)  # canonical menu order


class Role(enum.StrEnum):
    PLANNER = "planner"
    EXECUTOR = "executor"
    VERIFIER = "verifier"
    SUMMARIZER = "summarizer"


ROLES: tuple[Role, ...] = (Role.PLANNER, Role.EXECUTOR, Role.VERIFIER, Role.SUMMARIZER)

# ------------------------------------------------------------------------------------- tags
MODE_OPEN, MODE_CLOSE = "<mode>", "</mode>"
ROUTE_OPEN, ROUTE_CLOSE = "<route", "</route>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
OBSERVATION_OPEN, OBSERVATION_CLOSE = "<observation", "</observation>"

# Stop strings per turn kind (docs/protocol.md, "Tags"). The agentic turn does not stop on
# `</route>` so that one message can hold a whole parallel layer; the router ends it with EOS.
SELECTOR_STOPS: tuple[str, ...] = (MODE_CLOSE, ANSWER_CLOSE, OBSERVATION_OPEN)
SINGLE_MULTI_STOPS: tuple[str, ...] = (ROUTE_CLOSE, ANSWER_CLOSE, OBSERVATION_OPEN)
AGENTIC_STOPS: tuple[str, ...] = (ANSWER_CLOSE, OBSERVATION_OPEN)

# Placeholders copied from prompt templates instead of a real id / task (case-insensitive).
MODEL_PLACEHOLDERS: frozenset[str] = frozenset({"model_id"})
TASK_PLACEHOLDERS: frozenset[str] = frozenset({"query", "your_query", "concrete_subquery"})

# Qwen chat-template pieces the environment writes around an injected user turn
# (docs/protocol.md, "The token stream").
CHAT_USER_TURN_OPEN = "<|im_end|>\n<|im_start|>user\n"
CHAT_ASSISTANT_TURN_OPEN = "<|im_end|>\n<|im_start|>assistant\n"

OBS_TRUNCATION_MARKER = "\n\n... [observation truncated] ...\n\n"
# The paper's "observations truncated to 2048 tokens"; the original implementation uses the
# fixed 2048 only with its dynamic budget switched off (docs/protocol.md, "Observations").
PAPER_OBSERVATION_CAP = 2048


def stop_strings(mode: Mode | None) -> tuple[str, ...]:
    """Stop strings of the next router turn: selector when `mode` is None, else the action turn
    of `mode`."""
    if mode is None:
        return SELECTOR_STOPS
    return AGENTIC_STOPS if mode == Mode.AGENTIC else SINGLE_MULTI_STOPS


# ----------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
    """The original's protocol numbers, plus options for where the paper's wording departs
    from the original code (all off; docs/protocol.md, "Limits").

    `max_action_turns` None means `max_workers + 2` (10). `observation_cap` None means the
    dynamic per-turn budget `clamp(response_length - used - obs_reserve, 0, obs_budget_cap)`;
    an int (the paper: `PAPER_OBSERVATION_CAP`) is a fixed per-turn budget instead.
    `multi_attach_previous`: multi workers also receive the previous worker's output (paper
    wording; the original code does not attach it). `forced_declaration`: "user_turn" injects
    a forced `<mode>` as a user turn after an empty assistant turn (as the original does;
    docs/protocol.md, "Forced modes"); "assistant_text" writes it (mask 0) where a free
    declaration would stand. `recovery`: violations are cued and retried instead of ending the
    episode. `routing_state`: agentic turns get the routing-state header.
    """

    # Cap on one selector turn, tokens, >= 1.
    selector_max_tokens: int = bounded(64, "[1, inf)")  # tokens
    # Calls required and allowed in a single episode, >= 1.
    single_routes: int = bounded(1, "[1, inf)")
    # Calls a multi episode must make before `<answer>`, >= 1 and <= multi_max_routes.
    multi_min_routes: int = bounded(2, "[1, inf)")
    # Most calls a multi episode may make, >= multi_min_routes.
    multi_max_routes: int = bounded(4, "[1, inf)")
    # Calls per agentic episode, >= 1.
    max_workers: int = bounded(8, "[1, inf)")  # agentic calls, the summarizer's last slot included
    # Action turns per episode (rejected ones included, selector turns not), >= 1; None:
    # max_workers + 2.
    max_action_turns: int | None = bounded(None, "[1, inf)")
    # Selector turns allowed when `recovery` is on (1 without), >= 1.
    selector_attempts_with_recovery: int = bounded(2, "[1, inf)")
    # The whole response window, policy and environment tokens together, tokens, >= 1.
    response_length: int = bounded(16384, "[1, inf)")  # tokens, like the rest below
    # `max_tokens` of each worker call (also quoted in the catalog), tokens, >= 1.
    worker_max_tokens: int = bounded(4096, "[1, inf)")
    # Window kept free when the dynamic observation budget is computed, tokens, >= 0.
    obs_reserve: int = bounded(1024, "[0, inf)")
    # Most one observation turn may take under the dynamic budget, tokens, >= 1.
    obs_budget_cap: int = bounded(4096, "[1, inf)")
    # Smallest per-block share of an agentic observation turn, tokens, >= 0.
    obs_min_per_obs: int = bounded(256, "[0, inf)")
    # Share of a cut observation body kept from its end (the rest from its head), in [0, 1].
    obs_tail_fraction: float = bounded(0.5, "[0, 1]")  # share of a cut observation from its end
    # Fixed per-turn observation budget, tokens, >= 1; None: the dynamic budget.
    observation_cap: int | None = bounded(None, "[1, inf)")
    # Agentic action turns get the routing-state header.
    routing_state: bool = True
    # Violations are cued and retried instead of ending the episode.
    recovery: bool = False
    # Multi workers also receive the previous worker's output (paper wording).
    multi_attach_previous: bool = False
    # Where a forced `<mode>` goes: "user_turn" (a user turn, as the original) or
    # "assistant_text" (mask 0, where a free declaration would stand).
    forced_declaration: ForcedDeclaration = "user_turn"

    def __post_init__(self) -> None:
        lower_bounds = dict.fromkeys(
            ("selector_max_tokens", "single_routes", "multi_min_routes", "multi_max_routes",
             "max_workers", "max_action_turns", "selector_attempts_with_recovery",
             "response_length", "worker_max_tokens", "obs_budget_cap", "observation_cap"), 1)
        lower_bounds |= {"obs_reserve": 0, "obs_min_per_obs": 0}
        for name, low in lower_bounds.items():
            value = getattr(self, name)
            if value is None and name in ("max_action_turns", "observation_cap"):
                continue  # None selects the derived / dynamic default
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ProtocolConfig.{name}={value!r} must be an int >= {low}")
        if not 1 <= self.multi_min_routes <= self.multi_max_routes:
            raise ValueError(f"ProtocolConfig: need 1 <= multi_min_routes "
                             f"({self.multi_min_routes}) <= multi_max_routes "
                             f"({self.multi_max_routes})")
        if not 0.0 <= self.obs_tail_fraction <= 1.0:
            raise ValueError(f"ProtocolConfig.obs_tail_fraction={self.obs_tail_fraction!r} must "
                             "be in [0, 1]")
        if self.forced_declaration not in ("user_turn", "assistant_text"):
            raise ValueError(f"ProtocolConfig.forced_declaration={self.forced_declaration!r}: "
                             "expected 'user_turn' or 'assistant_text'")

    @property
    def action_turn_limit(self) -> int:
        return self.max_action_turns or self.max_workers + 2

    @property
    def selector_attempts(self) -> int:
        """Selector turns allowed: one, or one retry more with recovery on."""
        return self.selector_attempts_with_recovery if self.recovery else 1

    def route_bounds(self, mode: Mode) -> tuple[int, int]:
        """(calls required before `<answer>`, maximum calls) of a single/multi episode."""
        if mode == Mode.SINGLE:
            return self.single_routes, self.single_routes
        return self.multi_min_routes, self.multi_max_routes


# ----------------------------------------------------------------------------- parse results
@dataclasses.dataclass(frozen=True)
class Rejected:
    """A refused turn: `code` is the one recorded violation, `codes` every code found (sorted;
    `codes[0] == code`)."""

    codes: tuple[Violation, ...]

    def __post_init__(self) -> None:
        if not self.codes:
            raise ValueError("Rejected needs at least one violation code")
        object.__setattr__(self, "codes", tuple(sorted(set(self.codes))))

    @property
    def code(self) -> Violation:
        return self.codes[0]


def reject(code: Violation) -> Rejected:
    return Rejected((code,))


@dataclasses.dataclass(frozen=True)
class ModeDeclared:
    mode: Mode


@dataclasses.dataclass(frozen=True)
class RouteAction:
    """A parsed single/multi route; `model` stripped and lowercased, `task` stripped."""

    model: str
    task: str


@dataclasses.dataclass(frozen=True)
class AgenticRoute:
    """One member of an agentic layer as parsed: `role` lowercased, `model` stripped (case
    kept), `refs` split on `,`/`;`, `instruction` stripped. Not yet validated."""

    model: str
    role: str
    refs: tuple[str, ...]
    instruction: str


# ----------------------------------------------------------------------------------- regexes
_I, _IS = re.IGNORECASE, re.IGNORECASE | re.DOTALL
_MODE_DECLARATION_RE = re.compile(r"<mode>\s*([a-zA-Z_]+)\s*</mode>", _I)
_SELECTOR_FORBIDDEN: tuple[tuple[re.Pattern[str], Violation], ...] = tuple(
    (re.compile(rf"<{tag}\b", _I), code) for tag, code in (
        ("route", Violation.ROUTE_IN_SELECTOR), ("layer", Violation.LAYER_IN_SELECTOR),
        ("action", Violation.ACTION_IN_SELECTOR), ("paradigm", Violation.PARADIGM_IN_SELECTOR),
        ("observation", Violation.OBSERVATION_IN_SELECTOR),
        ("answer", Violation.ANSWER_IN_SELECTOR)))
MODE_OPEN_RE = re.compile(r"<mode\b", _I)
_ROUTE_OPEN_RE = re.compile(r"<route\b", _I)
_ROUTE_RE = re.compile(r"<route\b([^>]*)>(.*?)</route\s*>", _IS)
# Strict scanner for single/multi attributes: name = "v" or name = 'v', nothing else.
_ATTRIBUTE_RE = re.compile(r"\s*([A-Za-z_][\w.:-]*)\s*=\s*(?:\"([^\"]*)\"|'([^']*)')")
# Agentic routes close on exactly `</route>`; attributes are picked out leniently
# (docs/protocol.md, "Tags").
_LAYER_ROUTE_RE = re.compile(r"<route\b([^>]*)>(.*?)</route>", _IS)
_LAYER_ATTRIBUTE_RE = re.compile(r"(model|role|refs)\s*=\s*[\"']([^\"']*)[\"']", _I)
_ANSWER_RE = re.compile(r"<answer\s*>(.*?)</answer\s*>", _IS)


# ---------------------------------------------------------------------------------- parsers
def parse_mode_declaration(text: str) -> ModeDeclared | Rejected:
    """The selector turn: exactly one `<mode>x</mode>` (case-insensitive, inner whitespace and
    surrounding prose tolerated) naming a mode, and none of `<route`, `<layer`, `<action`,
    `<paradigm`, `<observation`, `<answer` anywhere in the turn."""
    codes = [code for pattern, code in _SELECTOR_FORBIDDEN if pattern.search(text)]
    values = _MODE_DECLARATION_RE.findall(text)
    if not values:
        codes.append(Violation.SELECTOR_MODE_MISSING)
    elif len(values) > 1:
        codes.append(Violation.SELECTOR_MODE_DUPLICATE)
    elif values[0].lower() not in MODES:
        codes.append(Violation.SELECTOR_MODE_INVALID)
    if codes:
        return Rejected(tuple(codes))
    return ModeDeclared(Mode(values[0].lower()))


def parse_answer(text: str) -> str | None:
    """Body of the last complete `<answer>…</answer>` block of `text`, stripped; None if none."""
    bodies = _ANSWER_RE.findall(text)
    return bodies[-1].strip() if bodies else None


def has_fabricated_observation(text: str) -> bool:
    """True when the policy wrote `<observation` (the stop string that cut its turn)."""
    return OBSERVATION_OPEN in text


def _scan_attributes(attrs: str) -> list[tuple[str, str]] | None:
    """`[(lowercased name, value)]` of a single/multi route tag; None on any stray text."""
    pairs, pos = [], 0
    while pos < len(attrs) and not attrs[pos:].isspace():
        match = _ATTRIBUTE_RE.match(attrs, pos)
        if match is None:
            return None
        value = match[2] if match[2] is not None else match[3]
        pairs.append((match[1].lower(), value))
        pos = match.end()
    return pairs


def parse_route(text: str) -> RouteAction | Rejected:
    """The first complete `<route …>TASK</route>` of a single/multi turn, strictly checked:
    malformed → duplicate → unknown → missing attribute, then placeholder model id, then
    empty or placeholder task (docs/protocol.md, "Tags")."""
    match = _ROUTE_RE.search(text)
    if match is None:
        opened = _ROUTE_OPEN_RE.search(text) is not None
        return reject(Violation.ROUTE_MALFORMED if opened else Violation.ROUTE_MISSING)
    pairs = _scan_attributes(match[1])
    if pairs is None:
        return reject(Violation.ROUTE_MALFORMED)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        return reject(Violation.ATTR_DUPLICATE)
    if any(name != "model" for name in names):
        return reject(Violation.ATTR_UNKNOWN)
    model = dict(pairs).get("model", "").strip().lower()
    if not model:
        return reject(Violation.ATTR_MISSING)
    if model in MODEL_PLACEHOLDERS:
        return reject(Violation.PLACEHOLDER)
    task = match[2].strip()
    if not task:
        return reject(Violation.QUERY_EMPTY)
    if task.lower() in TASK_PLACEHOLDERS:
        return reject(Violation.PLACEHOLDER)
    return RouteAction(model=model, task=task)


def split_refs(value: str) -> tuple[str, ...]:
    """`"n1; n2,,"` → `("n1", "n2")`: `;` counts as `,`, items stripped, blanks dropped."""
    return tuple(item.strip() for item in value.replace(";", ",").split(",") if item.strip())


def parse_layer_members(text: str) -> tuple[tuple[AgenticRoute, ...], tuple[Violation, ...]]:
    """Members of an agentic turn that parse, and the parse-level codes of the others."""
    matches = list(_LAYER_ROUTE_RE.finditer(text))
    if not matches:
        opened = _ROUTE_OPEN_RE.search(text) is not None
        return (), (Violation.ACTION_MALFORMED if opened else Violation.ACTION_MISSING,)
    routes, errors = [], []
    for match in matches:
        # A repeated attribute keeps its last value; unknown attributes are ignored.
        attrs = {name.lower(): value for name, value in _LAYER_ATTRIBUTE_RE.findall(match[1])}
        role = attrs.get("role", "").lower()
        model = attrs.get("model", "").strip()
        instruction = match[2].strip()
        member_errors = [code for code, missing in ((Violation.ROLE_MISSING, not role),
                                                    (Violation.MODEL_MISSING, not model),
                                                    (Violation.INSTRUCTION_MISSING,
                                                     not instruction)) if missing]
        if member_errors:
            errors.extend(member_errors)
        else:
            routes.append(AgenticRoute(model=model, role=role,
                                       refs=split_refs(attrs.get("refs", "")),
                                       instruction=instruction))
    return tuple(routes), tuple(errors)


# ------------------------------------------------------------------------------------ framing
def chat_delta(text: str) -> str:
    """`text` as a user turn inserted into the assistant stream (tokenize without adding
    special tokens): closes the assistant message and opens the next one (docs/protocol.md,
    "The token stream")."""
    return CHAT_USER_TURN_OPEN + text + CHAT_ASSISTANT_TURN_OPEN


def declaration_text(mode: Mode | str) -> str:
    """`<mode>m</mode>`: a mode declaration."""
    return f"{MODE_OPEN}{Mode(mode)}{MODE_CLOSE}"


def answer_text(answer: str) -> str:
    """`<answer>a</answer>`: a final answer action."""
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def forced_declaration_text(mode: Mode, config: ProtocolConfig) -> str:
    """The environment's `<mode>m</mode>` for a forced episode (mask 0), right after the
    prompt's generation header; the rulebook's chat delta follows it."""
    declaration = declaration_text(mode)
    if config.forced_declaration == "assistant_text":
        return declaration
    return chat_delta(declaration)


def inline_env_text(text: str) -> str:
    """Environment text inside the assistant message (a recovery cue), set off by blank lines."""
    return "\n\n" + text + "\n\n"
