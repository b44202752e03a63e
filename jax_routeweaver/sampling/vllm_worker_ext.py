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
or corrupt step on disk. (The served parameters themselves cannot be summed on every backend:
on CPU the linear weights live only inside prepacked kernels.)
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

__all__ = ["PolicyWeightLoader", "checksums", "compare_checksums", "model_checksums"]

def checksums(tensors: Iterable[tuple[str, np.ndarray]]) -> dict[str, list[float]]:
    """`{HF name: [sum, sum of squares]}` (float64) of host tensors."""
    out: dict[str, list[float]] = {}
    for name, a in tensors:
        a = np.asarray(a, np.float64)
        out[name] = [float(a.sum()), float(np.square(a).sum())]
    return out


def model_checksums(model: Qwen3) -> dict[str, list[float]]:
    """`checksums` of `model`'s HF tensors (tied head excluded), summed on its devices in
    float32: no host copy of the weights, so it scales to sharded models."""
    cfg = model.config
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out: dict[str, list[float]] = {}
    for rule in active_rules(cfg):
        a = jnp.asarray(flat[rule.path][...], jnp.float32)
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
