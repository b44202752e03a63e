"""Constrained answers drawn from the workers' candidate answers (`EnvConfig.answer_choices`):
the tiny quickstart router chooses *which* reply to trust instead of spelling an answer."""

from xgrammar.testing import _is_grammar_accept_string as accepts

from jax_routeweaver.routing.episodes.routeweaver_env import action_grammar, answer_candidates
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol import turns as tr
from jax_routeweaver.routing.protocol.calls import WorkerCall

OFFERED = ["worker_1", "worker_2"]


def call(text: str, success: bool = True) -> WorkerCall:
    return WorkerCall(worker="worker_1", prompt="p", text=text, success=success)


def test_candidates_are_extracted_distinct_and_fit_the_answer_pattern():
    calls = [call("Work...\n<answer>42</answer>"), call("so the answer is \\boxed{7}"),
             call("<answer>42</answer>"), call("<answer>" + "x" * 40 + "</answer>"),
             call("<answer>Paris</answer>", success=False), call("The answer is B.")]
    assert answer_candidates(calls) == ["42", "7", "B"]


def test_single_mode_answer_must_be_a_candidate():
    state = tr.RoutingState(mode=g.Mode.SINGLE,
                            nodes=(tr.Node("n1", 1, "worker_1", "solve it"),))
    ebnf = action_grammar(state, OFFERED, g.ProtocolConfig(), ["42", 'say "hi" \\ now']).ebnf
    assert accepts(ebnf, "<answer>42</answer>")
    assert accepts(ebnf, '<answer>say "hi" \\ now</answer>')
    assert not accepts(ebnf, "<answer>43</answer>")
    free = action_grammar(state, OFFERED, g.ProtocolConfig()).ebnf
    assert accepts(free, "<answer>43</answer>")


def test_agentic_final_answer_must_be_a_candidate():
    nodes = (tr.Node("n1", 1, "worker_1", "solve", g.Role.EXECUTOR),
             tr.Node("n2", 2, "worker_2", "merge", g.Role.SUMMARIZER, ("n1",)))
    state = tr.RoutingState(mode=g.Mode.AGENTIC, nodes=nodes)
    grammar = action_grammar(state, OFFERED, g.ProtocolConfig(), ["B", "C"])
    assert accepts(grammar.ebnf, "<answer>B</answer>")
    assert not accepts(grammar.ebnf, "<answer>A</answer>")
    # Nothing but an answer is allowed: a finite choice, matched over canonical tokens.
    assert grammar.choices == ("<answer>B</answer>", "<answer>C</answer>")


def test_finite_choices_are_choice_grammars_and_free_text_is_not():
    selector = action_grammar(tr.RoutingState(), OFFERED, g.ProtocolConfig())
    assert selector.choices == ("<mode>single</mode>", "<mode>multi</mode>",
                                "<mode>agentic</mode>")
    used = tr.RoutingState(mode=g.Mode.SINGLE, nodes=(tr.Node("n1", 1, "worker_1", "solve"),))
    assert action_grammar(used, OFFERED, g.ProtocolConfig(), ["7"]).choices == (
        "<answer>7</answer>",)
    assert action_grammar(used, OFFERED, g.ProtocolConfig()).choices == ()  # free answer
    fresh = tr.RoutingState(mode=g.Mode.MULTI)
    assert action_grammar(fresh, OFFERED, g.ProtocolConfig(), ["7"]).choices == ()  # a route


def test_fixed_task_text_replaces_free_text_in_every_route():
    multi = action_grammar(tr.RoutingState(mode=g.Mode.MULTI), OFFERED, g.ProtocolConfig(),
                           task_text="Solve it.").ebnf
    assert accepts(multi, '<route model="worker_2">Solve it.</route>')
    assert not accepts(multi, '<route model="worker_2">Solve that.</route>')
    agentic = action_grammar(tr.RoutingState(mode=g.Mode.AGENTIC), OFFERED, g.ProtocolConfig(),
                             task_text="Solve it.").ebnf
    route = '<route model="worker_1" role="planner" refs="">Solve it.</route>'
    assert accepts(agentic, route)
    assert not accepts(agentic, route.replace("Solve it.", "Plan."))


def _nodes(*roles):
    return tuple(tr.Node(f"n{i}", i, "worker_1", "t", role) for i, role in enumerate(roles, 1))


FINITE_CASES = [  # (state, answers, expected number of options)
    (tr.RoutingState(mode=g.Mode.SINGLE), ["7"], 2),  # a route to one of two workers
    (tr.RoutingState(mode=g.Mode.SINGLE, nodes=_nodes(None)), ["7", "8"], 2),  # answer only
    (tr.RoutingState(mode=g.Mode.MULTI, nodes=_nodes(None, None)), ["7"], 3),  # route or answer
    (tr.RoutingState(mode=g.Mode.AGENTIC), [], 2 * 2 + 2),  # planner/executor + summarizer
    # two nodes: planner/executor with refs "", n1, n2, "n1,n2"; verifier and summarizer
    # with one of the three non-empty ref sets; times two workers
    (tr.RoutingState(mode=g.Mode.AGENTIC, nodes=_nodes(g.Role.PLANNER, g.Role.EXECUTOR)), [],
     2 * (2 * 4 + 3 + 3)),
    (tr.RoutingState(mode=g.Mode.AGENTIC,
                     nodes=_nodes(g.Role.EXECUTOR, g.Role.SUMMARIZER)), ["B", "C"], 2),
]


def test_with_fixed_task_text_every_action_is_a_finite_canonical_choice():
    for state, answers, n in FINITE_CASES:
        grammar = action_grammar(state, OFFERED, g.ProtocolConfig(), answers,
                                 task_text="Solve it.")
        assert len(grammar.choices) == len(set(grammar.choices)) == n, (state, grammar.choices)
        assert grammar.end_with_stop_token == (state.mode == g.Mode.AGENTIC
                                               and not state.summarizer_done)
        for option in grammar.choices:  # every option is an action the protocol accepts
            decision = tr.handle_action_turn(option, state, OFFERED, g.ProtocolConfig()).decision
            assert isinstance(decision, tr.Dispatch | tr.AnswerAccepted), (option, decision)
            assert accepts(grammar.ebnf, option)


def test_fixed_task_text_with_a_free_answer_due_stays_a_text_grammar():
    used = tr.RoutingState(mode=g.Mode.SINGLE, nodes=_nodes(None))
    grammar = action_grammar(used, OFFERED, g.ProtocolConfig(), [], task_text="Solve it.")
    assert grammar.choices == ()
    assert accepts(grammar.ebnf, "<answer>anything</answer>")
