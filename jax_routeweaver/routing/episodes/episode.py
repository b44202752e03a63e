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
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jax_routeweaver.data.records import Record
from jax_routeweaver.routing.pools.pricing import CostSummary, Prices, trajectory_cost
from jax_routeweaver.routing.protocol.calls import WorkerCall, WorkerPool
from jax_routeweaver.sampling.base import Completion, Sampler, SamplingParams

log = logging.getLogger(__name__)

# `Trajectory.token_source` values.
SOURCE_ENV = 0
SOURCE_POLICY = 1
SOURCE_FORCED = 2

LOOP_ERROR = "loop_error"
# Exceptions of an env call that end the run rather than the trajectory: a broken install is
# no per-row failure. An env adds its own with `Env.fatal_errors`.
FATAL_ERRORS: tuple[type[BaseException], ...] = (ImportError,)


@dataclasses.dataclass
class Trajectory:
    """One episode. `response_ids` follow `prompt_ids`; `policy_mask`, `logprobs` align with
    `response_ids`. `mode_span_end`: index in the response just past the mode declaration
    (policy-written, or injected when `forced`). `violation`: the terminal violation code;
    `notices`: non-terminal records. `answer`: the router's; `final_turn`: the text of the turn
    that carried it (code rows grade its fenced program too); `summarizer_answer`: the agentic
    summarizer's candidate. `infra_failed`: a worker call finally failed (the trajectory is
    dropped from the gradient, never scored as wrong); a dialect whose failed calls are
    observed (`Env.failed_call_is_infra` False) leaves it to other failures. `finish`: why the
    episode ended (``loop_error:<ExceptionType>`` when an env call raised, ``wrapper_error``
    when a worker payload failed its hygiene check; both infra). `error`: that exception, as
    ``Type: message``. `cost`: worker cost of the episode (with `prices` given to
    `run_episodes`).

    Diagnostics the envs record for the metrics (`rl/reports/metrics.py`, docs/metrics.md); each
    stays at its default where a dialect has no such thing:
    `token_source`: per response token, `SOURCE_ENV` (appended by the env), `SOURCE_POLICY`
    (sampled, a choice) or `SOURCE_FORCED` (sampled, but the grammar admitted only that token);
    empty for a trajectory built by hand (provenance unknown). `mode_logprob`: summed sampler
    logprob of the selector turn that declared the mode (free rows; None otherwise).
    `selector_retries`: selector attempts after the first. `violations`: every violation code
    recorded, in order (the terminal one included); `first_call_violations`: how many of them
    came before the first worker call was dispatched (None: no call was dispatched).
    `routes`: (worker, task) of every dispatched route (Router-R1: (model name, query)).
    `max_layer_width`: the most calls one turn dispatched. `obs_blocks` / `obs_truncated`:
    observation blocks framed / cut to the observation budget. `exec_runs`: executor replies
    judged in the loop (execution feedback, docs/protocol.md, "What a worker receives": a
    verdict, or a harness failure), `exec_sandbox_errors`: harness failures among them,
    `exec_graded`: verdicts against hidden tests (CODE rows), `exec_passed_all`: those that
    passed every test.
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
    error: str | None = None
    cost: CostSummary | None = None
    token_source: list[int] = dataclasses.field(default_factory=list)
    mode_logprob: float | None = None
    selector_retries: int = 0
    violations: list[str] = dataclasses.field(default_factory=list)
    first_call_violations: int | None = None
    routes: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    max_layer_width: int = 0
    obs_blocks: int = 0
    obs_truncated: int = 0
    exec_runs: int = 0
    exec_sandbox_errors: int = 0
    exec_graded: int = 0
    exec_passed_all: int = 0

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
        self.token_source.extend([SOURCE_POLICY] * len(ids) if allowed is None else
                                 [SOURCE_FORCED if a == 1 else SOURCE_POLICY
                                  for a in allowed[:len(ids)]])

    def add_env(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.policy_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.token_source.extend([SOURCE_ENV] * len(ids))

    def end_with_error(self, error: Exception) -> None:
        """End the episode as a loop error (infra): `finish` ``loop_error:<Type>``."""
        self.finish = f"{LOOP_ERROR}:{type(error).__name__}"
        self.error = f"{type(error).__name__}: {error}"
        self.infra_failed = True


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
    violation, answer, finish, ...) as the episode goes.

    If one of its calls raises (an `Exception` not in `FATAL_ERRORS` or `fatal_errors`), the
    runner ends that trajectory only, as ``loop_error:<Type>`` (infra, what it had is kept;
    docs/protocol.md, "How an episode ends"); the other trajectories go on.
    """

    failed_call_is_infra: bool
    """True: a worker call that finally failed makes the row infra (`Trajectory.infra_failed`:
    out of the group statistics and the gradient, never scored; RouteWeaver, docs/algorithm.md,
    "Clean rows"). False: the policy observes the failure and the row is scored like any other
    (Router-R1, where the observation reads ``None``; docs/router_r1.md, "A failed call is an
    observation"). Read with `getattr`, default True."""

    fatal_errors: tuple[type[BaseException], ...]
    """Exceptions of this env's calls that end the run, on top of `FATAL_ERRORS` (e.g. a host
    without the sandbox's isolation). Read with `getattr`, default none."""

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
    `stats`, if given, is filled in. An env call that raises ends that trajectory only (see
    `Env`); the sampler's and the worker pool's exceptions end the run (a pool reports a
    failed call as a `WorkerCall`, so one that raises has a set-up problem).
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
            ok, ids = _guarded(traj, env, env.start, traj)
            if ok:
                traj.add_env(ids)
            episodes.append((traj, env))
    stats.env_cpu_s += time.process_time() - cpu
    while True:
        cpu = time.process_time()
        turns = _next_turns(episodes)
        stats.env_cpu_s += time.process_time() - cpu
        if not turns:
            break
        stats.rounds += 1
        start = time.perf_counter()
        completions = await _sample(sampler, turns)
        stats.sampler_s += time.perf_counter() - start
        cpu = time.process_time()
        pending = _read_turns(turns, completions)
        stats.env_cpu_s += time.process_time() - cpu
        start = time.perf_counter()
        results = await asyncio.gather(*(_call_and_inspect(workers, t, e, s.calls)
                                         for t, e, s in pending))
        stats.workers_s += time.perf_counter() - start
        cpu = time.process_time()
        _observe(pending, results)
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


def _end_or_raise(traj: Trajectory, env: Env, error: Exception) -> None:
    """End `traj` as a loop error, unless `error` is fatal (then re-raise it)."""
    if isinstance(error, FATAL_ERRORS + tuple(getattr(env, "fatal_errors", ()))):
        raise error
    log.warning("episode %s/%d ended by %s: %s", traj.record.sample_id, traj.repeat,
                type(error).__name__, error, exc_info=error)
    traj.end_with_error(error)


def _guarded(traj: Trajectory, env: Env, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """(True, fn(*args)), or (False, None) after an exception ended `traj` (`_end_or_raise`).
    Only `Exception`s are caught: KeyboardInterrupt, SystemExit and cancellation pass."""
    try:
        return True, fn(*args)
    except Exception as e:
        _end_or_raise(traj, env, e)
        return False, None


def _next_turns(episodes: Sequence[tuple[Trajectory, Env]]
                ) -> list[tuple[Trajectory, Env, Turn, list[int]]]:
    """(trajectory, env, turn, context) of every live trajectory that has a next turn."""
    turns = []
    for traj, env in episodes:
        if traj.done:
            continue
        ok, turn = _guarded(traj, env, env.next_turn, traj)
        if not ok or turn is None:
            continue
        ok, context = _guarded(traj, env, env.context, traj)
        if ok:
            turns.append((traj, env, turn, context))
    return turns


def _read_turns(turns: Sequence[tuple[Trajectory, Env, Turn, list[int]]],
                completions: Sequence[Completion]) -> list[tuple[Trajectory, Env, Step]]:
    """Each env reads its sampled turn; the kept policy tokens and the env's tokens are
    appended. Returns the steps that asked for worker calls."""
    pending: list[tuple[Trajectory, Env, Step]] = []
    for (traj, env, _, _), completion in zip(turns, completions, strict=True):
        traj.turns += 1
        traj.policy_versions.append(completion.policy_version)
        ok, step = _guarded(traj, env, env.step, traj, completion)
        if not ok:
            continue
        keep = step.keep
        traj.add_policy(completion.token_ids[:keep], completion.logprobs[:keep],
                        None if completion.allowed is None else completion.allowed[:keep])
        traj.add_env(step.env_ids)
        if step.calls:
            pending.append((traj, env, step))
    return pending


def _observe(pending: Sequence[tuple[Trajectory, Env, Step]],
             results: Sequence[tuple[list[WorkerCall], bool]]) -> None:
    """Record the calls (a failed one makes the row infra where the dialect says so) and
    append their observations (not after a failed inspection)."""
    for (traj, env, _), (calls, inspected) in zip(pending, results, strict=True):
        traj.calls.extend(calls)
        if getattr(env, "failed_call_is_infra", True):
            traj.infra_failed |= any(not c.success for c in calls)
        if inspected:
            ok, ids = _guarded(traj, env, env.observe, traj, calls)
            if ok:
                traj.add_env(ids)


async def _sample(sampler: Sampler, turns: list[tuple[Trajectory, Env, Turn, list[int]]]
                  ) -> list[Completion]:
    """One `generate` call per distinct SamplingParams; completions in `turns` order. A
    sampler with an ``agenerate`` coroutine (same arguments as `Sampler.generate`, e.g.
    `serving.batcher.BatchingSampler`, which merges the turns of concurrent episode runs) is
    awaited instead, so other episodes run while it samples."""
    agenerate = getattr(sampler, "agenerate", None)
    groups: dict[SamplingParams, list[int]] = {}
    for i, (_, _, turn, _) in enumerate(turns):
        groups.setdefault(turn.params, []).append(i)
    out: list[Completion | None] = [None] * len(turns)
    for params, idx in groups.items():
        prompts = [turns[i][3] for i in idx]
        grammars = [turns[i][2].grammar for i in idx]
        constrained = grammars if any(g is not None for g in grammars) else None
        if agenerate is not None:
            completions = await agenerate(prompts, params, constrained)
        elif constrained is not None:
            completions = sampler.generate(prompts, params, constrained)
        else:
            completions = sampler.generate(prompts, params)
        for i, c in zip(idx, completions, strict=True):
            out[i] = c
    return out  # type: ignore[return-value]


async def _call_and_inspect(workers: WorkerPool, traj: Trajectory, env: Env,
                            requests: Sequence[CallRequest]) -> tuple[list[WorkerCall], bool]:
    """The calls' results, and False if `env.inspect` raised (the trajectory then ended as a
    loop error). A worker pool that raises (rather than returning a failed call) is a set-up
    problem (a replay miss, a missing key): it ends the run."""
    calls = await asyncio.gather(*(workers.call(r.worker, r.prompt, max_tokens=r.max_tokens)
                                   for r in requests))
    calls = [dataclasses.replace(c, role=r.role, node=r.node)
             for c, r in zip(calls, requests, strict=True)]
    try:
        await env.inspect(traj, calls)
    except Exception as e:
        _end_or_raise(traj, env, e)
        return calls, False
    return calls, True
