"""Turn validation and the protocol's view of an episode: `RoutingState` (modes, calls and
records so far), the turn handlers that check a router turn against it and say what to do next,
and the `record_*` transitions that advance it (docs/protocol.md, "The rules of each mode").

Pure and I/O-free: the runner parses nothing itself, it hands each turn's text to a
`handle_*_turn`, runs the `Dispatch`ed calls and records the outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_routeweaver.routing.protocol.grammar import (
    MODE_OPEN_RE,
    ROLES,
    AgenticRoute,
    Mode,
    ModeDeclared,
    ProtocolConfig,
    Rejected,
    Role,
    has_fabricated_observation,
    parse_answer,
    parse_layer_members,
    parse_mode_declaration,
    parse_route,
    reject,
)
from jax_routeweaver.routing.protocol.violations import Notice, Violation


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
    """One single/multi action turn, checked in the original's order (docs/protocol.md,
    "Single/multi action turn"): `<mode` →
    when no route parses, an answer (accepted once the mode's required calls ran, else
    premature), else the parse error → call limit → registry (`unknown_model`; `registry`
    defaults to `offered`) → offered list.
    """
    if state.mode not in (Mode.SINGLE, Mode.MULTI):
        raise ValueError(f"handle_single_multi_turn: state.mode={state.mode!r} is not single "
                         "or multi")
    notices = _notices(text)
    if MODE_OPEN_RE.search(text):
        return TurnOutcome(reject(Violation.MODE_DUPLICATE), notices)
    required, limit = config.route_bounds(state.mode)
    route = parse_route(text)
    if isinstance(route, Rejected):
        answer = parse_answer(text)
        if answer is None:
            return TurnOutcome(route, notices)
        if state.calls_used >= required:
            return TurnOutcome(AnswerAccepted(answer), notices)
        return TurnOutcome(reject(Violation.ANSWER_PREMATURE), notices)
    if state.calls_used >= limit:
        return TurnOutcome(reject(Violation.ROUTE_LIMIT_EXCEEDED), notices)
    known = {worker.lower() for worker in (offered if registry is None else registry)}
    if route.model not in known:
        return TurnOutcome(reject(Violation.UNKNOWN_MODEL), notices)
    offered_by_key = {worker.lower(): worker for worker in offered}
    if route.model not in offered_by_key:
        return TurnOutcome(reject(Violation.WORKER_NOT_OFFERED), notices)
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
    routes, errors = parse_layer_members(text)
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
