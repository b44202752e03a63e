"""Every text the RouteWeaver router and its workers read (docs/protocol.md, "The turns of an
episode" and "What a worker receives").

* `selector_prompt`: the only prompt (turn 1, one user message, no system message).
* `mode_rulebook`: the execution rules injected as a user turn once the mode is fixed (free and
  forced episodes alike); `routing_state_header` before every agentic action turn.
* `worker_payload`: the one user message a worker gets (single/multi wrapper or agentic role
  brief, with referenced outputs spliced in).
* `SELECTOR_RETRY_CUE`, `violation_cue`: recovery-mode cues only.

Strings known verbatim from the original implementation are reproduced exactly (the rulebook's
opening and closing sentences, the catalog header, role menu, payload labels, routing-state
lines, selector retry cue). The rest is written from a paraphrase of the original's prompts:
the original repository ships no licence, so its prompt wording is not copied, and prompts
baked into the original's parquets differ in wording (`SELECTOR_VERSION` names ours). Workers
appear only as anonymous ids with capability descriptions — never model names, providers, prices
or tier words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.routing.protocol.calls import WorkerPool
from jax_routeweaver.routing.protocol.grammar import MODES, Mode, ProtocolConfig, Role
from jax_routeweaver.routing.protocol.turns import Node, PlannedCall, RoutingState, resolve_refs
from jax_routeweaver.routing.protocol.violations import Violation

WorkerEntry = tuple[str, str]  # (anonymous id, capability description)

SELECTOR_VERSION = "jrw-selector-v2"
MODE_MENU: Mapping[Mode, str] = {
    Mode.SINGLE: "one worker handles the task.",
    Mode.MULTI: "workers handle the task sequentially.",
    Mode.AGENTIC: "role-assigned workers handle the task in adaptive layers.",
}

# The original's six workers (docs/protocol.md, "The worker catalog"), described by capability
# only, in catalog order.
REFERENCE_WORKER_DESCRIPTIONS: Mapping[str, str] = {
    "worker_1": "dense model, 8.2B parameters; multilingual instruction following, dialogue, "
                "mathematical and logical reasoning, code generation.",
    "worker_2": "dense model, 8B parameters; instruction-tuned for multilingual dialogue; "
                "general reasoning, text generation, coding.",
    "worker_3": "mixture-of-experts model, 30.5B total / 3.3B active parameters; instruction "
                "following, text comprehension, logical reasoning, mathematics, science, "
                "coding.",
    "worker_4": "dense model, 27B-parameter class; multilingual question answering, "
                "summarization, reasoning, math problem solving, code generation.",
    "worker_5": "dense model, 70B parameters; instruction-tuned for multilingual dialogue; "
                "reasoning, instruction following, text and code generation.",
    "worker_6": "sparse mixture-of-experts model, parameter counts undisclosed; translation, "
                "classification, information extraction, coding, mathematics, reasoning.",
}

ROLE_MENU: Mapping[Role, str] = {
    Role.PLANNER: "analyses the problem and splits it into sub-tasks; never answers",
    Role.EXECUTOR: "carries out one assigned task and returns a candidate answer",
    Role.VERIFIER: "audits an existing output; returns PASS or FAIL with a reason; never answers",
    Role.SUMMARIZER: "reconciles everything and produces the final answer",
}

ROLE_BRIEF: Mapping[Role, str] = {
    Role.PLANNER: (
        "You are the planner. Break the problem into concrete sub-tasks that another worker "
        "could carry out: say what has to be computed or proved, in what order, and where the "
        "difficulties lie. Reason freely and show your work. Do NOT solve the problem and do "
        "NOT state a final answer."),
    Role.EXECUTOR: (
        "You are an executor. Carry out the assigned task. Reason freely and show your work, "
        "keeping the full derivation. End with <answer>your candidate answer</answer>."),
    Role.VERIFIER: (
        "You are a verifier. Check the given output against the original problem. Do not "
        "solve the problem yourself and do not give an answer. Reply with exactly PASS, or "
        "with FAIL followed by these three lines:\n"
        "Location: where the output goes wrong\n"
        "Reason: why it is wrong\n"
        "Suggestion: how to fix it"),
    Role.SUMMARIZER: (
        "You are the summarizer. Reconcile the information given below, disagreements "
        "included, and decide the answer. Say briefly which candidate you take and why. "
        "Reason freely. End with <answer>your final answer</answer>."),
}

# single/multi workers get this wrapper (the original client's output constraint;
# docs/protocol.md, "What a worker receives").
OUTPUT_CONSTRAINT = ("Reason freely and provide a complete derivation.\n"
                     "End with <answer>your final answer</answer>.")
QUESTION_LABEL = "Original question:"
SUBTASK_LABEL = "Current sub-task:"
PREVIOUS_OUTPUT_LABEL = "Previous worker output:"  # multi_attach_previous (paper wording) only
REFS_LABEL = "Earlier outputs you must use:"
TASK_LABEL = "Your task:"

# Brevity phrases the wrapper must never contain (a wrapper bug turns the row into an infra
# error); the same phrases in a router-written task are the router's choice and not checked.
BANNED_IN_PAYLOAD: tuple[str, ...] = (
    "final answer only", "answer only", "only the answer", "no explanation",
    "without explanation", "yes or no", "one word", "be brief", "briefly answer",
    "is this correct", "just confirm",
)

SELECTOR_RETRY_CUE = ("That reply was not a mode declaration. Reply with exactly one of "
                      "<mode>single</mode> or <mode>multi</mode> or <mode>agentic</mode> and "
                      "nothing else.")

RULEBOOK_CLOSING = ("The execution mode has already been declared. Do not declare it again.\n"
                    "Continue now, under these rules, on the question above.")

ROUTER_RULES = ("When you call a worker, give it the task to solve. Do not put your own "
                "candidate answer in the call, and do not ask a worker merely to confirm, "
                "verify or agree: each worker must do the work itself.")

ROUTE_TEMPLATE = '<route model="MODEL_ID">CONCRETE TASK</route>'
AGENTIC_ROUTE_TEMPLATE = '<route model="MODEL_ID" role="ROLE" refs="IDS">CONCRETE TASK</route>'


# ------------------------------------------------------------------------------------ catalog
def catalog_entries(pool: WorkerPool) -> list[WorkerEntry]:
    """`(id, description)` of every offered worker of `pool`, in catalog order."""
    return [(worker, pool.description(worker)) for worker in pool.worker_ids()]


def catalog_block(workers: Sequence[WorkerEntry], worker_max_tokens: int = 4096) -> str:
    """The worker catalog shown in every mode's rulebook (docs/protocol.md, "The worker
    catalog")."""
    lines = [f"{worker}: {description}" for worker, description in workers]
    return (f"Each worker call has a maximum output budget of {worker_max_tokens} tokens.\n\n"
            + "\n".join(lines))


def _allowed_ids_section(workers: Sequence[WorkerEntry], config: ProtocolConfig) -> str:
    ids = ", ".join(worker for worker, _ in workers)
    return ("## Allowed model IDs\n"
            'In model="..." write exactly one of these IDs, copied character for character. '
            "Do not invent, rename, combine or normalize IDs. The ID must be selected from "
            f"[{ids}].\n\n" + catalog_block(workers, config.worker_max_tokens))


# ----------------------------------------------------------------------------------- selector
def selector_prompt(question: str, order: Sequence[Mode] = MODES) -> str:
    """The turn-1 user message (docs/protocol.md, "The selector prompt"): mode menu, response
    format, question. No worker table, no examples, no domain labels."""
    order = [Mode(mode) for mode in order]
    if sorted(order) != sorted(MODES):
        raise ValueError(f"selector_prompt: order={order} must be a permutation of {MODES}")
    menu = "\n".join(f"{mode} — {MODE_MENU[mode]}" for mode in order)
    declarations = "\n".join(f"<mode>{mode}</mode>" for mode in order)
    return ("You are a router. Choose how worker models should handle the question.\n\n"
            "## Modes\nNo mode is preferred by default.\n" + menu + "\n\n"
            "## Response\nReply with exactly one mode declaration and nothing else, one of:\n"
            + declarations + "\n"
            "You will receive the corresponding execution rules after choosing.\n\n"
            f"Question: {question.strip()}")


# ----------------------------------------------------------------------------------- rulebooks
def _single_multi_grammar() -> str:
    return (
        "## Global grammar\n"
        "- A worker call is written <route ...>CONCRETE TASK</route>. The task must be concrete "
        "and non-empty: never a placeholder and never a copied worker description.\n"
        "- Worker replies come back as <observation>...</observation>. Observations are written "
        "by the ENVIRONMENT: never write, invent or paraphrase one yourself.\n"
        "- Attribute values use plain double quotes.\n"
        "- Finish with <answer>...</answer>, the last thing you write. Never answer without "
        "routing first.")


def _single_rules() -> str:
    return (
        "## Mode rules\n"
        "single -- exactly ONE worker call, in your first response; answer once its observation "
        f"arrives.\n{ROUTE_TEMPLATE}\n\n"
        "## Example -- single\n"
        '<route model="worker_1">Who created the constructed language Esperanto?</route>\n'
        "<observation>Esperanto was created by the ophthalmologist L. L. Zamenhof, who published "
        "it in 1887. <answer>L. L. Zamenhof</answer></observation>\n"
        "<answer>L. L. Zamenhof</answer>\n"
        "The example above is an ILLUSTRATION only: choose the worker that fits the question "
        "below, and do not reuse the example question or answer.\n\n" + ROUTER_RULES)


def _multi_rules(config: ProtocolConfig) -> str:
    low, high = config.multi_min_routes, config.multi_max_routes
    attach = ("\nEach worker after the first automatically sees the previous worker's full "
              "output." if config.multi_attach_previous else "")
    return (
        "## Mode rules\n"
        f"multi -- {low} to {high} worker calls in total, at most one <route> per turn, each "
        f"chosen after reading the previous observation.{attach}\n{ROUTE_TEMPLATE}\n\n"
        "## Example -- multi\n"
        "In multi, calls are made ONE AT A TIME: write one route, wait for its observation, "
        "then write the next route. Every later route must build on what the previous "
        "observation returned; if a later call could have been written before its predecessor "
        "answered, the question did not need multi. Never write <paradigm> or <layer>. The "
        "episode ends with one <answer>.\n\n"
        "Two calls:\n"
        '<route model="worker_1">Which film won Best Picture at the Academy Awards ceremony '
        "held in 1995?</route>\n"
        "<observation>The 67th Academy Awards, held in March 1995, gave Best Picture to Forrest "
        "Gump. <answer>Forrest Gump</answer></observation>\n"
        '<route model="worker_2">Who directed the film Forrest Gump?</route>\n'
        "<observation>Forrest Gump was directed by Robert Zemeckis. <answer>Robert Zemeckis"
        "</answer></observation>\n"
        "<answer>Robert Zemeckis</answer>\n\n"
        "Three calls:\n"
        '<route model="worker_1">Which river flows through Vienna, Bratislava, Budapest and '
        "Belgrade?</route>\n"
        "<observation>All four capitals lie on the Danube. <answer>The Danube</answer>"
        "</observation>\n"
        '<route model="worker_2">Into which sea does the Danube flow?</route>\n'
        "<observation>The Danube ends in a delta on the Black Sea coast. <answer>The Black Sea"
        "</answer></observation>\n"
        '<route model="worker_3">What is the maximum depth of the Black Sea?</route>\n'
        "<observation>The Black Sea is about 2,212 metres deep at its deepest point. <answer>"
        "About 2,212 m</answer></observation>\n"
        "<answer>About 2,212 m</answer>\n\n"
        f"Choose the workers that fit the question below. {ROUTER_RULES} Use between {low} and "
        f"{high} calls as the query requires.")


def _agentic_body(workers: Sequence[WorkerEntry], config: ProtocolConfig) -> str:
    roles = "\n".join(f"  {role}: {ROLE_MENU[role]}" for role in ROLE_MENU)
    rules = [
        f"At most {config.max_workers} worker calls in total.",
        "The last call must be the summarizer.",
        "A planner or a verifier may never be the last call.",
        "A verifier must reference at least one completed output.",
        "A summarizer must reference at least one completed output.",
        "The summarizer must be sent alone, in a layer of its own.",
        "Never put your own answer into a task, and never ask a worker merely to confirm or "
        "agree.",
        "Write the final <answer> only after the summarizer has run.",
    ]
    if config.routing_state:
        rules += [
            "Each message contains exactly one layer.",
            'Take refs only from "Valid refs" in the routing state; write refs="" when Valid '
            "refs is none.",
            "After sending a layer, stop and wait for its observations.",
        ]
    numbered = "\n".join(f"{i}. {rule}" for i, rule in enumerate(rules, 1))
    return (
        "Answer the question by coordinating a team of workers. You do not solve any part of "
        "the problem yourself, and your own reasoning stays out of the answer.\n\n"
        + _allowed_ids_section(workers, config) + "\n\n"
        "## Roles\n" + roles + "\n\n"
        "## Global grammar\n"
        f"- A worker call is written {AGENTIC_ROUTE_TEMPLATE}.\n"
        '- refs lists the ids of earlier outputs the worker must use (refs="" in the first '
        "layer). The environment splices the referenced outputs into the worker's message, so "
        "never copy them into the task.\n"
        "- refs may name only outputs of EARLIER layers, never a sibling in the same layer.\n"
        "- Several routes in ONE message form one LAYER: they run at the same time and cannot "
        "see each other.\n"
        '- Worker replies come back as <observation id="n1" role="...">...</observation>, '
        "written by the ENVIRONMENT; never write, invent or paraphrase one yourself.\n"
        "- Every worker already receives the original question.\n"
        "- After the summarizer's observation, finish with <answer>...</answer>.\n\n"
        "## Rules\n" + numbered + "\n"
        "You choose how many workers to use and how to arrange them; fewer calls are allowed."
        "\n\n"
        "## Example -- structure only, not a recommendation\n"
        "The first message contains only the first layer, for instance two executors working "
        "in parallel:\n"
        '<route model="worker_1" role="executor" refs="">Solve the problem your own way.'
        "</route>\n"
        '<route model="worker_2" role="executor" refs="">Solve the problem independently, from '
        "first principles.</route>\n"
        'Then stop and wait: one <observation id="n1" role="executor"> block per route arrives. '
        'A later layer could then be, for instance, a summarizer with refs="n1,n2", and after '
        "its observation you write <answer>...</answer>.")


def rulebook_body(mode: Mode, workers: Sequence[WorkerEntry],
                  config: ProtocolConfig | None = None) -> str:
    """The execution rules of `mode` (docs/protocol.md, "The rulebook"), without the question
    and without any mode-declaration instruction."""
    config = config or ProtocolConfig()
    mode = Mode(mode)
    if mode == Mode.AGENTIC:
        return _agentic_body(workers, config)
    rules = _single_rules() if mode == Mode.SINGLE else _multi_rules(config)
    return ("Answer the question at the end.\n\n" + _allowed_ids_section(workers, config)
            + "\n\n" + _single_multi_grammar() + "\n\n" + rules)


def mode_rulebook(mode: Mode, workers: Sequence[WorkerEntry],
                  config: ProtocolConfig | None = None, *, forced_worker: str | None = None
                  ) -> str:
    """The turn-2 user message (wrap it with `grammar.chat_delta`): the same text for free
    and forced episodes. `forced_worker` appends the worker-exploration sentence (off in the
    original's runs)."""
    text = (f"Your mode is {Mode(mode)}. These are its execution rules.\n\n"
            + rulebook_body(mode, workers, config) + "\n\n" + RULEBOOK_CLOSING)
    if forced_worker is not None:
        text += (f"\nFor this episode you must route to {forced_worker}. Name that exact id in "
                 "every worker call.")
    return text


def compact_rulebook(mode: Mode, workers: Sequence[WorkerEntry],
                     config: ProtocolConfig | None = None) -> str:
    """A short turn-2 rulebook (tens of tokens instead of 600-900): the mode, the allowed ids,
    the action format and the call bounds, no catalog descriptions or examples. For tiny
    random-init routers (the CPU quickstart), which cannot read the original rulebook and
    whose step time it dominates; the protocol enforced is the same."""
    config = config or ProtocolConfig()
    mode = Mode(mode)
    if mode == Mode.AGENTIC:
        how = (f"At most {config.max_workers} calls, in layers: {AGENTIC_ROUTE_TEMPLATE} with "
               "ROLE planner, executor, verifier or summarizer; a summarizer last, then "
               "<answer>...</answer>.")
    else:
        low, high = config.route_bounds(mode)
        calls = f"{low} call" if low == high == 1 else f"{low} to {high} calls, one per turn"
        how = f"{calls}: {ROUTE_TEMPLATE}, then <answer>...</answer>."
    ids = ", ".join(worker for worker, _ in workers)
    return f"Your mode is {mode}. Workers: {ids}.\n{how}\n{RULEBOOK_CLOSING}"


def routing_state_header(state: RoutingState, config: ProtocolConfig | None = None) -> str:
    """The six-line routing state shown before every agentic action turn (docs/protocol.md,
    "The routing-state header")."""
    config = config or ProtocolConfig()
    ids = ", ".join(state.completed_ids) or "none"
    return "\n".join((
        "Routing state:",
        f"Current layer: {state.layers_done + 1}",
        f"Completed node IDs: {ids}",
        f"Valid refs: {ids}",
        f"Worker calls remaining: {state.calls_remaining(config)}",
        f"Summarizer completed: {'yes' if state.summarizer_done else 'no'}",
    ))


# ----------------------------------------------------------------------------- worker payloads
def single_multi_payload(question: str, task: str, previous_output: str | None = None) -> str:
    """What a single/multi worker receives (docs/protocol.md, "What a worker receives"):
    output constraint, original question and the router's sub-task (omitted when it equals the
    question). The previous worker's output only with `previous_output` (the paper's wording,
    off in the original)."""
    parts = [OUTPUT_CONSTRAINT, f"{QUESTION_LABEL}\n{question}"]
    if previous_output is not None:
        parts.append(f"{PREVIOUS_OUTPUT_LABEL}\n{previous_output}")
    if task.strip() != question.strip():
        parts.append(f"{SUBTASK_LABEL}\n{task}")
    return "\n\n".join(parts)


def role_payload(role: Role, question: str, instruction: str, refs: Sequence[Node] = ()) -> str:
    """What an agentic worker receives (docs/protocol.md, "What a worker receives"): role
    brief, the full original question, the referenced nodes' full outputs (in the router's
    order), then the router's task."""
    parts = [ROLE_BRIEF[Role(role)], f"{QUESTION_LABEL}\n{question}"]
    if refs:
        blocks = "\n\n".join(f"[{node.id}] (from {node.role})\n{node.output}" for node in refs)
        parts.append(f"{REFS_LABEL}\n\n{blocks}")
    parts.append(f"{TASK_LABEL}\n{instruction}")
    return "\n\n".join(parts)


def worker_payload(call: PlannedCall, question: str, state: RoutingState,
                   config: ProtocolConfig | None = None) -> str:
    """The payload of a dispatched call, refs resolved against `state` (the episode before
    this turn's calls ran)."""
    if call.role is not None:
        return role_payload(call.role, question, call.task, resolve_refs(call, state))
    previous = payload_references(call, state, config)
    return single_multi_payload(question, call.task, previous[0] if previous else None)


def payload_references(call: PlannedCall, state: RoutingState,
                       config: ProtocolConfig | None = None) -> tuple[str, ...]:
    """The earlier outputs `worker_payload` splices into the call's payload: the referenced
    nodes' outputs (agentic), or the previous worker's output (multi with
    `multi_attach_previous`); none otherwise."""
    config = config or ProtocolConfig()
    if call.role is not None:
        return tuple(node.output for node in resolve_refs(call, state))
    if config.multi_attach_previous and state.mode == Mode.MULTI and state.nodes:
        return (state.nodes[-1].output,)
    return ()


class PayloadHygieneError(ValueError):
    """The wrapper-written part of a worker payload holds a brevity phrase (a wrapper bug: the
    row becomes a `wrapper_error`, infra; docs/protocol.md, "What a worker receives")."""


def check_payload(payload: str, *, task: str, question: str,
                  ref_outputs: Sequence[str] = ()) -> None:
    """Raise `PayloadHygieneError` (a ValueError) if the wrapper-written part of `payload`
    (everything but the router's task, the question and referenced outputs) contains a
    `BANNED_IN_PAYLOAD` phrase."""
    wrapper = payload
    for text in sorted((t for t in (task, question, *ref_outputs) if t), key=len,
                       reverse=True):
        wrapper = wrapper.replace(text, "")
    found = brevity_flags(wrapper)
    if found:
        raise PayloadHygieneError(f"worker payload wrapper contains brevity phrases "
                                  f"{list(found)}")


def checked_worker_payload(call: PlannedCall, question: str, state: RoutingState,
                           config: ProtocolConfig | None = None) -> str:
    """`worker_payload`, after `check_payload` on it (raises `PayloadHygieneError`)."""
    payload = worker_payload(call, question, state, config)
    check_payload(payload, task=call.task, question=question,
                  ref_outputs=payload_references(call, state, config))
    return payload


def brevity_flags(text: str) -> tuple[str, ...]:
    """`BANNED_IN_PAYLOAD` phrases occurring in `text` (case-insensitive)."""
    lowered = text.lower()
    return tuple(phrase for phrase in BANNED_IN_PAYLOAD if phrase in lowered)


# ------------------------------------------------------------------------------ recovery cues
_VIOLATION_CUES: Mapping[Violation, str] = {
    Violation.SELECTOR_MODE_MISSING: "No mode declaration was found.",
    Violation.SELECTOR_MODE_DUPLICATE: "More than one mode was declared.",
    Violation.SELECTOR_MODE_INVALID: "The declared mode is not single, multi or agentic.",
    Violation.ROUTE_IN_SELECTOR: "Do not route before the mode is fixed.",
    Violation.LAYER_IN_SELECTOR: "Do not write layers before the mode is fixed.",
    Violation.ACTION_IN_SELECTOR: "Do not write actions before the mode is fixed.",
    Violation.PARADIGM_IN_SELECTOR: "Do not write paradigms before the mode is fixed.",
    Violation.OBSERVATION_IN_SELECTOR: "Observations are written by the environment only.",
    Violation.ANSWER_IN_SELECTOR: "Do not answer before the mode is fixed.",
    Violation.MODE_DUPLICATE: "The mode is already fixed; do not write <mode> again.",
    Violation.ANSWER_PREMATURE: "Too few worker calls so far for this mode; route first.",
    Violation.ROUTE_MISSING: "No worker call was found; write one <route>.",
    Violation.ROUTE_MALFORMED: "The <route> tag is malformed or not closed.",
    Violation.ATTR_DUPLICATE: "An attribute of the route was given twice.",
    Violation.ATTR_UNKNOWN: "The route may only carry the model attribute.",
    Violation.ATTR_MISSING: "The route has no model id.",
    Violation.QUERY_EMPTY: "The route's task is empty.",
    Violation.PLACEHOLDER: "Replace the placeholder with a real model id and a concrete task.",
    Violation.ROUTE_LIMIT_EXCEEDED: "No more worker calls are allowed; give your <answer>.",
    Violation.UNKNOWN_MODEL: "That model id does not exist; copy one from the allowed IDs.",
    Violation.WORKER_NOT_OFFERED: "That worker is not offered; copy one of the allowed IDs.",
    Violation.ACTION_MISSING: "No worker call was found (an <answer> needs the summarizer "
                              "first).",
    Violation.ACTION_MALFORMED: "A <route> tag is malformed or not closed.",
    Violation.ROLE_MISSING: "A route has no role.",
    Violation.MODEL_MISSING: "A route has no model id.",
    Violation.INSTRUCTION_MISSING: "A route's task is empty.",
    Violation.ROLE_INVALID: "A role is not planner, executor, verifier or summarizer.",
    Violation.MODEL_INVALID: "A model id is not one of the allowed IDs.",
    Violation.REF_UNKNOWN: "A ref names no completed output.",
    Violation.REF_SAME_LAYER: "A ref names a sibling in the same layer.",
    Violation.SUMMARIZER_NEEDS_REFS: "The summarizer must reference completed outputs.",
    Violation.VERIFIER_NEEDS_REFS: "A verifier must reference completed outputs.",
    Violation.ALREADY_FINISHED: "The summarizer has run; give your <answer>.",
    Violation.LAYER_EXCEEDS_BUDGET: "The layer has more routes than calls remaining.",
    Violation.MUST_SUMMARIZE_NOW: "Only the summarizer's slot is left; send the summarizer.",
    Violation.SUMMARIZER_NOT_ALONE: "The summarizer must be alone in its layer.",
    Violation.DUPLICATE_IN_LAYER: "Two routes of the layer are identical.",
}


def violation_cue(code: Violation) -> str:
    """The recovery cue for `code` (recovery mode only; frame with `grammar.inline_env_text`,
    or for selector codes use `SELECTOR_RETRY_CUE` as a chat delta)."""
    return f"Invalid action ({code}): {_VIOLATION_CUES[Violation(code)]} Try again."


# ------------------------------------------------------------------------------- rendering
def render_user_turn_ids(tokenizer: Any, content: str) -> list[int]:
    """Token ids of one user message through `tokenizer`'s chat template with the generation
    prompt (`<|im_start|>assistant\\n`), encoded without adding special tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def selector_prompt_ids(tokenizer: Any, question: str, order: Sequence[Mode] = MODES
                        ) -> list[int]:
    """The episode's prompt ids: `selector_prompt` as the single user turn."""
    return render_user_turn_ids(tokenizer, selector_prompt(question, order))
