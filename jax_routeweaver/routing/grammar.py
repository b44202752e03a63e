"""The RouteWeaver action protocol: tags, parsers, violation codes, turn validation, observation
framing and the observation token budget (docs/protocol.md: "Tags", "The rules of each mode",
"Observations", "Violation codes").

Pure and I/O-free; the episode runner owns the tokenizer, the sampler and the worker pool.

* Turn 1 (selector) writes `<mode>single|multi|agentic</mode>`; single/multi action turns write
  one `<route model="worker_K">TASK</route>` each; an agentic action turn writes one layer of
  `<route model=… role=… refs=…>` members; `<answer>…</answer>` ends the episode.
* Every parse gives a typed action or a `Rejected` carrying exactly one `Violation` (`code`);
  selector and agentic turns keep all their codes in `Rejected.codes`, sorted, and the recorded
  code is the alphabetically first one, as the reference does.
* With `ProtocolConfig.recovery` off (the reference default) the first violation ends the
  episode; with it on the runner injects `violation_cue` text and the policy retries.
* Observations are framed here (`single_multi_observation`, `agentic_observation`) and cut to a
  token budget per block (`observation_ids`), head + tail around a fixed marker.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Sequence
from typing import Literal

from jax_routeweaver.config import bounded

Encode = Callable[[str], Sequence[int]]
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
# The paper's "observations truncated to 2048 tokens"; the reference implementation uses the
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
    """The reference's protocol numbers, plus options for where the paper's wording departs
    from the reference code (all off; docs/protocol.md, "Limits").

    `max_action_turns` None means `max_workers + 2` (10). `observation_cap` None means the
    dynamic per-turn budget `clamp(response_length - used - obs_reserve, 0, obs_budget_cap)`;
    an int (the paper: `PAPER_OBSERVATION_CAP`) is a fixed per-turn budget instead.
    `multi_attach_previous`: multi workers also receive the previous worker's output (paper
    wording; the reference code does not attach it). `forced_declaration`: "user_turn" injects
    a forced `<mode>` as a user turn after an empty assistant turn (as the reference does;
    docs/protocol.md, "Forced modes"); "assistant_text" writes it (mask 0) where a free
    declaration would stand. `recovery`: violations are cued and retried instead of ending the
    episode. `routing_state`: agentic turns get the routing-state header.
    """

    selector_max_tokens: int = bounded(64, "[1, inf)")  # tokens
    single_routes: int = bounded(1, "[1, inf)")
    multi_min_routes: int = bounded(2, "[1, inf)")
    multi_max_routes: int = bounded(4, "[1, inf)")
    max_workers: int = bounded(8, "[1, inf)")  # agentic calls, the summarizer's last slot included
    max_action_turns: int | None = bounded(None, "[1, inf)")
    selector_attempts_with_recovery: int = bounded(2, "[1, inf)")
    response_length: int = bounded(16384, "[1, inf)")  # tokens, like the rest below
    worker_max_tokens: int = bounded(4096, "[1, inf)")
    obs_reserve: int = bounded(1024, "[0, inf)")
    obs_budget_cap: int = bounded(4096, "[1, inf)")
    obs_min_per_obs: int = bounded(256, "[0, inf)")
    obs_tail_fraction: float = bounded(0.5, "[0, 1]")  # share of a cut observation from its end
    observation_cap: int | None = bounded(None, "[1, inf)")
    routing_state: bool = True
    recovery: bool = False
    multi_attach_previous: bool = False
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


# ------------------------------------------------------------------------------- violations
class Violation(enum.StrEnum):
    """Every policy violation of the live path (docs/protocol.md, "Violation codes"). Terminal
    unless recovery is on."""

    # selector turn (docs/protocol.md, "Selector turn")
    SELECTOR_MODE_MISSING = "selector_mode_missing"  # no <mode>x</mode> in the selector turn
    SELECTOR_MODE_DUPLICATE = "selector_mode_duplicate"  # two or more declarations
    SELECTOR_MODE_INVALID = "selector_mode_invalid"  # one declaration, value not a mode
    ROUTE_IN_SELECTOR = "route_in_selector"  # <route in the selector turn
    LAYER_IN_SELECTOR = "layer_in_selector"  # <layer in the selector turn
    ACTION_IN_SELECTOR = "action_in_selector"  # <action in the selector turn
    PARADIGM_IN_SELECTOR = "paradigm_in_selector"  # <paradigm in the selector turn
    OBSERVATION_IN_SELECTOR = "observation_in_selector"  # <observation in the selector turn
    ANSWER_IN_SELECTOR = "answer_in_selector"  # <answer in the selector turn
    # single / multi action turn (docs/protocol.md, "Single/multi action turn"), in check order
    MODE_DUPLICATE = "mode_duplicate"  # any <mode opening tag in an action turn
    ANSWER_PREMATURE = "answer_premature"  # <answer> before the required number of calls
    ROUTE_MISSING = "route_missing"  # no route and no <route opening at all
    ROUTE_MALFORMED = "route_malformed"  # unclosed <route, or stray text among attributes
    ATTR_DUPLICATE = "attr_duplicate"  # an attribute name given twice
    ATTR_UNKNOWN = "attr_unknown"  # an attribute other than model (role, refs, id, ...)
    ATTR_MISSING = "attr_missing"  # no model attribute, or an empty one
    QUERY_EMPTY = "query_empty"  # empty route body
    PLACEHOLDER = "placeholder"  # model="MODEL_ID", or a template placeholder as the task
    ROUTE_LIMIT_EXCEEDED = "route_limit_exceeded"  # a route after the mode's last allowed call
    UNKNOWN_MODEL = "unknown_model"  # model id not in the worker registry (aliases only)
    WORKER_NOT_OFFERED = "worker_not_offered"  # registered id not offered to this run
    # agentic action turn (docs/protocol.md, "Agentic action turn"): parse level
    ACTION_MISSING = "action_missing"  # no complete route and no <route (a bare <answer> too)
    ACTION_MALFORMED = "action_malformed"  # <route present but no complete route
    ROLE_MISSING = "role_missing"  # a member without role (or role="")
    MODEL_MISSING = "model_missing"  # a member without model (or an empty one)
    INSTRUCTION_MISSING = "instruction_missing"  # a member with an empty body
    # agentic: per member
    ROLE_INVALID = "role_invalid"  # role not planner/executor/verifier/summarizer
    MODEL_INVALID = "model_invalid"  # model not an offered id (exact, case-sensitive)
    REF_UNKNOWN = "ref_unknown"  # a ref that names no completed node
    REF_SAME_LAYER = "ref_same_layer"  # a ref to a node this very layer would create
    SUMMARIZER_NEEDS_REFS = "summarizer_needs_refs"  # summarizer with refs="" once nodes exist
    VERIFIER_NEEDS_REFS = "verifier_needs_refs"  # verifier with refs="" (always)
    ALREADY_FINISHED = "already_finished"  # any route after the summarizer ran
    # agentic: whole layer
    LAYER_EXCEEDS_BUDGET = "layer_exceeds_budget"  # more members than calls remaining
    MUST_SUMMARIZE_NOW = "must_summarize_now"  # no summarizer, and no slot would be left for it
    SUMMARIZER_NOT_ALONE = "summarizer_not_alone"  # summarizer with siblings in its layer
    DUPLICATE_IN_LAYER = "duplicate_in_layer"  # two members with equal (role, model, task)


# The enum is declared surface by surface, so the surfaces are slices of it.
SELECTOR_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[:9])
SINGLE_MULTI_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[9:21])
AGENTIC_VIOLATIONS: tuple[Violation, ...] = tuple(list(Violation)[21:])


class Notice(enum.StrEnum):
    """Non-terminal records (docs/protocol.md, "How an episode ends"); they never end an
    episode or cost reward by themselves."""

    FABRICATED_OBSERVATION_BLOCKED = "fabricated_observation_blocked"  # policy wrote <observation
    RULES_BUDGET_EXHAUSTED = "rules_budget_exhausted"  # rulebook did not fit the window
    OBS_BUDGET_EXHAUSTED = "obs_budget_exhausted"  # observation budget 0: the episode stops
    WORKER_SPAN_EXTRACTION_FAILED = "worker_span_extraction_failed"  # (worker exploration only)


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


def _reject(code: Violation) -> Rejected:
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
_MODE_OPEN_RE = re.compile(r"<mode\b", _I)
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
        return _reject(Violation.ROUTE_MALFORMED if opened else Violation.ROUTE_MISSING)
    pairs = _scan_attributes(match[1])
    if pairs is None:
        return _reject(Violation.ROUTE_MALFORMED)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        return _reject(Violation.ATTR_DUPLICATE)
    if any(name != "model" for name in names):
        return _reject(Violation.ATTR_UNKNOWN)
    model = dict(pairs).get("model", "").strip().lower()
    if not model:
        return _reject(Violation.ATTR_MISSING)
    if model in MODEL_PLACEHOLDERS:
        return _reject(Violation.PLACEHOLDER)
    task = match[2].strip()
    if not task:
        return _reject(Violation.QUERY_EMPTY)
    if task.lower() in TASK_PLACEHOLDERS:
        return _reject(Violation.PLACEHOLDER)
    return RouteAction(model=model, task=task)


def split_refs(value: str) -> tuple[str, ...]:
    """`"n1; n2,,"` → `("n1", "n2")`: `;` counts as `,`, items stripped, blanks dropped."""
    return tuple(item.strip() for item in value.replace(";", ",").split(",") if item.strip())


def _parse_layer_members(text: str) -> tuple[tuple[AgenticRoute, ...], tuple[Violation, ...]]:
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


def parse_layer(text: str) -> tuple[AgenticRoute, ...] | Rejected:
    """Every `<route …>…</route>` of an agentic turn, as one layer (parse-level checks only;
    `validate_layer` applies the episode rules)."""
    routes, errors = _parse_layer_members(text)
    return Rejected(errors) if errors else routes


# ----------------------------------------------------------------------------- episode state
@dataclasses.dataclass(frozen=True)
class PlannedCall:
    """A worker call the runner must make. `node_id` is `n{k}`, numbered across the episode in
    route order; `layer` is 1-based. `role` is None and `refs` empty in single/multi."""

    worker: str
    task: str
    node_id: str
    layer: int
    role: Role | None = None
    refs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Node:
    """A completed call (every mode). `output` is what refs splice in and what the router sees:
    execution verdict (if any) + the worker's reply, "" when the call failed."""

    id: str
    layer: int
    model: str
    instruction: str
    role: Role | None = None
    refs: tuple[str, ...] = ()
    output: str = ""
    success: bool = True
    candidate_answer: str | None = None
    execution_verdict: str | None = None

    @classmethod
    def from_call(cls, call: PlannedCall, output: str, *, success: bool = True,
                  candidate_answer: str | None = None,
                  execution_verdict: str | None = None) -> Node:
        return cls(id=call.node_id, layer=call.layer, model=call.worker, instruction=call.task,
                   role=call.role, refs=call.refs, output=output, success=success,
                   candidate_answer=candidate_answer, execution_verdict=execution_verdict)


@dataclasses.dataclass(frozen=True)
class RoutingState:
    """What the protocol knows of an episode; owned by the runner, advanced with the `record_*`
    functions. `policy_invalid` is the violation that ended the episode (None otherwise);
    `violations` lists every recorded code (more than one only with recovery on)."""

    mode: Mode | None = None
    forced: bool = False
    selector_attempts: int = 0
    action_turns: int = 0
    nodes: tuple[Node, ...] = ()
    answer: str | None = None
    policy_invalid: Violation | None = None
    violations: tuple[Violation, ...] = ()
    notices: tuple[Notice, ...] = ()

    @property
    def calls_used(self) -> int:
        return len(self.nodes)

    @property
    def layers_done(self) -> int:
        return max((node.layer for node in self.nodes), default=0)

    @property
    def completed_ids(self) -> tuple[str, ...]:
        return tuple(node.id for node in self.nodes)

    @property
    def summarizer_done(self) -> bool:
        return any(node.role == Role.SUMMARIZER for node in self.nodes)

    def calls_remaining(self, config: ProtocolConfig) -> int:
        """Agentic calls still allowed (the summarizer's reserved slot included)."""
        return max(0, config.max_workers - self.calls_used)

    def node(self, node_id: str) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(f"RoutingState: no completed node {node_id!r}; have "
                       f"{list(self.completed_ids)}")


# ------------------------------------------------------------------------------ turn results
@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Run these calls (concurrently in agentic), then frame their observations."""

    calls: tuple[PlannedCall, ...]


@dataclasses.dataclass(frozen=True)
class AnswerAccepted:
    answer: str


Decision = ModeDeclared | Dispatch | AnswerAccepted | Rejected


@dataclasses.dataclass(frozen=True)
class TurnOutcome:
    """What to do after a router turn, plus the turn's non-terminal records."""

    decision: Decision
    notices: tuple[Notice, ...] = ()


def _notices(text: str) -> tuple[Notice, ...]:
    return (Notice.FABRICATED_OBSERVATION_BLOCKED,) if has_fabricated_observation(text) else ()


# ----------------------------------------------------------------------------- turn handlers
def handle_selector_turn(text: str) -> TurnOutcome:
    """Turn 1 of a free episode: a mode declaration, or a rejection (docs/protocol.md,
    "Selector turn")."""
    return TurnOutcome(parse_mode_declaration(text), _notices(text))


def handle_single_multi_turn(text: str, state: RoutingState, offered: Sequence[str],
                             config: ProtocolConfig, registry: Sequence[str] | None = None
                             ) -> TurnOutcome:
    """One single/multi action turn, checked in the reference's order (docs/protocol.md,
    "Single/multi action turn"): `<mode` →
    when no route parses, an answer (accepted once the mode's required calls ran, else
    premature), else the parse error → call limit → registry (`unknown_model`; `registry`
    defaults to `offered`) → offered list.
    """
    if state.mode not in (Mode.SINGLE, Mode.MULTI):
        raise ValueError(f"handle_single_multi_turn: state.mode={state.mode!r} is not single "
                         "or multi")
    notices = _notices(text)
    if _MODE_OPEN_RE.search(text):
        return TurnOutcome(_reject(Violation.MODE_DUPLICATE), notices)
    required, limit = config.route_bounds(state.mode)
    route = parse_route(text)
    if isinstance(route, Rejected):
        answer = parse_answer(text)
        if answer is None:
            return TurnOutcome(route, notices)
        if state.calls_used >= required:
            return TurnOutcome(AnswerAccepted(answer), notices)
        return TurnOutcome(_reject(Violation.ANSWER_PREMATURE), notices)
    if state.calls_used >= limit:
        return TurnOutcome(_reject(Violation.ROUTE_LIMIT_EXCEEDED), notices)
    known = {worker.lower() for worker in (offered if registry is None else registry)}
    if route.model not in known:
        return TurnOutcome(_reject(Violation.UNKNOWN_MODEL), notices)
    offered_by_key = {worker.lower(): worker for worker in offered}
    if route.model not in offered_by_key:
        return TurnOutcome(_reject(Violation.WORKER_NOT_OFFERED), notices)
    call = PlannedCall(worker=offered_by_key[route.model], task=route.task,
                       node_id=f"n{state.calls_used + 1}", layer=state.layers_done + 1)
    return TurnOutcome(Dispatch((call,)), notices)


def _member_violations(route: AgenticRoute, state: RoutingState, offered: Sequence[str],
                       layer_ids: frozenset[str]) -> set[Violation]:
    if state.summarizer_done:
        return {Violation.ALREADY_FINISHED}
    codes = set()
    if route.role not in ROLES:
        codes.add(Violation.ROLE_INVALID)
    if route.model not in offered:
        codes.add(Violation.MODEL_INVALID)
    completed = set(state.completed_ids)
    for ref in route.refs:
        if ref in layer_ids:
            codes.add(Violation.REF_SAME_LAYER)
        elif ref not in completed:
            codes.add(Violation.REF_UNKNOWN)
    if route.role == Role.SUMMARIZER and not route.refs and state.nodes:
        codes.add(Violation.SUMMARIZER_NEEDS_REFS)
    if route.role == Role.VERIFIER and not route.refs:
        codes.add(Violation.VERIFIER_NEEDS_REFS)
    return codes


def validate_layer(routes: Sequence[AgenticRoute], state: RoutingState, offered: Sequence[str],
                   config: ProtocolConfig) -> tuple[Violation, ...]:
    """Sorted codes of a parsed layer against the episode so far; empty means legal
    (docs/protocol.md, "Agentic action turn").
    The layer is accepted or refused as a unit."""
    used = state.calls_used
    layer_ids = frozenset(f"n{used + i + 1}" for i in range(len(routes)))
    codes: set[Violation] = set()
    for route in routes:
        codes |= _member_violations(route, state, offered, layer_ids)
    remaining = state.calls_remaining(config)
    has_summarizer = any(route.role == Role.SUMMARIZER for route in routes)
    if len(routes) > remaining:
        codes.add(Violation.LAYER_EXCEEDS_BUDGET)
    if not has_summarizer and remaining - len(routes) < 1:
        codes.add(Violation.MUST_SUMMARIZE_NOW)  # the last slot belongs to the summarizer
    if has_summarizer and len(routes) > 1:
        codes.add(Violation.SUMMARIZER_NOT_ALONE)
    if len({(r.role, r.model, r.instruction) for r in routes}) < len(routes):
        codes.add(Violation.DUPLICATE_IN_LAYER)
    return tuple(sorted(codes))


def plan_layer(routes: Sequence[AgenticRoute], state: RoutingState) -> tuple[PlannedCall, ...]:
    """Calls of a validated layer, node ids continuing the episode's numbering."""
    layer = state.layers_done + 1
    return tuple(PlannedCall(worker=route.model, task=route.instruction,
                             node_id=f"n{state.calls_used + i + 1}", layer=layer,
                             role=Role(route.role), refs=route.refs)
                 for i, route in enumerate(routes))


def handle_agentic_turn(text: str, state: RoutingState, offered: Sequence[str],
                        config: ProtocolConfig) -> TurnOutcome:
    """One agentic action turn (docs/protocol.md, "Agentic action turn"): parse + validate the
    layer; on any code, accept the turn's `<answer>` if the summarizer already ran (the normal
    finish: a bare answer parses as `action_missing`), else reject with the sorted codes;
    otherwise dispatch the layer."""
    if state.mode != Mode.AGENTIC:
        raise ValueError(f"handle_agentic_turn: state.mode={state.mode!r} is not agentic")
    notices = _notices(text)
    routes, errors = _parse_layer_members(text)
    codes = set(errors)
    if routes:
        codes |= set(validate_layer(routes, state, offered, config))
    if codes:
        answer = parse_answer(text)
        if answer is not None and state.summarizer_done:
            return TurnOutcome(AnswerAccepted(answer), notices)
        return TurnOutcome(Rejected(tuple(codes)), notices)
    return TurnOutcome(Dispatch(plan_layer(routes, state)), notices)


def handle_action_turn(text: str, state: RoutingState, offered: Sequence[str],
                       config: ProtocolConfig, registry: Sequence[str] | None = None
                       ) -> TurnOutcome:
    """`handle_agentic_turn` or `handle_single_multi_turn`, by `state.mode`."""
    if state.mode == Mode.AGENTIC:
        return handle_agentic_turn(text, state, offered, config)
    return handle_single_multi_turn(text, state, offered, config, registry)


def resolve_refs(call: PlannedCall, state: RoutingState) -> tuple[Node, ...]:
    """The completed nodes a call references, in the order the router listed them; resolved
    against completed layers before any member of the new layer runs."""
    return tuple(state.node(ref) for ref in call.refs)


# ------------------------------------------------------------------------- state transitions
def _with_records(state: RoutingState, outcome: TurnOutcome, config: ProtocolConfig,
                  exhausted: bool) -> RoutingState:
    state = dataclasses.replace(state, notices=state.notices + outcome.notices)
    decision = outcome.decision
    if isinstance(decision, Rejected):
        ends = exhausted or not config.recovery
        state = dataclasses.replace(state, violations=(*state.violations, decision.code),
                                    policy_invalid=decision.code if ends else None)
    elif isinstance(decision, AnswerAccepted):
        state = dataclasses.replace(state, answer=decision.answer)
    return state


def declare_forced_mode(state: RoutingState, mode: Mode) -> RoutingState:
    """The forced arm: the environment declares `mode` (no selector turn)."""
    return dataclasses.replace(state, mode=Mode(mode), forced=True)


def record_selector_turn(state: RoutingState, outcome: TurnOutcome,
                         config: ProtocolConfig) -> RoutingState:
    """Count a selector attempt; set the mode, or record the violation (terminal without
    recovery, or when the recovery retry is used up)."""
    attempts = state.selector_attempts + 1
    state = dataclasses.replace(state, selector_attempts=attempts)
    if isinstance(outcome.decision, ModeDeclared):
        state = dataclasses.replace(state, mode=outcome.decision.mode)
    return _with_records(state, outcome, config, attempts >= config.selector_attempts)


def record_action_turn(state: RoutingState, outcome: TurnOutcome,
                       config: ProtocolConfig) -> RoutingState:
    """Count an action turn; record its answer or violation. Dispatched calls are added with
    `record_calls` once they return."""
    state = dataclasses.replace(state, action_turns=state.action_turns + 1)
    return _with_records(state, outcome, config, exhausted=False)


def record_calls(state: RoutingState, nodes: Sequence[Node]) -> RoutingState:
    """Append the completed nodes of one dispatched turn (in call order)."""
    return dataclasses.replace(state, nodes=state.nodes + tuple(nodes))


def record_notice(state: RoutingState, notice: Notice) -> RoutingState:
    return dataclasses.replace(state, notices=(*state.notices, notice))


def episode_over(state: RoutingState, config: ProtocolConfig) -> bool:
    """True once an answer was accepted, a violation ended the episode, the selector failed
    for good, or the action-turn limit is reached (the runner also stops on the response
    window and `obs_budget_exhausted`)."""
    if state.answer is not None or state.policy_invalid is not None:
        return True
    if state.mode is None:
        return state.selector_attempts >= config.selector_attempts
    return state.action_turns >= config.action_turn_limit


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


@dataclasses.dataclass(frozen=True)
class ObservationBlock:
    """One `<observation …>BODY</observation>`; `node_id`/`role` only in agentic mode."""

    body: str
    node_id: str | None = None
    role: str | None = None

    @property
    def open_tag(self) -> str:
        if self.node_id is None:
            return "<observation>"
        return f'<observation id="{self.node_id}" role="{self.role}">'

    @property
    def text(self) -> str:
        return self.open_tag + self.body + OBSERVATION_CLOSE


@dataclasses.dataclass(frozen=True)
class ObservationText:
    """The env text of one observation turn: separators (`str`) and blocks, in order."""

    parts: tuple[str | ObservationBlock, ...]

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    @property
    def blocks(self) -> tuple[ObservationBlock, ...]:
        return tuple(p for p in self.parts if isinstance(p, ObservationBlock))


def single_multi_observation(body: str) -> ObservationText:
    """`"\\n\\n<observation>" + BODY + "</observation>\\n\\n"`, BODY stripped ("" on failure)."""
    return ObservationText(("\n\n", ObservationBlock(body.strip()), "\n\n"))


def agentic_observation(nodes: Sequence[Node]) -> ObservationText:
    """One `<observation id="nK" role="ROLE">` block per node of the layer, joined by a blank
    line, the whole wrapped in a leading and a trailing `\\n`."""
    parts: list[str | ObservationBlock] = ["\n"]
    for i, node in enumerate(nodes):
        if i:
            parts.append("\n\n")
        parts.append(ObservationBlock(node.output.strip(), node.id, str(node.role)))
    parts.append("\n")
    return ObservationText(tuple(parts))


def frame_observation(mode: Mode, nodes: Sequence[Node]) -> ObservationText:
    """The observation turn for the nodes one dispatched turn produced, framed for `mode`."""
    if mode == Mode.AGENTIC:
        return agentic_observation(nodes)
    (node,) = nodes
    return single_multi_observation(node.output)


# ------------------------------------------------------------------------ observation budget
def turn_observation_budget(used_tokens: int, config: ProtocolConfig) -> int:
    """Tokens the next observation turn may take: `clamp(response_length - used - reserve,
    0, cap)` (dynamic, reference), or the fixed `observation_cap`. 0 means
    `obs_budget_exhausted`."""
    if config.observation_cap is not None:
        return config.observation_cap
    free = config.response_length - used_tokens - config.obs_reserve
    return max(0, min(config.obs_budget_cap, free))


def observation_share(turn_budget: int, n_blocks: int, mode: Mode,
                      config: ProtocolConfig) -> int:
    """Per-block budget: single/multi get the whole turn budget; an agentic layer splits it,
    `max(obs_min_per_obs, turn_budget // n_blocks)` (so a wide layer may exceed the turn
    budget)."""
    if mode != Mode.AGENTIC:
        return turn_budget
    return max(config.obs_min_per_obs, turn_budget // max(1, n_blocks))


@dataclasses.dataclass(frozen=True)
class ObservationIds:
    """Token ids of an observation turn and its truncation stats (per-row stats;
    docs/protocol.md, "Observations")."""

    ids: list[int]
    blocks: int
    truncated: int
    dropped_tokens: int


def truncate_block_ids(block: ObservationBlock, budget: int, encode: Encode,
                       tail_fraction: float = 0.5) -> tuple[list[int], bool, int]:
    """`(ids, truncated, dropped_body_tokens)` of one block within `budget` tokens.

    A block that fits is encoded whole. Otherwise the tags are kept and the body becomes
    head + `OBS_TRUNCATION_MARKER` + tail, the tail taking `tail_fraction` of
    `budget - tags - marker`; when that leaves no room, the tags are emitted balanced around
    an empty body (even if they alone exceed `budget`).
    """
    whole = list(encode(block.text))
    if len(whole) <= budget:
        return whole, False, 0
    open_ids, close_ids = list(encode(block.open_tag)), list(encode(OBSERVATION_CLOSE))
    body_ids = list(encode(block.body))
    if len(open_ids) + len(body_ids) + len(close_ids) <= budget:
        return open_ids + body_ids + close_ids, False, 0  # fits once encoded piecewise
    marker_ids = list(encode(OBS_TRUNCATION_MARKER))
    room = budget - len(open_ids) - len(close_ids) - len(marker_ids)
    if room <= 0:
        return open_ids + close_ids, bool(body_ids), len(body_ids)
    tail = int(room * tail_fraction)
    head = room - tail
    tail_ids = body_ids[len(body_ids) - tail:] if tail else []
    return open_ids + body_ids[:head] + marker_ids + tail_ids + close_ids, True, \
        len(body_ids) - room


def observation_ids(observation: ObservationText, share: int, encode: Encode,
                    config: ProtocolConfig) -> ObservationIds:
    """Token ids of an observation turn: each block cut to `share` tokens on its own,
    separators encoded whole."""
    ids: list[int] = []
    truncated = dropped = 0
    for part in observation.parts:
        if isinstance(part, str):
            ids += encode(part)
            continue
        block_ids, was_cut, block_dropped = truncate_block_ids(part, share, encode,
                                                               config.obs_tail_fraction)
        ids += block_ids
        truncated += was_cut
        dropped += block_dropped
    return ObservationIds(ids, len(observation.blocks), truncated, dropped)
