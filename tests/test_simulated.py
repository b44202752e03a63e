"""The SIMULATED worker pool and synthetic tasks: determinism, skills, roles, usage, design.

Payloads here follow the reference formats (single/multi and agentic roles; docs/protocol.md,
"What a worker receives") in our own words; the simulator must recognise them by question text
and role keywords only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import statistics
import time
import types

import pytest

from jax_routeweaver.data.records import Domain, Record
from jax_routeweaver.routing.protocol.calls import Usage, WorkerCall, WorkerPool
from jax_routeweaver.routing.simulated import profiles as simulated_profiles
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool, estimate_tokens
from jax_routeweaver.routing.simulated.profiles import (
    DEFAULT_DYNAMICS,
    DEFAULT_PROFILES,
    WorkerProfile,
)
from jax_routeweaver.routing.simulated.tasks import LEVELS, SIM_SCORERS, synthetic_tasks

# Reference price table (docs/algorithm.md, "Trajectory cost"), USD per 1M tokens (input,
# output). Kept here on purpose: the simulator reports usage only, cost is the caller's
# business.
PRICES = {"worker_1": (0.02, 0.05), "worker_2": (0.02, 0.05), "worker_3": (0.10, 0.30),
          "worker_4": (0.119, 0.20), "worker_5": (0.10, 0.32), "worker_6": (0.10, 0.40)}

OUTPUT_RULE = ("Reason freely and provide a complete derivation.\n"
               "End with <answer>your final answer</answer>.")
ROLE_BRIEFS = {
    "planner": ("You are the PLANNER. Study the problem and split it into concrete sub-tasks "
                "that another worker can do, in order, with the hard parts named. Show your "
                "reasoning. Do not solve it and give no final answer."),
    "executor": ("You are the EXECUTOR. Do the task you were given, show the whole "
                 "derivation, and finish with <answer>your candidate answer</answer>."),
    "verifier": ("You are the VERIFIER. Check the given output against the original problem "
                 "without solving it yourself. Reply with exactly PASS, or with FAIL followed "
                 "by Location:, Reason: and Suggestion: lines."),
    "summarizer": ("You are the SUMMARIZER. Reconcile the information below, including any "
                   "disagreement, decide the answer and say which candidate you take. Finish "
                   "with <answer>your final answer</answer>."),
}


def plain_payload(question: str, subtask: str | None = None) -> str:
    parts = [OUTPUT_RULE, f"Original question:\n{question}"]
    if subtask:
        parts.append(f"Current sub-task:\n{subtask}")
    return "\n\n".join(parts)


def role_payload(role: str, question: str, task: str,
                 refs: list[tuple[str, str, str]] = ()) -> str:
    parts = [ROLE_BRIEFS[role], f"Original question:\n{question}"]
    if refs:
        blocks = [f"[{node}] (from {ref_role})\n{text.strip()}" for node, ref_role, text in refs]
        parts.append("Earlier outputs you must use:\n\n" + "\n\n".join(blocks))
    parts.append(f"Your task:\n{task}")
    return "\n\n".join(parts)


def extract(text: str) -> str:
    """The reference's answer extraction, enough for simulator replies: last <answer> body, else
    last line."""
    tags = re.findall(r"<answer>([\s\S]*?)</answer>", text, re.IGNORECASE)
    if tags:
        return tags[-1].strip()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def program_of(text: str) -> str:
    fences = re.findall(r"```(?:python)?\n([\s\S]*?)```", text)
    return fences[-1] if fences else ""


def passes_tests(program: str, meta: dict) -> bool:
    namespace: dict = {}
    try:
        exec(compile(program, "<candidate>", "exec"), namespace)  # simulator output only
        fn = namespace[meta["func_name"]]
        return all(json.loads(json.dumps(fn(*t["input"]))) == t["output"] for t in meta["tests"])
    except Exception:
        return False


def is_correct(record: Record, reply: str) -> bool:
    if record.domain is Domain.CODE:
        return passes_tests(program_of(reply), record.meta)
    norm = lambda s: " ".join(s.lower().split()).rstrip(".")
    return norm(extract(reply)) in {norm(g) for g in record.gold}


def cost(call: WorkerCall) -> float:
    price_in, price_out = PRICES[call.worker]
    return (call.usage.prompt_tokens * price_in + call.usage.completion_tokens * price_out) / 1e6


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tasks() -> list[Record]:
    return synthetic_tasks(300, seed=11)


@pytest.fixture(scope="module")
def pool(tasks) -> SimulatedWorkerPool:
    return SimulatedWorkerPool(tasks, seed=5)


def by_domain(tasks, domain, level=None):
    return [t for t in tasks if t.domain is domain and (level is None or t.difficulty == level)]


# ---------------------------------------------------------------------------- synthetic tasks
def test_synthetic_tasks_are_deterministic_balanced_and_valid():
    a, b = synthetic_tasks(60, seed=3), synthetic_tasks(60, seed=3)
    assert [r.to_row() for r in a] == [r.to_row() for r in b]
    c = synthetic_tasks(60, seed=4)
    assert sum(x.question != y.question for x, y in zip(a, c, strict=True)) > 50
    assert len({r.sample_id for r in a}) == 60
    assert len({" ".join(r.question.split()) for r in a}) == 60
    for domain in Domain:
        rows = by_domain(a, domain)
        assert len(rows) == 12
        assert {r.scorer_dataset for r in rows} == {SIM_SCORERS[domain]}
        assert sorted(r.difficulty for r in rows) == sorted(LEVELS * 4)
    for r in a:
        assert Record.from_row(r.to_row()) == r


def test_synthetic_tasks_domain_subset_and_bad_arguments():
    only = synthetic_tasks(9, seed=0, domains=["math", Domain.RECALL, "CODE"])
    assert [r.domain for r in only[:3]] == [Domain.MATH, Domain.RECALL, Domain.CODE]
    with pytest.raises(ValueError, match="unknown domain"):
        synthetic_tasks(3, seed=0, domains=["poetry"])
    with pytest.raises(ValueError, match="distinct"):
        synthetic_tasks(3, seed=0, domains=["MATH", "MATH"])
    with pytest.raises(ValueError, match="non-negative"):
        synthetic_tasks(-1, seed=0)
    hard = synthetic_tasks(20, seed=0, levels=("medium", "hard", "hard"))
    assert [r.difficulty for r in hard[::5]] == ["medium", "hard", "hard", "medium"]
    assert all(r.difficulty in ("medium", "hard") for r in hard)
    with pytest.raises(ValueError, match="levels must be"):
        synthetic_tasks(3, seed=0, levels=("extreme",))


def test_synthetic_gold_is_gradable(tasks):
    """Gold answers fit the real scorers' shapes; code tests pass the kept reference program
    and fail the kept buggy one."""
    for r in tasks:
        if r.domain is Domain.MATH:
            assert re.fullmatch(r"-?\d+", r.gold[0])
        elif r.domain is Domain.KNOWLEDGE:
            assert re.fullmatch(r"[A-J]", r.gold[0]) and f"\n{r.gold[0]}. " in r.question
        elif r.domain is Domain.REASON:
            assert r.gold[0] in r.question
        elif r.domain is Domain.RECALL:
            assert r.gold and all(g.strip() for g in r.gold)
        else:
            assert r.meta["func_name"] in r.question and r.meta["test_type"] == "functional"
            assert passes_tests(r.meta["sim"]["solution"], r.meta)
            assert not passes_tests(r.meta["sim"]["buggy_solution"], r.meta)
        assert r.gold[0] not in r.meta["sim"].get("distractors", []) if r.gold else True


# ---------------------------------------------------------------------------- protocol, basics
def test_pool_satisfies_worker_pool_protocol(pool):
    assert isinstance(pool, WorkerPool)
    assert pool.worker_ids() == [f"worker_{k}" for k in range(1, 7)]
    for worker in pool.worker_ids():
        text = pool.description(worker)
        assert text and "simulat" not in text.lower() and worker not in text
    with pytest.raises(ValueError, match="unknown worker 'worker_9'"):
        pool.description("worker_9")


def test_plain_reply_format_and_usage(pool, tasks):
    record = tasks[0]
    prompt = plain_payload(record.question)
    call = asyncio.run(pool.call("worker_3", prompt))
    assert call.success and call.error is None and call.worker == "worker_3"
    assert call.prompt == prompt
    assert re.search(r"<answer>[^<]+</answer>\s*$", call.text)
    assert call.usage == Usage(prompt_tokens=math.ceil(len(prompt) / 4),
                               completion_tokens=math.ceil(len(call.text) / 4))
    assert estimate_tokens("") == 1 and estimate_tokens("abcde") == 2


def test_max_tokens_truncates_reply(pool, tasks):
    prompt = plain_payload(by_domain(tasks, Domain.MATH, "hard")[0].question)
    full = pool.respond("worker_5", prompt)
    cut = pool.respond("worker_5", prompt, max_tokens=10)
    assert full.usage.completion_tokens > 10
    assert cut.usage.completion_tokens == 10 and cut.text == full.text[:40]


def test_unknown_question_gets_a_plain_reply(pool):
    call = pool.respond("worker_1", "What is the airspeed of an unladen swallow?")
    assert call.success and extract(call.text) == "unknown"
    assert pool.find_task("nothing known here") is None


# ---------------------------------------------------------------------------- determinism
def _batch(tasks):
    return [(f"worker_{1 + k % 6}", plain_payload(r.question)) for k, r in enumerate(tasks[:60])]


def test_same_seed_same_replies_in_any_order_and_concurrently(tasks):
    calls = _batch(tasks)
    first = SimulatedWorkerPool(tasks, seed=7)
    sequential = [first.respond(w, p).text for w, p in calls]

    async def gather(pool, order):
        results = await asyncio.gather(*(pool.call(*calls[i]) for i in order))
        return {i: r.text for i, r in zip(order, results, strict=True)}

    second = SimulatedWorkerPool(list(reversed(tasks)), seed=7)  # task order must not matter
    shuffled = asyncio.run(gather(second, list(reversed(range(len(calls))))))
    assert [shuffled[i] for i in range(len(calls))] == sequential


def test_different_seeds_give_different_replies(tasks):
    calls = _batch(tasks)
    a = [SimulatedWorkerPool(tasks, seed=1).respond(w, p).text for w, p in calls]
    b = [SimulatedWorkerPool(tasks, seed=2).respond(w, p).text for w, p in calls]
    assert sum(x != y for x, y in zip(a, b, strict=True)) > len(calls) // 3


# ---------------------------------------------------------------------------- skills
def test_skill_rates_match_profiles(tasks):
    """Plain-call accuracy per (worker, domain) matches the profile within 4 sigma."""
    many = synthetic_tasks(900, seed=21)
    pool = SimulatedWorkerPool(many, seed=9)
    for worker, profile in DEFAULT_PROFILES.items():
        for domain in Domain:
            rows = by_domain(many, domain)
            hits = sum(is_correct(r, pool.respond(worker, plain_payload(r.question)).text)
                       for r in rows)
            expected = [profile.p_correct(domain, r.difficulty) for r in rows]
            mean = sum(expected)
            sigma = math.sqrt(sum(p * (1 - p) for p in expected))
            assert abs(hits - mean) <= 4 * sigma + 1, (worker, domain, hits, mean)


def test_skill_depends_on_difficulty(tasks):
    many = synthetic_tasks(600, seed=22)
    pool = SimulatedWorkerPool(many, seed=9)
    for level, lo, hi in (("easy", 0.8, 1.0), ("hard", 0.05, 0.5)):
        rows = by_domain(many, Domain.MATH, level)
        acc = statistics.mean(is_correct(r, pool.respond("worker_3", plain_payload(r.question))
                                         .text) for r in rows)
        assert lo <= acc <= hi, (level, acc)


def test_recall_errors_are_shared_across_workers_and_prompts(tasks):
    """RECALL ignorance is mostly common to all workers: asking a second worker, or the same
    worker with another sub-task wording, rarely turns a wrong answer right."""
    rows = by_domain(tasks, Domain.RECALL)
    pool = SimulatedWorkerPool(tasks, seed=3)
    same = sum(extract(pool.respond("worker_2", plain_payload(r.question)).text)
               == extract(pool.respond("worker_2", plain_payload(r.question, "Answer it."))
                          .text) for r in rows)
    assert same == len(rows)
    math_rows = by_domain(tasks, Domain.MATH, "hard")
    differ = sum(extract(pool.respond("worker_3", plain_payload(r.question)).text)
                 != extract(pool.respond("worker_3", plain_payload(r.question, "Solve it."))
                            .text) for r in math_rows)
    assert differ >= 3  # fresh noise on MATH: rewording can change the outcome


# ---------------------------------------------------------------------------- roles
def _find_record(tasks, domain, level, pool, worker, want_correct):
    for r in by_domain(tasks, domain, level):
        reply = pool.respond(worker, role_payload("executor", r.question, "Solve it.")).text
        if is_correct(r, reply) == want_correct:
            return r, reply
    raise AssertionError("no such record")


def test_planner_never_answers_and_tags_its_plan(pool, tasks):
    for r in tasks[:20]:
        text = pool.respond("worker_4", role_payload("planner", r.question, "Plan it.")).text
        assert "<answer>" not in text.lower()
        assert re.search(r"Plan reference: P-[0-9a-f]{8}", text)
        assert re.search(r"^1\. ", text, re.MULTILINE)


def test_plan_raises_executor_accuracy_on_hard_items():
    many = synthetic_tasks(600, seed=23, domains=["MATH", "CODE"])
    pool = SimulatedWorkerPool(many, seed=4)
    rows = [r for r in many if r.difficulty == "hard"]
    plain, planned = 0, 0
    for r in rows:
        plain += is_correct(r, pool.respond("worker_3", role_payload(
            "executor", r.question, "Solve the problem.")).text)
        plan = pool.respond("worker_3", role_payload("planner", r.question, "Plan it.")).text
        planned += is_correct(r, pool.respond("worker_3", role_payload(
            "executor", r.question, "Solve the problem.", [("n1", "planner", plan)])).text)
    assert planned / len(rows) >= plain / len(rows) + 0.2, (plain, planned, len(rows))


def test_verifier_replies_pass_or_fail_and_catches_wrong_outputs():
    many = synthetic_tasks(400, seed=24, domains=["MATH"])
    pool = SimulatedWorkerPool(many, seed=6)
    caught, wrong, rejected_right, right = 0, 0, 0, 0
    for r in many:
        out = pool.respond("worker_1", role_payload("executor", r.question, "Solve it.")).text
        verdict = pool.respond("worker_6", role_payload(
            "verifier", r.question, "Check n1.", [("n1", "executor", out)])).text
        assert verdict == "PASS" or (verdict.startswith("FAIL\nLocation: ")
                                     and "\nReason: " in verdict and "\nSuggestion: " in verdict)
        assert "<answer>" not in verdict
        if is_correct(r, out):
            right += 1
            rejected_right += verdict != "PASS"
        else:
            wrong += 1
            caught += verdict != "PASS"
            assert f"`{extract(out)}`" in verdict or verdict == "PASS"
    assert caught / wrong > 0.6 and rejected_right / right < 0.15, (caught, wrong,
                                                                    rejected_right, right)


def test_verifier_believes_execution_feedback(pool, tasks):
    record, wrong_reply = _find_record(tasks, Domain.CODE, "hard", pool, "worker_2", False)
    failing = "[execution] 2/5 hidden tests passed; first failure at test index 2.\n" + wrong_reply
    for worker in pool.worker_ids():
        verdict = pool.respond(worker, role_payload(
            "verifier", record.question, "Check n1.", [("n1", "executor", failing)])).text
        assert verdict.startswith("FAIL") and "[n1]" in verdict


def test_summarizer_takes_majority_and_drops_rejected_candidates(pool, tasks):
    record = by_domain(tasks, Domain.MATH, "medium")[0]
    gold, bad = record.gold[0], record.meta["sim"]["distractors"][0]
    ans = lambda a: f"Step 1: compute.\n<answer>{a}</answer>"
    refs = [("n1", "executor", ans(bad)), ("n2", "executor", ans(gold)),
            ("n3", "executor", ans(gold))]
    for worker in pool.worker_ids():
        text = pool.respond(worker, role_payload("summarizer", record.question,
                                                 "Decide.", refs)).text
        assert extract(text) == gold
    refs = [("n1", "executor", ans(bad)), ("n2", "executor", ans(bad)),
            ("n3", "executor", ans(gold)),
            ("n4", "verifier", f"FAIL\nLocation: [n1] the candidate answer `{bad}`\n"
                               "Reason: wrong.\nSuggestion: redo.")]
    for worker in pool.worker_ids():
        text = pool.respond(worker, role_payload("summarizer", record.question,
                                                 "Decide.", refs)).text
        assert extract(text) == gold


def test_summarizer_with_nothing_usable_solves_itself(pool, tasks):
    record = by_domain(tasks, Domain.MATH, "easy")[0]
    text = pool.respond("worker_3", role_payload("summarizer", record.question, "Answer.")).text
    assert "solve the problem myself" in text and extract(text)


def test_executor_after_fail_avoids_the_rejected_answer(pool, tasks):
    for r in by_domain(tasks, Domain.REASON, "hard"):
        first = pool.respond("worker_2", role_payload("executor", r.question, "Solve.")).text
        if is_correct(r, first):
            continue
        fail = (f"FAIL\nLocation: [n1] the candidate answer `{extract(first)}`\n"
                "Reason: contradicts a statement.\nSuggestion: recheck.")
        second = pool.respond("worker_2", role_payload(
            "executor", r.question, "Fix it.", [("n1", "executor", first),
                                                ("n2", "verifier", fail)])).text
        assert extract(second) != extract(first)
        assert "rejected" in second


def test_role_words_inside_the_router_task_do_not_change_the_role(pool, tasks):
    """Role comes from the brief before the question; the router's own text can say anything."""
    record = tasks[0]
    prompt = plain_payload(record.question, "Plan and verify, then summarize the result.")
    assert re.search(r"<answer>", pool.respond("worker_1", prompt).text)
    loose = f"Act as the planner.\n\nQuestion: {record.question}"
    assert "Plan reference" in pool.respond("worker_1", loose).text


def test_recognises_the_payloads_of_routing_prompts(pool, tasks):
    """Against the real payload builders (routing/protocol/prompts.py), when they are there:
    what the prompt writers must keep is the question verbatim, the role word in the brief, and the
    `[nK] (from ROLE)` headers of referenced outputs."""
    prompts = pytest.importorskip("jax_routeweaver.routing.protocol.prompts")
    if not all(hasattr(prompts, name) for name in ("single_multi_payload", "role_payload")):
        pytest.skip("routing.protocol.prompts has no single_multi_payload/role_payload")
    node = lambda i, role, out: types.SimpleNamespace(id=i, role=role, output=out)
    record = by_domain(tasks, Domain.MATH, "medium")[0]
    q, bad = record.question, record.meta["sim"]["distractors"][0]
    plain = pool.respond("worker_2", prompts.single_multi_payload(q, "Verify and plan it."))
    assert re.search(r"<answer>[^<]+</answer>$", plain.text)
    plan = pool.respond("worker_2", prompts.role_payload("planner", q, "Plan.")).text
    assert "Plan reference: P-" in plan and "<answer>" not in plan
    executor = pool.respond("worker_2", prompts.role_payload(
        "executor", q, "Solve.", [node("n1", "planner", plan)])).text
    assert "candidate answer" in executor and extract(executor)
    wrong = f"Step 1: add.\n<answer>{bad}</answer>"
    verdicts = {pool.respond(w, prompts.role_payload(
        "verifier", q, "Check n1.", [node("n1", "executor", wrong)])).text.split("\n")[0]
        for w in pool.worker_ids()}
    assert "FAIL" in verdicts and verdicts <= {"PASS", "FAIL"}
    fail = f"FAIL\nLocation: [n1] the candidate answer `{bad}`\nReason: x\nSuggestion: y"
    summary = pool.respond("worker_2", prompts.role_payload(
        "summarizer", q, "Decide.", [node("n1", "executor", wrong),
                                     node("n2", "executor", f"<answer>{record.gold[0]}</answer>"),
                                     node("n3", "verifier", fail)])).text
    assert extract(summary) == record.gold[0]


def test_module_doc_tables_match_the_defaults():
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in simulated_profiles.__doc__.splitlines() if line.startswith("| ")}
    triple = lambda cell: tuple(float(x) for x in cell.split("/"))
    for worker, profile in DEFAULT_PROFILES.items():
        cells = rows[worker]
        assert [triple(c) for c in cells[2:7]] == [profile.skill[d] for d in Domain], worker
        assert float(cells[7]) == profile.verbosity
    for domain, dyn in DEFAULT_DYNAMICS.items():
        cells = rows[domain.value]
        assert (float(cells[1]), float(cells[2]), triple(cells[3]), float(cells[4]),
                float(cells[5])) == (dyn.shared, dyn.persistent, dyn.plan_gain,
                                     dyn.verifiability, dyn.distraction), domain


# ---------------------------------------------------------------------------- infra behaviour
def test_failures_are_reported_never_raised(tasks):
    pool = SimulatedWorkerPool(tasks, seed=1, failure_rate=0.3)
    calls = [(f"worker_{1 + k % 6}", plain_payload(r.question)) for k, r in enumerate(tasks)]
    results = asyncio.run(_gather(pool, calls))
    failed = [r for r in results if not r.success]
    assert 0.2 < len(failed) / len(results) < 0.4
    assert all(r.text == "" and r.usage is None and r.error for r in failed)
    again = asyncio.run(_gather(pool, calls))
    assert [r.success for r in again] == [r.success for r in results]  # deterministic too
    assert all(r.success for r in asyncio.run(_gather(SimulatedWorkerPool(tasks, seed=1),
                                                        calls[:30])))


async def _gather(pool, calls):
    return await asyncio.gather(*(pool.call(w, p) for w, p in calls))


def test_latency_is_awaited_concurrently(tasks):
    pool = SimulatedWorkerPool(tasks, seed=1, latency_s=0.05)
    calls = [("worker_1", plain_payload(r.question)) for r in tasks[:20]]
    start = time.perf_counter()
    results = asyncio.run(_gather(pool, calls))
    elapsed = time.perf_counter() - start
    assert all(r.latency_s >= 0.05 for r in results)
    assert elapsed < 0.5  # 20 x 50 ms run concurrently, not one after another


def test_constructor_rejects_bad_arguments(tasks):
    with pytest.raises(ValueError, match="failure_rate"):
        SimulatedWorkerPool(tasks, seed=0, failure_rate=1.5)
    with pytest.raises(ValueError, match="skill"):
        WorkerProfile("x", {Domain.MATH: (0.5, 0.5, 0.5)})
    clash = tasks[0].replace(sample_id="other", gold=("12345",))
    with pytest.raises(ValueError, match="share a question"):
        SimulatedWorkerPool([tasks[0], clash], seed=0)


def test_distraction_costs_accuracy_where_answers_are_facts():
    """RECALL: an executor reading a plan is right with p (1 - distraction) instead of p;
    without distraction (and with no fresh noise on RECALL) it answers as a plain call."""
    records = [r for r in synthetic_tasks(400, seed=5) if r.domain == Domain.RECALL]

    def accuracy(dynamics):
        pool = SimulatedWorkerPool(records, seed=2, dynamics=dynamics)
        plain = planned = 0
        for r in records:
            plan = pool.respond("worker_2", role_payload("planner", r.question, "Plan it."))
            plain += is_correct(r, pool.respond("worker_2", plain_payload(r.question)).text)
            planned += is_correct(r, pool.respond("worker_2", role_payload(
                "executor", r.question, "Follow the plan.", [("n1", "planner", plan.text)])).text)
        return plain / len(records), planned / len(records)

    plain, planned = accuracy(DEFAULT_DYNAMICS)
    assert 0.4 * plain < planned < 0.7 * plain, (plain, planned)  # about (1 - 0.45) p
    calm = {**DEFAULT_DYNAMICS, Domain.RECALL: dataclasses.replace(
        DEFAULT_DYNAMICS[Domain.RECALL], distraction=0.0)}
    assert accuracy(calm)[0] == accuracy(calm)[1] == plain
    with pytest.raises(ValueError, match="distraction must be in"):
        dataclasses.replace(DEFAULT_DYNAMICS[Domain.RECALL], distraction=1.5)


# ---------------------------------------------------------------------------- design check
def _ranked(domain):
    def score(worker):
        return statistics.mean(DEFAULT_PROFILES[worker].skill[domain])
    return sorted(DEFAULT_PROFILES, key=score, reverse=True)


def _vote(replies):
    answers = [extract(r) if not program_of(r) else program_of(r).strip() for r in replies]
    counts = {a: answers.count(a) for a in answers}
    top = max(counts.values())
    return replies[next(i for i, a in enumerate(answers) if counts[a] == top)]


def run_strategy(pool, record, strategy):
    """(correct, cost in USD) of one fixed strategy on one record, by direct simulator calls."""
    best, second, third = _ranked(record.domain)[:3]
    q = record.question
    if strategy == "single":
        calls = [pool.respond(best, plain_payload(q))]
        final = calls[0].text
    elif strategy == "multi":
        calls = [pool.respond(w, plain_payload(q, "Solve the question.")) for w in (best, second,
                                                                                   third)]
        final = _vote([c.text for c in calls])
    else:
        plan = pool.respond(best, role_payload("planner", q, "Plan the solution."))
        execute = pool.respond(best, role_payload("executor", q, "Follow the plan.",
                                                  [("n1", "planner", plan.text)]))
        verify = pool.respond(second, role_payload("verifier", q, "Check n2.",
                                                   [("n2", "executor", execute.text)]))
        summary = pool.respond(best, role_payload("summarizer", q, "Decide the answer.",
                                                  [("n2", "executor", execute.text),
                                                   ("n3", "verifier", verify.text)]))
        calls, final = [plan, execute, verify, summary], summary.text
    return is_correct(record, final), sum(cost(c) for c in calls)


def strategy_table(n=3000, seed=31, pool_seed=8):
    """{(domain, level or 'all'): {strategy: (accuracy, mean cost)}}."""
    records = synthetic_tasks(n, seed=seed)
    pool = SimulatedWorkerPool(records, seed=pool_seed)
    raw: dict = {}
    for r in records:
        for strategy in ("single", "multi", "agentic"):
            ok, usd = run_strategy(pool, r, strategy)
            for key in ((r.domain, "all"), (r.domain, r.difficulty), ("ALL", r.difficulty)):
                raw.setdefault(key, {}).setdefault(strategy, []).append((ok, usd))
    return {key: {s: (statistics.mean(o for o, _ in v), statistics.mean(c for _, c in v))
                  for s, v in per.items()} for key, per in raw.items()}


@pytest.mark.slow
def test_no_single_mode_is_best_everywhere():
    """The simulator's reason to exist: fixed single / multi (majority of 3) / agentic (plan,
    execute, verify, summarize) strategies each win somewhere, as in the paper."""
    table = strategy_table()
    acc = {k: {s: a for s, (a, _) in v.items()} for k, v in table.items()}
    per_cost = {k: {s: a / c for s, (a, c) in v.items()} for k, v in table.items()}
    winners = {d: max(acc[(d, "all")], key=acc[(d, "all")].get) for d in Domain}
    # Accuracy: the best fixed mode depends on the domain.
    assert winners[Domain.KNOWLEDGE] == "multi", acc[(Domain.KNOWLEDGE, "all")]
    assert winners[Domain.MATH] == "agentic", acc[(Domain.MATH, "all")]
    assert winners[Domain.CODE] == "agentic", acc[(Domain.CODE, "all")]
    assert len(set(winners.values())) >= 2
    # RECALL: extra calls cannot create knowledge; one call is as accurate (within noise) and
    # by far the best accuracy per dollar.
    recall = acc[(Domain.RECALL, "all")]
    assert recall["single"] >= max(recall.values()) - 0.03, recall
    assert recall["multi"] <= recall["single"], recall
    recall_pc = per_cost[(Domain.RECALL, "all")]
    assert recall_pc["single"] > 5 * max(recall_pc["multi"], recall_pc["agentic"]), recall_pc
    # Agentic pays off on hard MATH/CODE by a wide margin; voting weak workers does not.
    for d in (Domain.MATH, Domain.CODE):
        hard = acc[(d, "hard")]
        assert hard["agentic"] >= max(hard["single"], hard["multi"]) + 0.2, hard
    # Multi (majority of 3) beats single on KNOWLEDGE/REASON (noisy items, voting helps), and
    # beats agentic on KNOWLEDGE (plans and checks do not create knowledge).
    for d in (Domain.KNOWLEDGE, Domain.REASON):
        assert acc[(d, "all")]["multi"] > acc[(d, "all")]["single"] + 0.03, acc[(d, "all")]
    assert acc[(Domain.KNOWLEDGE, "all")]["multi"] > acc[(Domain.KNOWLEDGE, "all")]["agentic"]
    # Figure 4's directions: on RECALL and KNOWLEDGE another worker's output distracts, so
    # orchestration loses to one call by a wide margin; on REASON it wins by one.
    for d in (Domain.RECALL, Domain.KNOWLEDGE):
        assert acc[(d, "all")]["agentic"] < acc[(d, "all")]["single"] - 0.15, acc[(d, "all")]
    reason = acc[(Domain.REASON, "all")]
    assert reason["agentic"] > max(reason["single"], reason["multi"]) + 0.1, reason
    # Accuracy per dollar: single is best on easy items and is the cheapest everywhere.
    assert max(per_cost[("ALL", "easy")], key=per_cost[("ALL", "easy")].get) == "single"
    for d in Domain:
        c = {s: cost_ for s, (_, cost_) in table[(d, "all")].items()}
        assert c["single"] * 2 < min(c["multi"], c["agentic"]), c
