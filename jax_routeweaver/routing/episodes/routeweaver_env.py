"""RouteWeaver as an `episode.Env`: the protocol of `grammar.py`, `turns.py`, `observations.py`
and `prompts.py`, turn by turn.

Per episode: selector turn (or the forced declaration), the mode's rulebook as a user turn, then
action turns until an answer, a violation (terminal unless recovery is on), the turn limit, the
response window or an exhausted observation budget. Agentic turns are preceded by the
routing-state header. With `constrained=True` every router turn carries a `Grammar` that only
admits valid actions (`action_grammar`), so even a random-init router acts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing.episodes.episode import CallRequest, EnvFactory, Step, Trajectory, Turn
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol import observations as ob
from jax_routeweaver.routing.protocol import prompts
from jax_routeweaver.routing.protocol import turns as tr
from jax_routeweaver.routing.protocol import violations as vi
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.routing.protocol.calls import WorkerCall, WorkerPool
from jax_routeweaver.sampling.base import Completion, SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, ebnf_literal

# The original's router decoding in training: T 0.8, top-p 0.95, top-k off (evaluation is
# greedy: `rl.run.router_checkpoint.greedy_config`; docs/paper_configs.md,
# "configs/paper/base.yaml").
TRAIN_SAMPLING = SamplingParams(temperature=0.8, top_p=0.95, top_k=-1, max_new_tokens=512)

# The answer when `answer_choices` is on and no worker reply yields a candidate.
NO_CANDIDATE_ANSWER = "none"

# `Trajectory.finish` of an episode whose worker payload failed the hygiene check
# (docs/protocol.md, "What a worker receives"); one of `rewards.reward.WRAPPER_MARKERS`, so the
# row is infra.
WRAPPER_ERROR = "wrapper_error"
# Execution-feedback verdict texts of CODE rows (`rewards.feedback.code_verdict`; docs/protocol.md,
# "What a worker receives"): graded against hidden tests, and all of them passed.
CODE_VERDICT_PREFIX = "[execution] "
CODE_VERDICT_ALL_PASSED = " hidden tests PASSED."

# Task and answer text: no tags or newlines, and a non-space first character (an empty task or
# answer would be a violation); bounded so a whole action fits a turn's token cap.
_TASK = r'[^<>\n ] [^<>\n]{0,47}'
_ANSWER = r'"<answer>" [^<>\n ] [^<>\n]{0,31} "</answer>"'


@dataclasses.dataclass(frozen=True)
class ExecutionFeedback:
    """The in-loop execution verdict, a port that the run and the server bind to the code
    sandbox (`rewards.feedback.execution_feedback`). `verdict(reply, role=, scorer_dataset=,
    meta=)`, awaited on every successful executor reply: the text to prepend to its
    observation and node output, or None (nothing to run). An exception of a `fatal` type
    ends the run (a host that cannot isolate programs); any other makes the row infra
    (`exec_sandbox_error`)."""

    verdict: Callable[..., Awaitable[str | None]]
    fatal: tuple[type[BaseException], ...] = ()


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Runner-side settings. `sampling`: router decoding (stops and max tokens are set per turn;
    its `max_new_tokens` caps an action turn). `constrained`: grammar-constrained actions.
    `feedback`: agentic executors' code (CODE rows) or python (MATH rows) runs through this
    port and the verdict is prepended to their observation (docs/protocol.md, "What a
    worker receives"; the run binds it when `rollout.execution_feedback` is on, as in the
    original; None: off). `answer_choices` (with `constrained`): the
    answer must be one of the candidate answers extracted from the workers' successful replies
    so far (`NO_CANDIDATE_ANSWER` when none fits, e.g. programs: CODE is graded on the
    workers' programs too), so a tiny router learns *which* reply to trust instead of how to
    spell it.
    `task_text` (with `constrained`): every route's task is this fixed text instead of free
    text, for workers that ignore the wording (the simulated pool answers the original
    question each payload carries), where free text is only noise in the gradient.
    `rulebook`: "reference" (`prompts.mode_rulebook`) or "compact" (`prompts.compact_rulebook`,
    for tiny routers that cannot read the original one). `offered`: the worker ids this run
    offers (catalog, grammar); empty: every worker of the pool. The pool's other workers stay
    registered: a single/multi route to one of them is `worker_not_offered`, to an id the
    pool does not know `unknown_model` (docs/protocol.md, "Single/multi action turn", checks
    5-6)."""

    # The protocol's numbers and options (turn, route and token limits; `grammar.ProtocolConfig`).
    protocol: g.ProtocolConfig = dataclasses.field(default_factory=g.ProtocolConfig)
    # Router decoding; stops and max tokens are set per turn, `max_new_tokens` caps an action
    # turn (tokens, >= 1).
    sampling: SamplingParams = TRAIN_SAMPLING
    # Constrain action turns with the grammar.
    constrained: bool = False
    # With `constrained`: the answer must be one of the workers' candidate answers so far.
    answer_choices: bool = False
    # With `constrained`: the fixed task text of every route; "" = free text.
    task_text: str = ""
    # Mode rulebook shown to the router: "reference" or "compact".
    rulebook: Literal["reference", "compact"] = "reference"
    # Run agentic executors' code / python through this port and prepend the verdict to
    # their observation; None = no execution feedback.
    feedback: ExecutionFeedback | None = None
    # Worker ids this run offers (catalog, grammar); () = every worker of the pool.
    offered: tuple[str, ...] = ()


class RouteWeaverEnv:
    """One RouteWeaver episode over `workers` (catalog order) for `record`.

    A worker call that finally failed makes the row infra (docs/algorithm.md, "Clean rows"); a
    worker payload whose wrapper text fails `prompts.check_payload` ends the episode as
    ``wrapper_error`` (infra, no call made; docs/protocol.md, "What a worker receives"); a host
    without the sandbox's isolation ends the run."""

    failed_call_is_infra = True
    fatal_errors: tuple[type[BaseException], ...] = ()  # this env's: its feedback's `fatal`

    def __init__(self, tokenizer: Any, workers: Sequence[tuple[str, str]], record: Record,
                 config: EnvConfig, forced_mode: str | None = None,
                 rulebooks: dict[g.Mode, list[int]] | None = None,
                 registry: Sequence[str] | None = None):
        self.tok = tokenizer
        self.workers = list(workers)
        self.offered = [w for w, _ in self.workers]
        # Every worker id the pool knows (offered or not); default: the offered ones.
        self.registry = list(registry) if registry is not None else self.offered
        self.record = record
        self.cfg = config
        if config.feedback is not None:
            self.fatal_errors = config.feedback.fatal
        self.pc = config.protocol
        self.state = tr.RoutingState()
        self.forced_mode = forced_mode
        self.eos = tuple(config.sampling.stop_token_ids) or (tokenizer.eos_token_id,)
        self._pending: tuple[tr.PlannedCall, ...] = ()
        self._before: tr.RoutingState = self.state
        # Rulebook ids by mode: the same text in every episode of a run, so shared.
        self._rulebooks = rulebooks if rulebooks is not None else {}
        self._verdicts: dict[str, str] = {}  # node id -> execution feedback verdict
        self._harness_errors: list[str] = []

    # ------------------------------------------------------------------ Env protocol
    def start(self, traj: Trajectory) -> list[int]:
        if self.forced_mode is None:
            return []
        self.state = tr.declare_forced_mode(self.state, g.Mode(self.forced_mode))
        ids = self._encode(g.forced_declaration_text(self.state.mode, self.pc))
        traj.forced, traj.mode, traj.mode_span_end = True, str(self.state.mode), len(ids)
        return ids + self._after_mode(traj, len(ids))

    def next_turn(self, traj: Trajectory) -> Turn | None:
        if self._over(traj):
            return None
        room = self.pc.response_length - len(traj.response_ids)
        if self.state.mode is None:
            params = self._params(g.SELECTOR_STOPS, min(self.pc.selector_max_tokens, room))
        else:
            params = self._params(g.stop_strings(self.state.mode),
                                  min(self.cfg.sampling.max_new_tokens, room))
        grammar = None
        if self.cfg.constrained:
            choices = (answer_candidates(traj.calls) or [NO_CANDIDATE_ANSWER]) \
                if self.cfg.answer_choices else None
            grammar = action_grammar(self.state, self.offered, self.pc, choices,
                                     task_text=self.cfg.task_text)
        return Turn(params, grammar)

    def context(self, traj: Trajectory) -> list[int]:
        return traj.context_ids

    def step(self, traj: Trajectory, completion: Completion) -> Step:
        keep = len(completion.token_ids)
        text = self.tok.decode(completion.token_ids, skip_special_tokens=True)
        if self.state.mode is None:
            outcome = tr.handle_selector_turn(text)
            self.state = tr.record_selector_turn(self.state, outcome, self.pc)
            if isinstance(outcome.decision, g.ModeDeclared):
                end = len(traj.response_ids) + keep
                traj.mode, traj.mode_span_end = str(self.state.mode), end
                traj.mode_logprob = float(sum(completion.logprobs[:keep]))
                return Step(keep, self._after_mode(traj, end))
            if not self._over(traj):  # recovery: one retry with the cue
                return Step(keep, self._encode(g.chat_delta(prompts.SELECTOR_RETRY_CUE)))
            return Step(keep)
        outcome = tr.handle_action_turn(text, self.state, self.offered, self.pc, self.registry)
        self._before = self.state
        self.state = tr.record_action_turn(self.state, outcome, self.pc)
        decision = outcome.decision
        if isinstance(decision, tr.AnswerAccepted):
            traj.final_turn = text
        if isinstance(decision, tr.Dispatch):
            return self._dispatch(traj, keep, decision.calls)
        if isinstance(decision, g.Rejected) and not self._over(traj):
            cue = g.inline_env_text(prompts.violation_cue(decision.code))
            return Step(keep, self._encode(cue) + self._header(traj, keep))
        return Step(keep, self._header(traj, keep) if not self._over(traj) else [])

    async def inspect(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> None:
        """Execution feedback (docs/protocol.md, "What a worker receives"): run each successful
        executor reply's program (concurrently, in the sandbox); keep the verdict by node id.
        A harness failure is recorded (`exec_sandbox_error`, an infra class of the reward); a
        host without the sandbox's isolation ends the run."""
        feedback = self.cfg.feedback
        if feedback is None:
            return
        executors = [c for c in calls if c.success and c.role == g.Role.EXECUTOR]
        verdicts = await asyncio.gather(*(feedback.verdict(
            c.text, role=c.role, scorer_dataset=self.record.scorer_dataset,
            meta=self.record.meta) for c in executors), return_exceptions=True)
        for call, verdict in zip(executors, verdicts, strict=True):
            if isinstance(verdict, feedback.fatal):
                raise verdict
            if isinstance(verdict, BaseException):  # any harness failure makes the row infra
                self._harness_errors.append(f"exec_sandbox_error:{type(verdict).__name__}")
                traj.exec_runs += 1
                traj.exec_sandbox_errors += 1
            elif verdict is not None:
                self._verdicts[call.node] = verdict
                traj.exec_runs += 1
                if verdict.startswith(CODE_VERDICT_PREFIX):
                    traj.exec_graded += 1
                    traj.exec_passed_all += verdict.endswith(CODE_VERDICT_ALL_PASSED)

    def observe(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> list[int]:
        nodes = [self._node(p, c) for p, c in zip(self._pending, calls, strict=True)]
        self.state = tr.record_calls(self.state, nodes)
        for node in nodes:
            if node.role == g.Role.SUMMARIZER:
                traj.summarizer_answer = node.candidate_answer
        budget = ob.turn_observation_budget(len(traj.response_ids), self.pc)
        if budget <= 0:
            self.state = tr.record_notice(self.state, vi.Notice.OBS_BUDGET_EXHAUSTED)
            self._sync(traj)
            traj.finish = "obs_budget_exhausted"
            return []
        share = ob.observation_share(budget, len(nodes), self.state.mode, self.pc)
        framed = ob.observation_ids(ob.frame_observation(self.state.mode, nodes), share,
                                    self._encode, self.pc)
        traj.obs_blocks += framed.blocks
        traj.obs_truncated += framed.truncated
        obs = list(framed.ids)
        return obs + self._header(traj, len(obs))

    # ------------------------------------------------------------------ helpers
    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _params(self, stops: tuple[str, ...], max_tokens: int) -> SamplingParams:
        return dataclasses.replace(self.cfg.sampling, stop_strings=stops,
                                   stop_token_ids=self.eos, max_new_tokens=max(1, max_tokens))

    def _after_mode(self, traj: Trajectory, used: int) -> list[int]:
        """The rulebook user turn (if it fits the window), then the first header."""
        mode = self.state.mode
        if mode not in self._rulebooks:
            text = prompts.compact_rulebook(mode, self.workers, self.pc) \
                if self.cfg.rulebook == "compact" else \
                prompts.mode_rulebook(mode, self.workers, self.pc)
            self._rulebooks[mode] = self._encode(g.chat_delta(text))
        rulebook = self._rulebooks[mode]
        if len(traj.response_ids) + used + len(rulebook) >= self.pc.response_length:
            self.state = tr.record_notice(self.state, vi.Notice.RULES_BUDGET_EXHAUSTED)
            return []
        return rulebook + self._header(traj, used + len(rulebook))

    def _header(self, traj: Trajectory, pending: int) -> list[int]:
        """The agentic routing-state header before the next action turn (if it fits)."""
        if self.state.mode != g.Mode.AGENTIC or not self.pc.routing_state \
                or tr.episode_over(self.state, self.pc):
            return []
        ids = self._encode(g.chat_delta(prompts.routing_state_header(self.state, self.pc)))
        if len(traj.response_ids) + pending + len(ids) >= self.pc.response_length:
            return []
        return ids

    def _dispatch(self, traj: Trajectory, keep: int, calls: Sequence[tr.PlannedCall]) -> Step:
        """The calls of an accepted turn, or (a payload failing its hygiene check;
        docs/protocol.md, "What a worker receives") the end of the episode as a
        ``wrapper_error`` without any call."""
        try:
            requests = [self._request(c) for c in calls]
        except prompts.PayloadHygieneError as e:
            traj.finish, traj.error = WRAPPER_ERROR, f"{type(e).__name__}: {e}"
            traj.infra_failed = True
            self._sync(traj)
            return Step(keep)
        self._pending = tuple(calls)
        if traj.first_call_violations is None:
            traj.first_call_violations = len(self.state.violations)
        traj.routes.extend((c.worker, c.task) for c in calls)
        traj.max_layer_width = max(traj.max_layer_width, len(calls))
        return Step(keep, calls=requests)

    def _request(self, call: tr.PlannedCall) -> CallRequest:
        payload = prompts.checked_worker_payload(call, self.record.question, self._before,
                                                 self.pc)
        return CallRequest(call.worker, payload, self.pc.worker_max_tokens,
                           None if call.role is None else str(call.role), call.node_id)

    def _node(self, planned: tr.PlannedCall, call: WorkerCall) -> tr.Node:
        text = call.text if call.success else ""
        verdict = self._verdicts.get(planned.node_id)
        output = text if verdict is None else f"{verdict}\n{text}"
        return tr.Node.from_call(planned, output, success=call.success,
                                 candidate_answer=extract_answer(text), execution_verdict=verdict)

    def _sync(self, traj: Trajectory) -> None:
        traj.violation = None if self.state.policy_invalid is None \
            else str(self.state.policy_invalid)
        traj.answer = self.state.answer
        traj.notices = [str(n) for n in self.state.notices] + self._harness_errors
        traj.violations = [str(v) for v in self.state.violations]
        traj.selector_retries = max(0, self.state.selector_attempts - 1)

    def _over(self, traj: Trajectory) -> bool:
        """Sync the record fields; set `finish` when the episode has ended."""
        self._sync(traj)
        if traj.finish is not None:
            return True
        if tr.episode_over(self.state, self.pc):
            traj.finish = ("answer" if self.state.answer is not None else "violation"
                           if self.state.policy_invalid is not None else "turn_limit")
        elif len(traj.response_ids) >= self.pc.response_length:
            traj.finish = "length_limit"
        return traj.finish is not None


def routeweaver_envs(tokenizer: Any, workers: WorkerPool,
                     config: EnvConfig | None = None) -> EnvFactory:
    """An `EnvFactory` for `run_episodes`: selector prompt ids and a fresh env per episode.

    A record's `forced_mode` (set by the curriculum) puts its episodes on the forced arm.
    """
    config = config or EnvConfig()
    registry = workers.worker_ids()
    unknown = [w for w in config.offered if w not in registry]
    if unknown:
        raise ValueError(f"workers.offered: {unknown} not in the worker pool ({registry})")
    catalog = [entry for entry in prompts.catalog_entries(workers)
               if not config.offered or entry[0] in config.offered]
    rulebooks: dict[g.Mode, list[int]] = {}

    def make(record: Record, repeat: int) -> tuple[list[int], RouteWeaverEnv]:
        prompt = prompts.selector_prompt_ids(tokenizer, record.question)
        return prompt, RouteWeaverEnv(tokenizer, catalog, record, config, record.forced_mode,
                                      rulebooks, registry)

    return make


# ---------------------------------------------------------------------------- grammars
def answer_candidates(calls: Sequence[WorkerCall], max_chars: int = 32) -> list[str]:
    """Distinct answers extracted from successful worker replies (first-seen order) that
    the free answer pattern would also admit: one line, no tags, non-blank first character,
    at most `max_chars` characters."""
    out: list[str] = []
    for call in calls:
        answer = extract_answer(call.text) if call.success else None
        if (answer and len(answer) <= max_chars and not answer[0].isspace()
                and not any(c in answer for c in "<>\n") and answer not in out):
            out.append(answer)
    return out


def action_grammar(state: tr.RoutingState, offered: Sequence[str],
                   config: g.ProtocolConfig, answers: Sequence[str] | None = None, *,
                   task_text: str = "") -> Grammar:
    """A grammar admitting only actions the protocol accepts in `state`. `answers`: if
    non-empty, the answer must be one of them. `task_text`: if set, every route's task is
    exactly this text (else free text).

    Selector: one of the three declarations. Finite choices (the selector; an answer that
    must be one of `answers` when nothing else is allowed) are `Grammar.choice`s, matched
    over canonical tokenizations. single/multi: a route to an offered worker while
    calls remain, an answer once enough calls were made. agentic: one route per layer (so no
    duplicate or crowded layer), refs only to completed nodes, a verifier always and a
    summarizer (after the first node) with refs, the last slot for the summarizer, then only
    the answer; the layer message ends with the stop token. With `task_text` every action is
    one of finitely many strings (unless a free-text answer is due), so the whole action is a
    `Grammar.choice`: a decision per branching token, the rest forced (`_finite_actions`).
    """
    if state.mode is None:
        return Grammar.choice([g.declaration_text(m) for m in g.MODES])
    if task_text:
        finite = _finite_actions(state, offered, config, answers or (), task_text)
        if finite is not None:
            return finite
    task = ebnf_literal(task_text) if task_text else _TASK
    workers = " | ".join(f'"{w}"' for w in offered)
    answer = _ANSWER if not answers else \
        '"<answer>" (' + " | ".join(ebnf_literal(a) for a in answers) + ') "</answer>"'
    answer_only = Grammar.choice([g.answer_text(a) for a in answers]) if answers else \
        Grammar(f"root ::= {answer}")
    if state.mode != g.Mode.AGENTIC:
        required, limit = config.route_bounds(state.mode)
        route = f'"<route model=\\"" ({workers}) "\\">" {task} "</route>"'
        if state.calls_used >= limit:
            return answer_only
        options = [route] + ([answer] if state.calls_used >= required else [])
        return Grammar("root ::= " + " | ".join(options))
    if state.summarizer_done:
        return answer_only
    nodes = state.completed_ids
    refs_ebnf = {"none": '""', "some": 'ref ("," ref){0,3}', "any": '"" | ref ("," ref){0,3}'}
    members = _agentic_members(state, config)
    rules = [f'root ::= {" | ".join(f"m{i}" for i in range(len(members)))}',
             f"worker ::= {workers}"]
    if nodes:
        rules.append("ref ::= " + " | ".join(f'"{n}"' for n in nodes))
    for i, (roles, refs) in enumerate(members):
        role_ebnf = " | ".join(f'"{r}"' for r in roles)
        rules.append(f'm{i} ::= "<route model=\\"" worker "\\" role=\\"" ({role_ebnf}) '
                     f'"\\" refs=\\"" ({refs_ebnf[refs]}) "\\">" {task} "</route>"')
    return Grammar("\n".join(rules), end_with_stop_token=True)


def _agentic_members(state: tr.RoutingState, config: g.ProtocolConfig
                     ) -> list[tuple[tuple[str, ...], str]]:
    """(roles, refs) of the routes an agentic layer may hold now; refs "none" (empty),
    "some" (one or more completed nodes) or "any" (either). Planner and executor while more
    than the summarizer's reserved slot remains, a verifier (with refs) once a node exists,
    and always a summarizer (with refs once a node exists)."""
    nodes = state.completed_ids
    members: list[tuple[tuple[str, ...], str]] = []
    if state.calls_remaining(config) > 1:
        members.append((("planner", "executor"), "any" if nodes else "none"))
        if nodes:
            members.append((("verifier",), "some"))
    members.append((("summarizer",), "some" if nodes else "none"))
    return members


def _finite_actions(state: tr.RoutingState, offered: Sequence[str], config: g.ProtocolConfig,
                    answers: Sequence[str], task_text: str) -> Grammar | None:
    """The action turn as a `Grammar.choice` over every admissible action string, or None
    when a free-text answer is admissible (no candidate answers). Same language as the text
    grammar of `action_grammar`, except that agentic refs are distinct and in completion order
    (a repeated or reordered ref list only repeats or reorders the same outputs): under a
    text grammar a token-level policy spreads one action over many tokenizations
    (`w`+`orker`, `wor`+`ker`, ...) and learns each separately; canonically it is one choice
    per branching token (worker, role, refs, route vs answer)."""
    answer_allowed = state.mode == g.Mode.AGENTIC and state.summarizer_done
    if state.mode != g.Mode.AGENTIC:
        required, limit = config.route_bounds(state.mode)
        answer_allowed = state.calls_used >= required
        routes = [] if state.calls_used >= limit else \
            [f'<route model="{w}">{task_text}</route>' for w in offered]
    if answer_allowed and not answers:
        return None
    finals = [g.answer_text(a) for a in answers] if answer_allowed else []
    if state.mode != g.Mode.AGENTIC:
        return Grammar.choice(routes + finals)
    if state.summarizer_done:
        return Grammar.choice(finals)
    nodes = state.completed_ids
    some = [",".join(c) for k in range(1, min(4, len(nodes)) + 1)
            for c in itertools.combinations(nodes, k)]
    ref_options = {"none": [""], "some": some, "any": ["", *some]}
    return Grammar.choice([f'<route model="{w}" role="{role}" refs="{refs}">{task_text}</route>'
                           for roles, kind in _agentic_members(state, config)
                           for role in roles for w in offered
                           for refs in ref_options[kind]], end_with_stop_token=True)
