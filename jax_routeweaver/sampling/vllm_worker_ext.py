"""Weight sync into a running vLLM server straight from the trainer's orbax policy step.

`PolicyWeightLoader` is a vLLM worker extension (`--worker-extension-cls
jax_routeweaver.sampling.vllm_worker_ext.PolicyWeightLoader`, `ServerConfig`'s default): its
methods run inside every vLLM worker through the dev server's `/collective_rpc` (arguments are
strings). `load_policy_step(step_dir)` reads the step's params with orbax (no HF re-export),
maps names and layouts with the HF export's own table (`models.hf.hf_arrays`) and hands them to
vLLM's in-place reload (`model_runner.reload_weights(weights_iterator=...)`: the model's own
loaders, then its post-load processing, e.g. oneDNN prepacking on CPU), so the engine and its
KV cache stay up. `load_hf_dir(hf_dir)` is the fallback transport: the same load from an HF
safetensors export.

Tied embeddings: vLLM's stock reload leaves a tied head unloaded ("ParallelLMHead: Failed to
load weights") and generates wrong tokens; the loader therefore also sends `lm_head.weight`
(the embedding) for a tied model, and the sidecar's probe check proves the head took it.

It returns `checksums` (`[sum, sum of squares]` in float64 per HF tensor) of exactly what it
loaded; the trainer compares them with `model_checksums` of its own params, which catches a stale
or corrupt step on disk.

`served_checksums()` sums what the engine then computes with. On CPU the linear layers keep
their weights only inside prepacked oneDNN or SGL kernels (the stored `weight` is emptied), so
each linear weight is read back through the layer's own kernel: its products with identity
rows, each output one weight times 1 plus zeros, exact in any dtype. Embeddings, norms and
biases are read as stored (an embedding's padding rows left out). The trainer compares them
with `expected_served(model, <served dtype>)`: its params rounded as the server rounds them,
so a server that kept older weights is told apart however small the step (as far as the
served dtype can tell the weights apart at all).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import SafetensorsReader, active_rules, hf_arrays, hf_names
from jax_routeweaver.models.policy_step import read_step
from jax_routeweaver.models.qwen3 import Qwen3

__all__ = ["SERVED_RTOL", "PolicyWeightLoader", "checksums", "compare_checksums", "copies",
           "expected_served", "model_checksums", "sum_workers"]

# `served_checksums` against `model_checksums(model, dtype)`: the same rounded values, summed
# in float64 there and in float32 (pairwise, on device) here.
SERVED_RTOL = 1e-5
_READBACK_ROWS = 256  # identity rows per product when reading a linear weight back

def checksums(tensors: Iterable[tuple[str, np.ndarray]]) -> dict[str, list[float]]:
    """`{HF name: [sum, sum of squares]}` (float64) of host tensors."""
    out: dict[str, list[float]] = {}
    for name, a in tensors:
        a = np.asarray(a, np.float64)
        out[name] = [float(a.sum()), float(np.square(a).sum())]
    return out


def model_checksums(model: Qwen3, dtype: str | None = None) -> dict[str, list[float]]:
    """`checksums` of `model`'s HF tensors (tied head excluded), summed on its devices in
    float32: no host copy of the weights, so it scales to sharded models. `dtype`: each
    tensor rounded to it first (the served dtype, as the server's load rounds it)."""
    cfg = model.config
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out: dict[str, list[float]] = {}
    for rule in active_rules(cfg):
        a = flat[rule.path][...]
        a = jnp.asarray(a.astype(dtype) if dtype else a, jnp.float32)
        axes = tuple(range(1 if rule.per_layer else 0, a.ndim))
        sums = np.atleast_1d(np.asarray(jnp.sum(a, axis=axes), np.float64))
        squares = np.atleast_1d(np.asarray(jnp.sum(a * a, axis=axes), np.float64))
        for i, name in enumerate(hf_names(rule, cfg)):
            out[name] = [float(sums[i]), float(squares[i])]
    return out


def compare_checksums(loaded: dict[str, list[float]], expected: dict[str, list[float]],
                      rtol: float = 1e-4) -> list[str]:
    """Names whose sums disagree (beyond `rtol` of the sum of squares, the scale of the
    summation error), or that only one side has."""
    bad = sorted(set(loaded) ^ set(expected))
    for name in sorted(set(loaded) & set(expected)):
        (s, q), (es, eq) = loaded[name], expected[name]
        scale = max(1.0, abs(eq)) * rtol
        if abs(s - es) > scale or abs(q - eq) > scale:
            bad.append(f"{name} (sum {s:.6g} vs {es:.6g}, sumsq {q:.6g} vs {eq:.6g})")
    return bad


def expected_served(model: Qwen3, dtype: str) -> dict[str, list[float]]:
    """What `served_checksums` must find for `model` served in `dtype`: `model_checksums`
    rounded to `dtype`, and for tied embeddings ``lm_head.weight`` too, equal to the
    embedding (vLLM keeps a head of its own that must compute with it)."""
    out = model_checksums(model, dtype=dtype)
    if model.config.tie_word_embeddings:
        out["lm_head.weight"] = list(out["model.embed_tokens.weight"])
    return out


def sum_workers(results: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per-tensor sums over the workers' shards (tensor parallel: each holds a slice; what
    several hold is already divided by its number of copies, `copies`)."""
    out: dict[str, list[float]] = {}
    for result in results:
        for name, (s, q) in result.items():
            a = out.setdefault(name, [0.0, 0.0])
            a[0], a[1] = a[0] + s, a[1] + q
    return out


class PolicyWeightLoader:
    """Mixed into vLLM's worker class: `self.model_runner.model` is the served model."""

    model_runner: Any

    def load_policy_step(self, step_dir: str) -> dict[str, Any]:
        """Load the orbax policy step at `step_dir` into the running model, in place; returns
        `tensors`, `checksums` (of what was loaded), `read_s`, `load_s`."""
        started = time.perf_counter()
        cfg, flat = read_step(step_dir)
        arrays = list(hf_arrays(flat.__getitem__, cfg, untie=True))
        return self._reload(cfg, arrays, time.perf_counter() - started)

    def load_hf_dir(self, hf_dir: str) -> dict[str, Any]:
        """The fallback transport: the same in-place load from an HF safetensors directory
        (`models.hf.save_hf` output); a tied model's head gets the embedding here too."""
        started = time.perf_counter()
        cfg = ModelConfig.from_hf(hf_dir)
        reader = SafetensorsReader(hf_dir)
        arrays = [(name, reader.get(name)) for name in sorted(reader.names())]
        if cfg.tie_word_embeddings and "lm_head.weight" not in reader.names():
            arrays.append(("lm_head.weight", reader.get("model.embed_tokens.weight")))
        return self._reload(cfg, arrays, time.perf_counter() - started)

    def _reload(self, cfg: ModelConfig, arrays: list[tuple[str, np.ndarray]],
                read_s: float) -> dict[str, Any]:
        import torch

        started = time.perf_counter()
        dtype = next(self.model_runner.model.parameters()).dtype
        copy = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # the embedding
        sums: dict[str, list[float]] = {}

        def tensors():  # checksums of exactly what is handed over, as it is handed over
            for name, a in arrays:
                if name not in copy:
                    sums.update(checksums([(name, a)]))
                yield name, torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=tensors(),
                                             is_checkpoint_format=True)
        return {"tensors": len(sums), "checksums": sums, "read_s": read_s,
                "load_s": time.perf_counter() - started}

    def served_checksums(self) -> dict[str, list[float]]:
        """`[sum, sum of squares]` (float64) per HF tensor of this worker's shard of what the
        engine computes with (module doc): linear weights read back through their kernels,
        the other parameters as stored."""
        import torch
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
        from vllm.model_executor.layers.linear import LinearBase, RowParallelLinear
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        tp = get_tensor_model_parallel_world_size()
        model = self.model_runner.model
        packed = getattr(model, "packed_modules_mapping", {})
        out: dict[str, list[float]] = {}

        def put(name: str, sums: list[float], copies: int) -> None:
            out[name] = [x / copies for x in sums]

        with torch.no_grad():
            for name, module in model.named_modules():
                parts = _hf_parts(name, packed)
                kv = getattr(module, "num_kv_head_replicas", 1)
                if isinstance(module, LinearBase):
                    sizes = list(module.output_partition_sizes)
                    for part, sums in zip(parts, _read_back(module, sizes), strict=True):
                        put(f"{part}.weight", sums, copies(part, "sharded", tp, kv))
                elif isinstance(module, VocabParallelEmbedding):
                    # The stored table (lookups read it); a head computes with it too (a
                    # prepacked copy is made from it at load, the table itself kept).
                    rows = module.weight[:module.shard_indices.num_org_elements]
                    out[f"{parts[0]}.weight"] = _sums(rows)
                for pname, p in module.named_parameters(recurse=False):
                    if pname == "weight" and isinstance(module, (LinearBase,
                                                                 VocabParallelEmbedding)):
                        continue
                    kind = "sharded" if isinstance(module, LinearBase) and not isinstance(
                        module, RowParallelLinear) else "replicated"
                    if pname == "bias" and len(parts) > 1:  # a packed bias, split as its rows
                        sizes = list(module.output_partition_sizes)
                        for part, piece in zip(parts, torch.split(p, sizes), strict=True):
                            put(f"{part}.bias", _sums(piece), copies(part, kind, tp, kv))
                    else:
                        put(f"{parts[0]}.{pname}", _sums(p), copies(parts[0], kind, tp, kv))
        return out


def copies(part: str, kind: str, tp: int, kv_replicas: int) -> int:
    """How many of `tp` tensor-parallel workers hold the same values of this worker's `part`,
    so that `sum_workers` counts each value once: "replicated" parameters (norms, a row-parallel
    layer's bias) are on every worker; a sharded k or v projection is on `kv_replicas` of them
    when the model has fewer kv heads than workers; other sharded parts on one."""
    if kind == "replicated":
        return tp
    if part.rsplit(".", 1)[-1] in ("k_proj", "v_proj"):
        return kv_replicas
    return 1


def _hf_parts(name: str, packed: dict[str, list[str]]) -> list[str]:
    """The HF module names a vLLM module holds: a packed one (``qkv_proj``) its parts."""
    head, _, last = name.rpartition(".")
    if last in packed:
        return [f"{head}.{part}" if head else part for part in packed[last]]
    return [name]


def _sums(t: Any) -> list[float]:
    import torch

    a = t.detach().to(torch.float64)
    return [float(a.sum()), float((a * a).sum())]


def _read_back(layer: Any, sizes: list[int]) -> list[list[float]]:
    """Sums of each output block of a linear layer's weight, read through its own kernel:
    identity rows in, the weight's columns out (`quant_method.apply`, no bias)."""
    import torch

    width = layer.input_size_per_partition
    dtype, device = layer.weight.dtype, layer.weight.device  # kept, if emptied, on CPU
    totals = [[0.0, 0.0] for _ in sizes]
    for start in range(0, width, _READBACK_ROWS):
        n = min(_READBACK_ROWS, width - start)
        eye = torch.zeros((n, width), dtype=dtype, device=device)
        eye[torch.arange(n), start + torch.arange(n)] = 1
        columns = layer.quant_method.apply(layer, eye, None).to(torch.float64)
        for total, block in zip(totals, torch.split(columns, sizes, dim=1), strict=True):
            total[0] += float(block.sum())
            total[1] += float((block * block).sum())
    return totals
