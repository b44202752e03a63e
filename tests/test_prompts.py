"""RouteWeaver prompts: selector, rulebooks, catalog, routing state, worker payloads, cues."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.routing.protocol.calls import WorkerCall
from jax_routeweaver.routing.protocol.grammar import MODES, Mode, ProtocolConfig, Role, chat_delta
from jax_routeweaver.routing.protocol.prompts import (
    OUTPUT_CONSTRAINT,
    REFERENCE_WORKER_DESCRIPTIONS,
    ROLE_BRIEF,
    RULEBOOK_CLOSING,
    SELECTOR_RETRY_CUE,
    PayloadHygieneError,
    brevity_flags,
    catalog_block,
    catalog_entries,
    check_payload,
    checked_worker_payload,
    compact_rulebook,
    mode_rulebook,
    payload_references,
    render_user_turn_ids,
    role_payload,
    routing_state_header,
    rulebook_body,
    selector_prompt,
    selector_prompt_ids,
    single_multi_payload,
    violation_cue,
    worker_payload,
)
from jax_routeweaver.routing.protocol.turns import Node, PlannedCall, RoutingState
from jax_routeweaver.routing.protocol.violations import Violation

WORKERS = list(REFERENCE_WORKER_DESCRIPTIONS.items())
# Backend names, providers, prices and tier words the router must never see.
LEAKS = re.compile(r"qwen|llama|gemma|gemini|openrouter|nebius|novita|coreweave|crusoe|google|"
                   r"meta-|\$|usd|price|cost|cheap|expensive|premium|budget tier|\b0\.\d+\b",
                   re.IGNORECASE)
CONFIGS = [ProtocolConfig(), ProtocolConfig(multi_attach_previous=True, routing_state=False,
                                            max_workers=6, multi_max_routes=3)]


class FakePool:
    def __init__(self, entries: dict[str, str]) -> None:
        self.entries = entries

    def worker_ids(self) -> list[str]:
        return list(self.entries)

    def description(self, worker: str) -> str:
        return self.entries[worker]

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        return WorkerCall(worker, prompt, "", True)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.getbasetemp() / "qwen3_cache")


# ----------------------------------------------------------------------------------- selector
def test_selector_prompt_structure() -> None:
    text = selector_prompt("  What is 2+2?\n")
    assert text.startswith("You are a router. Choose how worker models should handle the "
                           "question.\n\n## Modes\nNo mode is preferred by default.\n"
                           "single — one worker handles the task.\n"
                           "multi — workers handle the task sequentially.\n"
                           "agentic — role-assigned workers handle the task in adaptive "
                           "layers.\n\n## Response\n")
    assert ("<mode>single</mode>\n<mode>multi</mode>\n<mode>agentic</mode>\n"
            "You will receive the corresponding execution rules after choosing.\n\n"
            "Question: What is 2+2?") in text
    assert text.endswith("Question: What is 2+2?")
    assert "worker_" not in text and not LEAKS.search(text)


def test_selector_order_and_validation() -> None:
    text = selector_prompt("q", order=("agentic", "single", "multi"))
    assert text.index("agentic —") < text.index("single —") < text.index("multi —")
    assert text.index("<mode>agentic") < text.index("<mode>single") < text.index("<mode>multi")
    with pytest.raises(ValueError, match="permutation"):
        selector_prompt("q", order=("single", "single", "multi"))


def test_selector_prompt_ids_use_the_chat_template(qwen3) -> None:
    ids = selector_prompt_ids(qwen3, "What is 2+2?")
    expected = ("<|im_start|>user\n" + selector_prompt("What is 2+2?")
                + "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == qwen3.encode(expected, add_special_tokens=False)
    assert render_user_turn_ids(qwen3, "hi")[-3:] == qwen3.encode("<|im_start|>assistant\n",
                                                                  add_special_tokens=False)


def test_mode_declarations_token_counts(qwen3) -> None:
    # the mode span the COMET split relies on: 7 tokens, 8 for "ag"+"entic"
    counts = {m: len(qwen3.encode(f"<mode>{m}</mode>", add_special_tokens=False))
              for m in MODES}
    assert counts == {Mode.SINGLE: 7, Mode.MULTI: 7, Mode.AGENTIC: 8}


# ---------------------------------------------------------------------------------- rulebooks
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_rulebook_frame_catalog_and_no_leaks(mode: Mode, config: ProtocolConfig) -> None:
    text = mode_rulebook(mode, WORKERS, config)
    body = rulebook_body(mode, WORKERS, config)
    assert text == f"Your mode is {mode}. These are its execution rules.\n\n{body}\n\n" + (
        "The execution mode has already been declared. Do not declare it again.\n"
        "Continue now, under these rules, on the question above.")
    assert text.endswith(RULEBOOK_CLOSING)
    for line in body.splitlines():  # the reference asserts the same on its stripped body
        assert "<mode" not in line.lower() and "declare" not in line.lower()
    assert catalog_block(WORKERS, config.worker_max_tokens) in body
    assert f"[{', '.join(w for w, _ in WORKERS)}]" in body
    for worker, description in WORKERS:
        assert f"{worker}: {description}" in body
    assert not LEAKS.search(text), LEAKS.search(text)
    assert "Question:" not in body


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_compact_rulebook_states_mode_ids_format_and_bounds(mode: Mode, config: ProtocolConfig,
                                                            qwen3) -> None:
    text = compact_rulebook(mode, WORKERS, config)
    assert text.startswith(f"Your mode is {mode}. Workers: {', '.join(w for w, _ in WORKERS)}.")
    assert text.endswith(RULEBOOK_CLOSING) and "<answer>...</answer>" in text
    assert "<mode" not in text and not LEAKS.search(text)
    if mode == Mode.AGENTIC:
        assert f"At most {config.max_workers} calls" in text and 'role="ROLE"' in text
    else:
        low, high = config.route_bounds(mode)
        assert ("1 call:" if high == 1 else f"{low} to {high} calls, one per turn:") in text
    compact, full = (len(qwen3.encode(t)) for t in (text, mode_rulebook(mode, WORKERS, config)))
    assert compact < 120 and 5 * compact < full, (compact, full)


def test_catalog_block_exact_and_from_pool() -> None:
    pool = FakePool({"worker_2": "fast drafts.", "worker_7": "careful proofs."})
    entries = catalog_entries(pool)
    assert entries == [("worker_2", "fast drafts."), ("worker_7", "careful proofs.")]
    assert catalog_block(entries) == ("Each worker call has a maximum output budget of 4096 "
                                      "tokens.\n\nworker_2: fast drafts.\nworker_7: careful "
                                      "proofs.")
    body = rulebook_body(Mode.SINGLE, entries)
    assert "[worker_2, worker_7]" in body and "worker_7: careful proofs." in body
    assert "worker_6:" not in body


def test_single_and_multi_rules() -> None:
    single = rulebook_body(Mode.SINGLE, WORKERS)
    assert single.startswith("Answer the question at the end.\n\n## Allowed model IDs\n")
    assert ("single -- exactly ONE worker call, in your first response; answer once its "
            'observation arrives.\n<route model="MODEL_ID">CONCRETE TASK</route>') in single
    assert "<answer>L. L. Zamenhof</answer>" in single
    multi = rulebook_body(Mode.MULTI, WORKERS)
    assert ("multi -- 2 to 4 worker calls in total, at most one <route> per turn, each chosen "
            "after reading the previous observation.\n") in multi
    assert multi.endswith("Use between 2 and 4 calls as the query requires.")
    assert "automatically sees the previous worker" not in multi
    paper = rulebook_body(Mode.MULTI, WORKERS, CONFIGS[1])
    assert "2 to 3 worker calls" in paper
    assert "Each worker after the first automatically sees the previous worker's full " \
           "output." in paper


def test_agentic_rules() -> None:
    body = rulebook_body(Mode.AGENTIC, WORKERS)
    assert ("## Roles\n"
            "  planner: analyses the problem and splits it into sub-tasks; never answers\n"
            "  executor: carries out one assigned task and returns a candidate answer\n"
            "  verifier: audits an existing output; returns PASS or FAIL with a reason; never "
            "answers\n"
            "  summarizer: reconciles everything and produces the final answer\n") in body
    assert '<route model="MODEL_ID" role="ROLE" refs="IDS">CONCRETE TASK</route>' in body
    assert "1. At most 8 worker calls in total." in body
    assert "11. After sending a layer, stop and wait" in body
    assert 'refs="n1,n2"' in body
    without_state = rulebook_body(Mode.AGENTIC, WORKERS, CONFIGS[1])
    assert "1. At most 6 worker calls" in without_state
    assert "9." not in without_state and "Valid refs" not in without_state


def test_forced_worker_sentence() -> None:
    text = mode_rulebook(Mode.SINGLE, WORKERS, forced_worker="worker_4")
    assert text.endswith("\nFor this episode you must route to worker_4. Name that exact id in "
                         "every worker call.")
    assert "must route to" not in mode_rulebook(Mode.SINGLE, WORKERS)


def test_routing_state_header_exact() -> None:
    assert routing_state_header(RoutingState(mode=Mode.AGENTIC)) == (
        "Routing state:\nCurrent layer: 1\nCompleted node IDs: none\nValid refs: none\n"
        "Worker calls remaining: 8\nSummarizer completed: no")
    nodes = (Node("n1", 1, "worker_3", "a", Role.EXECUTOR),
             Node("n2", 1, "worker_6", "b", Role.EXECUTOR),
             Node("n3", 2, "worker_5", "c", Role.SUMMARIZER))
    state = RoutingState(mode=Mode.AGENTIC, nodes=nodes)
    assert routing_state_header(state) == (
        "Routing state:\nCurrent layer: 3\nCompleted node IDs: n1, n2, n3\n"
        "Valid refs: n1, n2, n3\nWorker calls remaining: 5\nSummarizer completed: yes")
    assert "Worker calls remaining: 3" in routing_state_header(state, CONFIGS[1])
    assert chat_delta(routing_state_header(state)).startswith("<|im_end|>\n<|im_start|>user\n"
                                                              "Routing state:\n")


# ------------------------------------------------------------------------------------ payloads
def test_single_multi_payload_exact() -> None:
    assert single_multi_payload("What is 2+2?", "Add 2 and 2.") == (
        "Reason freely and provide a complete derivation.\n"
        "End with <answer>your final answer</answer>.\n\n"
        "Original question:\nWhat is 2+2?\n\n"
        "Current sub-task:\nAdd 2 and 2.")
    # the sub-task is omitted when it repeats the question
    assert single_multi_payload("What is 2+2?", " What is 2+2? ") == (
        OUTPUT_CONSTRAINT + "\n\nOriginal question:\nWhat is 2+2?")


def test_role_payload_splices_refs_in_listed_order() -> None:
    refs = [Node("n2", 1, "worker_2", "b", Role.VERIFIER, output="FAIL\nReason: sign"),
            Node("n1", 1, "worker_1", "a", Role.EXECUTOR, output="x = -3")]
    text = role_payload(Role.SUMMARIZER, "Solve x+3=0.", "Reconcile.", refs)
    assert text == (ROLE_BRIEF[Role.SUMMARIZER] + "\n\nOriginal question:\nSolve x+3=0.\n\n"
                    "Earlier outputs you must use:\n\n"
                    "[n2] (from verifier)\nFAIL\nReason: sign\n\n"
                    "[n1] (from executor)\nx = -3\n\n"
                    "Your task:\nReconcile.")
    bare = role_payload(Role.EXECUTOR, "Q", "Do it.")
    assert bare == ROLE_BRIEF[Role.EXECUTOR] + "\n\nOriginal question:\nQ\n\nYour task:\nDo it."
    assert OUTPUT_CONSTRAINT not in bare


def test_role_briefs() -> None:
    assert "<answer>your candidate answer</answer>" in ROLE_BRIEF[Role.EXECUTOR]
    assert "<answer>your final answer</answer>" in ROLE_BRIEF[Role.SUMMARIZER]
    for line in ("PASS", "FAIL", "Location:", "Reason:", "Suggestion:"):
        assert line in ROLE_BRIEF[Role.VERIFIER]
    assert "<answer>" not in ROLE_BRIEF[Role.PLANNER] + ROLE_BRIEF[Role.VERIFIER]


def test_worker_payload_dispatch() -> None:
    nodes = (Node("n1", 1, "worker_1", "a", Role.EXECUTOR, output="first"),
             Node("n2", 1, "worker_2", "b", Role.EXECUTOR, output="second"))
    state = RoutingState(mode=Mode.AGENTIC, nodes=nodes)
    call = PlannedCall("worker_5", "Reconcile.", "n3", 2, Role.SUMMARIZER, ("n2", "n1"))
    text = worker_payload(call, "Q", state)
    assert text.index("[n2] (from executor)\nsecond") < text.index("[n1] (from executor)\nfirst")
    multi = RoutingState(mode=Mode.MULTI, nodes=(Node("n1", 1, "worker_1", "a",
                                                      output="Iron."),))
    plain = PlannedCall("worker_2", "Melting point of iron?", "n2", 2)
    assert worker_payload(plain, "Q", multi) == single_multi_payload("Q",
                                                                     "Melting point of iron?")
    attached = worker_payload(plain, "Q", multi, ProtocolConfig(multi_attach_previous=True))
    assert "Previous worker output:\nIron.\n\nCurrent sub-task:\nMelting point" in attached


def test_payload_hygiene() -> None:
    refs = [Node("n1", 1, "worker_1", "a", Role.EXECUTOR, output="Answer only: 5")]
    for role in Role:
        payload = role_payload(role, "Is 7 prime? Yes or no.", "Be brief.", refs)
        check_payload(payload, task="Be brief.", question="Is 7 prime? Yes or no.",
                      ref_outputs=["Answer only: 5"])  # only router/question/ref text flagged
    check_payload(single_multi_payload("Q", "one word please"), task="one word please",
                  question="Q")
    assert brevity_flags("One word, please. Be brief.") == ("one word", "be brief")
    with pytest.raises(ValueError, match="brevity"):
        check_payload("No explanation needed.\n\n" + single_multi_payload("Q", "T"),
                      task="T", question="Q")


def test_checked_payloads_and_their_references() -> None:
    """`payload_references` are exactly the texts `worker_payload` splices in; a checked
    payload raises `PayloadHygieneError` (a ValueError) only for wrapper text."""
    n1 = Node("n1", 1, "worker_1", "a", Role.EXECUTOR, output="Answer only: 5")
    state = RoutingState(mode=Mode.AGENTIC, nodes=(n1,))
    call = PlannedCall("worker_2", "Be brief.", "n2", 2, Role.VERIFIER, ("n1",))
    assert payload_references(call, state) == ("Answer only: 5",)
    payload = checked_worker_payload(call, "Yes or no?", state)
    assert payload == worker_payload(call, "Yes or no?", state)
    multi = RoutingState(mode=Mode.MULTI, nodes=(dataclasses.replace(n1, role=None),))
    plain = PlannedCall("worker_2", "T", "n2", 2)
    assert payload_references(plain, multi) == ()
    attach = ProtocolConfig(multi_attach_previous=True)
    assert payload_references(plain, multi, attach) == ("Answer only: 5",)
    checked_worker_payload(plain, "Q", multi, attach)  # the attached output is not wrapper
    with pytest.raises(PayloadHygieneError, match=r"\['no explanation'\]"):
        check_payload("No explanation.\n\n" + single_multi_payload("Q", "T"), task="T",
                      question="Q")
    assert issubclass(PayloadHygieneError, ValueError)


# ---------------------------------------------------------------------------------------- cues
def test_cues() -> None:
    assert SELECTOR_RETRY_CUE == ("That reply was not a mode declaration. Reply with exactly "
                                  "one of <mode>single</mode> or <mode>multi</mode> or "
                                  "<mode>agentic</mode> and nothing else.")
    cues = {violation_cue(code) for code in Violation}
    assert len(cues) == len(Violation)
    assert violation_cue(Violation.REF_SAME_LAYER).startswith("Invalid action (ref_same_layer):")
