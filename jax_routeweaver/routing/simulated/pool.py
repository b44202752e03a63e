"""SIMULATED workers: a seeded stand-in for the six paid LLM workers.

Nothing in this module calls a model or the network. `SimulatedWorkerPool` answers worker
payloads from a table of skills, so tests and the CPU quickstart can run whole episodes
(single, multi, agentic) offline and deterministically, on the questions
`routing/simulated/tasks.py` makes (or any records whose meta carries the same data).
Numbers produced with it say nothing about real LLMs; they only have to make the routing
problem non-trivial.

How a reply is decided
----------------------
The pool knows its tasks. For a call it (1) finds the task whose question text occurs in the
prompt (every payload carries `Original question:` + the raw question, docs/protocol.md, "What
a worker receives"; the longest matching question wins), (2) reads the role from the text
*before* the question (the role brief: words planner / executor / verifier / summarizer,
reconcile, PASS + FAIL; no role word -> a plain single/multi answer), (3) parses referenced
outputs after the question (`[nK] (from ROLE)` headers) and (4) draws the outcome:

* plain / executor: correct with probability `p = skill[worker][domain][difficulty]`, raised
  to p + g(1 - p) when the prompt contains a good plan written by a simulated planner
  (`g = plan_gain[domain][difficulty]`) and by `g = REVISE_GAIN * verifiability[domain]` when
  it contains a FAIL verdict (the rejected answer is then avoided). A wrong reply is a
  plausible wrong answer (a distractor kept in `meta['sim']`, or the buggy program for CODE).
* planner: numbered sub-tasks and a `Plan reference: P-<hex>` line, never an answer; the
  plan is good with probability 0.5 + 0.5 * skill (the tag tells executors which).
* verifier: `PASS`, or `FAIL` + `Location:` (naming the node and the rejected answer) +
  `Reason:` + `Suggestion:`. A wrong candidate is caught with probability
  verifiability[domain] * (0.4 + 0.55 * skill); a correct one is wrongly failed with
  probability 0.15 * (1 - skill). `[execution]` feedback lines are believed.
* summarizer: drops candidates named by a FAIL (or failing `[execution]` feedback), prefers
  ones whose tests passed, else takes the majority (ties: first listed; with probability
  0.1 * (1 - skill) it slips to another candidate); with nothing left it solves the task
  itself like an executor.

The uniform numbers come from a hash of (seed, purpose, worker, prompt or task), never from
global state, so a reply depends only on (seed, worker, prompt): call order, concurrency and
process do not matter. Correctness draws are correlated the way real errors are (a Gaussian
latent-factor model, u = Phi(z) with z = sqrt(shared) z_task + sqrt(persistent)
z_worker,task + sqrt(1 - shared - persistent) z_prompt): `shared` is the correlation between
two workers on a task (an obscure fact is obscure for everyone), `shared + persistent` the
correlation between two prompts to one worker (asking again does not help), the rest is
fresh noise. Wrong answers come from the same three sources in the same proportions, so
fresh noise scatters wrong answers (majority voting helps) and shared ignorance repeats
them (voting does not).

The workers' skill tables and how errors behave in each domain are `profiles.py`;
how a worker reads its prompt (role, referenced outputs, verdicts) is `prompts.py`.

Usage: prompt_tokens = ceil(len(prompt) / 4) and completion_tokens = ceil(len(reply) / 4)
(about 4 characters per token for English text with a BPE vocabulary); cost then follows
from the price table like for a real worker. A reply longer than `max_tokens` (default
4096, the catalog's budget) is cut to `4 * max_tokens` characters. `failure_rate` makes a
hash-chosen share of (worker, prompt) pairs fail with `success=False` (never an exception);
`latency_s` sleeps asynchronously.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import re
import statistics
import time
from collections.abc import Iterable, Mapping

from jax_routeweaver.data.records import Domain, Record
from jax_routeweaver.routing.pools.replay import CallIdentity
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall
from jax_routeweaver.routing.simulated.profiles import (
    DEFAULT_DYNAMICS,
    DEFAULT_PROFILES,
    DomainDynamics,
    WorkerProfile,
    level_index,
)
from jax_routeweaver.routing.simulated.prompts import (
    ANSWER_TAG,
    EXEC_FAIL,
    EXEC_PASS,
    FENCE,
    LOCATION,
    Block,
    Candidate,
    detect_role,
    split_blocks,
    verdict,
)
from jax_routeweaver.routing.simulated.tasks import normalize_ws

__all__ = [
    "CHARS_PER_TOKEN",
    "SimulatedWorkerPool",
    "estimate_tokens",
]

CHARS_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 4096
REVISE_GAIN = 0.3


def estimate_tokens(text: str) -> int:
    """The simulator's token count: ceil(characters / 4), at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) from a hash of `parts` (stateless, process-independent)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


_STD_NORMAL = statistics.NormalDist()


def _normal(*parts: object) -> float:
    """A standard normal number from a hash of `parts`."""
    return _STD_NORMAL.inv_cdf(min(max(_unit(*parts), 1e-12), 1.0 - 1e-12))


def _hex(*parts: object) -> str:
    return hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=4).hexdigest()


def _norm_answer(text: str) -> str:
    return normalize_ws(text).strip().rstrip(".").strip().lower()


def _norm_program(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines() if line.strip())


# ============================================================================ the pool
@dataclasses.dataclass(frozen=True)
class _Task:
    record: Record
    difficulty: str
    distractors: tuple[str, ...]
    solution: str | None
    buggy: str | None
    gold_keys: frozenset[str]

    @property
    def is_code(self) -> bool:
        return self.record.domain is Domain.CODE


def _fallback_distractors(gold: str) -> tuple[str, ...]:
    """Wrong answers for records without `meta['sim']` (real data given to the simulator)."""
    text = gold.strip()
    if re.fullmatch(r"-?\d+", text):
        value = int(text)
        return tuple(str(value + d) for d in (1, -1, 2, 10))
    if re.fullmatch(r"[A-J]", text):
        return tuple(letter for letter in "ABCD" if letter != text)
    return ("unknown", f"not {text}")


class SimulatedWorkerPool:
    """A SIMULATED `WorkerPool`: six seeded workers answering known tasks (see module doc).

    `tasks`: the records the workers can recognise (usually `synthetic_tasks(...)`; real
    records work too, with generic wrong answers and no program for CODE). `seed`: all
    randomness derives from it. `profiles`: worker id -> `WorkerProfile`, in catalog order.
    `latency_s`: asyncio sleep per call. `failure_rate`: share of (worker, prompt) pairs
    that fail (`success=False`, empty text). Replies depend only on (seed, worker, prompt).
    """

    def __init__(self, tasks: Iterable[Record], *, seed: int,
                 profiles: Mapping[str, WorkerProfile] = DEFAULT_PROFILES,
                 latency_s: float = 0.0, failure_rate: float = 0.0,
                 dynamics: Mapping[Domain, DomainDynamics] = DEFAULT_DYNAMICS,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if not profiles:
            raise ValueError("SimulatedWorkerPool: profiles must name at least one worker")
        if latency_s < 0 or not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"SimulatedWorkerPool: need latency_s >= 0 and failure_rate in "
                             f"[0, 1], got {latency_s}, {failure_rate}")
        missing = [d.value for d in Domain if d not in dynamics]
        if missing:
            raise ValueError(f"SimulatedWorkerPool: dynamics missing domains {missing}")
        self.seed = seed
        self.profiles = dict(profiles)
        self.dynamics = dict(dynamics)
        self.latency_s = float(latency_s)
        self.failure_rate = float(failure_rate)
        self.default_max_tokens = int(default_max_tokens)
        self._tasks: dict[str, _Task] = {}  # whitespace-normalised question -> task
        self._by_prefix: dict[str, list[str]] = {}
        for record in tasks:
            if not isinstance(record, Record):
                raise TypeError(f"SimulatedWorkerPool: tasks must be Records, got "
                                f"{type(record).__name__}")
            key = normalize_ws(record.question)
            known = self._tasks.get(key)
            if known is not None:
                if set(known.record.gold) != set(record.gold):
                    raise ValueError(f"SimulatedWorkerPool: records {known.record.sample_id!r} "
                                     f"and {record.sample_id!r} share a question but not the "
                                     f"gold answers")
                continue
            self._tasks[key] = self._make_task(record)
            self._by_prefix.setdefault(key[:_PREFIX], []).append(key)

    # -------------------------------------------------------------- WorkerPool protocol
    def worker_ids(self) -> list[str]:
        return list(self.profiles)

    def description(self, worker: str) -> str:
        return self._profile(worker).description

    async def call(self, worker: str, prompt: str, *, max_tokens: int | None = None
                   ) -> WorkerCall:
        """Answer `prompt` as `worker` (after `latency_s`); never raises for call failures."""
        self._profile(worker)  # an id outside the pool is a caller bug, not a call failure
        start = time.perf_counter()
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        result = self.respond(worker, prompt, max_tokens=max_tokens)
        return dataclasses.replace(result, latency_s=time.perf_counter() - start)

    # -------------------------------------------------------------- public helpers
    def respond(self, worker: str, prompt: str, *, max_tokens: int | None = None) -> WorkerCall:
        """The synchronous core of `call` (no latency): the same reply, instantly."""
        profile = self._profile(worker)
        if not isinstance(prompt, str):
            raise TypeError(f"SimulatedWorkerPool: prompt must be a string, got "
                            f"{type(prompt).__name__}")
        digest = hashlib.blake2b(prompt.encode(), digest_size=16).hexdigest()
        failed = _unit(self.seed, "failure", worker, digest) < self.failure_rate
        if failed:
            return WorkerCall(worker=worker, prompt=prompt, text="", success=False,
                              error="simulated provider failure (failure_rate)")
        text = self._reply(worker, profile, prompt, digest)
        limit = max_tokens if max_tokens is not None else self.default_max_tokens
        completion = estimate_tokens(text)
        if completion > limit:
            text = text[: limit * CHARS_PER_TOKEN]
            completion = limit
        usage = Usage(prompt_tokens=estimate_tokens(prompt), completion_tokens=completion)
        return WorkerCall(worker=worker, prompt=prompt, text=text, success=True, usage=usage)

    def call_identity(self, views: list[str]) -> CallIdentity:
        """What identifies this pool's calls in a replay cache (`routing.pools.replay`): its
        seed, failure rate and a digest of its profiles and dynamics; deterministic, so no
        temperature. `views`: the class names of the wrappers it is seen through."""
        profiles = hashlib.sha256(repr(sorted(self.profiles.items())).encode()).hexdigest()
        dynamics = hashlib.sha256(repr(sorted(self.dynamics.items())).encode()).hexdigest()
        backend = {"kind": "simulated", "seed": self.seed, "failure_rate": self.failure_rate,
                   "profiles_sha256": profiles, "dynamics_sha256": dynamics, "views": views}
        return CallIdentity(backend=backend, sampling={"deterministic": True},
                            default_max_tokens=self.default_max_tokens)

    def find_task(self, prompt: str) -> Record | None:
        """The known task whose question occurs in `prompt` (longest match), or None."""
        found = self._find(prompt)
        return found.record if found else None

    def skill(self, worker: str, record: Record) -> float:
        """P(correct) of a plain call by `worker` on `record` (the profile entry)."""
        return self._profile(worker).p_correct(record.domain, record.difficulty or "medium")

    # -------------------------------------------------------------- internals
    def _profile(self, worker: str) -> WorkerProfile:
        profile = self.profiles.get(worker)
        if profile is None:
            raise ValueError(f"SimulatedWorkerPool: unknown worker {worker!r}; offered: "
                             f"{list(self.profiles)}")
        return profile

    @staticmethod
    def _make_task(record: Record) -> _Task:
        sim = record.meta.get("sim") if isinstance(record.meta.get("sim"), dict) else {}
        gold = record.gold[0] if record.gold else ""
        distractors = tuple(str(d) for d in sim.get("distractors", ())) or \
            _fallback_distractors(gold)
        return _Task(record=record, difficulty=record.difficulty or "medium",
                     distractors=distractors, solution=sim.get("solution"),
                     buggy=sim.get("buggy_solution"),
                     gold_keys=frozenset(_norm_answer(g) for g in record.gold if g.strip()))

    def _find(self, prompt: str) -> _Task | None:
        flat = normalize_ws(prompt)
        # Fast path: the text right after a question marker starts with a known question.
        hits: list[str] = []
        for marker in ("Original question:", "Question:"):
            start = prompt.find(marker)
            while start != -1:
                after = start + len(marker)
                window = normalize_ws(prompt[after: after + 4 * _PREFIX])
                hits += [key for key in self._by_prefix.get(window[:_PREFIX], ()) if key in flat]
                start = prompt.find(marker, start + 1)
        if not hits:  # slow path: any known question anywhere in the prompt
            hits = [key for key in self._tasks if key in flat]
        return self._tasks[max(hits, key=len)] if hits else None

    def _question_span(self, prompt: str, task: _Task) -> tuple[int, int]:
        question = task.record.question.strip()
        start = prompt.find(question)
        if start != -1:
            return start, start + len(question)
        pattern = r"\s+".join(re.escape(token) for token in question.split())
        match = re.search(pattern, prompt)
        return (match.start(), match.end()) if match else (0, 0)

    # -------------------------------------------------------------- drawing outcomes
    def _draw(self, worker: str, task: _Task, digest: str, p: float, purpose: str
              ) -> tuple[bool, tuple[object, ...]]:
        """(correct?, key for the wrong answer): the latent-factor draw of the module doc.

        z = sqrt(shared) z_task + sqrt(persistent) z_worker,task + sqrt(rest) z_fresh and
        u = Phi(z) is uniform, so P(correct) = p exactly while two calls of one worker on a
        task correlate with shared + persistent and calls of two workers with shared.
        """
        dyn = self.dynamics[task.record.domain]
        sid = task.record.sample_id
        rest = max(0.0, 1.0 - dyn.shared - dyn.persistent)
        z = (math.sqrt(dyn.shared) * _normal(self.seed, "latent-task", sid)
             + math.sqrt(dyn.persistent) * _normal(self.seed, "latent-worker", worker, sid)
             + math.sqrt(rest) * _normal(self.seed, "latent-fresh", purpose, worker, digest))
        correct = _STD_NORMAL.cdf(z) < p
        # Which wrong answer: common to all workers, fixed per worker, or fresh, in the same
        # proportions (the choice of source is fixed per worker and task).
        coin = _unit(self.seed, "wrong-source", worker, sid)
        if coin < dyn.shared:
            source: tuple[object, ...] = ("task", sid)
        elif coin < dyn.shared + dyn.persistent:
            source = ("worker", worker, sid)
        else:
            source = ("fresh", purpose, worker, digest)
        return correct, source

    def _solve(self, worker: str, profile: WorkerProfile, task: _Task, digest: str,
               prompt: str, avoid: set[str], purpose: str, context: bool
               ) -> tuple[bool, str]:
        """Solve the task: (correct?, answer text or program). `context`: the prompt carries
        another worker's output (referenced blocks or a plan): distraction applies."""
        domain = task.record.domain
        level = level_index(task.difficulty)
        p = profile.p_correct(domain, task.difficulty)
        gains = []
        if self._plan_tag(task, good=True) in prompt:
            gains.append(self.dynamics[domain].plan_gain[level])
        if avoid:  # a rejected attempt helps where checking helps, not where knowledge lacks
            gains.append(REVISE_GAIN * self.dynamics[domain].verifiability)
        for gain in gains:
            p += gain * (1.0 - p)
        if avoid or context or self._plan_tag(task, good=False) in prompt \
                or self._plan_tag(task, good=True) in prompt:
            p *= 1.0 - self.dynamics[domain].distraction
        correct, source = self._draw(worker, task, digest, p, purpose)
        if correct:
            if task.is_code:
                return True, task.solution or "# (no reference program known to the simulator)"
            return True, task.record.gold[0]
        if task.is_code:
            return False, task.buggy or "def solution(*args):\n    return None"
        options = [d for d in task.distractors if _norm_answer(d) not in avoid] or \
            list(task.distractors)
        pick = int(_unit(self.seed, "wrong", *source) * len(options))
        return False, options[pick]

    def _plan_tag(self, task: _Task, *, good: bool) -> str:
        return "P-" + _hex(self.seed, "plan", task.record.sample_id, "good" if good else "weak")

    def _candidates(self, task: _Task, blocks: list[Block]) -> list[Candidate]:
        out = []
        for index, block in enumerate(blocks):
            if block.role in ("planner", "verifier") or verdict(block):
                continue
            executed = ("pass" if EXEC_PASS.search(block.text)
                        else "fail" if EXEC_FAIL.search(block.text) else None)
            if task.is_code:
                programs = FENCE.findall(block.text)
                if not programs:
                    continue
                answer = programs[-1].strip("\n")
                key = _norm_program(answer)
                correct = task.solution is not None and key == _norm_program(task.solution)
            else:
                tags = ANSWER_TAG.findall(block.text)
                if not tags or not tags[-1].strip():
                    continue
                answer = normalize_ws(tags[-1])
                key = _norm_answer(answer)
                correct = key in task.gold_keys
            out.append(Candidate(index, block.node, answer, key, correct, executed))
        return out

    def _rejections(self, blocks: list[Block], candidates: list[Candidate]) -> set[str]:
        """Keys of candidates named by a FAIL verdict (or the nearest one before it)."""
        rejected: set[str] = set()
        for index, block in enumerate(blocks):
            if verdict(block) != "FAIL":
                continue
            location = " ".join(LOCATION.findall(block.text))
            named = [c for c in candidates
                     if (c.node and f"[{c.node}]" in location)
                     or ("\n" not in c.answer and f"`{c.answer}`" in location)]
            if not named:
                earlier = [c for c in candidates if c.index < index]
                named = earlier[-1:] or candidates[:1]
            rejected.update(c.key for c in named)
        return rejected

    # -------------------------------------------------------------- replies
    def _reply(self, worker: str, profile: WorkerProfile, prompt: str, digest: str) -> str:
        task = self._find(prompt)
        if task is None:
            return ("I could not find a question I can work on in this request, so I cannot "
                    "give a reliable result.\n<answer>unknown</answer>")
        start, end = self._question_span(prompt, task)
        role = detect_role(prompt[:start], prompt)
        blocks = split_blocks(prompt[end:])
        if role == "planner":
            return self._planner_reply(worker, profile, task, digest)
        if role == "verifier":
            return self._verifier_reply(worker, profile, task, digest, blocks)
        if role == "summarizer":
            return self._summarizer_reply(worker, profile, task, digest, prompt, blocks)
        candidates = self._candidates(task, blocks)
        avoid = self._rejections(blocks, candidates)
        _, answer = self._solve(worker, profile, task, digest, prompt, avoid, "solve",
                                bool(blocks))
        return self._answer_reply(worker, profile, task, digest, answer,
                                  revised=bool(avoid), role=role)

    def _steps(self, worker: str, profile: WorkerProfile, task: _Task, digest: str,
               base: float) -> list[str]:
        count = max(1, round(base * profile.verbosity * (1 + level_index(task.difficulty))))
        phrases = _STEP_PHRASES[task.record.domain]
        # The phrases are in a sensible order; start at 0 or 1 and cycle, so longer
        # derivations revisit earlier checks.
        start = int(_unit(self.seed, "phrase", worker, digest) * 2)
        return [f"Step {k + 1}: {phrases[(start + k) % len(phrases)]}" for k in range(count)]

    def _answer_reply(self, worker: str, profile: WorkerProfile, task: _Task, digest: str,
                      answer: str, *, revised: bool, role: str | None) -> str:
        lines = []
        if revised:
            lines.append("The earlier attempt was rejected, so I redo the work and avoid that "
                         "result.")
        lines += self._steps(worker, profile, task, digest, 1.5)
        if task.is_code:
            lines.append("The implementation below follows these steps.")
            lines.append(f"<answer>\n```python\n{answer.rstrip()}\n```\n</answer>")
        else:
            label = "candidate answer" if role == "executor" else "answer"
            lines.append(f"So the {label} is {answer}.")
            lines.append(f"<answer>{answer}</answer>")
        return "\n".join(lines)

    def _planner_reply(self, worker: str, profile: WorkerProfile, task: _Task, digest: str
                       ) -> str:
        p_good = 0.5 + 0.5 * profile.p_correct(task.record.domain, task.difficulty)
        good = _unit(self.seed, "plan-quality", worker, digest) < p_good
        steps = self._steps(worker, profile, task, digest, 1.0)
        lines = [f"Plan reference: {self._plan_tag(task, good=good)}",
                 "Sub-tasks for the executor, in order:"]
        lines += [f"{k + 1}. {line.split(': ', 1)[1]}" for k, line in enumerate(steps)]
        lines.append("Difficulties: keep every intermediate result and check it against the "
                     "conditions of the question before combining.")
        lines.append("I do not solve the problem here.")
        return "\n".join(lines)

    def _verifier_reply(self, worker: str, profile: WorkerProfile, task: _Task, digest: str,
                        blocks: list[Block]) -> str:
        candidates = self._candidates(task, blocks)
        if not candidates:
            return ("FAIL\nLocation: no candidate output was provided\n"
                    "Reason: there is nothing to check against the original question.\n"
                    "Suggestion: reference the output that should be checked.")
        skill = profile.p_correct(task.record.domain, task.difficulty)
        catch = self.dynamics[task.record.domain].verifiability * (0.4 + 0.55 * skill)
        false_reject = 0.15 * (1.0 - skill)
        for c in candidates:
            if c.executed == "pass":
                continue
            u = _unit(self.seed, "verify", worker, digest, c.index)
            if c.executed == "fail" or (u < (false_reject if c.correct else catch)):
                where = f"[{c.node}] " if c.node else ""
                what = "the submitted program" if task.is_code else f"the candidate answer " \
                                                                    f"`{c.answer}`"
                return (f"FAIL\nLocation: {where}{what}\n"
                        "Reason: the result does not satisfy the conditions of the original "
                        "question when checked step by step.\n"
                        "Suggestion: redo the derivation from the original question and "
                        "check every intermediate value.")
        return "PASS"

    def _summarizer_reply(self, worker: str, profile: WorkerProfile, task: _Task, digest: str,
                          prompt: str, blocks: list[Block]) -> str:
        candidates = self._candidates(task, blocks)
        rejected = self._rejections(blocks, candidates)
        passed = [c for c in candidates if c.executed == "pass"]
        alive = [c for c in candidates if c.key not in rejected and c.executed != "fail"]
        skill = profile.p_correct(task.record.domain, task.difficulty)
        chosen: Candidate | None = None
        if passed:
            chosen, why = passed[0], "its program passed the hidden tests"
        elif alive:
            counts: dict[str, int] = {}
            for c in alive:
                counts[c.key] = counts.get(c.key, 0) + 1
            top = max(counts.values())
            chosen = next(c for c in alive if counts[c.key] == top)
            why = ("it is the majority among the unrejected candidates" if top > 1
                   else "it was not rejected by the checks")
            others = [c for c in alive if c.key != chosen.key]
            slip = 0.1 * (1.0 - skill)
            slip += (1.0 - slip) * self.dynamics[task.record.domain].distraction
            if others and _unit(self.seed, "slip", worker, digest) < slip:
                chosen, why = others[0], "its derivation looks more careful"
        if chosen is not None:
            where = f"[{chosen.node}]" if chosen.node else "the given candidate"
            head = [f"I compared {len(candidates)} candidate output(s); I take {where} because "
                    f"{why}."]
            answer = chosen.answer
        else:
            head = ["No usable candidate remains, so I solve the problem myself."]
            _, answer = self._solve(worker, profile, task, digest, prompt, rejected, "summarize",
                                    bool(blocks))
        body = self._answer_reply(worker, profile, task, digest, answer, revised=False,
                                  role="summarizer")
        return "\n".join(head) + "\n" + body


_PREFIX = 40

_STEP_PHRASES: Mapping[Domain, tuple[str, ...]] = {
    Domain.MATH: (
        "write down the given quantities and what the question asks for.",
        "set up the relation between the quantities as an equation.",
        "simplify the expression and compute the intermediate value.",
        "substitute the intermediate value back and check it.",
        "recheck the arithmetic of the last step.",
        "make sure the result answers exactly what is asked."),
    Domain.CODE: (
        "restate the input and the expected output of the function.",
        "choose a simple approach and note its complexity.",
        "handle the edge cases: empty input and boundary values.",
        "trace the approach by hand on a small example.",
        "write the function with the exact requested name.",
        "re-read the statement for off-by-one conditions."),
    Domain.KNOWLEDGE: (
        "recall what the question refers to.",
        "go through the options one by one.",
        "eliminate the options that clearly do not fit.",
        "compare the remaining options with what I remember.",
        "pick the option that matches best."),
    Domain.REASON: (
        "list every stated relation between the people.",
        "chain the relations to build a partial order.",
        "place each person in the order from tallest to shortest.",
        "check that the order respects every statement.",
        "count positions from the top to find the one asked for."),
    Domain.RECALL: (
        "identify the entity the question is about.",
        "recall the facts associated with that entity.",
        "make sure the fact matches the relation asked for.",
        "state the fact in its usual form."),
}
