"""Soak of `routeweaver serve` under worker faults: budgets held by the provider's own
count, errors by code, latency, the router's share cold and warm, RSS over time, an endpoint
killed and restarted, and SIGTERM under load (issue 43).

The server, the checkpoint and the simulated workers are set up as `bench/serve.py` does.
`--clients` clients (default 64) send requests back to back for
`--duration` seconds (default 600), with no client warm-up pass (the server's own is
`--server-warmup`). Each question is tagged ``[soak-<n>] `` so that the provider's own bills
(every worker prompt carries the question) can be attributed to its request, and carries a
`max_cost` cycling through `--soak-budgets` multiples of the worst case of one direct call of
the question on the dearest worker (1.2x, 2x, 3x: tight, 20x: loose); in turn it offers
all six workers, the second endpoint's three only, or those three and their fallbacks (a
random-init router left to choose may never call the second endpoint). The workers are two
SIMULATED endpoints, worker_1-3 on one and worker_4-6 on the other (keyed channels, as paid
providers are: a failure is retried at once rather than cooling the channel for every
request; 5 s timeout; fallbacks worker_4 -> worker_1, worker_5 -> worker_2, worker_6 ->
worker_1). Every attempt draws its fault, seeded by (`--seed`, its body, how often that body
was sent before); the shares of attempts:

    80 %  200 with the true usage
     3 %  429, no usage, not billed         1 %  429 with usage, billed 2 % of the bound
     2 %  500, no usage, billed 50 %        2 %  500 with usage, billed 25 %
     2 %  503, no usage, not billed         1 %  503 with usage, billed 10 %
     2 %  a stall: 200 two seconds past the channel's timeout, billed its true usage
     4 %  200 over-reporting its usage (2x + 1, within the request's bound)
     3 %  200 reporting implausible usage (beyond the bound)

(the bound: the most tokens the request body can be billed, `http_replies.UsageLimits`). At
40 % of the run the second endpoint is killed (listening socket closed, its open connections
reset, as a crashed process leaves them) and at 50 % restarted on the same port; at the end
the server gets SIGTERM with the clients' requests in flight (no new ones are sent).

Printed: requests, answers, errors by HTTP status and code (and by phase: before the kill,
during the outage, after the restart); requests over their max_cost by the PROVIDER's count
(the endpoints' bills for the request's tag, priced at the channel file's prices; goal 0);
returned routing records whose total_cost_usd is below the provider's bill (goal 0); 500s
(goal 0); p50/p99 latency; the router's share of the p50 (median router_s / p50 latency),
COLD (the first 64 requests) and WARM (the rest; goal <= 20 % each); the server's RSS every
`--rss-every` s (goal: flat, max/min <= 1.10 after the first 20 % of the run); and how the
requests in flight at SIGTERM ended (goal: every one answered or an HTTP error, none cut).

    python bench/serve_soak.py --json soak.json         # 64 clients, 10 minutes
    python bench/serve_soak.py --duration 60 --clients 16 --server-warmup 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import openai
import yaml
from serve import (
    async_client,
    common_arguments,
    mode_field,
    overhead_share,
    pct,
    print_summary,
    setup,
    start_server,
)

from jax_routeweaver.routing.simulated.http_endpoint import Fault, SimulatedHttpWorkers

# Seconds a soak channel waits for one attempt (its `timeout_s`); a stall answers later.
SOAK_TIMEOUT_S = 5.0
STALL_S = SOAK_TIMEOUT_S + 2.0
# The per-attempt fault mix (module docstring): (kind, share of attempts, fault).
# `Fault(status, report, billed, delay_s)`: billed None is the reply's true usage, else that
# share of the request's bound.
FAULT_MIX: tuple[tuple[str, float, Fault], ...] = (
    ("ok", 0.80, Fault()),
    ("429_no_usage", 0.03, Fault(429, "none", 0.0)),
    ("429_usage", 0.01, Fault(429, "true", 0.02)),
    ("500_no_usage", 0.02, Fault(500, "none", 0.5)),
    ("500_usage", 0.02, Fault(500, "true", 0.25)),
    ("503_no_usage", 0.02, Fault(503, "none", 0.0)),
    ("503_usage", 0.01, Fault(503, "true", 0.1)),
    ("stall", 0.02, Fault(200, "true", None, delay_s=STALL_S)),
    ("over_report", 0.04, Fault(200, "over")),
    ("implausible_report", 0.03, Fault(200, "implausible")),
)
# The two endpoints' workers; the second is killed and restarted mid-run.
ENDPOINT_WORKERS = (("worker_1", "worker_2", "worker_3"), ("worker_4", "worker_5", "worker_6"))
SOAK_FALLBACKS = {"worker_4": "worker_1", "worker_5": "worker_2", "worker_6": "worker_1"}
# The workers soak request n offers: SOAK_OFFERS[n mod 3]. The router's own choice among all
# six may never reach the second endpoint (a random-init router calls few workers), so a
# third of the requests may call its workers only (a call failing there has no fallback
# within the request: 502) and a third those and their fallbacks.
SOAK_OFFERS: tuple[tuple[str, ...], ...] = (
    (), ENDPOINT_WORKERS[1], (*ENDPOINT_WORKERS[1], "worker_1", "worker_2"))
# The variable NAME the soak channels' key is in (a dummy; the simulated workers take any).
SOAK_KEY_ENV = "ROUTEWEAVER_SOAK_WORKER_KEY"
SOAK_TAG = re.compile(r"\[soak-(\d+)\] ")
# Requests that count as cold: the first wave of a 64-client server.
COLD_REQUESTS = 64


class FaultScript:
    """`SimulatedHttpWorkers.script`: each attempt's fault drawn from FAULT_MIX by a hash of
    (seed, body, n), so a rerun with the same seed sees the same faults for the same
    requests; `drawn` counts the kinds drawn (attempts received, by fault)."""

    def __init__(self, seed: int):
        assert abs(sum(share for _, share, _ in FAULT_MIX) - 1.0) < 1e-9
        self.seed = seed
        self.drawn: Counter[str] = Counter()

    def __call__(self, body: dict[str, Any], n: int) -> Fault:
        key = f"{self.seed}|{n}|{json.dumps(body, sort_keys=True)}".encode()
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
        kind, fault = pick(u)
        self.drawn[kind] += 1  # under the GIL; a count lost to a race would not matter
        return fault


def pick(u: float) -> tuple[str, Fault]:
    """The FAULT_MIX entry that u in [0, 1) falls in (its shares laid end to end)."""
    for kind, share, fault in FAULT_MIX:
        if u < share:
            return kind, fault
        u -= share
    return FAULT_MIX[0][0], FAULT_MIX[0][2]  # float rounding at the very top: a success


class Endpoint:
    """One SIMULATED endpoint that can be killed and restarted on the same port. A kill
    closes the listening socket and resets the connections it holds open (keep-alive ones
    included: a plain `close` would leave them serving). `lives`: every server it ran, whose
    `bills` (the provider's own count) are all kept."""

    def __init__(self, sim: Any, workers: tuple[str, ...], delay_s: float,
                 script: FaultScript):
        from jax_routeweaver.routing.simulated.http_endpoint import model_name

        self.sim, self.delay_s, self.script = sim, delay_s, script
        self.models = [model_name(w) for w in workers]
        self.port = 0
        self.lives: list[SimulatedHttpWorkers] = []
        self._open: set[socket.socket] = set()
        self.start()

    def start(self) -> None:
        """Serve (again), on the port of the first life (HTTPServer sets SO_REUSEADDR)."""
        live = SimulatedHttpWorkers(self.sim, models=self.models, delay_s=self.delay_s,
                                    port=self.port, script=self.script)
        self.port, self.url = live.httpd.server_address[1], live.url
        self._track(live.httpd)
        self.lives.append(live)

    def kill(self) -> None:
        """Stop serving as a crashed process would: nothing listens, open connections reset."""
        httpd = self.lives[-1].httpd
        httpd.handle_error = lambda *_: None  # handlers writing to a reset socket: expected
        self.lives[-1].close()
        for sock in list(self._open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def bills(self) -> list:
        return [bill for live in self.lives for bill in live.bills]

    def _track(self, httpd: Any) -> None:
        """Keep the sockets of the connections being served (ThreadingMixIn's hooks)."""
        process, shutdown = httpd.process_request, httpd.shutdown_request

        def tracked(request: socket.socket, address: Any) -> None:
            self._open.add(request)
            process(request, address)

        def untracked(request: socket.socket) -> None:
            self._open.discard(request)
            shutdown(request)

        httpd.process_request, httpd.shutdown_request = tracked, untracked


def two_endpoint_channels(path: Path, sim: Any, endpoints: list[Endpoint]) -> Path:
    """The simulated channel file (the original's prices, keyed, `SOAK_TIMEOUT_S`, the soak's
    fallbacks) with each worker pointed at its endpoint."""
    from jax_routeweaver.routing.simulated.http_endpoint import simulated_channel_file

    simulated_channel_file(path, sim, endpoints[0].url, timeout_s=SOAK_TIMEOUT_S,
                           fallbacks=SOAK_FALLBACKS,
                           key_env={w: SOAK_KEY_ENV for w in sim.worker_ids()})
    data = yaml.safe_load(path.read_text())
    for endpoint, workers in zip(endpoints, ENDPOINT_WORKERS, strict=True):
        for worker in workers:
            data["workers"][worker]["base_url"] = endpoint.url
    path.write_text(yaml.safe_dump(data))
    return path


# -- soak: clients --------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    """One soak request: its number (tag), max_cost, start/end (s since the soak began), HTTP
    status (or "connection": no HTTP answer), error code, routing record (None if none came
    back)."""

    n: int
    max_cost: float
    start: float
    end: float
    status: int | str
    code: str | None
    record: dict[str, Any] | None


class Budgets:
    """max_cost of soak request n: `factors[n mod len]` x the worst case of one direct call of
    its question on the dearest served worker (the server's own pricing of a first call)."""

    def __init__(self, channels: Path, factors: list[float], max_tokens: int):
        # Imported here, not on the first request: an import would stall the clients' loop.
        from jax_routeweaver.routing.pools.channels import load_channels
        from jax_routeweaver.routing.pools.workers import HttpWorkerPool
        from jax_routeweaver.routing.protocol.prompts import single_multi_payload
        from jax_routeweaver.serving.router import DIRECT_TASK

        self.pool = HttpWorkerPool(load_channels(channels))  # only priced, never called
        self.prices, self.factors, self.max_tokens = self.pool.prices(), factors, max_tokens
        self.payload = lambda question: single_multi_payload(question, DIRECT_TASK)

    def __call__(self, n: int, question: str) -> float:
        from jax_routeweaver.routing.pools.pricing import tokens_cost

        payload = self.payload(question)
        worst = max(tokens_cost(w, b.prompt_tokens, b.completion_tokens, self.prices)
                    for w in self.pool.worker_ids()
                    for b in [self.pool.usage_bound(w, payload, self.max_tokens)])
        return self.factors[n % len(self.factors)] * worst


async def soak_request(client: openai.AsyncOpenAI, n: int, question: str, max_cost: float,
                       fields: dict[str, Any], t0: float) -> Outcome:
    """Send one tagged request; its outcome, with the routing record of an answer or of an
    error body (402, 502, 504 and 500 carry it)."""
    start = time.perf_counter() - t0
    status: int | str = 200
    code = record = None
    try:
        reply = await client.chat.completions.create(
            model="routeweaver", messages=[{"role": "user", "content": question}],
            extra_body={"max_cost": max_cost, **fields})
        record = reply.routeweaver
    except openai.APIStatusError as e:
        status = e.status_code
        with contextlib.suppress(ValueError):  # the openai error drops the record: reread
            body = e.response.json()
            code, record = (body.get("error") or {}).get("code"), body.get("routeweaver")
    except openai.APIConnectionError as e:  # timeouts included: no HTTP answer
        status, code = "connection", type(e).__name__
    return Outcome(n, max_cost, start, time.perf_counter() - t0, status, code, record)


async def soak_clients(url: str, questions: list[str], budgets: Budgets, modes: list[str],
                       clients: int, stop: asyncio.Event, t0: float) -> list[Outcome]:
    """`clients` loops sending requests back to back until `stop` (each finishes the one it
    has in flight); request n asks question n mod len(questions), tagged, offering the
    workers SOAK_OFFERS[n mod 3] in mode n mod len(modes)."""
    client = async_client(url, clients)
    numbers = itertools.count()
    outcomes: list[Outcome] = []

    async def loop() -> None:
        while not stop.is_set():
            n = next(numbers)
            question = f"[soak-{n}] {questions[n % len(questions)]}"
            offer = SOAK_OFFERS[n % len(SOAK_OFFERS)]
            fields = {**mode_field(modes, n), **({"workers": list(offer)} if offer else {})}
            outcomes.append(await soak_request(client, n, question, budgets(n, question),
                                               fields, t0))

    await asyncio.gather(*(loop() for _ in range(clients)))
    await client.close()
    return sorted(outcomes, key=lambda o: o.n)


def vm_rss_mib(pid: int) -> float | None:
    """The process's resident set (VmRSS) in MiB; None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def sample_rss(pid: int, every_s: float, t0: float, out: list) -> None:
    """Append (s since the soak began, RSS MiB) every `every_s` until the process exits."""
    while (rss := vm_rss_mib(pid)) is not None:
        out.append((round(time.perf_counter() - t0, 1), round(rss, 1)))
        await asyncio.sleep(every_s)


async def soak_timeline(duration: float, proc: subprocess.Popen, endpoint: Endpoint,
                        stop: asyncio.Event, t0: float, marks: dict) -> None:
    """Kill `endpoint` at 40 % of the run, restart it at 50 %; at 100 % stop the clients
    sending and SIGTERM the server. `marks`: when each happened (s since the soak began)."""
    async def at(share: float) -> None:
        await asyncio.sleep(max(0.0, t0 + share * duration - time.perf_counter()))

    try:
        await at(0.4)
        await asyncio.to_thread(endpoint.kill)  # its shutdown waits for the serve loop
        marks["endpoint_killed_s"] = round(time.perf_counter() - t0, 1)
        await at(0.5)
        await asyncio.to_thread(endpoint.start)
        marks["endpoint_restarted_s"] = round(time.perf_counter() - t0, 1)
        await at(1.0)
    finally:  # the clients must stop even if the timeline failed
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        marks["sigterm_s"] = round(time.perf_counter() - t0, 1)


async def soak_run(args: argparse.Namespace, url: str, proc: subprocess.Popen,
                   endpoint: Endpoint, questions: list[str], budgets: Budgets,
                   clients: int) -> tuple[list[Outcome], dict, list]:
    """The soak's clients, timeline and RSS sampling together: (outcomes, marks, RSS)."""
    t0 = time.perf_counter()
    stop, marks, rss = asyncio.Event(), {}, []
    sampler = asyncio.create_task(sample_rss(proc.pid, args.rss_every, t0, rss))
    timeline = asyncio.create_task(soak_timeline(args.duration, proc, endpoint, stop, t0,
                                                 marks))
    outcomes = await soak_clients(url, questions, budgets, args.modes.split(","), clients,
                                  stop, t0)
    await timeline
    try:  # the server drains its accepted requests, then exits
        marks["server_exit_code"] = await asyncio.to_thread(proc.wait, 400)
    except subprocess.TimeoutExpired:
        proc.kill()
        marks["server_exit_code"] = f"killed: still running 400 s after SIGTERM ({proc.wait()})"
    marks["server_exited_s"] = round(time.perf_counter() - t0, 1)
    sampler.cancel()
    return outcomes, marks, rss


# -- soak: report -------------------------------------------------------------------------

def provider_usd(bills: list, prices: dict) -> tuple[dict[int, float], int]:
    """What the provider billed each soak request (USD, by the tag in the attempt's prompt,
    at the channel file's prices), and how many bills carry no tag."""
    from jax_routeweaver.routing.pools.pricing import tokens_cost

    usd: dict[int, float] = defaultdict(float)
    untagged = 0
    for bill in bills:
        found = SOAK_TAG.search(bill.prompt)
        if found is None:
            untagged += 1
            continue
        worker = "worker_" + bill.model.split("-", 1)[1]
        usd[int(found.group(1))] += tokens_cost(worker, bill.usage.prompt_tokens,
                                                bill.usage.completion_tokens, prices)
    return usd, untagged


def budget_check(outcomes: list[Outcome], billed: dict[int, float]) -> dict[str, Any]:
    """Requests the provider billed beyond their max_cost, and returned records whose
    total_cost_usd is below the provider's bill (each must be none); a 1e-9 relative
    tolerance absorbs float summation order."""
    over = [o.n for o in outcomes if billed.get(o.n, 0.0) > o.max_cost * (1 + 1e-9)]
    below = [o.n for o in outcomes if o.record is not None
             and o.record["total_cost_usd"] < billed.get(o.n, 0.0) * (1 - 1e-9)]
    records = [o.record for o in outcomes if o.record is not None]
    return {
        "provider_billed_usd": round(sum(billed.values()), 6),
        "records_total_cost_usd": round(sum(r["total_cost_usd"] for r in records), 6),
        "over_max_cost_by_provider": len(over), "over_max_cost_examples": over[:10],
        "records_below_provider_bill": len(below), "below_bill_examples": below[:10],
        "records_returned": len(records),
        "records_reserved_left_usd": round(sum(r["reserved_usd"] for r in records), 9),
        "records_not_within_budget": sum(not r["within_budget"] for r in records),
    }


def errors_by(outcomes: list[Outcome], marks: dict) -> dict[str, Any]:
    """Errors by `status code`, in all and by phase of the run (when the request started:
    before the kill, during the endpoint's outage, after its restart)."""
    def phase(o: Outcome) -> str:
        if o.start < marks.get("endpoint_killed_s", float("inf")):
            return "before_kill"
        return "outage" if o.start < marks.get("endpoint_restarted_s", float("inf")) \
            else "after_restart"

    failed = [o for o in outcomes if o.status != 200]
    by_phase: dict[str, Counter] = defaultdict(Counter)
    for o in failed:
        by_phase[phase(o)][f"{o.status} {o.code}"] += 1
    return {"errors": dict(Counter(f"{o.status} {o.code}" for o in failed)),
            "errors_by_phase": {k: dict(v) for k, v in by_phase.items()},
            "requests_by_phase": dict(Counter(phase(o) for o in outcomes))}


def latency_split(outcomes: list[Outcome]) -> dict[str, Any]:
    """p50/p99 latency of the answered requests, and the router's share of the p50 for the
    COLD requests (the first `COLD_REQUESTS`) and the WARM rest."""
    answered = [o for o in outcomes if o.status == 200 and o.record is not None]
    lat = [o.end - o.start for o in answered]
    groups = {"cold": [o for o in answered if o.n < COLD_REQUESTS],
              "warm": [o for o in answered if o.n >= COLD_REQUESTS]}
    return {"latency_p50_s": round(pct(lat, 0.5), 3) if lat else None,
            "latency_p99_s": round(pct(lat, 0.99), 3) if lat else None,
            **{name: overhead_share([o.end - o.start for o in g], [o.record for o in g])
               for name, g in groups.items()}}


def rss_flat(rss: list, duration: float) -> dict[str, Any]:
    """The RSS series (s, MiB) and whether it stays flat after warm-up: max/min of the
    samples after the first 20 % of the run within 10 %."""
    after = [mib for t, mib in rss if t >= 0.2 * duration]
    ratio = max(after) / min(after) if after else None
    return {"rss_mib": rss, "rss_after_warmup_max_over_min": ratio and round(ratio, 4),
            "rss_flat": ratio is not None and ratio <= 1.10}


def sigterm_summary(outcomes: list[Outcome], marks: dict) -> dict[str, Any]:
    """How the requests in flight at SIGTERM ended: answered, an HTTP error (by status and
    code), or no HTTP answer at all (cut)."""
    t = marks["sigterm_s"]
    inflight = [o for o in outcomes if o.start <= t < o.end]
    return {"inflight_at_sigterm": len(inflight),
            "inflight_answered": sum(o.status == 200 for o in inflight),
            "inflight_errors": dict(Counter(f"{o.status} {o.code}" for o in inflight
                                            if o.status != 200)),
            "inflight_cut": sum(o.status == "connection" for o in inflight),
            "started_after_sigterm": sum(o.start > t for o in outcomes),
            "drain_s": round(marks["server_exited_s"] - t, 1),
            "server_exit_code": marks["server_exit_code"]}


def soak(args: argparse.Namespace, checkpoint: Path, work: Path, sim: Any, tasks: list,
         cfg: Any) -> tuple[dict, bool]:
    """The soak of the module docstring: (summary, every goal met)."""
    clients = args.clients or 64
    script = FaultScript(args.seed)
    endpoints = [Endpoint(sim, workers, args.delay, script) for workers in ENDPOINT_WORKERS]
    os.environ[SOAK_KEY_ENV] = "soak-dummy-key"  # the server inherits it
    channels = two_endpoint_channels(work / "channels.yaml", sim, endpoints)
    budgets = Budgets(channels, [float(f) for f in args.soak_budgets.split(",")],
                      cfg.rollout.protocol.worker_max_tokens)
    flags = () if args.request_timeout is None else ("--request-timeout",
                                                     str(args.request_timeout))
    log = work / "serve.log"
    proc, url = start_server(checkpoint, channels, log, args.max_batch, args.server_warmup,
                             args.overrides, flags)
    try:
        outcomes, marks, rss = asyncio.run(soak_run(args, url, proc, endpoints[1],
                                                    [t.question for t in tasks], budgets,
                                                    clients))
    finally:
        if proc.poll() is None:
            proc.kill()
        for endpoint in endpoints:
            endpoint.lives[-1].close()
    bills = [bill for endpoint in endpoints for bill in endpoint.bills()]
    billed, untagged = provider_usd(bills, budgets.prices)
    answered = [o for o in outcomes if o.status == 200]
    records = [o.record for o in answered if o.record is not None]
    text = log.read_text()
    summary = {
        "clients": clients, "duration_s": args.duration, "worker_delay_s": args.delay,
        "seed": args.seed, "soak_budget_factors": args.soak_budgets,
        "server_warmup_rows": args.server_warmup, "server_log": str(log),
        "checkpoint": str(args.checkpoint or "random-init quickstart"),
        "requests": len(outcomes), "answered": len(answered),
        **errors_by(outcomes, marks),
        "http_500": sum(o.status == 500 for o in outcomes),
        "server_log_tracebacks": text.count("Traceback"),
        **budget_check(outcomes, billed),
        "provider_bills": len(bills), "provider_bills_untagged": untagged,
        "attempts_by_worker": dict(sorted(Counter(bill.model for bill in bills).items())),
        "attempts_by_fault": dict(script.drawn),
        "attempts_by_endpoint_life": [[len(live.bills) for live in e.lives] for e in endpoints],
        "answer_sources": dict(Counter(r["answer_source"] for r in records)),
        "modes": dict(Counter(r["mode"] for r in records)),
        "fallback_calls": sum(r["fallback_calls"] for r in records),
        "refused_calls": sum(r["refused_calls"] for r in records),
        **latency_split(outcomes),
        **marks,
        **sigterm_summary(outcomes, marks),
        **rss_flat(rss, args.duration),
    }
    print_summary(summary)
    goals = {"0 over max_cost by the provider": summary["over_max_cost_by_provider"] == 0,
             "0 records below the provider's bill": summary["records_below_provider_bill"] == 0,
             "0 http 500": summary["http_500"] == 0,
             "cold overhead <= 20 %": (summary["cold"]["router_share_of_p50"] or 1) <= 0.20,
             "warm overhead <= 20 %": (summary["warm"]["router_share_of_p50"] or 1) <= 0.20,
             "RSS flat after warm-up": summary["rss_flat"],
             "0 in-flight requests cut at SIGTERM": summary["inflight_cut"] == 0}
    summary["goals"] = goals
    # Every request, for a closer look (the JSON only): n, start, end (s), status, code.
    summary["outcomes"] = [[o.n, round(o.start, 3), round(o.end, 3), o.status, o.code]
                           for o in outcomes]
    for goal, met in goals.items():
        print(f"goal {goal:40s} {'met' if met else 'NOT met'}")
    return summary, all(goals.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, "default 64")
    p.add_argument("--duration", type=float, default=600, help="seconds (default 600)")
    p.add_argument("--soak-budgets", default="1.2,2,3,20",
                   help="max_cost factors, x the worst case of one direct call of the "
                        "question on the dearest worker")
    p.add_argument("--seed", type=int, default=0, help="the fault draw seed")
    p.add_argument("--rss-every", type=float, default=10.0,
                   help="seconds between RSS samples of the server")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="serve --request-timeout (default: the server's)")
    args = p.parse_args()
    work, checkpoint, cfg, tasks, sim = setup(args)
    summary, good = soak(args, checkpoint, work, sim, tasks, cfg)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
