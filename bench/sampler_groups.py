"""`JaxSampler` cutting a call into length groups against one group padded to the longest prompt.

Prints, never fails on speed. One `generate` call of `--rows` prompts whose lengths are drawn
uniformly from `[--min-len, --max-len]` (a quickstart round: 40 rows of 300 to 1,600 tokens)
on the quickstart's tiny router (`--hidden`, `--layers`, vocabulary, `causal_parts`), sampled
at temperature 1 for up to `--new` tokens with a fixed seed. The reference is the sampler with
`group_cost=None`: the whole call as one group, every prompt left-padded to the longest one's
bucket and the batch to its bucket.

Both samplers first run the call once (which compiles) and the script checks that they drew
the same tokens (every row samples from its own stream, so the cut must not change them; exits
1 otherwise). Then the median of `--repeats` calls per side.

    .venv/bin/python bench/sampler_groups.py [--rows 40 --min-len 300 --max-len 1600
                                              --new 32 --repeats 5]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.dense_buckets import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_PROMPT_BUCKETS,
    GROUP_COST,
    length_groups,
    pick_bucket,
)
from jax_routeweaver.sampling.jax_sampler import JaxSampler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1600)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--causal-parts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_layers=args.layers, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=8192,
                      tie_word_embeddings=True, causal_parts=args.causal_parts)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_len, args.max_len + 1, args.rows)
    prompts = [rng.integers(1, args.vocab, n).tolist() for n in lengths]
    # Stop tokens are off: every row decodes --new tokens, so both sides do the same steps.
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=args.seed)
    # The loop's batch buckets: the defaults plus the round's row count.
    batch_buckets = sorted({*DEFAULT_BATCH_BUCKETS, args.rows})
    samplers = {name: JaxSampler(model, batch_buckets=batch_buckets, group_cost=cost)
                for name, cost in (("one group (reference)", None), ("length groups", GROUP_COST))}

    outputs = {name: s.generate(prompts, params) for name, s in samplers.items()}
    ref, got = ([c.token_ids for c in out] for out in outputs.values())
    console = Console()
    ordered = sorted(int(n) for n in lengths)
    ends = length_groups(ordered, DEFAULT_PROMPT_BUCKETS, batch_buckets)
    shapes = [(pick_bucket(e - s, batch_buckets), pick_bucket(ordered[e - 1],
                                                              DEFAULT_PROMPT_BUCKETS))
              for s, e in itertools.pairwise([0, *ends])]
    whole = (pick_bucket(args.rows, batch_buckets),
             pick_bucket(max(ordered), DEFAULT_PROMPT_BUCKETS))
    console.print(f"rows {args.rows}, prompt lengths {min(ordered)}-{max(ordered)} (mean "
                  f"{np.mean(ordered):.0f}); one group {whole}, length groups (B, P) {shapes}")
    if ref != got:
        console.print("[red]the two samplers drew different tokens: not the same work")
        return 1

    times = {}
    for name, sampler in samplers.items():
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            sampler.generate(prompts, params)
            runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    table = Table(title=f"generate, median of {args.repeats} (s)")
    table.add_column("sampler")
    table.add_column("s / call", justify="right")
    table.add_column("padded prompt tokens", justify="right")
    padded = {"one group (reference)": whole[0] * whole[1],
              "length groups": sum(b * p for b, p in shapes)}
    for name, t in times.items():
        table.add_row(name, f"{t:.3f}", str(padded[name]))
    console.print(table)
    ratio = times["one group (reference)"] / times["length groups"]
    console.print(f"speed-up of length groups over one group: {ratio:.2f}x "
                  f"({jax.device_count()} device(s), {os.cpu_count()} cpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
