"""Episode-runner overhead: 256 RouteWeaver episodes (32 queries x 8) on simulated workers.

Every worker call takes a fixed latency L. A perfectly concurrent runner needs
(dispatch rounds of the longest episode) x L of wall time: the critical-path bound. Prints the
wall time against that bound (the ratio the runner adds), and the environment's CPU time per
trajectory (parsing, prompts, framing, tokenising). The policy is a scripted stand-in (a third
of the episodes each single / multi / agentic) so the sampler costs almost nothing; never fails.

    .venv/bin/python bench/episodes.py [--queries 32 --repeats 8 --latency 0.2]

With `--json PATH` it also writes the measures and the ratio as JSON (`suite.write_bench_json`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from suite import write_bench_json

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.routing.episodes.episode import EpisodeStats, run_episodes
from jax_routeweaver.routing.episodes.routeweaver_env import EnvConfig, routeweaver_envs
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks
from jax_routeweaver.sampling.base import Completion, SamplingParams, apply_stop_strings

SCRIPTS = {  # router turns per mode; dispatch rounds: single 1, multi 2, agentic 2
    "single": ["<mode>single</mode>", '<route model="worker_3">Solve the question.</route>',
               "<answer>1</answer>"],
    "multi": ["<mode>multi</mode>", '<route model="worker_1">First part.</route>',
              '<route model="worker_5">Second part.</route>', "<answer>2</answer>"],
    "agentic": ["<mode>agentic</mode>",
                '<route model="worker_3" role="executor" refs="">Solve it.</route>\n'
                '<route model="worker_6" role="executor" refs="">Solve it too.</route><|im_end|>',
                '<route model="worker_5" role="summarizer" refs="n1,n2">Reconcile.</route>'
                "<|im_end|>", "<answer>3</answer>"],
}
DISPATCH_ROUNDS = {"single": 1, "multi": 2, "agentic": 2}


class ScriptedRouter:
    """A stand-in policy: the selector turn picks modes round-robin; later turns follow that
    mode's script, the position read off the response so far (script texts are distinct)."""

    policy_version = 0

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.selections = 0

    def generate(self, prompts, params: SamplingParams, grammars=None):
        return [self._turn(self.tok.decode(p), params) for p in prompts]

    def _turn(self, context: str, params: SamplingParams) -> Completion:
        response = context.split("<|im_start|>assistant\n", 1)[1]
        if not response:
            mode = ("single", "multi", "agentic")[self.selections % 3]
            self.selections += 1
            text = SCRIPTS[mode][0]
        else:
            script = SCRIPTS[response[len("<mode>"):response.index("</mode>")]]
            text = script[1 + sum(turn in response for turn in script[1:-1])]
        ids = self.tok.encode(text, add_special_tokens=False)
        c = Completion(ids, [-0.1] * len(ids), "length", None, self.policy_version)
        return apply_stop_strings(c, self.tok.decode, params.stop_strings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    tok = build_qwen3_tokenizer()
    tasks = synthetic_tasks(args.queries, seed=0)
    pool = SimulatedWorkerPool(tasks, seed=0, latency_s=args.latency)
    sampler = ScriptedRouter(tok)
    make_env = routeweaver_envs(tok, pool, EnvConfig())
    stats = EpisodeStats()
    start = time.perf_counter()
    trajs = run_episodes(tasks, sampler, pool, make_env, repeats=args.repeats, stats=stats)
    wall = time.perf_counter() - start
    bound = max(DISPATCH_ROUNDS[t.mode] for t in trajs) * args.latency
    answered = sum(t.finish == "answer" for t in trajs)
    calls = sum(len(t.calls) for t in trajs)

    table = Table("measure", "value")
    table.add_row("episodes", f"{len(trajs)} ({answered} answered, {calls} worker calls)")
    table.add_row("worker latency L", f"{args.latency:.3f} s")
    table.add_row("critical-path bound", f"{bound:.3f} s")
    table.add_row("wall time", f"{wall:.3f} s")
    table.add_row("wall / bound", f"{wall / bound:.2f}x")
    table.add_row("  of which sampler (scripted)", f"{stats.sampler_s:.3f} s")
    table.add_row("  of which worker waits", f"{stats.workers_s:.3f} s")
    table.add_row("env CPU per trajectory", f"{1000 * stats.env_cpu_s / len(trajs):.2f} ms")
    table.add_row("rounds", str(stats.rounds))
    Console().print(table)
    if args.json:
        row = dict(episodes=len(trajs), answered=answered, worker_calls=calls,
                   latency_s=args.latency, bound_s=bound, wall_s=wall, wall_over_bound=wall / bound,
                   sampler_s=stats.sampler_s, worker_waits_s=stats.workers_s,
                   env_cpu_ms_per_trajectory=1000 * stats.env_cpu_s / len(trajs),
                   rounds=stats.rounds)
        write_bench_json(
            args.json, "episodes", "critical-path bound: (dispatch rounds of the longest episode) "
            "x worker latency L, what a perfectly concurrent runner needs",
            [row], {"wall_over_bound": wall / bound},
            config={k: v for k, v in vars(args).items() if k != "json"})


if __name__ == "__main__":
    main()
