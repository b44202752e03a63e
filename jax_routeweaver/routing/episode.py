"""The multi-turn episode runner: B×K routing episodes against a `Sampler` and a `WorkerPool`.

Each round, every live trajectory asks its dialect (`Env`) for its next turn; trajectories
whose turns sample alike share one batched `Sampler.generate` call. Then each trajectory's env
reads the turn and says what to append and which workers to call; the worker calls of all
trajectories (and all members of an agentic layer) run concurrently; the env frames the
replies as observation tokens. Until every env says the episode is over.

Trajectories are token-in/token-out: the policy's tokens are kept exactly as sampled, with their
sampler logprobs (`policy_mask` 1); environment text is appended as token ids (mask 0, logprob
0). Dialects: `routeweaver_env.RouteWeaverEnv` and `router_r1_env.RouterR1Env`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing.calls import WorkerCall, WorkerPool
from jax_routeweaver.routing.pricing import CostSummary, Prices, trajectory_cost
from jax_routeweaver.sampling.base import Completion, Sampler, SamplingParams


@dataclasses.dataclass
class Trajectory:
    """One episode. `response_ids` follow `prompt_ids`; `policy_mask`, `logprobs` align with
    `response_ids`. `mode_span_end`: index in the response just past the mode declaration
    (policy-written, or injected when `forced`). `violation`: the terminal violation code;
    `notices`: non-terminal records. `answer`: the router's; `final_turn`: the text of the turn
    that carried it (code rows grade its fenced program too); `summarizer_answer`: the agentic
    summarizer's candidate. `infra_failed`: a worker call finally failed (the trajectory is
    dropped from the gradient, never scored as wrong). `finish`: why the episode ended.
    `cost`: worker cost of the episode (with `prices` given to `run_episodes`).
    """

    record: Record
    repeat: int
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    policy_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mode: str | None = None
    mode_span_end: int | None = None
    forced: bool = False
    calls: list[WorkerCall] = dataclasses.field(default_factory=list)
    violation: str | None = None
    notices: list[str] = dataclasses.field(default_factory=list)
    answer: str | None = None
    final_turn: str | None = None
    summarizer_answer: str | None = None
    turns: int = 0
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    infra_failed: bool = False
    finish: str | None = None
    cost: CostSummary | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_policy(self, ids: Sequence[int], logprobs: Sequence[float],
                   allowed: Sequence[int] | None = None) -> None:
        """Router tokens. `allowed` (per token, how many the grammar admitted): a token the
        grammar forced (1) gets `policy_mask` 0. Under the constraint its probability is 1
        whatever the parameters, so it is no action: training on it would only push up the
        raw logit of a token the policy could not avoid."""
        self.response_ids.extend(ids)
        self.policy_mask.extend([1] * len(ids) if allowed is None
                                else [int(a != 1) for a in allowed[:len(ids)]])
        self.logprobs.extend(float(x) for x in logprobs)

    def add_env(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.policy_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))


@dataclasses.dataclass(frozen=True)
class Turn:
    """How to sample the next router turn: `params` (stops, max tokens) and an optional grammar
    (`sampling.constraints.Grammar`) restricting it to valid actions."""

    params: SamplingParams
    grammar: Any = None


@dataclasses.dataclass(frozen=True)
class CallRequest:
    """A worker call the env wants made. `role` / `node`: recorded on the `WorkerCall`."""

    worker: str
    prompt: str
    max_tokens: int | None = None
    role: str | None = None
    node: str | None = None


@dataclasses.dataclass(frozen=True)
class Step:
    """The env's reading of one policy turn: keep `keep` of the sampled tokens, then append
    `env_ids` (mask 0), then make `calls` (their observations come from `Env.observe`)."""

    keep: int
    env_ids: Sequence[int] = ()
    calls: Sequence[CallRequest] = ()


class Env(Protocol):
    """One dialect's rules for one trajectory. It may set the trajectory's record fields (mode,
    violation, answer, finish, ...) as the episode goes."""

    def start(self, traj: Trajectory) -> Sequence[int]:
        """Env tokens to append before the first policy turn (e.g. a forced mode)."""
        ...

    def next_turn(self, traj: Trajectory) -> Turn | None:
        """The next router turn, or None when the episode is over (sets `traj.finish`)."""
        ...

    def context(self, traj: Trajectory) -> list[int]:
        """The token ids the sampler continues (normally prompt + response)."""
        ...

    def step(self, traj: Trajectory, completion: Completion) -> Step:
        """Read one sampled turn."""
        ...

    async def inspect(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> None:
        """Async work on the replies before they are framed (e.g. running an executor's code
        in the sandbox); runs concurrently with other trajectories' calls and inspections."""
        ...

    def observe(self, traj: Trajectory, calls: Sequence[WorkerCall]) -> Sequence[int]:
        """Env tokens framing the replies of the calls `step` asked for (same order)."""
        ...


EnvFactory = Callable[[Record, int], tuple[list[int], Env]]


@dataclasses.dataclass
class EpisodeStats:
    """Wall-clock split of a `run_episodes` call (for logs and `bench/episodes.py`)."""

    rounds: int = 0
    sampler_s: float = 0.0
    workers_s: float = 0.0
    env_cpu_s: float = 0.0


async def run_episodes_async(records: Sequence[Record], sampler: Sampler, workers: WorkerPool,
                             make_env: EnvFactory, *, repeats: int = 1,
                             prices: Prices | None = None,
                             stats: EpisodeStats | None = None) -> list[Trajectory]:
    """Run `len(records) × repeats` episodes; trajectories in (record, repeat) order.

    `make_env(record, repeat)` -> (prompt ids, env). `prices`: fill each trajectory's `cost`.
    `stats`, if given, is filled in.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    stats = stats if stats is not None else EpisodeStats()
    episodes: list[tuple[Trajectory, Env]] = []
    cpu = time.process_time()
    for record in records:
        for k in range(repeats):
            prompt, env = make_env(record, k)
            traj = Trajectory(record, k, list(prompt))
            traj.add_env(env.start(traj))
            episodes.append((traj, env))
    stats.env_cpu_s += time.process_time() - cpu
    while True:
        turns = [(t, e, turn) for t, e in episodes if not t.done
                 and (turn := e.next_turn(t)) is not None]
        if not turns:
            break
        stats.rounds += 1
        start = time.perf_counter()
        completions = _sample(sampler, turns)
        stats.sampler_s += time.perf_counter() - start
        cpu = time.process_time()
        pending: list[tuple[Trajectory, Env, Step]] = []
        for (traj, env, _), completion in zip(turns, completions, strict=True):
            traj.turns += 1
            traj.policy_versions.append(completion.policy_version)
            step = env.step(traj, completion)
            keep = step.keep
            traj.add_policy(completion.token_ids[:keep], completion.logprobs[:keep],
                            None if completion.allowed is None else completion.allowed[:keep])
            traj.add_env(step.env_ids)
            if step.calls:
                pending.append((traj, env, step))
        stats.env_cpu_s += time.process_time() - cpu
        start = time.perf_counter()
        results = await asyncio.gather(*(_call_and_inspect(workers, t, e, s.calls)
                                         for t, e, s in pending))
        stats.workers_s += time.perf_counter() - start
        cpu = time.process_time()
        for (traj, env, _), calls in zip(pending, results, strict=True):
            traj.calls.extend(calls)
            traj.infra_failed |= any(not c.success for c in calls)
            traj.add_env(env.observe(traj, calls))
        stats.env_cpu_s += time.process_time() - cpu
    trajectories = [t for t, _ in episodes]
    if prices is not None:
        for traj in trajectories:
            traj.cost = trajectory_cost(traj.calls, prices)
    return trajectories


def run_episodes(records: Sequence[Record], sampler: Sampler, workers: WorkerPool,
                 make_env: EnvFactory, *, repeats: int = 1, prices: Prices | None = None,
                 stats: EpisodeStats | None = None) -> list[Trajectory]:
    """Synchronous `run_episodes_async` (starts and closes its own event loop)."""
    return asyncio.run(run_episodes_async(records, sampler, workers, make_env, repeats=repeats,
                                          prices=prices, stats=stats))


def _sample(sampler: Sampler, turns: list[tuple[Trajectory, Env, Turn]]) -> list[Completion]:
    """One `generate` call per distinct SamplingParams; completions in `turns` order."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, (_, _, turn) in enumerate(turns):
        groups.setdefault(turn.params, []).append(i)
    out: list[Completion | None] = [None] * len(turns)
    for params, idx in groups.items():
        prompts = [turns[i][1].context(turns[i][0]) for i in idx]
        grammars = [turns[i][2].grammar for i in idx]
        if any(g is not None for g in grammars):
            completions = sampler.generate(prompts, params, grammars)
        else:
            completions = sampler.generate(prompts, params)
        for i, c in zip(idx, completions, strict=True):
            out[i] = c
    return out  # type: ignore[return-value]


async def _call_and_inspect(workers: WorkerPool, traj: Trajectory, env: Env,
                            requests: Sequence[CallRequest]) -> list[WorkerCall]:
    calls = await asyncio.gather(*(workers.call(r.worker, r.prompt, max_tokens=r.max_tokens)
                                   for r in requests))
    calls = [dataclasses.replace(c, role=r.role, node=r.node)
             for c, r in zip(calls, requests, strict=True)]
    await env.inspect(traj, calls)
    return calls
