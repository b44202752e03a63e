"""Model throughput against transformers (torch eager, fp32) on the same random weights.

Prints, never fails:
  1. forward+backward tokens/s of the jitted Qwen3 (chunked logprob loss) vs transformers'
     forward+backward with its cross-entropy loss, same config and batch;
  2. greedy decode tokens/s of `JaxSampler` vs `transformers.generate` (greedy, KV cache).

    .venv/bin/python bench/model.py [--layers 4 --hidden 256 --vocab 32000 --batch 8 --seq 256]

With `--json PATH` it also writes the two rows and ratios as JSON (`suite.write_bench_json`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from rich.console import Console
from rich.table import Table
from suite import write_bench_json
from transformers import Qwen3Config, Qwen3ForCausalLM

from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import token_logprobs
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.jax_sampler import JaxSampler


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, after one warm-up (compile) run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_step_bench(hf_model, model, batch: int, seq: int, repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (batch, seq))
    positions = np.broadcast_to(np.arange(seq), (batch, seq))
    mask = np.ones((batch, seq), np.int32)
    args = tuple(jnp.asarray(a) for a in (tokens, positions, mask))

    @nnx.jit
    def step(m, t, p, a):
        return nnx.value_and_grad(lambda m: -token_logprobs(m, t, p, a).mean())(m)

    def run_jax():
        loss, grads = step(model, *args)
        jax.block_until_ready((loss, grads))

    ids = torch.tensor(tokens)

    def run_torch():
        hf_model.zero_grad(set_to_none=True)
        hf_model(input_ids=ids, labels=ids).loss.backward()

    return timed(run_jax, repeats), timed(run_torch, repeats)


def decode_bench(hf_model, model, batch: int, prompt: int, new: int,
                 repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, model.config.vocab_size, (batch, prompt))
    sampler = JaxSampler(model)
    # No stop token: both sides generate exactly `new` tokens per row.
    params = SamplingParams(greedy=True, max_new_tokens=new)

    def run_jax():
        sampler.generate([list(map(int, p)) for p in prompts], params)

    ids = torch.tensor(prompts)

    def run_torch():
        with torch.no_grad():
            hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=0)

    return timed(run_jax, repeats), timed(run_torch, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 32, num_key_value_heads=max(
                             1, args.hidden // 64), head_dim=32, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    hf_model = Qwen3ForCausalLM(config).float()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(Path(tmp))
        model = load_hf(tmp)

    console = Console()
    console.print(f"jax {jax.__version__} on {jax.devices()[0].platform} "
                  f"({len(jax.devices())} device(s)), torch {torch.__version__} with "
                  f"{torch.get_num_threads()} threads; config: layers={args.layers} "
                  f"hidden={args.hidden} vocab={args.vocab}")
    table = Table("benchmark", "shape", "ours", "transformers (torch eager)", "ratio ours/ref")
    rows = []

    hf_model.train()
    t_jax, t_torch = train_step_bench(hf_model, model, args.batch, args.seq, args.repeats)
    tokens = args.batch * args.seq
    table.add_row("forward+backward", f"B={args.batch} T={args.seq}",
                  f"{tokens / t_jax:,.0f} tok/s", f"{tokens / t_torch:,.0f} tok/s",
                  f"{t_torch / t_jax:.2f}x")
    rows.append(dict(benchmark="forward+backward", batch=args.batch, seq=args.seq,
                     ours_tok_s=tokens / t_jax, transformers_tok_s=tokens / t_torch,
                     ratio_ours_over_ref=t_torch / t_jax))

    hf_model.eval()
    t_jax, t_torch = decode_bench(hf_model, model, args.batch, args.prompt, args.new_tokens,
                                  args.repeats)
    tokens = args.batch * args.new_tokens
    table.add_row("greedy decode", f"B={args.batch} prompt={args.prompt} new={args.new_tokens}",
                  f"{tokens / t_jax:,.0f} tok/s", f"{tokens / t_torch:,.0f} tok/s",
                  f"{t_torch / t_jax:.2f}x")
    rows.append(dict(benchmark="greedy decode (JaxSampler vs generate)", batch=args.batch,
                     prompt=args.prompt, new_tokens=args.new_tokens, ours_tok_s=tokens / t_jax,
                     transformers_tok_s=tokens / t_torch, ratio_ours_over_ref=t_torch / t_jax))
    console.print(table)
    if args.json:
        write_bench_json(
            args.json, "model", "transformers Qwen3ForCausalLM (torch eager, fp32), same random "
            "weights: forward+backward with its cross-entropy loss; greedy `generate`, KV cache",
            rows, {"forward_backward_ours_over_transformers": rows[0]["ratio_ours_over_ref"],
                   "greedy_decode_ours_over_transformers": rows[1]["ratio_ours_over_ref"]},
            config={k: v for k, v in vars(args).items() if k != "json"})


if __name__ == "__main__":
    main()
