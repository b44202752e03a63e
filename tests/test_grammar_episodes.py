"""Three example trajectories (single, multi, agentic; plus a forced arm ending in a violation)
driven through the protocol API the way the episode runner drives it (a scripted policy and
scripted workers, one token per character)."""

from __future__ import annotations

from collections.abc import Callable

from jax_routeweaver.routing.protocol.grammar import (
    Mode,
    ProtocolConfig,
    chat_delta,
    forced_declaration_text,
)
from jax_routeweaver.routing.protocol.observations import (
    frame_observation,
    observation_ids,
    observation_share,
    turn_observation_budget,
)
from jax_routeweaver.routing.protocol.prompts import (
    REFERENCE_WORKER_DESCRIPTIONS,
    mode_rulebook,
    routing_state_header,
    worker_payload,
)
from jax_routeweaver.routing.protocol.turns import (
    Dispatch,
    Node,
    PlannedCall,
    RoutingState,
    declare_forced_mode,
    episode_over,
    handle_action_turn,
    handle_selector_turn,
    record_action_turn,
    record_calls,
    record_selector_turn,
)

WORKERS = list(REFERENCE_WORKER_DESCRIPTIONS.items())
OFFERED = [worker for worker, _ in WORKERS]
Reply = Callable[[PlannedCall, str], str]


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def run(policy: list[str], reply: Reply, *, forced: Mode | None = None,
        config: ProtocolConfig | None = None
        ) -> tuple[RoutingState, list[tuple[str, int]], list[str]]:
    """A minimal runner: returns the final state, the (text, mask) stream and the payloads."""
    config = config or ProtocolConfig()
    turns, stream, payloads = iter(policy), [], []
    state = RoutingState()
    if forced is not None:
        state = declare_forced_mode(state, forced)
        stream.append((forced_declaration_text(forced, config), 0))
    else:
        text = next(turns)
        stream.append((text, 1))
        state = record_selector_turn(state, handle_selector_turn(text), config)
        if episode_over(state, config):
            return state, stream, payloads
    stream.append((chat_delta(mode_rulebook(state.mode, WORKERS, config)), 0))
    while not episode_over(state, config):
        if state.mode == Mode.AGENTIC and config.routing_state:
            stream.append((chat_delta(routing_state_header(state, config)), 0))
        text = next(turns)
        stream.append((text, 1))
        outcome = handle_action_turn(text, state, OFFERED, config)
        before, state = state, record_action_turn(state, outcome, config)
        if not isinstance(outcome.decision, Dispatch):
            continue
        nodes = []
        for call in outcome.decision.calls:  # concurrently in a real runner
            payload = worker_payload(call, "Q", before, config)
            payloads.append(payload)
            nodes.append(Node.from_call(call, reply(call, payload)))
        state = record_calls(state, nodes)
        used = sum(len(chars(t)) for t, _ in stream)
        share = observation_share(turn_observation_budget(used, config), len(nodes), state.mode,
                                  config)
        ids = observation_ids(frame_observation(state.mode, nodes), share, chars, config).ids
        stream.append(("".join(map(chr, ids)), 0))
    return state, stream, payloads


def test_single_trajectory() -> None:
    state, stream, payloads = run(
        ["<mode>single</mode>", '<route model="worker_3">Largest prime factor of 391?</route>',
         "<answer>23</answer>"],
        lambda call, _: "391 = 17 × 23. <answer>23</answer>")
    assert (state.mode, state.answer, state.policy_invalid) == (Mode.SINGLE, "23", None)
    assert [mask for _, mask in stream] == [1, 0, 1, 0, 1]
    assert stream[1][0].startswith("<|im_end|>\n<|im_start|>user\nYour mode is single.")
    assert stream[3][0] == "\n\n<observation>391 = 17 × 23. <answer>23</answer></observation>\n\n"
    assert payloads[0].endswith("Original question:\nQ\n\nCurrent sub-task:\nLargest prime "
                                "factor of 391?")


def test_multi_trajectory_has_no_auto_attach() -> None:
    replies = {"worker_5": "Iron (Fe).", "worker_1": "About 1538 °C."}
    policy = ["<mode>multi</mode>", '<route model="worker_5">Element 26?</route>',
              '<route model="worker_1">Melting point of iron?</route>', "<answer>1538 °C</answer>"]
    state, _, payloads = run(policy, lambda call, _: replies[call.worker])
    assert state.answer == "1538 °C" and state.calls_used == 2
    assert "Iron (Fe)." not in payloads[1]
    _, _, attached = run(policy, lambda call, _: replies[call.worker],
                         config=ProtocolConfig(multi_attach_previous=True))
    assert "Previous worker output:\nIron (Fe)." in attached[1]


def test_agentic_trajectory_with_routing_state() -> None:
    policy = [
        "<mode>agentic</mode>",
        '<route model="worker_3" role="executor" refs="">Solve it.</route>\n'
        '<route model="worker_6" role="executor" refs="">Solve it from first principles.</route>',
        '<route model="worker_5" role="summarizer" refs="n1,n2">Reconcile.</route>',
        "<answer>42</answer>",
    ]
    state, stream, payloads = run(policy, lambda call, _: f"{call.node_id}: <answer>42</answer>")
    assert (state.answer, state.calls_used, state.summarizer_done) == ("42", 3, True)
    headers = [text for text, _ in stream if "Routing state:" in text]
    assert [h.split("Current layer: ")[1][0] for h in headers] == ["1", "2", "3"]
    assert "Completed node IDs: n1, n2\nValid refs: n1, n2\nWorker calls remaining: 6\n" \
           "Summarizer completed: no" in headers[1]
    assert "Worker calls remaining: 5\nSummarizer completed: yes" in headers[2]
    layer_one = next(text for text, _ in stream if text.startswith('\n<observation id="n1"'))
    assert layer_one == ('\n<observation id="n1" role="executor">n1: <answer>42</answer>'
                         '</observation>\n\n<observation id="n2" role="executor">n2: <answer>42'
                         '</answer></observation>\n')
    assert "[n1] (from executor)\nn1: <answer>42</answer>\n\n[n2] (from executor)" in payloads[2]


def test_forced_arm_and_violation_end() -> None:
    state, stream, _ = run(['<route model="worker_1">x</route>'], lambda c, p: "r",
                           forced=Mode.AGENTIC)
    assert stream[0] == ("<|im_end|>\n<|im_start|>user\n<mode>agentic</mode><|im_end|>\n"
                         "<|im_start|>assistant\n", 0)
    assert state.forced and state.policy_invalid == "role_missing"
    assert state.calls_used == 0  # the first violation ends the episode: no call made
    state, stream, _ = run(["<mode>solo</mode>"], lambda c, p: "r")
    assert state.policy_invalid == "selector_mode_invalid" and len(stream) == 1
