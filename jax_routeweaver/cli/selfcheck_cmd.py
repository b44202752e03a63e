"""`routeweaver selfcheck`: every part of the project end to end on CPU in about a minute,
one table row per stage; exit 1 if a check fails."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from jax_routeweaver.cli.common import Command
from jax_routeweaver.cli.sandbox_cmd import sandbox_row

# Every part end to end on CPU, no keys: real Qwen3 tokenizer (offline), a tiny Qwen3 router
# born sharded over the local devices, an orbax policy checkpoint and its restore, HF export
# checked against transformers, a chat-templated generation through the in-process JAX
# sampler, and RouteWeaver episodes of the (random-init, grammar-constrained) router against
# the simulated worker pool.
QUICKSTART_ROUTER = dict(vocab_size=151_936, hidden_size=64, intermediate_size=192, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=5_000_000.0,
                         tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=151_643, eos_token_id=151_645, pad_token_id=151_643)


def _quickstart_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/selfcheck"),
                   help="output directory (default: runs/selfcheck; replaced if it exists)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--queries", type=int, default=4, help="synthetic queries for the episodes")
    p.add_argument("--repeats", type=int, default=2, help="episodes per query")


def _quickstart(args: argparse.Namespace) -> int:
    import shutil

    import jax
    import numpy as np
    import torch
    from flax import nnx
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.models.hf import save_hf
    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.models.sharding import create_sharded, describe, make_mesh
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.rl.run.checkpoint import restore_policy, save_policy
    from jax_routeweaver.sampling.base import SamplingParams
    from jax_routeweaver.sampling.jax_sampler import JaxSampler

    console = Console()
    shutil.rmtree(args.out, ignore_errors=True)
    table = Table("stage", "result")
    tokenizer = build_qwen3_tokenizer()
    tokenizer.save_pretrained(str(args.out / "tokenizer"))
    table.add_row("tokenizer", f"Qwen3, {len(tokenizer):,} tokens (built offline)")

    cfg = ModelConfig(**QUICKSTART_ROUTER)
    mesh = make_mesh((1, -1, 1))
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(args.seed)), mesh)
    n_params = sum(int(np.prod(shape)) for shape, _ in describe(model).values())
    table.add_row("router", f"tiny Qwen3, {n_params:,} params on mesh {dict(mesh.shape)}")

    save_policy(model, args.out / "checkpoints", 0, tokenizer_dir=args.out / "tokenizer")
    model, step = restore_policy(args.out / "checkpoints", mesh=mesh)
    table.add_row("orbax", f"saved and restored step {step} ({args.out / 'checkpoints'})")

    messages = [{"role": "user", "content": "Which worker should answer: what is 17 * 23?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    save_hf(model, args.out / "hf", tokenizer=args.out / "tokenizer")
    hf_model = AutoModelForCausalLM.from_pretrained(args.out / "hf").eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    ours, _ = model(*(jax.numpy.asarray(a) for a in ([ids], [list(range(len(ids)))],
                                                     [[1] * len(ids)])))
    diff = float(np.abs(np.asarray(ours) - ref).max())
    table.add_row("HF export", f"{args.out / 'hf'}; transformers logits max |diff| {diff:.2e}")

    sampler = JaxSampler(model, decode=tokenizer.decode, pad_id=cfg.pad_token_id)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=(cfg.eos_token_id,),
                            stop_strings=("</route>", "</answer>"), seed=args.seed)
    out = sampler.generate([ids], params)[0]
    table.add_row("sampler", f"{len(out.token_ids)} tokens, finish={out.finish_reason}, "
                             f"mean logprob {np.mean(out.logprobs):.2f}")
    trajs = _quickstart_episodes(args, tokenizer, model, cfg)
    modes = Counter(t.mode for t in trajs)
    finishes = Counter(t.finish for t in trajs)
    cost = sum(t.cost.cost_usd for t in trajs)
    table.add_row("episodes", f"{len(trajs)} on simulated workers: modes {dict(modes)}, "
                              f"finish {dict(finishes)}, {sum(len(t.calls) for t in trajs)} "
                              f"calls, ${cost:.6f}")
    sandbox_line, sandbox_ok = sandbox_row()
    table.add_row("sandbox", sandbox_line)
    console.print(table)
    console.print("[bold]generation[/] (random weights: expect noise)",
                  repr(tokenizer.decode(out.token_ids)))
    violations = [t.violation for t in trajs if t.violation is not None]
    return 0 if diff < 1e-4 and not violations and sandbox_ok else 1


def _quickstart_episodes(args: argparse.Namespace, tokenizer, model, cfg) -> list:
    """RouteWeaver episodes of the router against the simulated pool (a simulation of paid
    LLM APIs); grammar constraints keep every action of the random-init router valid."""
    from jax_routeweaver.rewards.feedback import execution_feedback
    from jax_routeweaver.routing.episodes.episode import run_episodes
    from jax_routeweaver.routing.episodes.routeweaver_env import EnvConfig, routeweaver_envs
    from jax_routeweaver.routing.pools.pricing import REFERENCE_PRICES
    from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
    from jax_routeweaver.routing.simulated.tasks import synthetic_tasks
    from jax_routeweaver.sampling.base import SamplingParams
    from jax_routeweaver.sampling.constraints import GrammarConstraints
    from jax_routeweaver.sampling.jax_sampler import JaxSampler

    tasks = synthetic_tasks(args.queries, seed=args.seed)
    pool = SimulatedWorkerPool(tasks, seed=args.seed)
    sampler = JaxSampler(model, decode=tokenizer.decode, pad_id=cfg.pad_token_id,
                         constraints=GrammarConstraints(tokenizer, cfg.vocab_size))
    config = EnvConfig(sampling=SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=96,
                                               seed=args.seed), constrained=True,
                       feedback=execution_feedback())
    return run_episodes(tasks, sampler, pool, routeweaver_envs(tokenizer, pool, config),
                        repeats=args.repeats, prices=REFERENCE_PRICES)


SELFCHECK = Command("selfcheck", "check every part end to end on CPU in about a minute "
                    "(tokenizer, sharded model, orbax, HF export parity, sampler, episodes, "
                    "code sandbox)", _quickstart_arguments, _quickstart)
