"""The vLLM sidecar as a rollout engine: its config section and its lifecycle (start or
attach, publish each policy step, verify, sleep, stop).

At start-up the initial policy is exported once as a Hugging Face directory for the server to
boot from (``OUT/sidecar/initial_hf``; server log and vLLM cache under ``OUT/sidecar``), unless
``rollout.vllm.url`` names a running server. After that the hot path has no HF export: every
policy step the trainer writes anyway (orbax) is synced into the server in place and verified
(`VllmSidecarSampler.sync_policy_step`) against the trainer's own params: per-tensor checksums
of what was loaded and of what the engine then computes with (its linear weights read back
through its own kernels), and the logprobs of a fixed probe sequence.
``rollout.vllm.transport: hf`` is the fallback: each step is exported as HF safetensors and
loaded the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jax_routeweaver.config import bounded
from jax_routeweaver.models.hf import save_hf
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.sharding import to_host
from jax_routeweaver.sampling.probe_check import Probe, calibrate, tolerance
from jax_routeweaver.sampling.vllm_server import (
    ServerBaseConfig,
    ServerConfig,
    SidecarError,
    VllmServer,
)
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler
from jax_routeweaver.sampling.vllm_worker_ext import expected_served, model_checksums


@dataclasses.dataclass(frozen=True)
class VllmConfig(ServerBaseConfig):
    """The vLLM sidecar (``rollout.sampler: vllm``; see `sampling.vllm_sidecar`): the server's
    `ServerBaseConfig` (the same keys, defaults and ranges) plus how the trainer talks to it. The
    trainer starts it on an HF export of the initial policy (or attaches to ``url``) and syncs
    every policy step into it in place, verified by checksums and a probe sequence's logprobs
    (`sampling.probe_check`): within ``probe_atol`` of the trainer's (0: the serving dtype's
    tolerance, scaled by the gap measured at start-up on the initial weights) and nearer the
    new version's than the previous one's. vLLM's CPU attention needs head_dim >= 32.
    ``sleep_level`` serves time-shared placement (the sidecar on the trainer's GPUs): the
    server sleeps after each rollout so the update can use its memory; the next sync wakes
    it and reloads the weights anyway."""

    url: str = ""  # a running server to attach to ("http://host:port"); "" = start one
    # how a policy step reaches the server: "orbax" (the policy step itself) or "hf" (the
    # fallback: an HF safetensors export of each step, loaded the same way)
    transport: Literal["orbax", "hf"] = "orbax"
    request_timeout_s: float = bounded(300.0, "(0, inf)")  # seconds per request
    max_in_flight: int = bounded(64, "[1, inf)")  # concurrent requests
    probe_atol: float = bounded(0.0, "[0, inf)")  # nats per probe token; 0 = measured


# The probe whose logprobs are checked after every sync (`probe_check`). Any fixed text works;
# a longer one tells apart versions that moved less (the check's power grows with the square
# root of its length), at the cost of one prefill of it on each side. This one exercises words,
# digits, code and punctuation, in the vocabulary of routing prompts.
PROBE_TEXT = (
    "Route the question to the worker most likely to answer it: 17 * 23 = 391, and the "
    "capital of France is Paris. In single mode one worker answers the whole task; in multi "
    "mode several workers answer the same question and the router compares their answers; in "
    "agentic mode the router plans steps, calls a worker for each step, reads the result and "
    "decides what to do next. A math question such as 'what is the sum of the first 100 "
    "positive integers?' has the answer 5050. A code task asks for a function: def add(a, b): "
    "return a + b. A knowledge question may need a fact recalled from memory, and a reasoning "
    "question a chain of small deductions: if every worker that answered correctly was cheap, "
    "and worker_2 answered correctly, then worker_2 was cheap. The router pays for every token "
    "a worker reads and writes, so it should call the strong and expensive workers only when "
    "the cheaper ones are likely to fail, and it must give its final answer in the required "
    "format.")
# Earlier versions' probe logprobs kept for the check (newest first).
PROBE_HISTORY = 256


class Sidecar:
    """Starts (or attaches to) the server and publishes policy steps into it.

    At start-up it checks what the server runs with (`VllmSidecarSampler.check_server`) and,
    for a server it started on the initial policy, measures the serving dtype's gap on the
    probe (`probe_check.calibrate`): the tolerance of every later sync, unless
    ``rollout.vllm.probe_atol`` sets one. Each sync's probe is then checked against the new
    version's logprobs and the earlier versions' (`probe_check.verdict`)."""

    def __init__(self, config: VllmConfig, model: Qwen3, tokenizer: Any, out: Path, *,
                 seed: int):
        """`config`: the ``rollout.vllm`` section; `model`: the initial policy (exported for
        a server this starts, and the probe's reference); `out`: the run directory (the
        sidecar's files go under ``out/sidecar``); `seed`: the started server's seed."""
        v = config
        self.transport, self.sleep_level = v.transport, v.sleep_level
        self.exports = out / "sidecar" / "hf_steps"
        self.server: VllmServer | None = None
        if v.url:
            target: VllmServer | str = v.url
        else:
            initial = save_hf(model, out / "sidecar" / "initial_hf", tokenizer=tokenizer)
            # The section's server options are its ServerBaseConfig fields.
            shared = [f.name for f in dataclasses.fields(ServerBaseConfig)]
            self.server = target = VllmServer(ServerConfig(
                model=str(initial), work_dir=str(out / "sidecar"), seed=seed,
                **{name: getattr(v, name) for name in shared}))
        self.sampler = VllmSidecarSampler(target, decode=tokenizer.decode,
                                          max_in_flight=v.max_in_flight,
                                          request_timeout_s=v.request_timeout_s)
        self.probe_ids = [int(t) for t in tokenizer.encode(PROBE_TEXT)]
        # Probe logprobs of the versions served so far, newest first (the served one first).
        self.history: collections.deque[np.ndarray] = collections.deque(maxlen=PROBE_HISTORY)
        try:
            if self.server is not None:
                self.server.start()
            self._check_and_calibrate(model, v.probe_atol)
        except BaseException:
            self.close()
            raise

    def _check_and_calibrate(self, model: Qwen3, probe_atol: float) -> None:
        """Check the server's settings; set `atol`, `noise` (and, for a server started on
        `model`, measure the probe gap on it and start the history with it)."""
        self.settings = self.sampler.check_server()
        # Without a start-up measurement: the dtype's floor, and no discrimination scale.
        self.atol, self.noise = probe_atol or tolerance(self.settings["dtype"]), 0.0
        if self.server is None:
            return
        initial = self._probe_logprobs(model)
        self.history.appendleft(initial)
        try:
            atol, self.noise = calibrate(self.sampler.probe_logprobs(self.probe_ids),
                                         initial, self.settings["dtype"])
        except ValueError as e:
            raise SidecarError(f"{e} (the initial export {self.server.config.model})") from e
        self.atol = probe_atol or atol

    def _probe_logprobs(self, model: Qwen3) -> np.ndarray:
        """The trainer's fp32 logprobs of the probe's tokens after the first `[T - 1]`."""
        tokens = jnp.asarray([self.probe_ids])
        logp = token_logprobs(model, tokens, jnp.arange(tokens.shape[1])[None],
                              jnp.ones_like(tokens, bool))
        return np.asarray(to_host(logp)[0, 1:], np.float64)

    def publish(self, model: Qwen3, step_dir: Path, version: int) -> dict[str, float]:
        """Sync the committed policy step `step_dir` (= `model`'s params) as `version`
        (transport "hf": an HF export of `model`, the previous export deleted after)."""
        extra: dict[str, float] = {}
        if self.transport == "hf":
            started = time.perf_counter()
            step_dir = save_hf(model, self.exports / str(version))
            extra["sync/export_s"] = time.perf_counter() - started
        new = self._probe_logprobs(model)
        probe = Probe(self.probe_ids, new, tuple(self.history), self.atol, self.noise)
        timings = self.sampler.sync_policy_step(
            step_dir, version, probe=probe, expected=model_checksums(model),
            served=expected_served(model, self.settings["dtype"]),
            transport=self.transport)
        self.history.appendleft(new)
        if self.transport == "hf":
            for old in self.exports.iterdir():
                if old.name != str(version):
                    shutil.rmtree(old)
        return timings | extra | {"sync/restarts": float(self.sampler.restarts),
                                  "probe/atol": self.atol}

    def release(self) -> None:
        """After the rollout: free the server's memory for the update (``sleep_level``)."""
        if self.sleep_level:
            self.sampler.sleep(self.sleep_level)

    def close(self) -> None:
        self.sampler.close()
        if self.server is not None:
            self.server.stop()
