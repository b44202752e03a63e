"""The vLLM sidecar as the loop's rollout engine (``rollout.sampler: vllm``).

At start-up the initial policy is exported once as a Hugging Face directory for the server to
boot from (``OUT/sidecar/initial_hf``; server log and vLLM cache under ``OUT/sidecar``), unless
``rollout.vllm.url`` names a running server. After that the hot path has no HF export: every
policy step the trainer writes anyway (orbax) is synced into the server in place and verified
(`VllmSidecarSampler.sync_policy_step`) against the trainer's own params: per-tensor checksums
and the logprobs of a fixed probe sequence. ``rollout.vllm.transport: hf`` is the fallback: each
step is exported as HF safetensors and loaded the same way.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jax_routeweaver.models.hf import save_hf
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.sharding import to_host
from jax_routeweaver.rl.train_config import TrainConfig
from jax_routeweaver.sampling.vllm_sidecar import ServerConfig, VllmServer, VllmSidecarSampler
from jax_routeweaver.sampling.vllm_worker_ext import model_checksums

# The probe whose logprobs must agree after every sync (any fixed text works; this one
# exercises ordinary words, digits and punctuation).
PROBE_TEXT = ("Route the question to the worker most likely to answer it: 17 * 23 = 391, "
              "and the capital of France is Paris.")


class Sidecar:
    """Starts (or attaches to) the server and publishes policy steps into it."""

    def __init__(self, cfg: TrainConfig, model: Qwen3, tokenizer: Any, out: Path):
        v = cfg.rollout.vllm
        self.atol, self.transport, self.sleep_level = v.probe_atol, v.transport, v.sleep_level
        self.exports = out / "sidecar" / "hf_steps"
        self.server: VllmServer | None = None
        if v.url:
            target: VllmServer | str = v.url
        else:
            initial = save_hf(model, out / "sidecar" / "initial_hf", tokenizer=tokenizer)
            # The section's server options are ServerConfig fields of the same names.
            shared = {f.name for f in dataclasses.fields(ServerConfig)} \
                & {f.name for f in dataclasses.fields(v)}
            self.server = target = VllmServer(ServerConfig(
                model=str(initial), work_dir=str(out / "sidecar"), seed=cfg.seed,
                **{name: getattr(v, name) for name in shared}))
        self.sampler = VllmSidecarSampler(target, decode=tokenizer.decode,
                                          max_in_flight=v.max_in_flight,
                                          request_timeout_s=v.request_timeout_s)
        if self.server is not None:
            self.server.start()
        self.probe_ids = [int(t) for t in tokenizer.encode(PROBE_TEXT)]

    def publish(self, model: Qwen3, step_dir: Path, version: int) -> dict[str, float]:
        """Sync the committed policy step `step_dir` (= `model`'s params) as `version`
        (transport "hf": an HF export of `model`, the previous export deleted after)."""
        extra: dict[str, float] = {}
        if self.transport == "hf":
            started = time.perf_counter()
            step_dir = save_hf(model, self.exports / str(version))
            extra["sync/export_s"] = time.perf_counter() - started
        tokens = jnp.asarray([self.probe_ids])
        logp = token_logprobs(model, tokens, jnp.arange(tokens.shape[1])[None],
                              jnp.ones_like(tokens, bool))
        probe = (self.probe_ids, to_host(logp)[0, 1:])
        timings = self.sampler.sync_policy_step(step_dir, version, atol=self.atol,
                                                expected=model_checksums(model), probe=probe,
                                                transport=self.transport)
        if self.transport == "hf":
            for old in self.exports.iterdir():
                if old.name != str(version):
                    shutil.rmtree(old)
        return timings | extra | {"sync/restarts": float(self.sampler.restarts)}

    def release(self) -> None:
        """After the rollout: free the server's memory for the update (``sleep_level``)."""
        if self.sleep_level:
            self.sampler.sleep(self.sleep_level)

    def close(self) -> None:
        self.sampler.close()
        if self.server is not None:
            self.server.stop()
