"""A `Sampler` served by a vLLM OpenAI-compatible server beside the trainer (the sidecar).

`VllmSidecarSampler` samples from a `sampling.vllm_server.VllmServer` it was given (and
restarts it when it died) or attaches to the URL of a server already running.

`VllmSidecarSampler.generate` sends every prompt as token ids to `/v1/completions` (many
requests in flight, from a private event-loop thread, so it works from sync and async callers
alike) and gets back token ids and their logprobs (`return_token_ids`, `logprobs: 0`). Mapping to
the `sampling.base` contract:

* seeds: request i gets `seed + i`, so K rollouts of one prompt differ but a call is
  reproducible (vLLM seeds per request).
* stop strings: vLLM stops on text with `include_stop_str_in_output`; the completion is then cut
  in token space with `apply_stop_strings`, like `JaxSampler`.
* grammars: `Grammar.ebnf` goes to vLLM's structured outputs (xgrammar), the same language the
  in-process sampler accepts (a `Grammar.choice` passes its options as EBNF alternatives, so the
  canonical-tokenization restriction is the in-process sampler's alone). vLLM ends a grammar only
  on a stop token; for a grammar that terminates without one (`end_with_stop_token=False`) that
  forced trailing stop token is dropped and the finish reason is "grammar", as in `JaxSampler`.
* logprobs: the server runs with `--logprobs-mode processed_logprobs` (temperature applied). They
  equal the contract's `log_softmax(logits / T)` when top-p/top-k are off and no grammar is set;
  vLLM applies the grammar mask (and top-p/top-k) before its logprobs, `JaxSampler` does not. The
  trainer recomputes its own logprobs either way; the gap is a logged diagnostic.

Weight sync (`sync_policy_step`): the trainer's orbax policy step is loaded into the running
server in place by the `vllm_worker_ext.PolicyWeightLoader` worker extension (pause -> load ->
reset prefix cache -> resume), verified (checksums of what was loaded against the trainer's
arrays; a probe sequence's prompt logprobs against the trainer's) and only then reported as
the new version; a sync that did not take effect is retried once, then fatal.
`update_weights(hf_dir, version)` is the slow fallback: restart the server on an HF directory.

A crashed or unreachable server fails the in-flight requests loudly (`SidecarError`, with the
log's tail) instead of hanging; the next `generate` restarts a server this sampler started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from jax_routeweaver.sampling.base import (
    Completion,
    Decode,
    SamplingParams,
    apply_stop_strings,
    check_version,
)
from jax_routeweaver.sampling.constraints import Grammar
from jax_routeweaver.sampling.probe_check import Probe, verdict
from jax_routeweaver.sampling.vllm_server import SidecarError, VllmServer
from jax_routeweaver.sampling.vllm_worker_ext import (
    SERVED_RTOL,
    compare_checksums,
    sum_workers,
)

__all__ = ["VllmSidecarSampler"]

# transport -> the PolicyWeightLoader method that loads it
LOADERS = {"orbax": "load_policy_step", "hf": "load_hf_dir"}


class VllmSidecarSampler:
    """`sampling.base.Sampler` over a vLLM server: a `VllmServer` (restarted when it died) or
    the URL of one already running (never restarted). `decode` is needed for stop strings;
    `max_in_flight` bounds concurrent requests; a request taking longer than
    `request_timeout_s` fails."""

    def __init__(self, server: VllmServer | str, *, decode: Decode | None = None,
                 served_name: str | None = None, max_in_flight: int = 64,
                 request_timeout_s: float = 300.0, policy_version: int = 0):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.server = server if isinstance(server, VllmServer) else None
        self._url = None if self.server else str(server).rstrip("/")
        self.served_name = served_name or (self.server.config.served_name if self.server
                                           else "policy")
        self._decode = decode
        self._max_in_flight = max_in_flight
        self._timeout = request_timeout_s
        self._version = int(policy_version)
        self._rng: np.random.Generator | None = None
        self._last_sync: tuple | None = None  # replayed into a restarted server
        self._unverified: str | None = None  # why the served weights are not trusted
        self._sleeping = False
        self.restarts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="vllm-sidecar-client")
        self._thread.start()

    @property
    def url(self) -> str:
        return self.server.url if self.server else self._url

    @property
    def policy_version(self) -> int:
        return self._version

    def reseed(self, seed: int) -> None:
        """Restart the stream of per-call seeds used when `SamplingParams.seed` is None (a run
        that reseeds per step samples the same tokens when resumed), as `JaxSampler` does."""
        self._rng = np.random.default_rng(seed)

    def close(self) -> None:
        """Stop the client thread (the server belongs to whoever made it)."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 grammars: Sequence[Any] | None = None) -> list[Completion]:
        return [c for (c,) in self.generate_n(prompts, params, 1, grammars)]

    def generate_n(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                   grammars: Sequence[Any] | None = None) -> list[list[Completion]]:
        """`n` completions per prompt from one request each (vLLM's `n`: the prompt is
        prefilled once)."""
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        if grammars is not None and len(grammars) != len(prompts):
            raise ValueError(f"{len(grammars)} grammars for {len(prompts)} prompts")
        if params.stop_strings and self._decode is None:
            raise ValueError("stop strings need the sampler's `decode`")
        if not prompts:
            return []
        if self._unverified:
            raise SidecarError(f"not sampling from unverified weights: {self._unverified}")
        if self._sleeping:
            raise SidecarError("the server sleeps (its memory is lent to the trainer's update) "
                               "until the next weight sync")
        self._ensure_server()
        if params.seed is None and self._rng is not None:
            params = dataclasses.replace(params, seed=int(self._rng.integers(2**31)))
        grammars = list(grammars) if grammars is not None else [None] * len(prompts)
        future = asyncio.run_coroutine_threadsafe(
            self._generate(prompts, params, grammars, n), self._loop)
        return future.result()

    def request_body(self, prompt: Sequence[int], params: SamplingParams,
                     grammar: Grammar | None, index: int = 0, n: int = 1) -> dict[str, Any]:
        """The `/v1/completions` JSON for one prompt (see the module doc for the mapping)."""
        body: dict[str, Any] = {
            "model": self.served_name, "prompt": [int(t) for t in prompt], "n": n,
            "max_tokens": params.max_new_tokens,
            "temperature": 0.0 if params.is_greedy else params.temperature,
            "top_p": 1.0 if params.is_greedy else params.top_p,
            "top_k": params.top_k if params.top_k_enabled and not params.is_greedy else -1,
            "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop_strings),
            "include_stop_str_in_output": True, "logprobs": 0, "return_token_ids": True,
            "skip_special_tokens": False}
        if params.seed is not None:
            body["seed"] = params.seed + index
        if grammar is not None:
            body["structured_outputs"] = {"grammar": grammar.ebnf}
        return body

    async def _generate(self, prompts, params, grammars, n) -> list[list[Completion]]:
        limit = asyncio.Semaphore(self._max_in_flight)
        timeout = httpx.Timeout(self._timeout, connect=10.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=timeout) as client:
            async def one(i: int) -> list[Completion]:
                async with limit:
                    body = self.request_body(prompts[i], params, grammars[i], i, n)
                    choices = await self._post(client, body)
                if len(choices) != n:
                    raise SidecarError(f"vLLM returned {len(choices)} choices for n={n}")
                order = sorted(choices, key=lambda c: c.get("index", 0))
                return [self._completion(c, params, grammars[i]) for c in order]

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]
                    ) -> list[dict[str, Any]]:
        try:
            response = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise SidecarError(f"vLLM request to {self.url} failed ({type(e).__name__}: {e}); "
                               f"{self._server_state()}") from e
        if response.status_code != 200:
            raise SidecarError(f"vLLM answered {response.status_code}: {response.text[:500]}")
        return response.json()["choices"]

    def _completion(self, choice: dict[str, Any], params: SamplingParams,
                    grammar: Grammar | None) -> Completion:
        ids = [int(t) for t in choice.get("token_ids") or []]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs", [])]
        if len(logprobs) != len(ids):
            raise SidecarError(f"vLLM returned {len(ids)} token ids but {len(logprobs)} "
                               "logprobs (is return_token_ids supported by this server?)")
        stop = choice.get("stop_reason")
        if choice.get("finish_reason") == "length":
            reason, stop = "length", None
        elif ids and ids[-1] in params.stop_token_ids:
            reason, stop = "stop_token", ids[-1]
        elif isinstance(stop, str):
            reason = "stop_string"
        else:  # an EOS the server knows from the model's generation config
            reason, stop = "stop_token", ids[-1] if ids else None
        if grammar is not None and not grammar.end_with_stop_token and reason == "stop_token":
            # vLLM ends a grammar only on a stop token; ours terminate without one.
            ids, logprobs, reason, stop = ids[:-1], logprobs[:-1], "grammar", None
        completion = Completion(ids, logprobs, reason, stop, policy_version=self._version)
        if params.stop_strings and reason != "grammar":
            completion = apply_stop_strings(completion, self._decode, params.stop_strings)
        return completion

    # ------------------------------------------------------------------ server state
    def _ensure_server(self) -> None:
        """Restart a server this sampler started that died, and load the last synced policy
        step into it again (verified), so it serves `policy_version` as before."""
        if self.server is None or self.server.alive():
            return
        self.server.start()
        self.restarts += 1
        self._sleeping = False  # a fresh process is awake
        if self._last_sync is not None:
            self._sync_once(*self._last_sync)

    def _server_state(self) -> str:
        if self.server is None:
            return "attached server (not restarted by this sampler)"
        if not self.server.alive(settle_s=5.0):
            return (f"the server process died; it is restarted on the next call. "
                    f"{self.server.log_path}:\n{self.server.log_tail()}")
        return "server process still running"

    # ------------------------------------------------------------------ time sharing
    def sleep(self, level: int) -> None:
        """Free the server's accelerator memory until the next sync (time-shared placement:
        the trainer's update runs in it): vLLM sleep `level` 1 offloads the weights to host
        memory and drops the KV cache, 2 drops both — the next `sync_policy_step` loads the
        new weights anyway, so 2 saves the copy. The next sync wakes the server first;
        `generate` refuses to run while it sleeps."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level}: expected 1 or 2")
        with httpx.Client(base_url=self.url, timeout=self._timeout) as client:
            self._rpc(client, "/sleep", params={"level": level})
        self._sleeping = True

    # ------------------------------------------------------------------ weight sync
    def sync_policy_step(self, step_dir: str | Path, version: int, *,
                         expected: dict[str, list[float]],
                         probe: Probe | tuple[Sequence[int], Sequence[float]] | None = None,
                         served: dict[str, list[float]] | None = None,
                         atol: float = 1e-3, retries: int = 1,
                         transport: str = "orbax") -> dict[str, float]:
        """Load the orbax policy step at `step_dir` (transport "hf": an HF safetensors
        export directory instead) into the running server as `version`:
        pause -> load in place (`vllm_worker_ext`) -> reset the prefix cache -> resume ->
        verify -> set the server's weight version. Verified means: the checksums of what
        each worker loaded equal `expected` (`vllm_worker_ext.model_checksums` of the
        trainer's params); with `served` (`vllm_worker_ext.expected_served`),
        the sums of what the engine computes with after the load
        (`PolicyWeightLoader.served_checksums`, over all workers) equal it within
        `SERVED_RTOL`; and the server's prompt logprobs of the `probe` pass
        `probe_check.verdict` (agree with the new version's within its atol and, where the
        versions can be told apart, lie nearer the new version than any earlier one; a
        plain (token ids, the trainer's logprobs of ids[1:]) tuple is agreement within
        `atol` only). A sync that did not take effect is
        retried `retries` times, then raises SidecarError, and `generate` refuses to sample
        from the unverified weights until a sync succeeds (or `update_weights` restarts the
        server). Returns `sync/load_s` (pause to resume), `sync/verify_s`, `sync/tensors`,
        `sync/attempts` and the probe's `probe/...` metrics."""
        check_version(self._version, version)
        if probe is not None and not isinstance(probe, Probe):
            probe = Probe(probe[0], probe[1], atol=atol)
        if transport not in LOADERS:
            raise ValueError(f"transport={transport!r}: expected one of {sorted(LOADERS)}")
        for attempt in range(retries + 1):
            try:
                args = (Path(step_dir), version, expected, probe, LOADERS[transport], served)
                timings = self._sync_once(*args)
                self._version, self._last_sync, self._unverified = int(version), args, None
                return timings | {"sync/attempts": float(attempt + 1)}
            except SidecarError as e:
                if attempt == retries:
                    self._unverified = (f"weight sync to version {version} from {step_dir} "
                                        f"failed {attempt + 1} time(s): {e}")
                    raise SidecarError(self._unverified) from e
        raise AssertionError("unreachable")

    def _rpc(self, client: httpx.Client, path: str, **kwargs: Any) -> Any:
        try:
            response = client.post(path, **kwargs)
        except httpx.HTTPError as e:
            raise SidecarError(f"{path}: {type(e).__name__}: {e}; {self._server_state()}") from e
        if response.status_code != 200:
            raise SidecarError(f"{path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    def probe_logprobs(self, ids: Sequence[int]) -> list[float]:
        """The served model's logprobs of `ids[1:]` given their prefixes (prompt logprobs)."""
        body = {"model": self.served_name, "prompt": [int(t) for t in ids], "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": 0}
        with httpx.Client(base_url=self.url, timeout=self._timeout) as client:
            choice = self._rpc(client, "/v1/completions", json=body)["choices"][0]
        return [entry[str(int(t))]["logprob"]
                for t, entry in zip(ids[1:], choice["prompt_logprobs"][1:], strict=True)]

    def _sync_once(self, step_dir, version, expected, probe, loader, served=None
                   ) -> dict[str, float]:
        self._ensure_server()
        started = time.perf_counter()
        with httpx.Client(base_url=self.url, timeout=self._timeout) as client:
            if self._sleeping:  # its memory back first: the load writes into it
                self._rpc(client, "/wake_up")
                self._sleeping = False
            self._rpc(client, "/pause", params={"mode": "wait"})
            try:
                loaded = self._rpc(client, "/collective_rpc", json={
                    "method": loader, "args": [str(step_dir.absolute())]})
                computed = None if served is None else self._rpc(
                    client, "/collective_rpc", json={"method": "served_checksums"})
                self._rpc(client, "/reset_prefix_cache")
            finally:
                self._rpc(client, "/resume")
            load_s = time.perf_counter() - started
            for worker in loaded["results"]:
                bad = compare_checksums(worker["checksums"], expected)
                if bad:
                    raise SidecarError(f"the weights loaded from {step_dir} differ from the "
                                       f"trainer's: {bad[:5]} ({len(bad)} tensors)")
            if computed is not None:
                bad = compare_checksums(sum_workers(computed["results"]), served,
                                        rtol=SERVED_RTOL)
                if bad:
                    raise SidecarError(f"the weights the server computes with after loading "
                                       f"{step_dir} are not the trainer's: {bad[:5]} "
                                       f"({len(bad)} tensors)")
            metrics: dict[str, float] = {}
            if probe is not None:
                why, found = verdict(self.probe_logprobs(probe.ids), probe)
                if why is not None:
                    raise SidecarError(f"{why} after loading {step_dir}")
                metrics = {f"probe/{k}": v for k, v in found.items()}
            self._rpc(client, "/update_weight_version", json={"new_version": str(version)})
        return metrics | {"sync/load_s": load_s, "sync/tensors": float(
            loaded["results"][0]["tensors"]),
            "sync/verify_s": time.perf_counter() - started - load_s}

    def server_settings(self) -> dict[str, Any]:
        """What the server actually runs with (its `/server_info`, dev mode): `device`,
        `dtype` (e.g. "bfloat16"), `chunked_prefill`, `max_num_batched_tokens`,
        `max_model_len`."""
        try:
            response = httpx.get(f"{self.url}/server_info", params={"config_format": "json"},
                                 timeout=30.0)
            config = response.json()["vllm_config"]
            return {"device": str(config["device_config"]["device"]),
                    "dtype": str(config["model_config"]["dtype"]).removeprefix("torch."),
                    "chunked_prefill": bool(config["scheduler_config"]["enable_chunked_prefill"]),
                    "max_num_batched_tokens":
                        int(config["scheduler_config"]["max_num_batched_tokens"]),
                    "max_model_len": int(config["model_config"]["max_model_len"])}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            raise SidecarError(f"{self.url}/server_info did not describe the server "
                               f"({type(e).__name__}: {e}); run vLLM with "
                               "VLLM_SERVER_DEV_MODE=1") from e

    def check_server(self) -> dict[str, Any]:
        """Refuse a server this sampler cannot sample from reproducibly; returns
        `server_settings()`. On CPU, chunked prefill must be off: a seeded request prefilled
        in parts crashes the engine (`ServerConfig.chunked_prefill`)."""
        settings = self.server_settings()
        if settings["device"] == "cpu" and settings["chunked_prefill"]:
            raise SidecarError(f"the vLLM server at {self.url} runs on CPU with chunked "
                               "prefill on: a seeded request prefilled in parts crashes its "
                               "engine (\"CPU Generator does not use offset\"); start it with "
                               "--no-enable-chunked-prefill --max-num-batched-tokens "
                               f">= max_model_len ({settings['max_model_len']})")
        return settings

    def served_version(self) -> str | None:
        """The server's weight version label (`/weight_info`)."""
        response = httpx.get(f"{self.url}/weight_info", timeout=10.0)
        return response.json().get("weight_version")

    def update_weights(self, weights: Any, version: int) -> None:
        """Serve the Hugging Face checkpoint directory `weights` as `version`: restart the
        server on it (the in-place reload through orbax is `vllm_worker_ext`)."""
        check_version(self._version, version)
        if self.server is None:
            raise SidecarError("update_weights needs a server this sampler started (an "
                               "attached server's weights are its owner's)")
        path = Path(weights)
        config = dataclasses.replace(self.server.config, model=str(path))
        self.server.stop()
        self.server.config = config
        self.server.start()
        self._version, self._last_sync, self._unverified = int(version), None, None
