"""Router-R1's multi-round dialect (compat mode): prompt, actions, observations, turn logic.

Pure and I/O-free. Behaviour follows Router-R1's original code (docs/router_r1.md; the
training code path of Router-R1, which produced the released checkpoints):

* One user message holds the whole prompt; everything the policy writes afterwards, including
  the `<information>` blocks the environment inserts, lives in a single assistant turn.
* A turn is cut after the first `</search>`, else after the first `</answer>` (no stop strings
  are used in training). The first `<search>`/`<answer>` pair in the cut text is the action.
* A well-formed search is routed; its reply comes back as
  `"\\n\\n<information>" + reply.strip() + "</information>\\n\\n"`, or with `None` as the reply
  when the model name does not resolve or the call failed. An invalid action gets the empty
  observation and the policy simply generates again.
* At most `max_turns` (4) routed turns, then one final generation that is never routed.
* Observations are cut to their first 600 tokens (which can drop `</information>`).

The reward's dialect-level inputs live here too: `format_violations` (the format check),
`extract_answer` (the answer extraction) and `count_routes` (the route count of the gating); the
reward arithmetic itself does not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from jax_routeweaver.routing.protocol.calls import WorkerCall
from jax_routeweaver.sampling.base import SamplingParams, find_stop_string

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]
PromptVariant = Literal["qwen", "llama"]

# ------------------------------------------------------------------------------------ tags
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
INFORMATION_OPEN, INFORMATION_CLOSE = "<information>", "</information>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAG_NAMES: tuple[str, ...] = ("search", "answer", "think", "information")
TAG_STRINGS: tuple[str, ...] = (SEARCH_OPEN, SEARCH_CLOSE, THINK_OPEN, THINK_CLOSE,
                                ANSWER_OPEN, ANSWER_CLOSE, INFORMATION_OPEN, INFORMATION_CLOSE)

SEARCH_PLACEHOLDER = "<search> LLM-Name:Your-Query </search>"
PLACEHOLDER_MARKERS: tuple[str, ...] = ("llm-name", "your-query")  # matched case-insensitively

# Training passes no stop strings (the turn is cut afterwards, `cut_turn_text`); Router-R1's
# inference script (`infer_vllm.py`) stops on these.
TRAINING_STOP_STRINGS: tuple[str, ...] = ()
INFERENCE_STOP_STRINGS: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)

INVALID_ACTION_OBSERVATION = ""
NONE_REPLY = "None"  # shown when the name does not resolve or the call failed
OBSERVATION_PREFIX = "\n\n" + INFORMATION_OPEN
OBSERVATION_SUFFIX = INFORMATION_CLOSE + "\n\n"

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_TAG_RE = re.compile(r"<(search|answer|think|information)>(.*?)</\1>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


# ---------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class RouterR1Config:
    """Router-R1's numbers (`train.sh`, `generation.py`, `route_service.py`).

    Token budgets: `start_max_tokens` keeps the last N prompt tokens; `per_turn_max_tokens` is
    the generation cap of each turn; `obs_max_tokens` keeps the first N tokens of an
    observation; `context_max_tokens` keeps the last N tokens of the rolling context and
    `trajectory_max_tokens` the first N of the trajectory (both `max_prompt_length` upstream).
    Turns: `max_turns` routed generations, then one final generation that never routes.
    Sampling: train `temperature`/`top_p` (top-k off), validation greedy. Worker calls:
    `worker_max_tokens`, `worker_top_p`, `worker_seed`, at most `worker_concurrency` at once.
    """

    # Routed generations per episode before the final, never-routed one; int >= 1.
    max_turns: int = 4
    # The prompt keeps its last N tokens; int >= 1.
    start_max_tokens: int = 2048
    # The rolling context keeps its last N tokens; int >= 1.
    context_max_tokens: int = 4096
    # The trajectory keeps its first N tokens (episode ends there); int >= 1.
    trajectory_max_tokens: int = 4096
    # Generation cap of each turn, tokens; int >= 1.
    per_turn_max_tokens: int = 1024
    # An observation keeps its first N tokens; int >= 1.
    obs_max_tokens: int = 600
    # Training sampling temperature of the policy, >= 0 (validation is greedy).
    train_temperature: float = 1.0
    # Training nucleus top-p of the policy, in (0, 1].
    train_top_p: float = 0.95
    # Chat prompt template: "qwen" or "llama".
    prompt_variant: PromptVariant = "qwen"
    # Tokens a worker call may generate; int >= 1.
    worker_max_tokens: int = 512
    # Nucleus top-p of worker calls, in (0, 1].
    worker_top_p: float = 1.0
    # Sampling seed of worker calls; any int.
    worker_seed: int = 42
    # Worker calls in flight at once; int >= 1.
    worker_concurrency: int = 10

    def __post_init__(self) -> None:
        for field in ("max_turns", "start_max_tokens", "context_max_tokens",
                      "trajectory_max_tokens", "per_turn_max_tokens", "obs_max_tokens",
                      "worker_max_tokens", "worker_concurrency"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RouterR1Config.{field}={value!r} must be an int >= 1")
        if self.prompt_variant not in ("qwen", "llama"):
            raise ValueError(f"RouterR1Config.prompt_variant={self.prompt_variant!r}: expected "
                             "'qwen' or 'llama'")


def rollout_sampling_params(config: RouterR1Config, *, validation: bool) -> SamplingParams:
    """Per-turn policy sampling: T=1, top-p 0.95 in training; greedy in validation; no stops."""
    if validation:
        return SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=config.per_turn_max_tokens,
                              stop_strings=TRAINING_STOP_STRINGS)
    return SamplingParams(temperature=config.train_temperature, top_p=config.train_top_p,
                          max_new_tokens=config.per_turn_max_tokens,
                          stop_strings=TRAINING_STOP_STRINGS)


# ---------------------------------------------------------------------------------- models
@dataclasses.dataclass(frozen=True)
class RouterR1Model:
    """One routable model. `name`: as written in the prompt; `api_id`: the id sent to the
    endpoint (NVIDIA catalogue); `price_per_million`: $ per 1M completion tokens (None: the
    original has no price, a call would crash upstream); `in_prompt`: listed in the default
    prompt (the others are only known to the name parser)."""

    name: str
    api_id: str
    price_per_million: float | None
    temperature: float
    descriptor: str
    in_prompt: bool = True


QWEN_7B = RouterR1Model(
    "Qwen2.5-7B-Instruct", "qwen/qwen2.5-7b-instruct", 0.30, 0.0,
    "A Chinese-English instruction-tuned model for language understanding, coding, mathematics "
    "and reasoning. Compared with its predecessor it knows more, codes and does mathematics "
    "better, follows instructions more reliably and writes long and structured text better. It "
    "reads up to 128K tokens of context and supports more than 29 languages.")
LLAMA_8B = RouterR1Model(
    "LLaMA-3.1-8B-Instruct", "meta/llama-3.1-8b-instruct", 0.18, 0.0,
    "An 8B multilingual model tuned for dialogue, with good language understanding, reasoning "
    "and text generation. On common benchmarks it beats many open and closed chat models.")
LLAMA_70B = RouterR1Model(
    "LLaMA-3.1-70B-Instruct", "meta/llama-3.1-70b-instruct", 0.88, 0.0,
    "A 70B state-of-the-art multilingual model tuned for dialogue, with strong comprehension, "
    "complex reasoning and high-quality text generation.")
MISTRAL_7B = RouterR1Model(
    "Mistral-7B-Instruct", "mistralai/mistral-7b-instruct-v0.3", 0.20, 0.0,
    "An instruction-tuned version of Mistral-7B-v0.3 that follows instructions and writes "
    "creative text; it was fine-tuned on publicly available conversation data.")
MIXTRAL_8X22B = RouterR1Model(
    "Mixtral-8x22B-Instruct", "mistralai/mixtral-8x22b-instruct-v0.1", 1.20, 0.0,
    "A sparse mixture-of-experts model that activates 39B of its 141B parameters, giving high "
    "performance at a lower cost. It follows instructions, writes creative text, works in "
    "English, French, Italian, German and Spanish, handles mathematics, code and function "
    "calling, and reads up to 64K tokens of context.")
GEMMA_27B = RouterR1Model(
    "Gemma-2-27B-Instruct", "google/gemma-2-27b-it", 0.80, 0.1,
    "An open-weight, decoder-only model from Google, built with the technology behind Gemini. "
    "It is suited to understanding and transforming text, code, question answering, "
    "summarisation and reasoning, and is small enough to run on a laptop.")
# Known to the name parser only (the "unseen models" experiment); temperatures are not given
# by the original and default to 0.
PALMYRA_122B = RouterR1Model("Palmyra-Creative-122B", "writer/palmyra-creative-122b", 1.80, 0.0,
                             "", in_prompt=False)
CHATQA_8B = RouterR1Model("Llama3-ChatQA-1.5-8B", "nvidia/llama3-chatqa-1.5-8b", 0.18, 0.0, "",
                          in_prompt=False)
NEMOTRON_51B = RouterR1Model("Llama-3.1-Nemotron-51B-Instruct",
                             "nvidia/llama-3.1-nemotron-51b-instruct", None, 0.0, "",
                             in_prompt=False)
NEMOTRON_SUPER_49B = RouterR1Model("Llama-3.3-Nemotron-Super-49B-v1",
                                   "nvidia/llama-3.3-nemotron-super-49b-v1", None, 0.0, "",
                                   in_prompt=False)
GRANITE_8B = RouterR1Model("Granite-3.0-8B-Instruct", "ibm/granite-3.0-8b-instruct", None, 0.0,
                           "", in_prompt=False)

PROMPT_MODELS: tuple[RouterR1Model, ...] = (QWEN_7B, LLAMA_8B, LLAMA_70B, MISTRAL_7B,
                                            MIXTRAL_8X22B, GEMMA_27B)
ALL_MODELS: tuple[RouterR1Model, ...] = (
    *PROMPT_MODELS, PALMYRA_122B, CHATQA_8B, NEMOTRON_51B, NEMOTRON_SUPER_49B, GRANITE_8B)


def resolve_model(name: str) -> RouterR1Model | None:
    """Router-R1's loose name matcher: ordered substring tests on `name.strip().lower()`.

    qwen -> Qwen2.5-7B; palmyra|creative -> Palmyra; llama -> (70b, 51b, 49b, 8b -> ChatQA if
    chatqa else Llama-8B, otherwise None); mistral; mixtral; granite; gemma; else None.
    """
    m = name.strip().lower()
    if "qwen" in m:
        return QWEN_7B
    if "palmyra" in m or "creative" in m:
        return PALMYRA_122B
    if "llama" in m:
        if "70b" in m:
            return LLAMA_70B
        if "51b" in m:
            return NEMOTRON_51B
        if "49b" in m:
            return NEMOTRON_SUPER_49B
        if "8b" in m:
            return CHATQA_8B if "chatqa" in m else LLAMA_8B
        return None
    for key, model in (("mistral", MISTRAL_7B), ("mixtral", MIXTRAL_8X22B),
                       ("granite", GRANITE_8B), ("gemma", GEMMA_27B)):
        if key in m:
            return model
    return None


# ---------------------------------------------------------------------------------- prompt
_LLAMA_EXTRA_RULE = (
    "- Do not print <think> </think> as a literal string and do not comment on the tags; "
    "write your actual reasoning between them.\n")


def normalize_question(question: str) -> str:
    """`question.strip()`, with `?` appended unless it already ends with one."""
    q = question.strip()
    if not q:
        raise ValueError("Router-R1 prompt: the question is empty after strip()")
    return q if q.endswith("?") else q + "?"


def render_prompt_text(question: str, *, variant: PromptVariant = "qwen",
                       models: Sequence[RouterR1Model] = PROMPT_MODELS) -> str:
    """The Router-R1 user message for `question` (sections a-g of Router-R1's prompt template).

    Wording is our own paraphrase (the original gives content and order, not the text);
    protocol strings (tags, the placeholder, the model names, the heading) are exact.
    """
    if variant not in ("qwen", "llama"):
        raise ValueError(f"Router-R1 prompt variant {variant!r}: expected 'qwen' or 'llama'")
    names = ", ".join(m.name for m in models)
    descriptions = "".join(f"{m.name}:\n{m.descriptor}\n\n" for m in models)
    return (
        "Answer the question below. Each time you receive new information, first reason about "
        "it inside <think> and </think>. If that reasoning shows you lack some knowledge, you "
        f"can call a specialized LLM by writing {SEARCH_PLACEHOLDER}.\n\n"
        "STRICT FORMAT RULES for <search>:\n"
        f"- LLM-Name must be exactly one of [{names}].\n"
        "- Your-Query must be a concrete question whose answer helps you answer the original "
        "question.\n"
        "- Never paste the model descriptions into a call.\n"
        f"- Never write the literal placeholder {SEARCH_PLACEHOLDER}; replace both parts with "
        "real content.\n"
        + (_LLAMA_EXTRA_RULE if variant == "llama" else "")
        + "\nBefore each call, reason inside <think> and </think> about why outside information "
        "is needed and which LLM suits the sub-question best, judging from the descriptions "
        "below.\n\n"
        "The called LLM's response will be returned between <information> and </information>. "
        "Do not stick to one LLM unless it is consistently the best; explore different LLMs. "
        "Calling several LLMs, or the same LLM several times, for one question is acceptable "
        "and encouraged.\n\n"
        "#### The Descriptions of Each LLM\n\n"
        f"{descriptions}"
        "If no further external knowledge is needed, give the final answer inside <answer> and "
        "</answer> with no extra explanation, for example <answer> Beijing </answer>. Do not "
        "output the bare tags <answer> and </answer> alone; put the actual answer between "
        "them.\n\n"
        f"Question: {normalize_question(question)}\n\n"
    )


def render_chat_prompt(question: str, tokenizer: Any, *,
                       variant: PromptVariant = "qwen") -> str:
    """The prompt as one user message through `tokenizer`'s chat template with the generation
    prompt; the bare message text when the tokenizer has no chat template."""
    content = render_prompt_text(question, variant=variant)
    if not getattr(tokenizer, "chat_template", None):
        return content
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)


def render_prompt_ids(question: str, tokenizer: Any,
                      config: RouterR1Config | None = None) -> list[int]:
    """Token ids of `render_chat_prompt` (encoded without added special tokens, as veRL does),
    keeping the last `config.start_max_tokens`."""
    config = config or RouterR1Config()
    text = render_chat_prompt(question, tokenizer, variant=config.prompt_variant)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids[-config.start_max_tokens:]


# ------------------------------------------------------------------------------ worker call
WORKER_PROMPT_ANCHOR = "Here is the sub-question for you to assist with:"


def render_worker_prompt(query: str) -> str:
    """The one user message sent to a routed model (paraphrase of Router-R1's agent prompt);
    `query` is inserted verbatim after `WORKER_PROMPT_ANCHOR`."""
    return (
        "You are a helpful assistant taking part in a multi-agent reasoning process, in which a "
        "base model delegates sub-questions to specialized models like you. Do your best either "
        "to answer the sub-question directly with a brief explanation, or to give relevant "
        "context, background or insights even if you cannot answer it fully. If you can offer "
        "nothing useful, say so clearly and suggest that the base model consult other LLMs. Be "
        "clear, concise and informative (preferably under 512 tokens) and stay strictly on "
        f"topic.\n\n{WORKER_PROMPT_ANCHOR} {query}"
    )


# ------------------------------------------------------------------------------------ turn
def cut_turn_text(text: str) -> str:
    """Cut after the first `</search>` if there is one, else after the first `</answer>`,
    else keep all (Router-R1's post-hoc truncation; `</search>` wins even if it comes later)."""
    for tag in (SEARCH_CLOSE, ANSWER_CLOSE):
        at = text.find(tag)
        if at >= 0:
            return text[:at + len(tag)]
    return text


def cut_turn_ids(token_ids: Sequence[int], decode: Decode, *,
                 drop_trailing_ids: Sequence[int] = ()) -> int:
    """How many sampled tokens to keep: `cut_turn_text` done in token space.

    Keeps the shortest prefix whose `decode` contains the first `</search>` (else `</answer>`),
    so the kept text may run past the tag to the end of the token that completes it. With no
    tag, trailing ids in `drop_trailing_ids` (EOS) are dropped: Router-R1 decodes with special
    tokens skipped, so it never trains on EOS. `decode` should skip special tokens too.
    """
    for tag in (SEARCH_CLOSE, ANSWER_CLOSE):
        found = find_stop_string(token_ids, decode, (tag,))
        if found is not None:
            return found[0]
    n = len(token_ids)
    drop = set(drop_trailing_ids)
    while n and token_ids[n - 1] in drop:
        n -= 1
    return n


# --------------------------------------------------------------------------------- actions
InvalidReason = Literal["no_action", "placeholder", "no_colon", "empty_query"]


@dataclasses.dataclass(frozen=True)
class SearchAction:
    """A well-formed `<search>`: `content` stripped; `model_text` =
    `content.split(":")[0].strip().lower()`; `query` = `content.split(":")[1]` verbatim (text
    between the first and second colon, not stripped); `model` its resolution (None: the
    observation is `<information>None</information>` and no call is made)."""

    content: str
    model_text: str
    query: str
    model: RouterR1Model | None


@dataclasses.dataclass(frozen=True)
class AnswerAction:
    """An `<answer>` block (content stripped); ends the episode."""

    answer: str


@dataclasses.dataclass(frozen=True)
class InvalidAction:
    """Neither: no tag pair, placeholder text, no colon, or a blank query after the last colon.
    Its observation is `INVALID_ACTION_OBSERVATION` (the empty string) and the turn is spent."""

    reason: InvalidReason
    observation: str = INVALID_ACTION_OBSERVATION


Action = SearchAction | AnswerAction | InvalidAction


def parse_action(text: str) -> Action:
    """Router-R1's environment parser on one (cut) turn's text.

    First non-greedy `<(search|answer)>(.*?)</same>` match (dot matches newline), content
    stripped. A search is invalid if its lower-cased content contains `llm-name` or
    `your-query`, has no `:`, or is blank after its last `:`. Never raises.
    """
    match = _ACTION_RE.search(text)
    if match is None:
        return InvalidAction("no_action")
    tag, content = match.group(1), match.group(2).strip()
    if tag == "answer":
        return AnswerAction(content)
    lowered = content.lower()
    if any(marker in lowered for marker in PLACEHOLDER_MARKERS):
        return InvalidAction("placeholder")
    if ":" not in content:
        return InvalidAction("no_colon")
    parts = content.split(":")
    if not parts[-1].strip():
        return InvalidAction("empty_query")
    model_text = parts[0].strip().lower()
    return SearchAction(content, model_text, parts[1], resolve_model(model_text))


# ----------------------------------------------------------------------------- observation
def render_observation(reply: str | None) -> str:
    """`"\\n\\n<information>" + reply.strip() + "</information>\\n\\n"`; `None` as the reply
    when it is None (unresolved name or failed call)."""
    body = NONE_REPLY if reply is None else reply.strip()
    return OBSERVATION_PREFIX + body + OBSERVATION_SUFFIX


def observation_for_call(call: WorkerCall) -> str:
    """Observation for a finished worker call: its reply, or `None` if it failed."""
    return render_observation(call.text if call.success else None)


@dataclasses.dataclass(frozen=True)
class CappedObservation:
    """An observation cut to its first `max_tokens` tokens: `ids` (to append, mask 0), `text`
    (`decode(ids)`) and whether anything was cut."""

    ids: list[int]
    text: str
    truncated: bool


def cap_observation(text: str, encode: Encode, decode: Decode,
                    max_tokens: int = 600) -> CappedObservation:
    """Keep the first `max_tokens` tokens of `encode(text)` (`encode` must add no special
    tokens). A cut observation loses its closing `</information>`, as in Router-R1."""
    if max_tokens < 1:
        raise ValueError(f"cap_observation: max_tokens={max_tokens} must be >= 1")
    ids = list(encode(text)) if text else []
    if len(ids) <= max_tokens:
        return CappedObservation(ids, text, False)
    kept = ids[:max_tokens]
    return CappedObservation(kept, decode(kept), True)


# ------------------------------------------------------------------------------ turn logic
@dataclasses.dataclass(frozen=True)
class EpisodeState:
    """`turn`: 0-based index of the generation being decided (0..max_turns, the last one final);
    `calls`: worker calls issued so far."""

    turn: int = 0
    calls: int = 0


@dataclasses.dataclass(frozen=True)
class CallWorker:
    """Send `prompt` (the worker prompt around `query`) to `model`, then append
    `observation_for_call(...)` capped to `obs_max_tokens`, and generate again."""

    model: RouterR1Model
    query: str
    prompt: str


@dataclasses.dataclass(frozen=True)
class AppendObservation:
    """Append `text` (capped; "" appends nothing) and generate again. `reason`: the invalid
    action's reason, or "unknown_model" for a search whose name did not resolve."""

    text: str
    reason: str


@dataclasses.dataclass(frozen=True)
class EndEpisode:
    """Append the response only; the episode is over. `reason`: "answer" or "final_turn"."""

    reason: Literal["answer", "final_turn"]


TurnDecision = CallWorker | AppendObservation | EndEpisode


def is_final_turn(state: EpisodeState, config: RouterR1Config) -> bool:
    """True for the extra generation after `max_turns` routed turns (never routed)."""
    return state.turn == config.max_turns


def decide_turn(state: EpisodeState, action: Action,
                config: RouterR1Config | None = None) -> TurnDecision:
    """What the runner does with this turn's parsed `action`.

    answer -> end; final turn -> end whatever the action (a search there gets no observation,
    which later fails the format check); resolvable search -> call; unresolved search ->
    `<information>None</information>`; invalid -> empty observation.
    """
    config = config or RouterR1Config()
    if not 0 <= state.turn <= config.max_turns:
        raise ValueError(f"EpisodeState.turn={state.turn}: must be in 0..{config.max_turns} "
                         "(the last one is the final, unrouted generation)")
    if isinstance(action, AnswerAction):
        return EndEpisode("answer")
    if is_final_turn(state, config):
        return EndEpisode("final_turn")
    if isinstance(action, InvalidAction):
        return AppendObservation(action.observation, action.reason)
    if action.model is None:
        return AppendObservation(render_observation(None), "unknown_model")
    return CallWorker(action.model, action.query, render_worker_prompt(action.query))


def advance(state: EpisodeState, decision: TurnDecision) -> EpisodeState:
    """State for the next generation; raises after `EndEpisode` (nothing follows it)."""
    if isinstance(decision, EndEpisode):
        raise ValueError(f"advance: the episode ended ({decision.reason}); no next turn")
    return EpisodeState(state.turn + 1, state.calls + isinstance(decision, CallWorker))


# ---------------------------------------------------------------------------- reward inputs
FormatViolation = Literal[
    "no_tags", "unbalanced_tags", "empty_think", "nesting", "answer_count", "no_think",
    "search_information_mismatch", "not_start_think", "not_end_answer", "query_format",
    "bad_name"]


def search_flags(content: str) -> tuple[bool, bool]:
    """(query_format, bad_name) for one stripped `<search>` content (Router-R1's format
    check): both False means the format check accepts this search."""
    if content.count(":") != 1:
        return True, False
    model_part, query_part = content.split(":")
    model_lower = model_part.strip().lower()
    query_format = (not query_part.strip()
                    or any(marker in content.lower() for marker in PLACEHOLDER_MARKERS)
                    or model_lower in query_part.lower())
    return query_format, resolve_model(model_part) is None


def format_violations(response: str) -> tuple[FormatViolation, ...]:
    """Every Router-R1 format check `response` fails, in check order; empty means format
    score 0.

    `response` is the decoded response part (policy text and observations, no prompt).
    """
    matches = [(m.group(1), m.group(2).strip()) for m in _TAG_RE.finditer(response)]
    found: list[FormatViolation] = []
    if not matches:
        found.append("no_tags")
    if any(response.count(f"<{t}>") != response.count(f"</{t}>") for t in TAG_NAMES):
        found.append("unbalanced_tags")
    query_format = bad_name = empty_think = nesting = False
    counts = dict.fromkeys(TAG_NAMES, 0)
    for tag, content in matches:
        if tag == "search":
            q, b = search_flags(content)
            query_format, bad_name = query_format or q, bad_name or b
        elif tag == "think" and content in ("", "..."):
            empty_think = True
        nesting = nesting or any(s in content for s in TAG_STRINGS)
        counts[tag] += 1
    if empty_think:
        found.append("empty_think")
    if nesting:
        found.append("nesting")
    if counts["answer"] != 1:
        found.append("answer_count")
    if counts["think"] == 0:
        found.append("no_think")
    if counts["search"] != counts["information"]:
        found.append("search_information_mismatch")
    stripped = response.strip()
    if not stripped.startswith(THINK_OPEN):
        found.append("not_start_think")
    if not stripped.endswith(ANSWER_CLOSE):
        found.append("not_end_answer")
    if query_format:
        found.append("query_format")
    if bad_name:
        found.append("bad_name")
    return tuple(found)


def extract_answer(response: str) -> str | None:
    """The last `<answer>…</answer>` block's content, stripped; None when there is none."""
    answers = _ANSWER_RE.findall(response)
    return answers[-1].strip() if answers else None


def count_routes(response: str) -> int:
    """Validation "route count": `<search>` blocks counted until the first one that raises the
    query-format or bad-name flag (the flags are sticky, so counting stops there)."""
    count = 0
    for m in _TAG_RE.finditer(response):
        if m.group(1) != "search":
            continue
        query_format, bad_name = search_flags(m.group(2).strip())
        if query_format or bad_name:
            break
        count += 1
    return count
