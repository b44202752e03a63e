"""The paged KV cache (`JaxSampler(kv_cache="paged")`) against the dense sampler (the reference).

Prints, never fails on speed. Two rollout mixes on the quickstart's tiny router shape (random
weights, CPU), each run by the dense sampler and by the paged engine at two pool budgets:
the dense sampler's own peak KV memory ("equal memory") and a third of it.

(a) `quickstart`: `--queries` queries x `--group` rollouts. Turn 1: a shared `--prefix`-token
    rulebook + the query (`--q-min`..`--q-max` tokens; the group's rollouts share it), up to 64
    new tokens. Turn 2: turn 1's prompt + its completion + an observation of 100-300 tokens,
    as an episode's next turn. The dense sampler runs the quickstart's setting (no prefix
    store: every turn prefills its whole prompt).
(b) `paper`: the paper's length profile scaled down by `--scale` (prompts up to 6k tokens,
    completions up to 16k, long-tailed: most short, a few very long), `--rows` rows in one call.
(c) `uniform`: the dense sampler's best case: `--rows` distinct prompts of exactly
    `--uniform-prompt` tokens, every completion exactly `--uniform-new` tokens, no shared
    prefix and no second turn (nothing for pages to share, no padding for dense to waste).

Completion lengths are set, not left to a random model: every row ends on a stop string that
the bench's detokeniser reports once a row has as many tokens as a length table assigns to
its first token (drawn from the mix's distribution), so both samplers generate exactly the
same lengths (and, up to float noise, the same tokens: the script counts identical rows).
Each arm runs the workload once to compile, then `--repeats` timed runs (median). Reported:
generated tokens / s, the ratio to dense, KV bytes (dense: its largest group's cache
`B x (P + N)`; paged: its whole pool) and the peak pages in use.

    .venv/bin/python bench/paged_sampler.py [--mix quickstart paper uniform] [--repeats 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.sampling.base import Completion, SamplingParams
from jax_routeweaver.sampling.dense_buckets import DEFAULT_BATCH_BUCKETS
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.paged_options import PagedConfig, kv_bytes_per_token

STOP = "<stop>"
Workload = Callable[[JaxSampler], list[Completion]]


@dataclasses.dataclass
class Arm:
    name: str
    seconds: float
    tokens: int
    kv_bytes: int
    peak_bytes: int
    outputs: list[list[int]]


def length_decoder(table: np.ndarray) -> Callable[[list[int]], str]:
    """A detokeniser whose text holds STOP once a row has table[first token] tokens."""
    def decode(ids: list[int]) -> str:
        ids = list(ids)
        done = bool(ids) and len(ids) >= table[ids[0] % len(table)]
        return "x" * len(ids) + (STOP if done else "")
    return decode


def quickstart_mix(args: argparse.Namespace, vocab: int) -> tuple[Workload, np.ndarray, int]:
    rng = np.random.default_rng(args.seed)
    prefix = rng.integers(1, vocab, args.prefix).tolist()
    queries = [prefix + rng.integers(1, vocab, rng.integers(args.q_min, args.q_max + 1)).tolist()
               for _ in range(args.queries)]
    prompts = [q for q in queries for _ in range(args.group)]
    obs = [rng.integers(1, vocab, rng.integers(100, 301)).tolist() for _ in prompts]
    # Router turns: a few to a few dozen tokens.
    table = np.clip(rng.geometric(1 / 16, vocab), 3, 64)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=args.seed,
                            stop_strings=(STOP,))

    def run(sampler: JaxSampler) -> list[Completion]:
        first = sampler.generate(prompts, params)
        second = sampler.generate([p + c.token_ids + o for p, c, o in
                                   zip(prompts, first, obs, strict=True)], params)
        return first + second

    return run, table, len(prompts)


def paper_mix(args: argparse.Namespace, vocab: int) -> tuple[Workload, np.ndarray, int]:
    rng = np.random.default_rng(args.seed)
    max_prompt, max_new = 6144 // args.scale, 16384 // args.scale
    lengths = rng.integers(max_prompt // 4, max_prompt + 1, args.rows)
    prompts = [rng.integers(1, vocab, n).tolist() for n in lengths]
    # Long-tailed: lognormal, median 1/20 of the cap; ~2-3 % of rows past half of it.
    table = np.clip(np.round(rng.lognormal(np.log(max_new / 20), 1.2, vocab)), 4,
                    max_new).astype(int)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=args.seed,
                            stop_strings=(STOP,))
    return (lambda sampler: sampler.generate(prompts, params)), table, args.rows


def uniform_mix(args: argparse.Namespace, vocab: int) -> tuple[Workload, np.ndarray, int]:
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, vocab, args.uniform_prompt).tolist() for _ in range(args.rows)]
    table = np.full(vocab, args.uniform_new)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.uniform_new, seed=args.seed,
                            stop_strings=(STOP,))
    return (lambda sampler: sampler.generate(prompts, params)), table, args.rows


MIXES = {"quickstart": quickstart_mix, "paper": paper_mix, "uniform": uniform_mix}


def measure(name: str, sampler: JaxSampler, workload: Workload, repeats: int,
            per_token: int) -> Arm:
    def cold() -> list[Completion]:
        # Each run starts without the pages of the one before (same prompts: it would reuse
        # them all); within a run, turn 2 finds turn 1's pages as an episode's next turn does.
        if sampler.engine is not None:
            sampler.engine.invalidate()
        return workload(sampler)

    outputs = cold()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = cold()
        times.append(time.perf_counter() - start)
    tokens = sum(len(c.token_ids) for c in outputs)
    if sampler.engine is None:
        kv = max(b * (p + n) for b, p, n in sampler.shape_state()) * per_token
        peak = kv
        kv += sampler.prefix_store.max_bytes
    else:
        kv = sampler.engine.pool_bytes
        peak = sampler.engine.last_call.peak_pages * sampler.engine.options.page_size * per_token
    return Arm(name, statistics.median(times), tokens, kv, peak,
               [c.token_ids for c in outputs])


def run_mix(mix: str, args: argparse.Namespace, model: Qwen3, console: Console) -> None:
    cfg = model.config
    workload, table, rows = MIXES[mix](args, cfg.vocab_size)
    decode = length_decoder(table)
    per_token = kv_bytes_per_token(cfg)
    buckets = sorted({*DEFAULT_BATCH_BUCKETS, rows})
    dense = JaxSampler(model, decode=decode, batch_buckets=buckets)
    arms = [measure("dense (reference)", dense, workload, args.repeats, per_token)]
    dense_tokens = arms[0].kv_bytes // per_token
    if mix == "quickstart":
        # The dense engine's best setting for multi-turn calls: its copy-based prefix store
        # (turn 2 reuses turn 1's caches), given the memory of its own largest cache.
        stored = JaxSampler(model, decode=decode, batch_buckets=buckets,
                            prefix_cache_mb=arms[0].kv_bytes / 2**20)
        arms.append(measure("dense + prefix store", stored, workload, args.repeats,
                            per_token))
    max_rows = {"quickstart": args.qs_rows, "paper": args.paper_rows}.get(mix, rows)
    for label, budget in (("paged, equal memory", dense_tokens),
                          ("paged, 1/3 memory", dense_tokens // 3)):
        options = PagedConfig(page_size=args.page, budget_tokens=int(budget),
                               max_rows=max_rows, steps_per_sync=args.sync)
        paged = JaxSampler(model, decode=decode, kv_cache="paged", paged=options)
        arm = measure(label, paged, workload, args.repeats, per_token)
        stats = paged.engine.last_call
        console.print(f"  {label}: {stats}")
        arms.append(arm)
    report(mix, arms, console)


def report(mix: str, arms: list[Arm], console: Console) -> None:
    ref = arms[0]
    table = Table(title=f"{mix}: generated tokens / s (median), KV memory")
    for col in ("sampler", "s", "tokens", "tok/s", "tok/s vs dense", "KV MiB",
                "KV vs dense", "peak in use MiB", "rows = dense"):
        table.add_column(col, justify="left" if col == "sampler" else "right")
    for arm in arms:
        same = sum(a == b for a, b in zip(arm.outputs, ref.outputs, strict=True))
        table.add_row(arm.name, f"{arm.seconds:.2f}", str(arm.tokens),
                      f"{arm.tokens / arm.seconds:.0f}",
                      f"{(arm.tokens / arm.seconds) / (ref.tokens / ref.seconds):.2f}x",
                      f"{arm.kv_bytes / 2**20:.1f}", f"{arm.kv_bytes / ref.kv_bytes:.2f}",
                      f"{arm.peak_bytes / 2**20:.1f}", f"{same}/{len(ref.outputs)}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--sync", type=int, default=8, help="paged steps_per_sync")
    ap.add_argument("--queries", type=int, default=10)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--q-min", type=int, default=100)
    ap.add_argument("--q-max", type=int, default=1300)
    ap.add_argument("--qs-rows", type=int, default=40, help="paged max_rows, quickstart mix")
    ap.add_argument("--rows", type=int, default=64, help="rows of the paper mix")
    ap.add_argument("--scale", type=int, default=16, help="paper lengths divided by this")
    ap.add_argument("--uniform-prompt", type=int, default=256, help="uniform mix: prompt")
    ap.add_argument("--uniform-new", type=int, default=32, help="uniform mix: completion")
    ap.add_argument("--paper-rows", type=int, default=16, help="paged max_rows, paper mix")
    args = ap.parse_args(argv)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=8192,
                      tie_word_embeddings=True, causal_parts=8)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    console = Console(width=150)
    console.print(f"{os.cpu_count()} cpus; router: vocab {args.vocab}, hidden {args.hidden}, "
                  f"{args.layers} layers; KV {kv_bytes_per_token(cfg)} B/token")
    for mix in args.mix:
        start = time.perf_counter()
        run_mix(mix, args, model, console)
        console.print(f"  ({mix}: {time.perf_counter() - start:.0f} s in all, compiles "
                      "included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
