"""`loss.group_by_length` against padding every row to the longest: seconds per update.

Prints, never fails on speed. One RL batch of the embedded default's shape (`--rows` rows,
`--micro` per micro-batch, the quickstart's tiny router: `--hidden`, `--layers`, vocabulary,
`causal_parts`) whose row lengths are drawn uniformly from `[--min-len, --max-len]` (the
quickstart's rows run from about 300 to 1,600 tokens: a ~200-token prompt, then 100 to 1,400
tokens of actions and observations; `episode/response_tokens_max` in its metrics). Each row
has `--policy` policy tokens at the end of its prompt and among its observations, and the
update takes the loop's layout (logprobs at those positions only, `index`).

First both trainers take the same step from the same weights, and the script checks that
their accumulated gradients agree (exits 1 beyond 1e-4 relative: then the timing would
compare different work). That also compiles; then the median of `--repeats` updates per side.
The reference is the plain update (`group_by_length: false`, one `lax.scan` over
micro-batches padded to the batch's length bucket).

    .venv/bin/python bench/length_groups.py [--rows 40 --micro 4 --min-len 300
                                             --max-len 1600 --repeats 5]
"""

from __future__ import annotations

import argparse
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
from jax_routeweaver.models.sharding import create_sharded, make_mesh
from jax_routeweaver.rl.core.shapes import length_bucket
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch

TOLERANCE = 1e-4


def make_batch(rows: int, lengths: np.ndarray, policy: int, vocab: int,
               seed: int) -> dict[str, np.ndarray]:
    """Right-padded rows to the batch's length bucket; ``policy`` policy tokens per row
    (the first 8 after a 200-token prompt, the rest spread over the observations), the
    first 4 of them the mode span on every other row; per-row advantages."""
    rng = np.random.default_rng(seed)
    width = length_bucket(int(lengths.max()))
    tokens = rng.integers(0, vocab, (rows, width)).astype(np.int32)
    mask = np.arange(width)[None] < lengths[:, None]
    index = np.ones((rows, policy), np.int32)
    for i, n in enumerate(lengths):
        prompt = min(200, int(n) - policy)
        rest = rng.choice(np.arange(prompt + 8, n), policy - 8, replace=False)
        index[i] = np.concatenate([np.arange(prompt, prompt + 8), np.sort(rest)])
    valid = np.ones((rows, policy), np.float32)
    mode = np.zeros((rows, policy), np.float32)
    mode[::2, :4] = 1.0
    adv = rng.normal(size=(rows, 1)).astype(np.float32) * valid
    return dict(tokens=tokens, attention_mask=mask, index=index, response_mask=valid,
                mode_mask=mode, advantages=adv, clean=np.ones(rows, bool),
                positions=np.broadcast_to(np.arange(width, dtype=np.int32),
                                          (rows, width)).copy())


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """The batch and router flags this script shares with `bench/last_layer.py`."""
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1600)
    ap.add_argument("--policy", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--causal-parts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)


def router_config(args: argparse.Namespace) -> ModelConfig:
    """The quickstart's router (`configs/quickstart.yaml`) at the flags' sizes."""
    return ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=3 * args.hidden, num_layers=args.layers,
                       num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=8192,
                       tie_word_embeddings=True, logprob_chunk=256,
                       causal_parts=args.causal_parts)


def drawn_batch(args: argparse.Namespace) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The flags' row lengths (uniform in ``[--min-len, --max-len]``) and their batch."""
    lengths = np.random.default_rng(args.seed).integers(args.min_len, args.max_len + 1,
                                                         args.rows)
    return lengths, make_batch(args.rows, lengths, args.policy, args.vocab, args.seed)


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(ap)
    args = ap.parse_args(argv)

    cfg = router_config(args)
    lengths, batch = drawn_batch(args)
    mesh = make_mesh((1, -1, 1))  # as the training loop places the quickstart's router
    trainers = {}
    for name, grouped in (("padded (reference)", False), ("group_by_length", True)):
        loss = LossConfig(micro_batch_size=args.micro, kl_coef=0.001, group_by_length=grouped)
        trainers[name] = Trainer(create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), mesh),
                                 OptimConfig(lr=1e-3), loss, temperature=1.0, mesh=mesh)

    grads = {name: flat(t.gradients(UpdateBatch(**batch))[0]) for name, t in trainers.items()}
    ref, got = grads.values()
    rel = float(np.abs(ref - got).max() / np.abs(ref).max())
    console = Console()
    grouped = trainers["group_by_length"]
    groups = grouped.length_groups(batch["attention_mask"])
    # None: the cut saves too little (GROUP_MIN_SAVING), the trainer runs the plain scan.
    cuts = sorted(cut for _, cut in groups) if groups else [batch["tokens"].shape[1]] * (
        args.rows // args.micro)
    console.print(f"rows {args.rows}, lengths {lengths.min()}-{lengths.max()} (mean "
                  f"{lengths.mean():.0f}), padded to {batch['tokens'].shape[1]}; grouped "
                  f"micro-batch lengths {cuts}{'' if groups else ' (not cut)'}; gradient "
                  f"max rel diff {rel:.2e}")
    if rel > TOLERANCE:
        console.print(f"[red]gradients differ by {rel:.2e} > {TOLERANCE}: not the same work")
        return 1

    times = {}
    for name, trainer in trainers.items():
        for _ in range(2):  # compile (the second: params placed as the update returns them)
            trainer.update(UpdateBatch(**batch))
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            trainer.update(UpdateBatch(**batch))
            jax.block_until_ready(trainer.state.params)
            runs.append(time.perf_counter() - start)
        times[name] = statistics.median(runs)
    table = Table(title=f"update, median of {args.repeats} (s)")
    table.add_column("layout")
    table.add_column("s / update", justify="right")
    table.add_column("padded tokens", justify="right")
    padded = {"padded (reference)": args.rows * batch["tokens"].shape[1],
              "group_by_length": args.micro * sum(cuts)}
    for name, t in times.items():
        table.add_row(name, f"{t:.3f}", str(padded[name]))
    console.print(table)
    ratio = times["padded (reference)"] / times["group_by_length"]
    console.print(f"speed-up of group_by_length over padding: {ratio:.2f}x "
                  f"({jax.device_count()} device(s), {os.cpu_count()} cpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
