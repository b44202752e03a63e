"""Constrained answers drawn from the workers' candidate answers (`EnvConfig.answer_choices`):
the tiny quickstart router chooses *which* reply to trust instead of spelling an answer."""

from xgrammar.testing import _is_grammar_accept_string as accepts

from jax_routeweaver.routing import grammar as g
from jax_routeweaver.routing.calls import WorkerCall
from jax_routeweaver.routing.routeweaver_env import action_grammar, answer_candidates

OFFERED = ["worker_1", "worker_2"]


def call(text: str, success: bool = True) -> WorkerCall:
    return WorkerCall(worker="worker_1", prompt="p", text=text, success=success)


def test_candidates_are_extracted_distinct_and_fit_the_answer_pattern():
    calls = [call("Work...\n<answer>42</answer>"), call("so the answer is \\boxed{7}"),
             call("<answer>42</answer>"), call("<answer>" + "x" * 40 + "</answer>"),
             call("<answer>Paris</answer>", success=False), call("The answer is B.")]
    assert answer_candidates(calls) == ["42", "7", "B"]


def test_single_mode_answer_must_be_a_candidate():
    state = g.RoutingState(mode=g.Mode.SINGLE,
                           nodes=(g.Node("n1", 1, "worker_1", "solve it"),))
    ebnf = action_grammar(state, OFFERED, g.ProtocolConfig(), ["42", 'say "hi" \\ now']).ebnf
    assert accepts(ebnf, "<answer>42</answer>")
    assert accepts(ebnf, '<answer>say "hi" \\ now</answer>')
    assert not accepts(ebnf, "<answer>43</answer>")
    free = action_grammar(state, OFFERED, g.ProtocolConfig()).ebnf
    assert accepts(free, "<answer>43</answer>")


def test_agentic_final_answer_must_be_a_candidate():
    nodes = (g.Node("n1", 1, "worker_1", "solve", g.Role.EXECUTOR),
             g.Node("n2", 2, "worker_2", "merge", g.Role.SUMMARIZER, ("n1",)))
    state = g.RoutingState(mode=g.Mode.AGENTIC, nodes=nodes)
    grammar = action_grammar(state, OFFERED, g.ProtocolConfig(), ["B", "C"])
    assert accepts(grammar.ebnf, "<answer>B</answer>")
    assert not accepts(grammar.ebnf, "<answer>A</answer>")
    # Nothing but an answer is allowed: a finite choice, matched over canonical tokens.
    assert grammar.choices == ("<answer>B</answer>", "<answer>C</answer>")


def test_finite_choices_are_choice_grammars_and_free_text_is_not():
    selector = action_grammar(g.RoutingState(), OFFERED, g.ProtocolConfig())
    assert selector.choices == ("<mode>single</mode>", "<mode>multi</mode>",
                                "<mode>agentic</mode>")
    used = g.RoutingState(mode=g.Mode.SINGLE, nodes=(g.Node("n1", 1, "worker_1", "solve"),))
    assert action_grammar(used, OFFERED, g.ProtocolConfig(), ["7"]).choices == (
        "<answer>7</answer>",)
    assert action_grammar(used, OFFERED, g.ProtocolConfig()).choices == ()  # free answer
    fresh = g.RoutingState(mode=g.Mode.MULTI)
    assert action_grammar(fresh, OFFERED, g.ProtocolConfig(), ["7"]).choices == ()  # a route


def test_fixed_task_text_replaces_free_text_in_every_route():
    multi = action_grammar(g.RoutingState(mode=g.Mode.MULTI), OFFERED, g.ProtocolConfig(),
                           task_text="Solve it.").ebnf
    assert accepts(multi, '<route model="worker_2">Solve it.</route>')
    assert not accepts(multi, '<route model="worker_2">Solve that.</route>')
    agentic = action_grammar(g.RoutingState(mode=g.Mode.AGENTIC), OFFERED, g.ProtocolConfig(),
                             task_text="Solve it.").ebnf
    route = '<route model="worker_1" role="planner" refs="">Solve it.</route>'
    assert accepts(agentic, route)
    assert not accepts(agentic, route.replace("Solve it.", "Plan."))
