"""RL train-step throughput against a PyTorch step computing the same loss (fp32, eager).

Prints, never fails on speed: tokens/s (B·T per second) of one full optimizer step —
reference logprobs, forward, backward, grad-norm clip, AdamW — of our jitted
`Trainer.update` (full `[N, L]` layout, `index=None`, one micro-batch) vs a straightforward
transformers + torch step on the same random Qwen3 weights and the same batch:

  - logprobs at temperature 0.8 (full logits / T, `log_softmax`, gather);
  - PPO dual clip (0.2 / 0.2, c = 3, log-ratio clamp ±20) with old = detached current
    logprobs (one optimizer step per batch), segment reduction
    `Σ_mode ℓ / N_mode + Σ_inner ℓ / N_inner`, plus `0.001 · Σ k3_kl / N_tokens` against a
    frozen copy of the initial model;
  - `clip_grad_norm_(1.0)`, `AdamW(lr=1e-6, weight_decay=0.01)`.

First both sides take one step from identical weights and the script checks that they agree
(loss, pre-clip grad norm; the token logprob gap is printed): it exits 1 when loss or grad
norm differ by more than 1e-3 relative, since then the timing compares different work.
That step doubles as the warm-up (compile); then the median of `--repeats` steps per side.

    .venv/bin/python bench/train_step.py [--layers 4 --hidden 256 --vocab 32000 --batch 8
                                          --seq 256 --repeats 5 --causal-parts 1]

With `--json PATH` it also writes both tables and the ratio as JSON (`suite.write_bench_json`);
nothing is written when the first-step check fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from suite import write_bench_json
from tiny_models import make_hf_model

TEMPERATURE = 0.8
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.2, 3.0
LOG_RATIO_CLAMP, KL_VALUE_CLAMP = 20.0, 10.0
KL_COEF = 0.001
TOLERANCE = 1e-3  # relative; beyond it the two sides do not compute the same step


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens; the response is the last 3/4 of each row with ~10% holes (env
    tokens); the mode span is the first 4 response tokens of every other row; per-token
    advantages (one value on the mode span, another on the rest, as the estimator gives);
    every row clean."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    attention_mask = np.ones((batch, seq), bool)
    start = seq // 4
    col = np.arange(seq)[None]
    response = (col >= start) & (rng.random((batch, seq)) >= 0.1)
    response[:, start] = True  # the mode span starts on a response token
    mode = response & (col < start + 4) & (np.arange(batch) % 2 == 0)[:, None]
    a_mode = rng.normal(size=(batch, 1))
    a_inner = rng.normal(size=(batch, 1))
    advantages = np.where(mode, a_mode, a_inner) * response
    return dict(tokens=tokens, positions=positions, attention_mask=attention_mask,
                response_mask=response.astype(np.float32), mode_mask=mode.astype(np.float32),
                advantages=advantages.astype(np.float32), clean=np.ones(batch, bool))


# ------------------------------------------------------------------ torch reference


def torch_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """`[B, T]`: out[:, t] = log softmax(logits[:, t-1] / T)[ids[:, t]], out[:, 0] = 0
    (the layout of our `token_logprobs`), through the full `[B, T, V]` logits."""
    logits = model(input_ids=ids).logits[:, :-1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0))


def ppo_sum(logp, old, adv, mask) -> torch.Tensor:
    """Σ_mask of the dual-clip PPO loss (verl `vanilla`)."""
    logp, old, adv = (torch.where(mask > 0, x, 0.0) for x in (logp, old, adv))
    ratio = torch.exp(torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, clipped), clipped)
    return (loss * mask).sum()


def torch_loss(logp, ref_logp, adv, response, mode, clean) -> torch.Tensor:
    """Segment reduction + k3 KL, with the same masks and denominators as `losses.py`."""
    row = clean[:, None]
    mode = mode * response
    old = logp.detach()
    n_tokens, n_mode = response.sum(), mode.sum()
    pg_mode = ppo_sum(logp, old, adv, mode * row) / n_mode.clamp(min=1)
    pg_inner = ppo_sum(logp, old, adv, (response - mode) * row) / (n_tokens - n_mode).clamp(min=1)
    loss_mask = response * row
    lp, rp = (torch.where(loss_mask > 0, x, 0.0) for x in (logp, ref_logp))
    d = torch.clamp(rp - lp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kl = torch.clamp(torch.exp(d) - d - 1, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return pg_mode + pg_inner + KL_COEF * (kl * loss_mask).sum() / n_tokens.clamp(min=1)


def torch_step_fn(hf_model, batch: dict[str, np.ndarray]):
    ref_model = copy.deepcopy(hf_model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(hf_model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.from_numpy(batch["tokens"]).long()
    adv, response, mode = (torch.from_numpy(batch[k]) for k in
                           ("advantages", "response_mask", "mode_mask"))
    clean = torch.from_numpy(batch["clean"]).float()

    def step() -> tuple[float, float, torch.Tensor]:
        with torch.no_grad():
            ref_logp = torch_logprobs(ref_model, ids)
        opt.zero_grad(set_to_none=True)
        logp = torch_logprobs(hf_model, ids)
        loss = torch_loss(logp, ref_logp, adv, response, mode, clean)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        opt.step()
        return float(loss.detach()), float(norm), logp.detach()

    return step


# ------------------------------------------------------------------ timing


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--causal-parts", type=int, default=1,
                    help="model.causal_parts of our side (1: every attention block reads "
                         "every key)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    hf_model = make_hf_model(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64), head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=max(4096, args.seq)).float().train()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(Path(tmp))
        model = load_hf(tmp, causal_parts=args.causal_parts)
    batch = make_batch(args.batch, args.seq, args.vocab)
    trainer = Trainer(model, OptimConfig(), LossConfig(micro_batch_size=0),
                      temperature=TEMPERATURE)
    torch_step = torch_step_fn(hf_model, batch)

    console = Console()
    console.print(f"jax {jax.__version__} on {jax.devices()[0].platform} "
                  f"({len(jax.devices())} device(s)), torch {torch.__version__} with "
                  f"{torch.get_num_threads()} threads; config: layers={args.layers} "
                  f"hidden={args.hidden} vocab={args.vocab} causal_parts={args.causal_parts}; "
                  f"batch B={args.batch} "
                  f"T={args.seq}, {int(batch['response_mask'].sum())} response tokens, "
                  f"{int(batch['mode_mask'].sum())} mode tokens")

    # First step of each side from identical weights: the correctness check and warm-up.
    t_loss, t_norm, t_logp = torch_step()
    metrics = trainer.update(UpdateBatch(**batch, sampler_logp=t_logp.numpy()))
    o_loss, o_norm = metrics["loss/total"], metrics["grad/norm"]
    check = Table("first step", "ours", "torch", "rel diff")
    check.add_row("loss", f"{o_loss:.8g}", f"{t_loss:.8g}", f"{rel(o_loss, t_loss):.2e}")
    check.add_row("grad norm (pre-clip)", f"{o_norm:.8g}", f"{t_norm:.8g}",
                  f"{rel(o_norm, t_norm):.2e}")
    check.add_row("logprob |Δ| mean / max", "", "",
                  f"{metrics['logprob/sampler_gap_mean']:.2e} / "
                  f"{metrics['logprob/sampler_gap_max']:.2e} (abs)")
    console.print(check)
    if rel(o_loss, t_loss) > TOLERANCE or rel(o_norm, t_norm) > TOLERANCE:
        console.print(f"[red]the two steps disagree by more than {TOLERANCE:g} relative: "
                      "the timing would compare different computations[/red]")
        sys.exit(1)

    t_ours = median_seconds(lambda: trainer.update(UpdateBatch(**batch)), args.repeats)
    t_torch = median_seconds(torch_step, args.repeats)
    tokens = args.batch * args.seq
    table = Table("side", "tokens/s", "step ms")
    table.add_row("ours (jitted Trainer.update)", f"{tokens / t_ours:,.0f}",
                  f"{1e3 * t_ours:,.1f}")
    table.add_row("torch eager + transformers", f"{tokens / t_torch:,.0f}",
                  f"{1e3 * t_torch:,.1f}")
    console.print(table)
    console.print(f"ratio ours/torch (tokens/s): {t_torch / t_ours:.2f}x "
                  f"(median of {args.repeats} steps after one warm-up step)")
    if args.json:
        check_table, speed_table = "first step (ours vs torch)", "train step throughput"
        rows = [
            dict(table=check_table, measure="loss", ours=o_loss, torch=t_loss,
                 rel_diff=rel(o_loss, t_loss)),
            dict(table=check_table, measure="grad norm (pre-clip)", ours=o_norm, torch=t_norm,
                 rel_diff=rel(o_norm, t_norm)),
            dict(table=check_table, measure="logprob |Δ| mean",
                 abs_diff=metrics["logprob/sampler_gap_mean"]),
            dict(table=check_table, measure="logprob |Δ| max",
                 abs_diff=metrics["logprob/sampler_gap_max"]),
            dict(table=speed_table, side="ours (jitted Trainer.update)", tok_s=tokens / t_ours,
                 step_ms=1e3 * t_ours),
            dict(table=speed_table, side="torch eager + transformers", tok_s=tokens / t_torch,
                 step_ms=1e3 * t_torch),
        ]
        write_bench_json(
            args.json, "train_step", "a torch eager + transformers step computing the same loss "
            "(PPO dual clip, segment reduction, k3 KL), clip and AdamW on the same weights",
            rows, {"train_step_ours_over_torch": t_torch / t_ours},
            config={k: v for k, v in vars(args).items() if k != "json"})


if __name__ == "__main__":
    main()
