"""Property tests: the RouteWeaver parsers never crash, always give a typed action or exactly
one violation code of their surface, and tolerate exactly the mutations the reference does."""

from __future__ import annotations

import re

from grammar_helpers import parse_layer
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_routeweaver.routing.protocol.grammar import (
    MODES,
    OBS_TRUNCATION_MARKER,
    ROLES,
    AgenticRoute,
    Mode,
    ModeDeclared,
    ProtocolConfig,
    Rejected,
    Role,
    RouteAction,
    parse_mode_declaration,
    parse_route,
)
from jax_routeweaver.routing.protocol.observations import ObservationBlock, truncate_block_ids
from jax_routeweaver.routing.protocol.turns import (
    AnswerAccepted,
    Dispatch,
    Node,
    RoutingState,
    handle_agentic_turn,
    handle_selector_turn,
    handle_single_multi_turn,
    record_action_turn,
    record_calls,
)
from jax_routeweaver.routing.protocol.violations import (
    AGENTIC_VIOLATIONS,
    SELECTOR_VIOLATIONS,
    SINGLE_MULTI_VIOLATIONS,
    Violation,
)

OFFERED = tuple(f"worker_{k}" for k in range(1, 7))
CFG = ProtocolConfig()
FAST = settings(max_examples=150, deadline=None)

FRAGMENTS = [
    "<mode>", "</mode>", "single", "multi", "agentic", "<route", "</route>", "<ROUTE ",
    "</Route >", ">", " model=", " role=", " refs=", ' model="worker_1"', " model='worker_3'",
    ' role="executor"', ' role="summarizer"', ' role="verifier"', ' refs="n1"', ' refs="n1,n2"',
    ' refs=""', '"', "'", "=", " ", "\n", "task", "<answer>", "</answer>", "<observation",
    "<layer>", "<paradigm>", "<action>", "n1", "n2", "MODEL_ID", "query", "worker_9", "Worker_2",
]
protocol_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)),
                         max_size=25).map("".join)
any_text = st.one_of(st.text(max_size=200), protocol_text)


def _agentic_states() -> st.SearchStrategy[RoutingState]:
    def build(roles: list[Role]) -> RoutingState:
        nodes = tuple(Node(f"n{i + 1}", i + 1, "worker_1", "t", role)
                      for i, role in enumerate(roles))
        return RoutingState(mode=Mode.AGENTIC, nodes=nodes)
    return st.lists(st.sampled_from(ROLES), max_size=9).map(build)


def _assert_one_code(decision: object, allowed: tuple[Violation, ...]) -> None:
    if isinstance(decision, Rejected):
        assert decision.code in allowed
        assert set(decision.codes) <= set(allowed)
        assert list(decision.codes) == sorted(set(decision.codes))
        assert decision.codes[0] == decision.code


# ------------------------------------------------------------------------- never crash
@FAST
@given(any_text)
def test_selector_total(text: str) -> None:
    decision = handle_selector_turn(text).decision
    assert isinstance(decision, ModeDeclared | Rejected)
    _assert_one_code(decision, SELECTOR_VIOLATIONS)


@FAST
@given(any_text, st.sampled_from([Mode.SINGLE, Mode.MULTI]), st.integers(0, 5))
def test_single_multi_total(text: str, mode: Mode, calls: int) -> None:
    nodes = tuple(Node(f"n{k}", k, "worker_1", "t") for k in range(1, calls + 1))
    decision = handle_single_multi_turn(text, RoutingState(mode=mode, nodes=nodes), OFFERED,
                                        CFG).decision
    assert isinstance(decision, Dispatch | AnswerAccepted | Rejected)
    _assert_one_code(decision, SINGLE_MULTI_VIOLATIONS)
    if isinstance(decision, Dispatch):
        assert len(decision.calls) == 1 and decision.calls[0].worker in OFFERED
        assert calls < CFG.route_bounds(mode)[1]
    if isinstance(decision, AnswerAccepted):
        assert calls >= CFG.route_bounds(mode)[0]


@FAST
@given(any_text, _agentic_states())
def test_agentic_total(text: str, state: RoutingState) -> None:
    decision = handle_agentic_turn(text, state, OFFERED, CFG).decision
    assert isinstance(decision, Dispatch | AnswerAccepted | Rejected)
    _assert_one_code(decision, AGENTIC_VIOLATIONS)
    if isinstance(decision, AnswerAccepted):
        assert state.summarizer_done


# ------------------------------------------------------------------- tolerated mutations
def _random_case(draw, word: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(word, flips, strict=True))


ws = st.sampled_from(["", " ", "  ", "\n", "\t "])
quote = st.sampled_from(['"', "'"])
task_text = st.text(st.characters(blacklist_characters="<>", blacklist_categories=["Cs"]),
                    min_size=1, max_size=40).filter(
    lambda s: s.strip() and s.strip().lower() not in {"query", "your_query",
                                                      "concrete_subquery"})


@FAST
@given(st.data(), st.sampled_from(MODES), ws, ws, st.text(max_size=30))
def test_selector_mutations_still_declare(data, mode: Mode, pre: str, post: str,
                                         prose: str) -> None:
    prose = re.sub(r"[<>]", "", prose)
    text = (f"{prose}<{_random_case(data.draw, 'mode')}>{pre}{_random_case(data.draw, mode)}"
            f"{post}</{_random_case(data.draw, 'mode')}>{prose}")
    assert parse_mode_declaration(text) == ModeDeclared(mode)


@FAST
@given(st.data(), st.sampled_from(OFFERED), task_text, quote, ws, ws, ws)
def test_route_mutations_parse_the_same(data, worker: str, task: str, q: str, a: str, b: str,
                                        c: str) -> None:
    tag = _random_case(data.draw, "route")
    attr = _random_case(data.draw, "model")
    value = _random_case(data.draw, worker)
    text = f"<{tag} {a}{attr}{b}={c}{q}{value}{q}{a}>{task}</{_random_case(data.draw, 'route')}{a}>"
    assert parse_route(text) == RouteAction(worker, task.strip())


@FAST
@given(st.sampled_from(OFFERED), task_text, quote, st.sampled_from(["model", "role", "id"]),
       st.booleans())
def test_route_extra_attributes_are_refused(worker: str, task: str, q: str, extra: str,
                                            before: bool) -> None:
    model = f"model={q}{worker}{q}"
    other = f"{extra}={q}x{q}"
    attrs = f"{other} {model}" if before else f"{model} {other}"
    expected = "attr_duplicate" if extra == "model" else "attr_unknown"
    assert parse_route(f"<route {attrs}>{task}</route>").code == expected


@FAST
@given(st.data(), st.lists(st.tuples(st.sampled_from(OFFERED), st.sampled_from(ROLES),
                                     st.lists(st.sampled_from(["n1", "n2", "n3"]), max_size=3),
                                     task_text), min_size=1, max_size=4))
def test_layer_mutations_parse_the_same(data, members) -> None:
    parts, expected = [], []
    for worker, role, refs, task in members:
        q = data.draw(quote)
        sep = data.draw(st.sampled_from([", ", ";", ","]))
        attrs = [f"{_random_case(data.draw, 'model')}={q}{worker}{q}",
                 f"{_random_case(data.draw, 'role')}{data.draw(ws)}={data.draw(ws)}{q}"
                 f"{_random_case(data.draw, role)}{q}",
                 f"refs={q}{sep.join(refs)}{q}",
                 f"id={q}{data.draw(st.integers(0, 9))}{q}"]  # unknown: ignored
        attrs = data.draw(st.permutations(attrs))
        if data.draw(st.booleans()):  # a repeated attribute keeps its last value
            attrs = [f"model={q}worker_9{q}", *attrs]
        tag = _random_case(data.draw, "route")
        parts.append(f"<{tag}{data.draw(ws)} {' '.join(attrs)}>{task}</{tag}>")
        expected.append(AgenticRoute(worker, role, tuple(refs), task.strip()))
    assert parse_layer(data.draw(ws).join(parts)) == tuple(expected)


# -------------------------------------------------------------------- agentic invariants
@FAST
@given(st.lists(st.lists(st.tuples(st.sampled_from(OFFERED), st.sampled_from(ROLES),
                                   st.lists(st.sampled_from([f"n{k}" for k in range(1, 10)]),
                                            max_size=2),
                                   st.sampled_from(["a", "b"])), min_size=1, max_size=4),
                min_size=1, max_size=8))
def test_accepted_layers_keep_the_rules(layers) -> None:
    state = RoutingState(mode=Mode.AGENTIC)
    for layer in layers:
        text = "".join(f'<route model="{w}" role="{r}" refs="{",".join(refs)}">{t}</route>'
                       for w, r, refs, t in layer)
        outcome = handle_agentic_turn(text, state, OFFERED, CFG)
        state = record_action_turn(state, outcome, CFG)
        if not isinstance(outcome.decision, Dispatch):
            continue
        calls = outcome.decision.calls
        done = set(state.completed_ids)
        assert not state.summarizer_done
        assert state.calls_used + len(calls) <= CFG.max_workers
        if any(c.role == Role.SUMMARIZER for c in calls):
            assert len(calls) == 1
        else:
            assert state.calls_used + len(calls) < CFG.max_workers  # summarizer slot kept
        for call in calls:
            assert set(call.refs) <= done
            if call.role == Role.VERIFIER:
                assert call.refs
        assert len({(c.role, c.worker, c.task) for c in calls}) == len(calls)
        state = record_calls(state, [Node.from_call(c, "out") for c in calls])
    assert state.calls_used <= CFG.max_workers


# ------------------------------------------------------------------------------ truncation
@FAST
@given(st.text(max_size=400), st.integers(0, 300), st.floats(0, 1),
       st.sampled_from([None, "n1"]))
def test_truncation_properties(body: str, budget: int, tail_fraction: float,
                               node: str | None) -> None:
    encode = lambda s: [ord(c) for c in s]
    block = ObservationBlock(body, node, "executor" if node else None)
    ids, truncated, dropped = truncate_block_ids(block, budget, encode, tail_fraction)
    text = "".join(map(chr, ids))
    tags = len(block.open_tag) + len("</observation>")
    assert text.startswith(block.open_tag) and text.endswith("</observation>")
    assert len(ids) <= max(budget, tags)
    if not truncated:
        assert text == block.text and dropped == 0
    else:
        inner = text[len(block.open_tag):len(text) - len("</observation>")]
        kept = 0
        if inner:
            head, tail = inner.split(OBS_TRUNCATION_MARKER)
            assert body.startswith(head) and body.endswith(tail)
            kept = len(head) + len(tail)
        assert dropped == len(body) - kept > 0
