"""The last layer run at the gathered positions only (`Qwen3.hidden_states(gather=...)`)
against the full last layer gathered after: seconds per update and per prefill.

Prints, never fails on speed. The update: `bench/length_groups.py`'s batch (the quickstart's
router, `--rows` rows of `[--min-len, --max-len]` tokens with `--policy` policy tokens each,
length-sorted micro-batches, k3 KL on so the reference pass runs too). The prefill: the
sampler's, `--prefill-rows` left-padded prompts of `--prefill-len` tokens into a fresh cache,
logits at the last position. The reference is the same code with `gather` ignored until the
final norm (every layer at every position, then the gathered rows), as before the change.

First both sides compute the same gradient (and prefill logits) from the same weights and the
script checks that they agree (exits 1 beyond 1e-4 relative: then the timing would compare
different work). Then the median of `--repeats` runs per side.

    .venv/bin/python bench/last_layer.py [--rows 40 --layers 2 --repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from length_groups import add_batch_args, drawn_batch, flat, router_config
from rich.console import Console
from rich.table import Table

from jax_routeweaver.models.qwen3 import Qwen3, init_cache
from jax_routeweaver.models.sharding import create_sharded, make_mesh
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch

TOLERANCE = 1e-4


@contextlib.contextmanager
def full_last_layer() -> Iterator[None]:
    """`Qwen3.hidden_states` with `gather` applied after the full pass (the reference)."""
    original = Qwen3.hidden_states

    def full(self, *args, gather=None, **kwargs):
        hidden, cache = original(self, *args, **kwargs)
        if gather is not None:
            hidden = jnp.take_along_axis(hidden, gather[..., None], axis=1)
        return hidden, cache

    Qwen3.hidden_states = full
    try:
        yield
    finally:
        Qwen3.hidden_states = original


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn(), fn()  # compile, then once more with the arguments as a step returns them
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    ap.add_argument("--prefill-rows", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=1024)
    args = ap.parse_args(argv)

    cfg = router_config(args)
    lengths, batch = drawn_batch(args)
    mesh = make_mesh((1, -1, 1))  # as the training loop places the quickstart's router
    loss = LossConfig(micro_batch_size=args.micro, kl_coef=0.001, group_by_length=True)
    sides = {"full last layer (reference)": full_last_layer, "gathered": contextlib.nullcontext}
    trainers = {name: Trainer(create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), mesh),
                              OptimConfig(lr=1e-3), loss, temperature=1.0, mesh=mesh)
                for name in sides}

    rng = np.random.default_rng(args.seed + 1)
    B, P = args.prefill_rows, args.prefill_len
    pads = rng.integers(0, P // 2, B)
    mask = jnp.asarray(np.arange(P)[None] >= pads[:, None])
    tokens = jnp.asarray(rng.integers(0, args.vocab, (B, P)), jnp.int32) * mask
    positions = jnp.clip(jnp.cumsum(mask, 1) - 1, 0)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def prefill(state):
        m = nnx.merge(graphdef, state)
        cache = init_cache(cfg, B, P + 16)
        h, cache = m.hidden_states(tokens, positions, mask, cache, empty_cache=True,
                                   gather=jnp.full((B, 1), P - 1))
        return m.logits(h[:, 0]), cache.k

    console = Console()
    grads, logits, prefills = {}, {}, {}
    for name, side in sides.items():
        with side():
            grads[name] = flat(trainers[name].gradients(UpdateBatch(**batch))[0])
            # A new jit per side: jit would reuse the first side's trace.
            prefills[name] = jax.jit(lambda s: prefill(s)).lower(state).compile()
            logits[name] = np.asarray(prefills[name](state)[0])
    ref, got = grads.values()
    rel = float(np.abs(ref - got).max() / np.abs(ref).max())
    a, b = logits.values()
    rel_logits = float(np.abs(a - b).max() / np.abs(a).max())
    console.print(f"rows {args.rows}, lengths {lengths.min()}-{lengths.max()}; {args.layers} "
                  f"layers; gradient max rel diff {rel:.2e}; prefill logits {rel_logits:.2e}")
    if max(rel, rel_logits) > TOLERANCE:
        console.print(f"[red]the sides differ by more than {TOLERANCE}: not the same work")
        return 1

    times: dict[str, dict[str, float]] = {}
    for name, side in sides.items():
        with side():
            trainer = trainers[name]
            times[name] = {
                "update": median_time(
                    lambda t=trainer: (t.update(UpdateBatch(**batch)), t.state.params)[1],
                    args.repeats),
                "prefill": median_time(lambda c=prefills[name]: c(state), args.repeats)}
    table = Table(title=f"median of {args.repeats} (s)")
    for col in ("last layer", "update", f"prefill [{B}, {P}]"):
        table.add_column(col, justify="right" if col != "last layer" else "left")
    for name, t in times.items():
        table.add_row(name, f"{t['update']:.3f}", f"{t['prefill']:.4f}")
    console.print(table)
    ref_t, new_t = times.values()
    console.print(f"speed-up of the gathered last layer: update "
                  f"{ref_t['update'] / new_t['update']:.2f}x, prefill "
                  f"{ref_t['prefill'] / new_t['prefill']:.2f}x "
                  f"({jax.device_count()} device(s), {os.cpu_count()} cpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
