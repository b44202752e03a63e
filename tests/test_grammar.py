"""RouteWeaver protocol: parsers, every violation code, check precedence, episode state."""

from __future__ import annotations

import dataclasses

import pytest
from grammar_helpers import parse_layer

from jax_routeweaver.routing.protocol.grammar import (
    AGENTIC_STOPS,
    SELECTOR_STOPS,
    SINGLE_MULTI_STOPS,
    AgenticRoute,
    Mode,
    ModeDeclared,
    ProtocolConfig,
    Rejected,
    Role,
    RouteAction,
    parse_answer,
    parse_mode_declaration,
    parse_route,
    split_refs,
    stop_strings,
)
from jax_routeweaver.routing.protocol.turns import (
    AnswerAccepted,
    Dispatch,
    Node,
    PlannedCall,
    RoutingState,
    declare_forced_mode,
    episode_over,
    handle_action_turn,
    handle_agentic_turn,
    handle_selector_turn,
    handle_single_multi_turn,
    record_action_turn,
    record_calls,
    record_selector_turn,
    resolve_refs,
)
from jax_routeweaver.routing.protocol.violations import (
    AGENTIC_VIOLATIONS,
    SELECTOR_VIOLATIONS,
    SINGLE_MULTI_VIOLATIONS,
    Notice,
    Violation,
)

OFFERED = tuple(f"worker_{k}" for k in range(1, 7))
CFG = ProtocolConfig()


def _node(k: int, layer: int, role: Role | None = None, output: str = "") -> Node:
    return Node(id=f"n{k}", layer=layer, model="worker_1", instruction=f"task {k}", role=role,
                output=output or f"output {k}")


def sm_state(mode: Mode, calls: int = 0) -> RoutingState:
    return RoutingState(mode=mode, nodes=tuple(_node(k, k) for k in range(1, calls + 1)))


def agentic_state(*layers: list[str]) -> RoutingState:
    nodes, k = [], 0
    for layer, roles in enumerate(layers, 1):
        for role in roles:
            k += 1
            nodes.append(_node(k, layer, Role(role)))
    return RoutingState(mode=Mode.AGENTIC, nodes=tuple(nodes))


def route(model: str = "worker_1", role: str = "executor", refs: str = "",
          task: str = "Solve it.") -> str:
    return f'<route model="{model}" role="{role}" refs="{refs}">{task}</route>'


def _selector(text: str) -> object:
    return handle_selector_turn(text).decision


def _sm(text: str, mode: Mode = Mode.MULTI, calls: int = 0, **kw: object) -> object:
    return handle_single_multi_turn(text, sm_state(mode, calls), kw.pop("offered", OFFERED),
                                    CFG, **kw).decision


def _ag(text: str, state: RoutingState | None = None, config: ProtocolConfig = CFG) -> object:
    return handle_agentic_turn(text, state or agentic_state(), OFFERED, config).decision


# Every violation code with one turn that triggers it (the table is checked to cover all).
CASES: list[tuple[Violation, object]] = [
    (Violation.SELECTOR_MODE_MISSING, lambda: _selector("I would pick single here.")),
    (Violation.SELECTOR_MODE_DUPLICATE, lambda: _selector("<mode>single</mode><mode>multi</mode>")),
    (Violation.SELECTOR_MODE_INVALID, lambda: _selector("<mode>hybrid</mode>")),
    (Violation.ROUTE_IN_SELECTOR,
     lambda: _selector('<mode>single</mode><route model="worker_1">x</route>')),
    (Violation.LAYER_IN_SELECTOR, lambda: _selector("<mode>agentic</mode><layer>")),
    (Violation.ACTION_IN_SELECTOR, lambda: _selector("<mode>single</mode><action>")),
    (Violation.PARADIGM_IN_SELECTOR, lambda: _selector("<mode>agentic</mode><paradigm>")),
    (Violation.OBSERVATION_IN_SELECTOR, lambda: _selector("<mode>single</mode><observation")),
    (Violation.ANSWER_IN_SELECTOR, lambda: _selector("<mode>single</mode><answer>4</answer>")),
    (Violation.MODE_DUPLICATE, lambda: _sm('<mode>multi</mode><route model="worker_1">x</route>')),
    (Violation.ANSWER_PREMATURE, lambda: _sm("<answer>4</answer>", Mode.MULTI, calls=1)),
    (Violation.ROUTE_MISSING, lambda: _sm("Let me think about it.")),
    (Violation.ROUTE_MALFORMED, lambda: _sm('<route model="worker_1">no close tag')),
    (Violation.ATTR_DUPLICATE, lambda: _sm('<route model="worker_1" model="worker_2">x</route>')),
    (Violation.ATTR_UNKNOWN, lambda: _sm('<route model="worker_1" role="executor">x</route>')),
    (Violation.ATTR_MISSING, lambda: _sm("<route>x</route>")),
    (Violation.QUERY_EMPTY, lambda: _sm('<route model="worker_1">  \n </route>')),
    (Violation.PLACEHOLDER, lambda: _sm('<route model="worker_1">Concrete_SubQuery</route>')),
    (Violation.ROUTE_LIMIT_EXCEEDED,
     lambda: _sm('<route model="worker_1">x</route>', Mode.SINGLE, calls=1)),
    (Violation.UNKNOWN_MODEL, lambda: _sm('<route model="qwen3_8b">x</route>')),
    (Violation.WORKER_NOT_OFFERED,
     lambda: _sm('<route model="worker_5">x</route>', offered=OFFERED[:3], registry=OFFERED)),
    (Violation.ACTION_MISSING, lambda: _ag("<answer>42</answer>")),
    (Violation.ACTION_MALFORMED, lambda: _ag('<route model="worker_1" role="executor">x')),
    (Violation.ROLE_MISSING, lambda: _ag('<route model="worker_1" refs="">x</route>')),
    (Violation.MODEL_MISSING, lambda: _ag('<route model="  " role="executor">x</route>')),
    (Violation.INSTRUCTION_MISSING, lambda: _ag(route(task="   "))),
    (Violation.ROLE_INVALID, lambda: _ag(route(role="critic"))),
    (Violation.MODEL_INVALID, lambda: _ag(route(model="Worker_1"))),
    (Violation.REF_UNKNOWN, lambda: _ag(route(refs="n7"), agentic_state(["executor"]))),
    (Violation.REF_SAME_LAYER, lambda: _ag(route() + route("worker_2", "verifier", "n1"))),
    (Violation.SUMMARIZER_NEEDS_REFS,
     lambda: _ag(route(role="summarizer"), agentic_state(["executor"]))),
    (Violation.VERIFIER_NEEDS_REFS, lambda: _ag(route(role="verifier"))),
    (Violation.ALREADY_FINISHED,
     lambda: _ag(route(), agentic_state(["executor"], ["summarizer"]))),
    (Violation.LAYER_EXCEEDS_BUDGET,
     lambda: _ag("".join(route(task=f"t{i}") for i in range(2)),
                 agentic_state(["executor"] * 7))),
    (Violation.MUST_SUMMARIZE_NOW, lambda: _ag(route(), agentic_state(["executor"] * 7))),
    (Violation.SUMMARIZER_NOT_ALONE,
     lambda: _ag(route(role="summarizer", refs="n1") + route(), agentic_state(["executor"]))),
    (Violation.DUPLICATE_IN_LAYER, lambda: _ag(route() + route())),
]


@pytest.mark.parametrize(("code", "run"), CASES, ids=[str(code) for code, _ in CASES])
def test_every_violation_code_fires(code: Violation, run) -> None:
    decision = run()
    assert isinstance(decision, Rejected), decision
    assert decision.code == code
    assert decision.codes[0] == code


def test_violation_table_covers_every_code_and_the_spec_list() -> None:
    assert {code for code, _ in CASES} == set(Violation)
    assert len(Violation) == 37
    assert [str(v) for v in SELECTOR_VIOLATIONS] == [
        "selector_mode_missing", "selector_mode_duplicate", "selector_mode_invalid",
        "route_in_selector", "layer_in_selector", "action_in_selector", "paradigm_in_selector",
        "observation_in_selector", "answer_in_selector"]
    assert {str(v) for v in SINGLE_MULTI_VIOLATIONS} == {
        "mode_duplicate", "answer_premature", "route_missing", "route_malformed",
        "attr_missing", "attr_unknown", "attr_duplicate", "query_empty", "placeholder",
        "route_limit_exceeded", "unknown_model", "worker_not_offered"}
    assert {str(v) for v in AGENTIC_VIOLATIONS} == {
        "action_missing", "action_malformed", "role_missing", "model_missing",
        "instruction_missing", "role_invalid", "model_invalid", "ref_unknown", "ref_same_layer",
        "summarizer_needs_refs", "verifier_needs_refs", "already_finished",
        "layer_exceeds_budget", "must_summarize_now", "summarizer_not_alone",
        "duplicate_in_layer"}
    assert {str(n) for n in Notice} == {"fabricated_observation_blocked", "rules_budget_exhausted",
                                        "obs_budget_exhausted", "worker_span_extraction_failed"}


# ------------------------------------------------------------------------------ constants
def test_protocol_numbers_are_the_reference_defaults() -> None:
    assert (CFG.selector_max_tokens, CFG.single_routes, CFG.multi_min_routes,
            CFG.multi_max_routes, CFG.max_workers, CFG.action_turn_limit) == (64, 1, 2, 4, 8, 10)
    assert (CFG.response_length, CFG.worker_max_tokens, CFG.obs_reserve, CFG.obs_budget_cap,
            CFG.obs_min_per_obs, CFG.obs_tail_fraction) == (16384, 4096, 1024, 4096, 256, 0.5)
    assert (CFG.observation_cap, CFG.recovery, CFG.multi_attach_previous,
            CFG.routing_state, CFG.forced_declaration) == (None, False, False, True, "user_turn")
    assert CFG.selector_attempts == 1
    assert ProtocolConfig(recovery=True).selector_attempts == 2
    assert ProtocolConfig(max_workers=6).action_turn_limit == 8
    assert ProtocolConfig(max_action_turns=3).action_turn_limit == 3
    assert CFG.route_bounds(Mode.SINGLE) == (1, 1)
    assert CFG.route_bounds(Mode.MULTI) == (2, 4)


@pytest.mark.parametrize("bad", [dict(max_workers=0), dict(multi_min_routes=5),
                                 dict(observation_cap=0), dict(obs_tail_fraction=1.5),
                                 dict(forced_declaration="system"), dict(response_length=True),
                                 dict(obs_reserve=-1)])
def test_protocol_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="ProtocolConfig"):
        ProtocolConfig(**bad)


def test_stop_strings_per_turn_kind() -> None:
    assert stop_strings(None) == SELECTOR_STOPS == ("</mode>", "</answer>", "<observation")
    assert stop_strings(Mode.SINGLE) == stop_strings(Mode.MULTI) == SINGLE_MULTI_STOPS
    assert SINGLE_MULTI_STOPS == ("</route>", "</answer>", "<observation")
    assert stop_strings(Mode.AGENTIC) == AGENTIC_STOPS == ("</answer>", "<observation")


# --------------------------------------------------------------------------------- selector
@pytest.mark.parametrize(("text", "mode"), [
    ("<mode>single</mode>", Mode.SINGLE),
    ("<MODE> Multi\n</Mode>", Mode.MULTI),
    ("I will coordinate roles. <mode>AGENTIC</mode> Done.", Mode.AGENTIC),
    ("<think>hmm</think><mode>single</mode>", Mode.SINGLE),
])
def test_selector_tolerance(text: str, mode: Mode) -> None:
    assert parse_mode_declaration(text) == ModeDeclared(mode)


def test_selector_value_pattern_and_codes_sorted() -> None:
    # `multi-agent` is not `[a-zA-Z_]+`, so there is no declaration at all.
    assert parse_mode_declaration("<mode>multi-agent</mode>").code == "selector_mode_missing"
    assert parse_mode_declaration("< mode>single</mode>").code == "selector_mode_missing"
    answer_only = parse_mode_declaration("<answer>4</answer>")
    assert answer_only.codes == ("answer_in_selector", "selector_mode_missing")
    # A legal declaration is still refused next to a forbidden tag; the first sorted code wins.
    both = parse_mode_declaration("<mode>bogus</mode><Route model='x'>")
    assert both.codes == ("route_in_selector", "selector_mode_invalid")
    assert both.code == "route_in_selector"


def test_rejected_normalises_codes() -> None:
    rejected = Rejected((Violation.ROLE_MISSING, Violation.MODEL_INVALID, Violation.ROLE_MISSING))
    assert rejected.codes == (Violation.MODEL_INVALID, Violation.ROLE_MISSING)
    assert rejected.code == Violation.MODEL_INVALID
    with pytest.raises(ValueError):
        Rejected(())


# ------------------------------------------------------------------------- single / multi
def test_parse_route_tolerance() -> None:
    assert parse_route("<ROUTE MODEL='Worker_3' >  Find X. </Route >") == RouteAction(
        "worker_3", "Find X.")
    assert parse_route('prose <route  model = "worker_2">a\nb</route> more') == RouteAction(
        "worker_2", "a\nb")
    # first complete route only
    assert parse_route('<route model="worker_1">a</route><route model="worker_2">b</route>'
                       ) == RouteAction("worker_1", "a")


@pytest.mark.parametrize(("text", "code"), [
    # stray text is checked first, then duplicates, unknown names, missing model
    ('<route model="a" model="b" junk>x</route>', "route_malformed"),
    ('<route model=worker_1>x</route>', "route_malformed"),
    ('<route role="x" role="y">x</route>', "attr_duplicate"),
    ('<route role="x">x</route>', "attr_unknown"),
    ('<route model="">x</route>', "attr_missing"),
    ("<route></route>", "attr_missing"),
    ('<route model="Model_ID"></route>', "placeholder"),
    ('<route model="worker_1">query</route>', "placeholder"),
    ('<route model="worker_1">YOUR_QUERY</route>', "placeholder"),
    ('<route model="worker_1"></route>', "query_empty"),
])
def test_parse_route_check_order(text: str, code: str) -> None:
    assert parse_route(text).code == code


def test_single_multi_precedence() -> None:
    # 1. <mode beats everything, even an acceptable answer
    assert _sm("<mode>x</mode><answer>1</answer>", Mode.SINGLE, calls=1).code == "mode_duplicate"
    # 2. an answer with no parseable route: accepted once enough calls ran, else premature
    assert _sm("<answer> 9 </answer>", Mode.SINGLE, calls=1) == AnswerAccepted("9")
    assert _sm("<answer>9</answer>", Mode.SINGLE, calls=0).code == "answer_premature"
    assert _sm("<answer>a</answer><answer>b</answer>", Mode.MULTI, calls=2) == AnswerAccepted("b")
    assert _sm('<route model="worker_1">x <answer>5</answer>', Mode.MULTI,
               calls=2) == AnswerAccepted("5")
    # a parseable route wins over an answer in the same text
    assert isinstance(_sm('<route model="worker_1">x</route><answer>5</answer>', Mode.MULTI,
                          calls=2), Dispatch)
    # 3. parse errors before the call limit; 4. the limit before the registry
    assert _sm("<route>x</route>", Mode.SINGLE, calls=1).code == "attr_missing"
    assert _sm('<route model="bogus">x</route>', Mode.SINGLE, calls=1).code == \
        "route_limit_exceeded"
    assert _sm('<route model="worker_1">x</route>', Mode.MULTI, calls=4).code == \
        "route_limit_exceeded"
    # 5. registry before offered list
    assert _sm('<route model="worker_9">x</route>', offered=OFFERED[:3],
               registry=OFFERED).code == "unknown_model"


def test_single_multi_dispatch() -> None:
    decision = _sm('<route model="WORKER_2">Compute 7*6.</route>', Mode.MULTI, calls=2)
    assert decision == Dispatch((PlannedCall(worker="worker_2", task="Compute 7*6.",
                                             node_id="n3", layer=3),))
    assert _sm('<route model="worker_1">x</route>', Mode.MULTI, calls=3).calls[0].node_id == "n4"
    with pytest.raises(ValueError, match="not single or multi"):
        handle_single_multi_turn("x", RoutingState(mode=Mode.AGENTIC), OFFERED, CFG)


# -------------------------------------------------------------------------------- agentic
def test_parse_layer_tolerance() -> None:
    text = ("<ROUTE refs='n1 ; n2,,' Role=\"Executor\" id=\"7\" model=' worker_3 '>"
            " Do it. </route>\n"
            '<route model="worker_1" model="worker_2" role="verifier" refs="n2">Check.</route>')
    assert parse_layer(text) == (
        AgenticRoute(model="worker_3", role="executor", refs=("n1", "n2"),
                     instruction="Do it."),
        AgenticRoute(model="worker_2", role="verifier", refs=("n2",), instruction="Check."))
    assert split_refs("") == ()
    assert split_refs(" n1;n2 , ,n3") == ("n1", "n2", "n3")


def test_parse_layer_codes() -> None:
    assert parse_layer("nothing").codes == ("action_missing",)
    assert parse_layer("<Route model='worker_1'>").codes == ("action_malformed",)
    # an unclosed trailing route is ignored once another route is complete
    assert len(parse_layer(route() + '<route model="worker_2">')) == 1
    assert parse_layer('<route refs="">  </route>').codes == (
        "instruction_missing", "model_missing", "role_missing")
    assert parse_layer('<route model="worker_1" role="">x</route>').codes == ("role_missing",)


def test_agentic_precedence_and_answers() -> None:
    done = agentic_state(["executor", "executor"], ["summarizer"])
    # the normal finish: a bare answer after the summarizer
    assert _ag("<answer> 42 </answer>", done) == AnswerAccepted("42")
    # a route + answer after the summarizer: already_finished is overridden by the answer
    assert _ag(route() + "<answer>42</answer>", done) == AnswerAccepted("42")
    assert _ag(route(), done).code == "already_finished"
    # before the summarizer a bare answer is simply no action
    assert _ag("<answer>42</answer>", agentic_state(["executor"])).code == "action_missing"
    # codes of a turn are pooled and sorted; parse errors mix with rule codes
    mixed = _ag(route(model="worker_9") + '<route model="worker_1">b</route>')
    assert mixed.codes == ("model_invalid", "role_missing")
    wide = _ag("".join(route(task=f"t{i}") for i in range(9)))
    assert wide.codes == ("layer_exceeds_budget", "must_summarize_now")
    assert _ag(route(model="Worker_1", role="Planner", refs="n9")).codes == (
        "model_invalid", "ref_unknown")


def test_agentic_rules_edges() -> None:
    # a summarizer alone as the very first call, with no refs, is legal
    assert isinstance(_ag(route(role="summarizer")), Dispatch)
    # seven non-summarizer calls leave the reserved slot; an eighth must be the summarizer
    assert isinstance(_ag("".join(route(task=f"t{i}") for i in range(7))), Dispatch)
    assert _ag("".join(route(task=f"t{i}") for i in range(8))).codes == ("must_summarize_now",)
    full = agentic_state(["executor"] * 7)
    assert isinstance(_ag(route(role="summarizer", refs="n1,n7"), full), Dispatch)
    # duplicates differ by any of role / model / instruction
    assert isinstance(_ag(route() + route(model="worker_2")), Dispatch)
    # a ref to a later node of the same layer is same-layer, a ref beyond it is unknown
    assert _ag(route(refs="n2") + route(task="b")).codes == ("ref_same_layer",)
    assert _ag(route(refs="n3") + route(task="b")).codes == ("ref_unknown",)
    # verifiers and planners may stand anywhere as long as refs are legal
    state = agentic_state(["planner"], ["executor"])
    decision = _ag(route(role="verifier", refs="n2") + route(role="executor", refs="n1;n2",
                                                             model="worker_4"), state)
    assert decision == Dispatch((
        PlannedCall("worker_1", "Solve it.", "n3", 3, Role.VERIFIER, ("n2",)),
        PlannedCall("worker_4", "Solve it.", "n4", 3, Role.EXECUTOR, ("n1", "n2"))))
    assert [n.id for n in resolve_refs(decision.calls[1], state)] == ["n1", "n2"]
    assert resolve_refs(decision.calls[0], state)[0].output == "output 2"
    with pytest.raises(ValueError, match="not agentic"):
        handle_agentic_turn("x", sm_state(Mode.MULTI), OFFERED, CFG)


def test_smaller_budget_config() -> None:
    six = ProtocolConfig(max_workers=6)
    state = agentic_state(["executor"] * 5)
    assert _ag(route(), state, six).code == "must_summarize_now"
    assert isinstance(_ag(route(role="summarizer", refs="n5"), state, six), Dispatch)


def test_parse_answer() -> None:
    assert parse_answer("no") is None
    assert parse_answer("<answer>a</answer> x <ANSWER >\n b \n</Answer >") == "b"
    assert parse_answer("<answer></answer>") == ""
    assert parse_answer("<answer>open") is None


# ----------------------------------------------------------------------- notices and state
def test_fabricated_observation_is_recorded_not_fatal() -> None:
    text = route() + "\n<observation"
    outcome = handle_agentic_turn(text, agentic_state(), OFFERED, CFG)
    assert isinstance(outcome.decision, Dispatch)
    assert outcome.notices == (Notice.FABRICATED_OBSERVATION_BLOCKED,)
    sm = handle_single_multi_turn("Sure. <observation", sm_state(Mode.SINGLE), OFFERED, CFG)
    assert sm.decision.code == "route_missing"
    assert sm.notices == (Notice.FABRICATED_OBSERVATION_BLOCKED,)
    selector = handle_selector_turn("<mode>single</mode><observation")
    assert selector.decision.code == "observation_in_selector"
    assert selector.notices == (Notice.FABRICATED_OBSERVATION_BLOCKED,)
    assert handle_selector_turn("<mode>single</mode>").notices == ()


def test_state_transitions_without_recovery() -> None:
    state = record_selector_turn(RoutingState(), handle_selector_turn("<mode>multi</mode>"), CFG)
    assert (state.mode, state.selector_attempts, episode_over(state, CFG)) == (Mode.MULTI, 1,
                                                                              False)
    outcome = handle_action_turn('<route model="worker_1">a</route>', state, OFFERED, CFG)
    state = record_action_turn(state, outcome, CFG)
    state = record_calls(state, [Node.from_call(outcome.decision.calls[0], "A", success=False)])
    assert (state.calls_used, state.action_turns, state.nodes[0].success) == (1, 1, False)
    outcome = handle_action_turn("<answer>x</answer>", state, OFFERED, CFG)
    state = record_action_turn(state, outcome, CFG)
    assert state.policy_invalid == "answer_premature"
    assert state.violations == ("answer_premature",)
    assert episode_over(state, CFG)


def test_state_transitions_with_recovery() -> None:
    cfg = ProtocolConfig(recovery=True)
    state = record_selector_turn(RoutingState(), handle_selector_turn("single"), cfg)
    assert (state.policy_invalid, episode_over(state, cfg)) == (None, False)
    state = record_selector_turn(state, handle_selector_turn("<mode>x</mode>"), cfg)
    assert state.policy_invalid == "selector_mode_invalid"  # the one retry is used up
    assert state.violations == ("selector_mode_missing", "selector_mode_invalid")
    assert episode_over(state, cfg)

    state = declare_forced_mode(RoutingState(), Mode.SINGLE)
    assert (state.mode, state.forced) == (Mode.SINGLE, True)
    for _ in range(cfg.action_turn_limit - 1):
        state = record_action_turn(state, handle_action_turn("hmm", state, OFFERED, cfg), cfg)
        assert not episode_over(state, cfg)
    state = record_action_turn(state, handle_action_turn("hmm", state, OFFERED, cfg), cfg)
    assert episode_over(state, cfg)  # out of turns is not a violation
    assert state.policy_invalid is None and len(state.violations) == 10


def test_selector_failure_without_recovery_ends_episode() -> None:
    state = record_selector_turn(RoutingState(), handle_selector_turn("<answer>1</answer>"), CFG)
    assert (state.mode, state.policy_invalid) == (None, "answer_in_selector")
    assert episode_over(state, CFG)


def test_routing_state_views() -> None:
    state = agentic_state(["executor", "executor"], ["summarizer"])
    assert state.completed_ids == ("n1", "n2", "n3")
    assert (state.layers_done, state.calls_used, state.summarizer_done) == (2, 3, True)
    assert state.calls_remaining(CFG) == 5
    assert state.node("n2").id == "n2"
    with pytest.raises(KeyError, match="n9"):
        state.node("n9")
    overfull = dataclasses.replace(state, nodes=state.nodes * 3)
    assert overfull.calls_remaining(CFG) == 0
    answered = record_action_turn(state, handle_action_turn("<answer>1</answer>", state,
                                                            OFFERED, CFG), CFG)
    assert answered.answer == "1" and episode_over(answered, CFG)
