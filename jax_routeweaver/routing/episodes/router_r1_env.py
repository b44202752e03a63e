"""Router-R1 as an `episode.Env`: its dialect (`router_r1.py`) driven turn by turn.

The router names LLMs by their Router-R1 names; the worker pool only knows anonymous ids, so
`model_workers` maps each `RouterR1Model.name` the policy may call to a pool worker id
(`default_model_workers`: the six prompt models onto worker_1..6, in prompt order).

With `Constraints` every turn carries a `Grammar` (`router_r1_grammar`) that admits only actions
Router-R1's format check accepts, so even a random-init router writes valid episodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing.episodes.episode import CallRequest, EnvFactory, Step, Trajectory, Turn
from jax_routeweaver.routing.episodes.routeweaver_env import answer_candidates
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.protocol.calls import PoolView, WorkerCall
from jax_routeweaver.sampling.base import Completion, SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, ebnf_literal

# Free text of constrained actions, printable ASCII only (one byte, so at most one token per
# character: a bounded action always fits the turn's token cap). No "<" or ">": no tag can
# appear inside a tag (nesting, unbalanced tags). Think opens with an alphanumeric, so it is
# never "" or "..." (empty-think). A free query also has no ":" (a search holds exactly one)
# and no "-": every placeholder marker ("llm-name", "your-query") and every model name has
# one, so the query can contain neither (query-format).
THINK_MAX_CHARS = 16
QUERY_MAX_CHARS = 32
ANSWER_MAX_CHARS = 32
_THINK = f'[A-Za-z0-9] [ -;=?-~]{{0,{THINK_MAX_CHARS - 1}}}'
_QUERY = f'[A-Za-z0-9] [ -,.-9;=?-~]{{0,{QUERY_MAX_CHARS - 1}}}'
_ANSWER = f'[!-;=?-~] [ -;=?-~]{{0,{ANSWER_MAX_CHARS - 1}}}'


def default_model_workers(workers: Sequence[str]) -> dict[str, str]:
    """The six Router-R1 prompt models onto the first six offered worker ids, in prompt order
    (Qwen2.5-7B, LLaMA-3.1-8B, LLaMA-3.1-70B, Mistral-7B, Mixtral-8x22B, Gemma-2-27B ->
    worker_1..6 of the simulated pool). Fewer workers than models is an error."""
    if len(workers) < len(r1.PROMPT_MODELS):
        raise ValueError(f"the default Router-R1 model map needs {len(r1.PROMPT_MODELS)} "
                         f"workers, the pool offers {list(workers)}")
    return {m.name: w for m, w in zip(r1.PROMPT_MODELS, workers, strict=False)}


@dataclasses.dataclass(frozen=True)
class Constraints:
    """Grammar options of a constrained episode. `answer_choices`: the answer must be one of
    the candidate answers of the successful replies so far (free text when none fits).
    `question_query`: a search's query is the episode's question verbatim (when it is a valid
    query and the action fits the turn's token cap; a free query otherwise), so the calls of
    a tiny router reach simulated workers, which answer only questions they recognise. Both
    let a random-init router act; leave them off for real models."""

    answer_choices: bool = False
    question_query: bool = False


class RouterR1Env:
    """One Router-R1 episode. `tokenizer`: HF tokenizer (chat template, encode, decode).
    `constraints`: grammar-constrained turns (None: free generation, as upstream).

    A failed worker call (an API error after the pool's retries) is what the policy sees, as
    for an unresolvable name: the observation reads ``None`` and the row is scored like any
    other (a failed call costs 0; docs/router_r1.md, "A failed call is an observation"), so it
    is not infra."""

    failed_call_is_infra = False
    fatal_errors: tuple[type[BaseException], ...] = ()

    def __init__(self, tokenizer: Any, model_workers: Mapping[str, str],
                 config: r1.RouterR1Config, sampling: SamplingParams,
                 constraints: Constraints | None = None, question: str = ""):
        self.tok = tokenizer
        self.model_workers = model_workers
        self.config = config
        self.sampling = sampling
        self.constraints = constraints
        self.state = r1.EpisodeState()
        self.eos_ids = tuple(sampling.stop_token_ids) or tuple(
            i for i in (tokenizer.eos_token_id,) if i is not None)
        self.queries: tuple[str, ...] = ()
        if constraints is not None and constraints.question_query:
            self.queries = valid_queries([question], model_workers,
                                         max_bytes=sampling.max_new_tokens)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def start(self, traj: Trajectory) -> Sequence[int]:
        return ()

    def next_turn(self, traj: Trajectory) -> Turn | None:
        if traj.done:
            return None
        if len(traj.response_ids) >= self.config.trajectory_max_tokens:
            traj.finish = "length_limit"
            return None
        if self.constraints is None:
            return Turn(self.sampling)
        answers: list[str] = []
        if self.constraints.answer_choices:  # ASCII-length bound: the action still fits
            answers = [a for a in answer_candidates(traj.calls, ANSWER_MAX_CHARS)
                       if len(a.encode()) <= ANSWER_MAX_CHARS]
        grammar = router_r1_grammar(self.state, self.config, list(self.model_workers),
                                    queries=self.queries, answers=answers)
        return Turn(self.sampling, grammar)

    def context(self, traj: Trajectory) -> list[int]:
        return traj.context_ids[-self.config.context_max_tokens:]

    def step(self, traj: Trajectory, completion: Completion) -> Step:
        keep = r1.cut_turn_ids(completion.token_ids, self._decode,
                               drop_trailing_ids=self.eos_ids)
        action = r1.parse_action(self._decode(completion.token_ids[:keep]))
        decision = r1.decide_turn(self.state, action, self.config)
        if isinstance(decision, r1.EndEpisode):
            traj.finish = decision.reason
            if isinstance(action, r1.AnswerAction):
                traj.answer = action.answer
                traj.final_turn = self._decode(completion.token_ids[:keep])
            return Step(keep)
        self.state = r1.advance(self.state, decision)
        if isinstance(decision, r1.AppendObservation):
            traj.notices.append(decision.reason)
            return Step(keep, self._cap(traj, decision.text))
        traj.routes.append((decision.model.name, decision.query.strip()))
        worker = self.model_workers.get(decision.model.name)
        if worker is None:  # a real model the pool does not serve: Router-R1 shows "None"
            traj.notices.append("model_not_served")
            return Step(keep, self._cap(traj, r1.render_observation(None)))
        return Step(keep, calls=[CallRequest(worker, decision.prompt,
                                             max_tokens=self.config.worker_max_tokens)])

    async def inspect(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> None:
        return None

    def observe(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> Sequence[int]:
        return self._cap(traj, r1.observation_for_call(calls[0]))

    def _cap(self, traj: Trajectory, text: str) -> list[int]:
        """`text` cut to the observation cap; a non-empty one counts as an observation block
        (`obs_blocks`, `obs_truncated`)."""
        capped = r1.cap_observation(text, self._encode, self._decode, self.config.obs_max_tokens)
        if text:
            traj.obs_blocks += 1
            traj.obs_truncated += capped.truncated
        return capped.ids


def router_r1_envs(tokenizer: Any, model_workers: Mapping[str, str], *,
                   config: r1.RouterR1Config | None = None, validation: bool = False,
                   sampling: SamplingParams | None = None,
                   constraints: Constraints | None = None) -> EnvFactory:
    """An `EnvFactory` for `run_episodes`: Router-R1 prompt ids and a fresh env per episode.

    `sampling` overrides the original's rollout sampling (e.g. to set a seed); its
    `max_new_tokens` is the per-turn cap. `constraints`: grammar-constrained turns; the cap
    must then hold the longest free action (ValueError otherwise).
    """
    config = config or r1.RouterR1Config()
    unknown = sorted(set(model_workers) - {m.name for m in r1.ALL_MODELS})
    if unknown:
        raise ValueError(f"model_workers names unknown Router-R1 models {unknown}")
    params = sampling or r1.rollout_sampling_params(config, validation=validation)
    if params.stop_token_ids == () and tokenizer.eos_token_id is not None:
        params = dataclasses.replace(params, stop_token_ids=(tokenizer.eos_token_id,))
    if constraints is not None:
        if not model_workers:
            raise ValueError("constrained Router-R1 turns need at least one served model")
        need = max_action_bytes(list(model_workers))
        if params.max_new_tokens < need:
            raise ValueError(f"per-turn max_new_tokens={params.max_new_tokens} cannot hold the "
                             f"longest constrained Router-R1 action ({need} tokens)")

    def make(record: Record, repeat: int) -> tuple[list[int], RouterR1Env]:
        prompt = r1.render_prompt_ids(record.question, tokenizer, config)
        return prompt, RouterR1Env(tokenizer, model_workers, config, params, constraints,
                                   record.question)

    return make


# ---------------------------------------------------------------------------- grammars
def think_text(thought: str) -> str:
    """``<think> thought </think>`` and a newline, as constrained turns open."""
    return f"{r1.THINK_OPEN} {thought} {r1.THINK_CLOSE}\n"


def search_text(model: str, query: str) -> str:
    """``<search> model: query </search>`` (the query reaches the worker with its spaces)."""
    return f"{r1.SEARCH_OPEN} {model}: {query} {r1.SEARCH_CLOSE}"


def answer_text(answer: str) -> str:
    """``<answer> answer </answer>`` (the reward strips the content)."""
    return f"{r1.ANSWER_OPEN} {answer} {r1.ANSWER_CLOSE}"


def valid_queries(candidates: Sequence[str], models: Sequence[str], *,
                  max_bytes: int | None = None) -> tuple[str, ...]:
    """The `candidates` (stripped) that make a search the format check accepts with every one
    of `models` (Router-R1's format check: one colon, no placeholder, model name not in the
    query, resolvable; no tag strings: nesting) and, with `max_bytes`, whose longest action
    fits in that many bytes (so in that many tokens)."""
    out: list[str] = []
    for query in (c.strip() for c in candidates):
        if not query or query in out or any(t in query for t in r1.TAG_STRINGS):
            continue
        if any(any(r1.search_flags(f"{m}: {query}")) for m in models):
            continue
        if max_bytes is not None and max_action_bytes(models, [query]) > max_bytes:
            continue
        out.append(query)
    return tuple(out)


def max_action_bytes(models: Sequence[str], queries: Sequence[str] = (),
                     answers: Sequence[str] = ()) -> int:
    """UTF-8 length of the longest action `router_r1_grammar` admits: an upper bound on its
    tokens (every byte-level BPE token spans at least one byte)."""
    def longest(options: Sequence[str], free: int) -> int:
        return max([free, *(len(o.encode()) for o in options)])

    think = len(think_text("x" * THINK_MAX_CHARS).encode())
    model = max(len(m.encode()) for m in models)
    search = len(search_text("", "").encode()) + model + longest(queries, QUERY_MAX_CHARS)
    answer = len(answer_text("").encode()) + longest(answers, ANSWER_MAX_CHARS)
    return think + max(search, answer)


def router_r1_grammar(state: r1.EpisodeState, config: r1.RouterR1Config,
                      models: Sequence[str], *, queries: Sequence[str] = (),
                      answers: Sequence[str] = ()) -> Grammar:
    """A grammar admitting only Router-R1 actions its format check accepts.

    Routed turns: ``<think> T </think>\\n`` then ``<search> MODEL: QUERY </search>`` with
    MODEL one of `models` (served, exact names), or ``<answer> A </answer>``. The final turn
    (`is_final_turn`: never routed) admits only the answer: a `Grammar.choice` over the
    candidate `answers` when there are any (matched over canonical tokenizations), free text
    otherwise; the response already opens with a think, which is all the format asks.
    QUERY: one of `queries` if given (see `valid_queries`), else free text; A: one of
    `answers` if given, else free text (see the character classes above). Every turn ends
    with its closing tag, where Router-R1 cuts it.
    """
    answer = _ANSWER if not answers else "(" + " | ".join(ebnf_literal(a) for a in answers) + ")"
    answer_rule = f'"{r1.ANSWER_OPEN} " {answer} " {r1.ANSWER_CLOSE}"'
    if r1.is_final_turn(state, config):
        if answers:
            return Grammar.choice([answer_text(a) for a in answers])
        return Grammar(f"root ::= {answer_rule}")
    names = " | ".join(ebnf_literal(m) for m in models)
    query = _QUERY if not queries else "(" + " | ".join(ebnf_literal(q) for q in queries) + ")"
    rules = [
        f'root ::= "{r1.THINK_OPEN} " {_THINK} " {r1.THINK_CLOSE}\\n" (search | answer)',
        f'search ::= "{r1.SEARCH_OPEN} " ({names}) ": " {query} " {r1.SEARCH_CLOSE}"',
        f"answer ::= {answer_rule}",
    ]
    return Grammar("\n".join(rules))


# ------------------------------------------------------------------ simulated replies
class TagFreeReplies(PoolView):
    """A `WorkerPool` view of `pool` whose replies have Router-R1's tag strings removed.

    The simulated workers reply in RouteWeaver's worker format (``<answer>X</answer>``);
    Router-R1's worker prompt asks for plain text, and a reply holding a tag string fails the
    format check as nesting (one of the edge cases of Router-R1's original code), which would
    make every routed episode −1. A simulated Router-R1 run therefore uses this view; real
    endpoints are used as they reply (compat). Usage (and so cost) is the original reply's.
    """

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        call = await self.pool.call(worker, prompt, max_tokens=max_tokens)
        text = strip_tags(call.text)
        return call if text == call.text else dataclasses.replace(call, text=text)


def strip_tags(text: str) -> str:
    """`text` without any of Router-R1's eight tag strings."""
    for tag in r1.TAG_STRINGS:
        text = text.replace(tag, "")
    return text
