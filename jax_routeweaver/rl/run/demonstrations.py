"""Demonstrations: protocol-valid episodes that execute each mode the way the simulated pool
was designed to reward, with the mode and every worker drawn at random.

Not part of the paper's method. A pretrained router knows how to run a plan -> solve ->
verify -> summarize pipeline before RL; the tiny CPU router does not, and at its own
execution the three modes differ by almost nothing (its agentic episodes are mostly one lone
summarizer call). The stand-in (`rl.run.stand_in`) clones these episodes, so that each mode is
executed competently while the prior says nothing about *which* mode or worker to choose:

* ``single``: one call, then its answer;
* ``multi``: ``MULTI_CALLS`` calls to distinct workers, then the answer most of their replies
  give (ties: the first seen), the router acting as the summarizer of its calls;
* ``agentic``: planner -> executor (refs the plan) -> verifier (refs the candidate) ->
  summarizer (refs the candidate and the verdict), one route per layer, then the
  summarizer's answer.

Each episode runs through the run's own environment (`routing.episodes.routeweaver_env`, grammar
constraints with a fixed ``rollout.task_text``, so every action is a finite choice) and its
worker pool, by the ordinary episode runner (`routing.episodes.episode.run_episodes`). `ScriptedEnv`
wraps each episode's env and hands the sampler, with the grammar of each turn, the option
the script picked; `ScriptedSampler` emits that option's canonical tokens with the
per-token counts of options the grammar admitted, as a constrained sampler would, so the
trajectory's policy mask marks exactly the tokens a router decides (the mode word, worker
ids, roles, refs, the answer). Half of the episodes declare their mode in a selector turn
(free rows), half are forced (the curriculum's injected declaration), so both contexts are
covered. The draws come from a seeded generator per episode.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing.episodes.episode import (
    EnvFactory,
    Step,
    Trajectory,
    Turn,
    run_episodes,
)
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.routing.protocol.calls import WorkerPool
from jax_routeweaver.sampling.base import Completion, SamplingParams
from jax_routeweaver.sampling.constraints import ChoiceMatcher, Grammar

MULTI_CALLS = 3  # calls of a demonstrated multi episode (majority of three)
# (role, refs) of the demonstrated agentic layers, by the number of completed nodes.
AGENTIC_LAYERS = (("planner", ""), ("executor", "n1"), ("verifier", "n2"),
                  ("summarizer", "n2,n3"))
_ROUTE = re.compile(r'<route model="([^"]+)"(?: role="([^"]+)" refs="([^"]*)")?>')


@dataclasses.dataclass(frozen=True)
class Pick:
    """A turn's grammar and the option the script chose from its choices."""

    grammar: Grammar
    option: str


@dataclasses.dataclass
class Script:
    """One demonstrated episode: its mode, whether it declares it itself, and the workers of
    its calls in order (drawn when the episode is planned)."""

    mode: str
    free: bool
    workers: list[str]

    def choose(self, options: Sequence[str], traj: Trajectory) -> str:
        """The option of this turn (ValueError when the grammar does not offer it)."""
        if all(o.startswith(g.MODE_OPEN) for o in options):  # the selector turn
            want = g.declaration_text(self.mode)
        else:
            want = self._action(options, traj)
        if want not in options:
            raise ValueError(f"demonstration: {want!r} is not among the turn's options "
                             f"{list(options)[:6]}...")
        return want

    def _action(self, options: Sequence[str], traj: Trajectory) -> str:
        calls = len(traj.calls)
        routes = len(self.workers)
        if calls < routes:
            want = (self.workers[calls], *AGENTIC_LAYERS[calls]) \
                if self.mode == g.Mode.AGENTIC else (self.workers[calls], None, None)
            for option in options:
                match = _ROUTE.match(option)
                if match is not None and match.groups() == want:
                    return option
            raise ValueError(f"demonstration: no route {want} among the turn's options")
        answers = [o for o in options if o.startswith(g.ANSWER_OPEN)]
        return g.answer_text(self.answer(traj, [a[len(g.ANSWER_OPEN):-len(g.ANSWER_CLOSE)]
                                                for a in answers]))

    def answer(self, traj: Trajectory, offered: Sequence[str]) -> str:
        """The demonstrated answer among the offered ones: the summarizer's (agentic), else
        the most frequent candidate of the replies (first seen on ties), else the first."""
        if self.mode == g.Mode.AGENTIC and traj.summarizer_answer in offered:
            return str(traj.summarizer_answer)
        counts = Counter(a for c in traj.calls if c.success
                         for a in [extract_answer(c.text)] if a in offered)
        if counts:
            top = max(counts.values())
            return next(a for a in offered if counts.get(a) == top)
        return offered[0]


def plan(rng: np.random.Generator, workers: Sequence[str], *, forced_share: float = 0.5
         ) -> Script:
    """A random `Script`: the mode uniform, forced with probability ``forced_share``, the
    workers uniform (distinct for multi)."""
    mode = g.MODES[int(rng.integers(len(g.MODES)))]
    free = bool(rng.random() >= forced_share)
    if mode == g.Mode.SINGLE:
        chosen = [workers[int(rng.integers(len(workers)))]]
    elif mode == g.Mode.MULTI:
        chosen = [workers[i] for i in rng.choice(len(workers), MULTI_CALLS, replace=False)]
    else:
        chosen = [workers[int(i)] for i in rng.integers(len(workers), size=len(AGENTIC_LAYERS))]
    return Script(str(mode), free, chosen)


class ScriptedEnv:
    """An episode env whose turns carry the script's pick (`Pick`); everything else is the
    wrapped env's."""

    def __init__(self, env: Any, script: Script):
        self.env, self.script = env, script
        self.failed_call_is_infra = getattr(env, "failed_call_is_infra", True)
        self.fatal_errors = getattr(env, "fatal_errors", ())

    def start(self, traj: Trajectory) -> Sequence[int]:
        return self.env.start(traj)

    def next_turn(self, traj: Trajectory) -> Turn | None:
        turn = self.env.next_turn(traj)
        if turn is None:
            return None
        choices = getattr(turn.grammar, "choices", ())
        if not choices:
            raise ValueError("demonstrations need finite actions (rollout.constrained with "
                             "rollout.task_text and rollout.answer_choices)")
        return Turn(turn.params, Pick(turn.grammar, self.script.choose(choices, traj)))

    def context(self, traj: Trajectory) -> list[int]:
        return self.env.context(traj)

    def step(self, traj: Trajectory, completion: Completion) -> Step:
        return self.env.step(traj, completion)

    async def inspect(self, traj: Trajectory, calls: Sequence[Any]) -> None:
        await self.env.inspect(traj, calls)

    def observe(self, traj: Trajectory, calls: Sequence[Any]) -> Sequence[int]:
        return self.env.observe(traj, calls)


class ScriptedSampler:
    """A `Sampler` that writes each turn's `Pick`: the option's canonical tokens (the stop
    token after them when the grammar ends with one), each with how many tokens the grammar
    admitted there (`Completion.allowed`), log-probability 0."""

    policy_version = 0

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._encoded: dict[str, list[int]] = {}

    def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return self._encoded[text]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 grammars: Sequence[Any] | None = None) -> list[Completion]:
        if grammars is None or any(not isinstance(p, Pick) for p in grammars):
            raise ValueError("ScriptedSampler needs a Pick per prompt (ScriptedEnv's turns)")
        return [self._complete(pick, params) for pick in grammars]

    def _complete(self, pick: Pick, params: SamplingParams) -> Completion:
        stops = list(params.stop_token_ids) if pick.grammar.end_with_stop_token else []
        matcher = ChoiceMatcher([self._encode(c) for c in pick.grammar.choices], stops)
        ids = self._encode(pick.option) + stops[:1]
        allowed = []
        for t in ids:
            allowed.append(len(matcher.allowed()))
            if not matcher.accept_token(t):
                raise ValueError(f"ScriptedSampler: {pick.option!r} is not a path of its "
                                 "grammar")
        return Completion(ids, [0.0] * len(ids), "grammar" if not stops else "stop_token",
                          stop=stops[0] if stops else None, allowed=allowed)

    def update_weights(self, weights: Any, version: int) -> None:
        raise NotImplementedError("ScriptedSampler has no weights")


def demonstrations(records: Sequence[Record], make_env: EnvFactory, pool: WorkerPool,
                   tokenizer: Any, workers: Sequence[str], *, seed: int,
                   forced_share: float = 0.5) -> list[Trajectory]:
    """One demonstrated episode per record (a random `plan` over the offered ``workers``,
    seeded by ``seed`` and the record's position), run by `run_episodes` through
    ``make_env``'s envs and ``pool``. Sample ids must be distinct (ValueError)."""
    if len({r.sample_id for r in records}) != len(records):
        raise ValueError("demonstrations: the records' sample ids are not distinct")
    scripts: dict[str, Script] = {}
    for i, record in enumerate(records):
        scripts[record.sample_id] = plan(np.random.default_rng([seed, i]), workers,
                                         forced_share=forced_share)
    planned = [r if scripts[r.sample_id].free else
               r.replace(forced_mode=scripts[r.sample_id].mode) for r in records]

    def make(record: Record, repeat: int) -> tuple[list[int], ScriptedEnv]:
        prompt, env = make_env(record, repeat)
        return prompt, ScriptedEnv(env, scripts[record.sample_id])

    return run_episodes(planned, ScriptedSampler(tokenizer), pool, make)
