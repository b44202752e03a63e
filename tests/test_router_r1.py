"""Router-R1 dialect (docs/router_r1.md): prompt, parser, observations, turns,
format checks. The real Qwen3 tokenizer is built once per session into a temporary cache."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall
from jax_routeweaver.routing.protocol.router_r1 import (
    AnswerAction,
    AppendObservation,
    CallWorker,
    EndEpisode,
    EpisodeState,
    InvalidAction,
    RouterR1Config,
    SearchAction,
    advance,
    cap_observation,
    count_routes,
    cut_turn_ids,
    cut_turn_text,
    decide_turn,
    extract_answer,
    format_violations,
    parse_action,
    render_observation,
    render_prompt_ids,
    render_prompt_text,
    resolve_model,
)


@pytest.fixture(scope="session")
def qwen_tok(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.mktemp("r1_tok"))


def _encode(tok):
    return lambda text: tok.encode(text, add_special_tokens=False)


def _decode(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


# One character per token: exact, tokenizer-independent boundaries.
def char_encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def char_decode(ids) -> str:
    return "".join(chr(i) for i in ids)


# ------------------------------------------------------------------------------ config
def test_config_defaults_are_the_reference_numbers():
    c = RouterR1Config()
    assert (c.max_turns, c.start_max_tokens, c.context_max_tokens, c.trajectory_max_tokens,
            c.per_turn_max_tokens, c.obs_max_tokens) == (4, 2048, 4096, 4096, 1024, 600)
    assert (c.train_temperature, c.train_top_p, c.prompt_variant) == (1.0, 0.95, "qwen")
    assert (c.worker_max_tokens, c.worker_top_p, c.worker_seed, c.worker_concurrency) == (
        512, 1.0, 42, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_turns = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad", [{"max_turns": 0}, {"obs_max_tokens": -1},
                                 {"per_turn_max_tokens": 1.5}, {"prompt_variant": "mistral"},
                                 {"max_turns": True}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="RouterR1Config"):
        RouterR1Config(**bad)


def test_sampling_params():
    train = r1.rollout_sampling_params(RouterR1Config(), validation=False)
    assert (train.temperature, train.top_p, train.top_k, train.max_new_tokens) == (
        1.0, 0.95, 0, 1024)
    assert train.stop_strings == () and not train.is_greedy
    val = r1.rollout_sampling_params(RouterR1Config(), validation=True)
    assert val.is_greedy and val.top_p == 1.0 and val.stop_strings == ()
    assert r1.INFERENCE_STOP_STRINGS == ("</search>", "</answer>")


# ------------------------------------------------------------------------------ prompt
NAMES = ("[Qwen2.5-7B-Instruct, LLaMA-3.1-8B-Instruct, LLaMA-3.1-70B-Instruct, "
         "Mistral-7B-Instruct, Mixtral-8x22B-Instruct, Gemma-2-27B-Instruct]")


def test_prompt_protocol_pieces_in_order():
    text = render_prompt_text("  What is the capital of China  ")
    pieces = ["<think> and </think>", "<search> LLM-Name:Your-Query </search>",
              "STRICT FORMAT RULES for <search>", NAMES, "<information> and </information>",
              "#### The Descriptions of Each LLM\n\n"]
    pieces += [f"{m.name}:\n{m.descriptor}\n\n" for m in r1.PROMPT_MODELS]
    pieces += ["<answer> Beijing </answer>", "Question: What is the capital of China?\n\n"]
    at = [text.find(p) for p in pieces]
    assert -1 not in at and at == sorted(at)
    assert text.endswith("Question: What is the capital of China?\n\n")
    assert "Palmyra" not in text and "$" not in text  # parser-only models, no prices
    assert "<|im_start|>" not in text


def test_question_normalisation():
    assert r1.normalize_question(" Who? ") == "Who?"
    assert r1.normalize_question("Who\n") == "Who?"
    assert r1.normalize_question("a?b") == "a?b?"
    with pytest.raises(ValueError, match="empty"):
        r1.normalize_question("  \n")


def test_llama_variant_adds_only_the_tag_rule():
    qwen = render_prompt_text("q", variant="qwen")
    llama = render_prompt_text("q", variant="llama")
    assert "literal string" in llama and "literal string" not in qwen
    assert llama.replace(r1._LLAMA_EXTRA_RULE, "") == qwen
    with pytest.raises(ValueError, match="variant"):
        render_prompt_text("q", variant="gpt")  # type: ignore[arg-type]


@pytest.mark.slow
def test_prompt_through_qwen3_chat_template(qwen_tok):
    content = render_prompt_text("Who wrote Hamlet")
    chat = r1.render_chat_prompt("Who wrote Hamlet", qwen_tok)
    assert chat == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    ids = render_prompt_ids("Who wrote Hamlet", qwen_tok)
    assert ids == qwen_tok.encode(chat, add_special_tokens=False)
    assert ids[0] == qwen_tok.convert_tokens_to_ids("<|im_start|>")
    assert 400 < len(ids) < 2048
    short = render_prompt_ids("Who wrote Hamlet", qwen_tok, RouterR1Config(start_max_tokens=7))
    assert short == ids[-7:]  # the *last* start_max_tokens are kept
    llama = render_prompt_ids("Who wrote Hamlet", qwen_tok,
                              RouterR1Config(prompt_variant="llama"))
    assert len(llama) > len(ids)


def test_prompt_without_chat_template_is_the_bare_message():
    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return char_encode(text)

    assert r1.render_chat_prompt("q", Plain()) == render_prompt_text("q")
    assert char_decode(render_prompt_ids("q", Plain())) == render_prompt_text("q")[-2048:]


def test_worker_prompt_ends_with_the_query_verbatim():
    prompt = r1.render_worker_prompt(" Who is X?")
    assert prompt.endswith("Here is the sub-question for you to assist with:  Who is X?")


# ------------------------------------------------------------------------------ models
@pytest.mark.parametrize(("name", "expected"), [
    ("qwen2.5-72b", r1.QWEN_7B),  # loose: resolves to the 7B model
    ("LLaMA-3.1-8B", r1.LLAMA_8B),
    ("Llama3-ChatQA-1.5-8B", r1.CHATQA_8B),
    ("llama-2", None),
    ("  LLaMA-3.1-70B-Instruct ", r1.LLAMA_70B),
    ("llama-3.1-nemotron-51b", r1.NEMOTRON_51B),
    ("Llama-3.3-Nemotron-Super-49B-v1", r1.NEMOTRON_SUPER_49B),
    ("Mistral-7B-Instruct", r1.MISTRAL_7B),
    ("Mixtral-8x22B-Instruct", r1.MIXTRAL_8X22B),
    ("gemma-2-27b", r1.GEMMA_27B),
    ("Granite", r1.GRANITE_8B),
    ("Palmyra", r1.PALMYRA_122B),
    ("creative llama-70b", r1.PALMYRA_122B),  # palmyra|creative is tested before llama
    ("qwen-llama-70b", r1.QWEN_7B),  # qwen first
    ("GPT-4o", None),
    ("", None),
])
def test_resolve_model(name, expected):
    assert resolve_model(name) is expected


def test_every_model_name_resolves_to_itself():
    for model in r1.ALL_MODELS:
        assert resolve_model(model.name) is model
    assert [m.price_per_million for m in r1.PROMPT_MODELS] == [0.30, 0.18, 0.88, 0.20, 1.20, 0.80]
    assert r1.GEMMA_27B.temperature == 0.1
    assert all(m.in_prompt and m.descriptor for m in r1.PROMPT_MODELS)
    assert not any(m.in_prompt for m in r1.ALL_MODELS[6:])


# ------------------------------------------------------------------------------ parser
def test_parse_answer():
    assert parse_action("<think>x</think>\n<answer> Beijing </answer>") == AnswerAction("Beijing")
    assert parse_action("<answer></answer>") == AnswerAction("")
    assert parse_action("<answer>a\nb</answer>") == AnswerAction("a\nb")


def test_parse_search():
    action = parse_action("<think>r</think>\n<search> Qwen2.5-7B-Instruct: Who is X? </search>")
    assert action == SearchAction("Qwen2.5-7B-Instruct: Who is X?", "qwen2.5-7b-instruct",
                                  " Who is X?", r1.QWEN_7B)
    multi = parse_action("<search>\nLLaMA-3.1-70B-Instruct:\nline one\nline two\n</search>")
    assert isinstance(multi, SearchAction) and multi.model is r1.LLAMA_70B
    assert multi.query == "\nline one\nline two"


def test_parse_query_is_between_first_and_second_colon():
    action = parse_action("<search>gemma: Title: Subtitle</search>")
    assert isinstance(action, SearchAction) and action.query == " Title"
    blank_middle = parse_action("<search>gemma: : x</search>")  # valid, blank query sent
    assert isinstance(blank_middle, SearchAction) and blank_middle.query == " "


def test_parse_unknown_model_is_a_search_without_model():
    action = parse_action("<search>GPT-4o: what?</search>")
    assert isinstance(action, SearchAction) and action.model is None
    assert action.model_text == "gpt-4o"


@pytest.mark.parametrize(("text", "reason"), [
    ("no tags at all", "no_action"),
    ("<think>only thinking</think>", "no_action"),
    ("<search>qwen: open but never closed", "no_action"),
    ("<search>qwen: q</answer>", "no_action"),
    ("<SEARCH>qwen: q</SEARCH>", "no_action"),
    ("<search> LLM-Name:Your-Query </search>", "placeholder"),
    ("<search>qwen: what is your-QUERY</search>", "placeholder"),
    ("<search>LLM-NAME: real question</search>", "placeholder"),
    ("<search>qwen what is it</search>", "no_colon"),
    ("<search></search>", "no_colon"),
    ("<search>qwen:   </search>", "empty_query"),
    ("<search>qwen: a :\n</search>", "empty_query"),  # blank after the *last* colon
])
def test_parse_invalid(text, reason):
    action = parse_action(text)
    assert action == InvalidAction(reason)
    assert action.observation == ""


def test_parse_first_pair_wins():
    assert parse_action("<answer>A</answer><search>qwen: q</search>") == AnswerAction("A")
    first = parse_action("<search>qwen: q1</search><answer>A</answer>")
    assert isinstance(first, SearchAction) and first.query == " q1"
    # an unclosed search does not block a later complete answer
    assert parse_action("<search>qwen: q <answer>A</answer>") == AnswerAction("A")


# ------------------------------------------------------------------------------ turn cut
@pytest.mark.parametrize(("text", "cut"), [
    ("<think>t</think><search>qwen: q</search>\n<information>fake</information>",
     "<think>t</think><search>qwen: q</search>"),
    ("<answer>A</answer> tail <search>qwen: q</search> more",
     "<answer>A</answer> tail <search>qwen: q</search>"),  # </search> wins even if later
    ("<search>a:b</search><search>c:d</search>", "<search>a:b</search>"),
    ("<think>t</think><answer>A</answer> trailing", "<think>t</think><answer>A</answer>"),
    ("no tags", "no tags"),
    ("", ""),
])
def test_cut_turn_text(text, cut):
    assert cut_turn_text(text) == cut


def test_cut_turn_ids_char_level():
    text = "<answer>A</answer>x<search>q:r</search>yy"
    n = cut_turn_ids(char_encode(text), char_decode)
    assert char_decode(char_encode(text)[:n]) == cut_turn_text(text)
    ids = [*char_encode("no tag"), 0, 0]
    assert cut_turn_ids(ids, char_decode, drop_trailing_ids=[0]) == 6
    assert cut_turn_ids(ids, char_decode) == 8
    assert cut_turn_ids([], char_decode, drop_trailing_ids=[0]) == 0


def test_cut_turn_ids_qwen(qwen_tok):
    dec = _decode(qwen_tok)
    eos = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    text = ("<think>Need facts.</think>\n<search> LLaMA-3.1-70B-Instruct: Who wrote Hamlet? "
            "</search>\n\n<information>hallucinated</information>")
    ids = [*qwen_tok.encode(text, add_special_tokens=False), eos]
    n = cut_turn_ids(ids, dec, drop_trailing_ids=[eos])
    assert dec(ids[:n]).startswith(cut_turn_text(text))
    assert "</search>" not in dec(ids[:n - 1])  # shortest such prefix
    answer = [*qwen_tok.encode("<think>x</think><answer> Shakespeare </answer>",
                               add_special_tokens=False), eos]
    m = cut_turn_ids(answer, dec, drop_trailing_ids=[eos])
    assert eos not in answer[:m] and dec(answer[:m]).endswith("</answer>")
    plain = [*qwen_tok.encode("just rambling", add_special_tokens=False), eos]
    assert cut_turn_ids(plain, dec, drop_trailing_ids=[eos]) == len(plain) - 1


# ------------------------------------------------------------------------------ observation
def test_observation_framing():
    assert render_observation("  Paris is the capital.\n") == (
        "\n\n<information>Paris is the capital.</information>\n\n")
    assert render_observation(None) == "\n\n<information>None</information>\n\n"
    assert render_observation("") == "\n\n<information></information>\n\n"
    ok = WorkerCall("worker_1", "p", "reply", True, Usage(3, 4))
    failed = WorkerCall("worker_1", "p", "", False, error="timeout")
    assert r1.observation_for_call(ok) == "\n\n<information>reply</information>\n\n"
    assert r1.observation_for_call(failed) == "\n\n<information>None</information>\n\n"


def test_cap_observation_exact_boundary():
    at_cap = render_observation("x" * (600 - len(render_observation(""))))
    assert len(at_cap) == 600
    kept = cap_observation(at_cap, char_encode, char_decode)
    assert (kept.text, kept.truncated, len(kept.ids)) == (at_cap, False, 600)
    over = render_observation("x" * 600)
    cut = cap_observation(over, char_encode, char_decode)
    assert cut.truncated and cut.ids == char_encode(over)[:600] and cut.text == over[:600]
    assert "</information>" not in cut.text
    assert cap_observation("", char_encode, char_decode) == r1.CappedObservation([], "", False)
    assert cap_observation("abc", char_encode, char_decode, max_tokens=2).text == "ab"
    with pytest.raises(ValueError, match="max_tokens"):
        cap_observation("abc", char_encode, char_decode, max_tokens=0)


def test_cap_observation_qwen_drops_closing_tag_and_fails_format(qwen_tok):
    enc, dec = _encode(qwen_tok), _decode(qwen_tok)
    short = render_observation("Hamlet was written by William Shakespeare.")
    kept = cap_observation(short, enc, dec)
    assert not kept.truncated and kept.ids == enc(short) and kept.text == short
    long_obs = render_observation(" ".join(f"fact{i}" for i in range(700)))
    cut = cap_observation(long_obs, enc, dec)
    assert cut.truncated and len(cut.ids) == 600 and cut.ids == enc(long_obs)[:600]
    assert cut.text.startswith("\n\n<information>") and "</information>" not in cut.text
    response = ("<think>Need it.</think>\n<search> Qwen2.5-7B-Instruct: Who? </search>"
                + cut.text + "<think>Got it.</think>\n<answer> X </answer>")
    assert "unbalanced_tags" in format_violations(response)


# ------------------------------------------------------------------------------ turns
SEARCH = parse_action("<search>Qwen2.5-7B-Instruct: Who wrote Hamlet?</search>")
UNKNOWN = parse_action("<search>GPT-4o: Who wrote Hamlet?</search>")
ANSWER = AnswerAction("Shakespeare")
INVALID = InvalidAction("no_action")


@pytest.mark.parametrize("turn", range(4))
def test_routed_turns(turn):
    state = EpisodeState(turn, calls=turn)
    call = decide_turn(state, SEARCH)
    assert isinstance(call, CallWorker) and call.model is r1.QWEN_7B
    assert call.query == " Who wrote Hamlet?" and call.prompt == r1.render_worker_prompt(call.query)
    assert advance(state, call) == EpisodeState(turn + 1, turn + 1)
    assert decide_turn(state, ANSWER) == EndEpisode("answer")
    invalid = decide_turn(state, INVALID)
    assert invalid == AppendObservation("", "no_action")
    assert advance(state, invalid) == EpisodeState(turn + 1, turn)
    assert decide_turn(state, UNKNOWN) == AppendObservation(
        "\n\n<information>None</information>\n\n", "unknown_model")


def test_final_turn_never_routes():
    final = EpisodeState(4, calls=4)
    assert r1.is_final_turn(final, RouterR1Config())
    for action in (SEARCH, UNKNOWN, INVALID):
        assert decide_turn(final, action) == EndEpisode("final_turn")
    assert decide_turn(final, ANSWER) == EndEpisode("answer")
    with pytest.raises(ValueError, match="episode ended"):
        advance(final, EndEpisode("final_turn"))
    for bad in (EpisodeState(5), EpisodeState(-1)):
        with pytest.raises(ValueError, match="EpisodeState.turn"):
            decide_turn(bad, SEARCH)
    assert decide_turn(EpisodeState(2), SEARCH, RouterR1Config(max_turns=2)) == EndEpisode(
        "final_turn")


def _drive(actions, config=None):
    """A scripted episode; returns (generations, calls, end reason)."""
    state = EpisodeState()
    for gens, action in enumerate(actions, start=1):
        decision = decide_turn(state, action, config)
        if isinstance(decision, EndEpisode):
            return gens, state.calls, decision.reason
        state = advance(state, decision)
    raise AssertionError("episode did not end")


def test_episode_limits():
    assert _drive([SEARCH] * 10) == (5, 4, "final_turn")  # <= 4 calls, <= 5 generations
    assert _drive([INVALID] * 10) == (5, 0, "final_turn")
    assert _drive([SEARCH, INVALID, UNKNOWN, ANSWER]) == (4, 1, "answer")
    assert _drive([ANSWER]) == (1, 0, "answer")
    assert _drive([SEARCH] * 10, RouterR1Config(max_turns=2)) == (3, 2, "final_turn")


# ------------------------------------------------------------------------------ format checks
THINK = "<think>I should ask.</think>\n"
ROUTE = "<search> LLaMA-3.1-70B-Instruct: Who wrote Hamlet? </search>"
INFO = render_observation("William Shakespeare.")
END = "<think>Known now.</think>\n<answer> William Shakespeare </answer>"


@pytest.mark.parametrize(("response", "expected"), [
    ("<think>easy</think>\n<answer> Paris </answer>", ()),
    (THINK + ROUTE + INFO + END, ()),
    ("\n " + THINK + ROUTE + INFO + ROUTE + INFO + END + " \n", ()),
    ("<answer> Paris </answer>", ("no_think", "not_start_think")),
    ("<think>...</think><answer> Paris </answer>", ("empty_think",)),
    ("<think> </think><answer> Paris </answer>", ("empty_think",)),
    (THINK + "<search> LLM-Name:Your-Query </search>" + INFO + END, ("query_format", "bad_name")),
    (THINK + "<search> GPT-4o: Who wrote Hamlet? </search>" + INFO + END, ("bad_name",)),
    (THINK + "<search> gemma: Hamlet: who wrote it? </search>" + INFO + END, ("query_format",)),
    (THINK + "<search> gemma: Is gemma good? </search>" + INFO + END, ("query_format",)),
    (THINK + "<search> gemma:  </search>" + INFO + END, ("query_format",)),
    (THINK + ROUTE + render_observation("<answer>x</answer>") + END, ("nesting",)),
    (THINK + ROUTE + END, ("search_information_mismatch",)),
    (THINK + ROUTE + INFO + THINK + ROUTE, ("answer_count", "search_information_mismatch",
                                            "not_end_answer")),
    ("<think>a</think><answer>A</answer><answer>B</answer>", ("answer_count",)),
    ("<think>a</think><answer>A</answer> thanks", ("not_end_answer",)),
    ("<think>a</think><answer>A</answer></answer>", ("unbalanced_tags",)),
    ("hello", ("no_tags", "answer_count", "no_think", "not_start_think", "not_end_answer")),
])
def test_format_violations(response, expected):
    assert format_violations(response) == expected


def test_extract_answer_and_route_count():
    assert extract_answer("<answer> a </answer> x <answer>\n b\n</answer>") == "b"
    assert extract_answer("<answer>open only") is None
    assert extract_answer("<answer></answer>") == ""
    assert count_routes(THINK + ROUTE + INFO + ROUTE + INFO + END) == 2
    bad = "<search> GPT-4o: q </search>"
    assert count_routes(ROUTE + INFO + bad + INFO + ROUTE + INFO) == 1  # sticky flags
    assert count_routes("<think>t</think><answer>a</answer>") == 0


# ------------------------------------------------------------------------------ properties
FRAGMENTS = st.sampled_from([
    "<search>", "</search>", "<answer>", "</answer>", "<think>", "</think>", "<information>",
    "</information>", ":", " ", "\n", "qwen", "llama", "70b", "8b", "gemma", "LLM-Name",
    "your-query", "x", "?", "<", ">", "/"])
TEXTS = st.one_of(st.text(), st.lists(FRAGMENTS, max_size=24).map("".join))


@settings(max_examples=400, deadline=None)
@given(TEXTS)
def test_parse_action_total_and_exclusive(text):
    action = parse_action(text)
    kinds = [isinstance(action, k) for k in (SearchAction, AnswerAction, InvalidAction)]
    assert sum(kinds) == 1
    if isinstance(action, SearchAction):
        assert ":" in action.content and action.content == action.content.strip()
        assert action.content.split(":")[-1].strip()
        assert not any(m in action.content.lower() for m in r1.PLACEHOLDER_MARKERS)
        assert action.model is resolve_model(action.model_text)
    elif isinstance(action, AnswerAction):
        assert "<answer>" in text and "</answer>" in text
    else:
        assert action.observation == ""


@settings(max_examples=300, deadline=None)
@given(TEXTS, st.integers(0, 4))
def test_turn_functions_never_crash(text, turn):
    cut = cut_turn_text(text)
    assert text.startswith(cut)
    n = cut_turn_ids(char_encode(text), char_decode)
    assert char_decode(char_encode(text)[:n]) == cut
    decision = decide_turn(EpisodeState(turn), parse_action(cut))
    assert isinstance(decision, CallWorker | AppendObservation | EndEpisode)
    violations = format_violations(text)
    assert len(set(violations)) == len(violations)
    assert count_routes(text) >= 0
