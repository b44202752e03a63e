"""Serving benchmark: `routeweaver serve` under N concurrent OpenAI clients, against the same
requests sent straight to one worker; and the cold start (`--cold`). The soak under worker
faults is `bench/serve_soak.py`.

Setup (all on loopback): the SIMULATED workers behind real HTTP (`routing.simulated.http_endpoint`),
each completion taking `--delay` seconds; `routeweaver serve` as its own process on a router
checkpoint (default: a random-init quickstart router, built here; `--checkpoint` for a
trained run); `--clients` concurrent `openai.AsyncOpenAI` clients send `--requests` questions
(synthetic tasks), each with a `max_cost` cycling through `--budgets`. An untimed warm-up pass
(`--warmup` requests at the same concurrency) compiles the sampler's shapes first;
`--server-warmup ROWS` has the server compile them itself before it listens (`serve --warmup`).

Printed: throughput, p50/p99 latency, errors and lost requests; the router's own overhead
(latency not spent waiting for workers: sampling, queueing for the shared sampler,
orchestration; from each response's routing record) as a share of the p50 latency (goal:
<= 20 % at 32 clients with 1 s workers); the share of requests whose cost stayed within
their max_cost (goal: 100 %); and the reference: the same questions sent straight to
worker_1 (one call each) at the same concurrency.

Cold start (`--cold 0,32`): for each ROWS a fresh server started with `serve --warmup ROWS`
(fault-free workers), one wave of `--clients` requests (cold), then a second (warm): the
router's share of each wave's p50 and the start-up time, to choose `serve --warmup`'s default
from the cold figure.

    python bench/serve.py                       # 32 clients, 256 requests, 1 s workers
    python bench/serve.py --checkpoint runs/quickstart --json out.json
    python bench/serve.py --cold 0,32,64 --clients 64 --json cold.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai

from jax_routeweaver.routing.simulated.http_endpoint import SimulatedHttpWorkers

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# The tests' random-init quickstart run (`tests/serve_helpers.tiny_run`).
sys.path.insert(0, str(ROOT / "tests"))
PORT_LINE = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


def start_server(checkpoint: Path, channels: Path, log: Path, max_batch: int,
                 warmup: int | None, overrides: list[str], flags: tuple[str, ...] = ()
                 ) -> tuple:
    """`routeweaver serve` on a free loopback port; (process, base url). `warmup`: `serve
    --warmup` (None: its default); `flags`: more `serve` options."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.pop("ROUTEWEAVER_SERVE_TOKEN", None)
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "jax_routeweaver.cli", "serve",
                             "--checkpoint", str(checkpoint), "--channels", str(channels),
                             "--port", "0", "--max-batch", str(max_batch),
                             *([] if warmup is None else ["--warmup", str(warmup)]), *flags,
                             *overrides],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.time() + 600
    while time.time() < deadline:
        found = PORT_LINE.search(log.read_text())
        if found:
            return proc, f"http://127.0.0.1:{found.group(1)}/v1"
        if proc.poll() is not None:
            raise RuntimeError(f"routeweaver serve exited {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("routeweaver serve did not start in 600 s")


def async_client(url: str, clients: int) -> openai.AsyncOpenAI:
    """An OpenAI client with one connection per concurrent client, no retries, no proxy."""
    return openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600,
                              http_client=httpx.AsyncClient(
                                  limits=httpx.Limits(max_connections=clients),
                                  trust_env=False))


async def routed(url: str, questions: list[str], budgets: list[float], modes: list[str],
                 clients: int) -> list:
    """(latency s, routing record or None, error or None) per question, in order; question i
    gets budget i mod len(budgets) and mode i mod len(modes) ("auto": the router's)."""
    client = async_client(url, clients)
    gate = asyncio.Semaphore(clients)

    async def one(i: int, question: str) -> tuple:
        async with gate:
            start = time.perf_counter()
            try:
                c = await client.chat.completions.create(
                    model="routeweaver", messages=[{"role": "user", "content": question}],
                    extra_body={"max_cost": budgets[i % len(budgets)],
                                **mode_field(modes, i)})
                return time.perf_counter() - start, c.routeweaver, None
            except openai.APIError as e:
                return time.perf_counter() - start, None, f"{type(e).__name__}: {e}"

    out = await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))
    await client.close()
    return list(out)


def mode_field(modes: list[str], i: int) -> dict[str, str]:
    """The request's ``mode`` field: mode i mod len(modes), none for "auto" (the router's)."""
    mode = modes[i % len(modes)]
    return {} if mode == "auto" else {"mode": mode}


async def direct(url: str, questions: list[str], clients: int, worker: str = "sim-1") -> list:
    """Latency of each question sent straight to one worker (the reference)."""
    client = async_client(url, clients)
    gate = asyncio.Semaphore(clients)

    async def one(question: str) -> float:
        async with gate:
            start = time.perf_counter()
            await client.chat.completions.create(
                model=worker, messages=[{"role": "user", "content": question}], max_tokens=4096)
            return time.perf_counter() - start

    out = await asyncio.gather(*(one(q) for q in questions))
    await client.close()
    return list(out)


def pct(values: list[float], q: float) -> float:
    from jax_routeweaver.routing.pools.pricing import percentile_linear

    return percentile_linear(sorted(values), q)


def overhead_share(latencies: list[float], records: list[dict]) -> dict[str, Any]:
    """The router's own share of the p50 latency: median `router_s` of the routing records
    (latency not spent waiting for workers) / the p50 of the client-measured latencies."""
    if not latencies or not records:
        return {"answered": len(latencies), "latency_p50_s": None, "router_p50_s": None,
                "router_share_of_p50": None}
    p50, router = pct(latencies, 0.5), statistics.median(r["router_s"] for r in records)
    return {"answered": len(latencies), "latency_p50_s": round(p50, 4),
            "router_p50_s": round(router, 4), "router_share_of_p50": round(router / p50, 4)}


# -- the classic benchmark ------------------------------------------------------------------

def bench(args: argparse.Namespace, checkpoint: Path, work: Path, sim: Any,
          tasks: list) -> tuple[dict, bool]:
    """The benchmark of the module docstring's first part: (summary, goal met)."""
    from jax_routeweaver.routing.simulated.http_endpoint import simulated_channel_file

    budgets = [float(b) for b in args.budgets.split(",")]
    modes = args.modes.split(",")
    clients = args.clients or 32
    warm = [t.question for t in tasks[:args.warmup]]
    measured = [t.question for t in tasks[args.warmup:args.warmup + args.requests]]
    with SimulatedHttpWorkers(sim, delay_s=args.delay) as workers:
        channels = simulated_channel_file(work / "channels.yaml", sim, workers.url,
                                          fallbacks={"worker_6": "worker_1"})
        proc, url = start_server(checkpoint, channels, work / "serve.log", args.max_batch,
                                 args.server_warmup, args.overrides)
        try:
            asyncio.run(routed(url, warm, budgets, modes, clients))
            start = time.perf_counter()
            results = asyncio.run(routed(url, measured, budgets, modes, clients))
            wall = time.perf_counter() - start
            floor = asyncio.run(direct(workers.url, measured, clients))
            metrics = httpx.get(url.removesuffix("/v1") + "/metrics", trust_env=False).text
        finally:
            proc.terminate()
            proc.wait(60)

    ok = [(lat, rec) for lat, rec, err in results if err is None]
    errors = Counter(err.split(":")[0] for _, _, err in results if err is not None)
    lat = [lat for lat, _ in ok]
    router = [rec["router_s"] for _, rec in ok]
    within = [rec["total_cost_usd"] <= rec["max_cost_usd"] for _, rec in ok]
    p50 = pct(lat, 0.5) if lat else float("nan")
    summary = {
        "clients": clients, "requests": len(measured), "worker_delay_s": args.delay,
        "budgets_usd": args.budgets, "modes_asked": args.modes,
        "server_warmup_rows": args.server_warmup, "client_warmup_requests": args.warmup,
        "checkpoint": str(args.checkpoint or "random-init quickstart"),
        "ok": len(ok), "errors": dict(errors), "lost": len(measured) - len(results),
        "throughput_rps": len(ok) / wall,
        "latency_p50_s": p50, "latency_p99_s": pct(lat, 0.99) if lat else float("nan"),
        "router_overhead_p50_s": statistics.median(router) if router else float("nan"),
        "router_overhead_share_of_p50": (statistics.median(router) / p50) if router else None,
        "within_budget_share": sum(within) / len(within) if within else None,
        "refused_calls": sum(rec["refused_calls"] for _, rec in ok),
        "answer_sources": dict(Counter(rec["answer_source"] for _, rec in ok)),
        "modes": dict(Counter(rec["mode"] for _, rec in ok)),
        "worker_calls_mean": statistics.mean(len(rec["calls"]) for _, rec in ok) if ok else 0,
        "direct_p50_s": pct(floor, 0.5), "direct_p99_s": pct(floor, 0.99),
        "p50_vs_direct": p50 / pct(floor, 0.5),
        "sampler_batches": _metric(metrics, "routeweaver_sampler_batch_rows_count"),
        "sampler_rows": _metric(metrics, "routeweaver_sampler_batch_rows_sum"),
        "sampler_seconds": _metric(metrics, "routeweaver_sampler_batch_seconds_sum"),
    }
    good = (not errors and summary["lost"] == 0 and summary["within_budget_share"] == 1.0
            and summary["router_overhead_share_of_p50"] <= 0.20)
    print_summary(summary)
    print("goal (0 errors, 0 lost, 100 % within max_cost, overhead <= 20 % of p50):",
          "met" if good else "NOT met")
    return summary, good


# -- cold start ---------------------------------------------------------------------------

def cold_start(args: argparse.Namespace, checkpoint: Path, work: Path, sim: Any,
               tasks: list) -> tuple[dict, bool]:
    """For each `--cold` ROWS: a fresh server with `serve --warmup ROWS`, a first wave of
    `--clients` requests (cold: the first requests it ever serves) and a second (warm), on
    fault-free workers. Measures start-up seconds (process start to listening) and the
    router's share of each wave's p50."""
    from jax_routeweaver.routing.simulated.http_endpoint import simulated_channel_file

    budgets = [float(b) for b in args.budgets.split(",")]
    modes = args.modes.split(",")
    clients = args.clients or 64
    questions = [t.question for t in tasks]
    runs = {}
    for rows in [int(r) for r in args.cold.split(",")]:
        with SimulatedHttpWorkers(sim, delay_s=args.delay) as workers:
            channels = simulated_channel_file(work / "channels.yaml", sim, workers.url,
                                              fallbacks={"worker_6": "worker_1"})
            started = time.perf_counter()
            proc, url = start_server(checkpoint, channels, work / f"serve-warmup{rows}.log",
                                     args.max_batch, rows, args.overrides)
            startup = time.perf_counter() - started
            try:
                waves = [asyncio.run(routed(url, questions[i * clients:(i + 1) * clients],
                                            budgets, modes, clients)) for i in range(2)]
            finally:
                proc.terminate()
                proc.wait(60)
        runs[f"warmup_{rows}"] = {"startup_s": round(startup, 1), **{
            name: {**overhead_share([lat for lat, _, err in wave if err is None],
                                    [rec for _, rec, err in wave if err is None]),
                   "errors": sum(err is not None for _, _, err in wave)}
            for name, wave in zip(("cold", "warm"), waves, strict=True)}}
    summary = {"clients": clients, "worker_delay_s": args.delay, "runs": runs}
    print_cold(summary)
    good = all((r["cold"]["router_share_of_p50"] or 1) <= 0.20 for r in runs.values())
    print("goal (cold overhead <= 20 % of p50 for every ROWS):", "met" if good else "NOT met")
    return summary, good


def print_cold(summary: dict) -> None:
    """One line per `serve --warmup` ROWS: start-up, and each wave's router share (p50)."""
    print(f"{summary['clients']} clients, {summary['worker_delay_s']:g} s workers: the "
          "router's share of the p50 (p50 latency, s)")
    print(f"{'serve --warmup':>14s} {'start-up s':>10s} {'errors':>6s} {'cold':>17s} "
          f"{'warm':>17s}")
    for name, run in summary["runs"].items():
        cells = [f"{run[w]['router_share_of_p50']} ({run[w]['latency_p50_s']})"
                 for w in ("cold", "warm")]
        errors = run["cold"]["errors"] + run["warm"]["errors"]
        print(f"{name.removeprefix('warmup_'):>14s} {run['startup_s']:>10g} {errors:>6d} "
              f"{cells[0]:>17s} {cells[1]:>17s}")


# -- main -----------------------------------------------------------------------------------

def common_arguments(p: argparse.ArgumentParser, clients: str) -> None:
    """The options `bench/serve.py` and `bench/serve_soak.py` share."""
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--clients", type=int, default=None, help=f"concurrent clients ({clients})")
    p.add_argument("--delay", type=float, default=1.0, help="seconds per worker completion")
    p.add_argument("--modes", default="auto",
                   help="modes the requests cycle through: auto (the router decides), single, "
                        "multi, agentic (forced)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--server-warmup", type=int, default=None, metavar="ROWS",
                   help="serve --warmup ROWS: compile the router's shapes before listening "
                        "(default: serve's own, --max-batch rows)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="run-config overrides passed to routeweaver serve")


def setup(args: argparse.Namespace) -> tuple[Path, Path, Any, list, Any]:
    """(a work directory, the router checkpoint: `--checkpoint`, else a random-init
    quickstart router built there, its run config, the run's synthetic questions, the
    simulated workers that know their answers)."""
    from jax_routeweaver.rl.run.train_config import load_train_config
    from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
    from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    checkpoint = args.checkpoint
    if checkpoint is None:  # with the quickstart's own 1,500 questions
        from serve_helpers import tiny_run

        quickstart = load_train_config(QUICKSTART, [])
        checkpoint = tiny_run(work, f"data.synthetic_queries="
                                    f"{quickstart.data.synthetic_queries}")[0]
    run_dir = checkpoint if (checkpoint / "config.yaml").is_file() else None
    cfg = load_train_config(run_dir / "config.yaml" if run_dir else QUICKSTART, [])
    d = cfg.data
    # Questions of the run's own synthetic set (the workers know their answers); the
    # warm-up uses others of the same set.
    tasks = synthetic_tasks(d.synthetic_queries, seed=d.synthetic_seed, levels=d.synthetic_levels)
    return work, checkpoint, cfg, tasks, SimulatedWorkerPool(tasks, seed=cfg.workers.seed)


def print_summary(summary: dict) -> None:
    for key, value in summary.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(p, "default 32; 64 with --cold")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--warmup", type=int, default=128,
                   help="requests of the untimed client warm-up pass (not with --cold, which "
                        "measures the cold start)")
    p.add_argument("--budgets", default="0.00025,0.0005,0.002,0.01",
                   help="max_cost values (USD) the requests cycle through")
    p.add_argument("--cold", default=None, metavar="ROWS[,ROWS...]",
                   help="cold start: for each ROWS a fresh `serve --warmup ROWS`, one cold "
                        "and one warm wave of --clients requests")
    args = p.parse_args()
    work, checkpoint, _, tasks, sim = setup(args)
    if args.cold:
        summary, _ = cold_start(args, checkpoint, work, sim, tasks)
    else:
        summary, _ = bench(args, checkpoint, work, sim, tasks)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else float("nan")


if __name__ == "__main__":
    sys.exit(main())
