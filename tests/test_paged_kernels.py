"""The paged engine's Pallas decode path, checked on CPU in Pallas's interpret mode: JAX's TPU
paged-attention kernel (under `force_tpu_interpret_mode`) and its GPU kernel (`interpret=True`)
against the portable path on the engine's shapes (page sizes, GQA ratios, ragged lengths,
shared and scattered pages), the path each backend takes, the engine generating through the
kernel, and the plan pricing it. Neither kernel takes more than one query per row, so prefill
stays on the portable path (the only path it has)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import (
    attention_path,
    decode_kernel,
    paged_attention,
)
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.planning import rollout as ro
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.paged_options import PagedConfig

TPU_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tpu" / "main_alpha0.yaml"
# (kv heads K, query heads N, head_dim H, page size S, pages per row M): the quickstart's
# router (N 2, K 1, H 16), the engine tests' (4, 2, 16, 8), Qwen3-4B's head (H 128, 32 / 8).
SHAPES = [(1, 2, 16, 16, 4), (2, 4, 16, 8, 8), (2, 8, 128, 16, 4)]


def case(K: int, N: int, H: int, S: int, M: int, dtype=jnp.float32, seed: int = 0):
    """A layer-0 pool of 3 rows with ragged lengths (1 token, mid-page, every slot) over
    scattered pages, one page shared by two rows (a common prefix). Values are bf16 numbers,
    so the TPU kernel's one-pass bf16 products are exact (module doc of paged_attention)."""
    rng = np.random.default_rng(seed)
    P = 3 * M + 2
    pool = rng.normal(size=(2, 1, K, P, S, H)).astype(np.float32)
    pool = jnp.asarray(pool, jnp.bfloat16).astype(dtype)
    q = jnp.asarray(rng.normal(size=(3, 1, N, H)), jnp.bfloat16).astype(dtype)
    table = rng.permutation(P)[:3 * M].reshape(3, M)
    table[1, 0] = table[0, 0]  # rows 0 and 1 share their first page
    lengths = jnp.asarray([1, S * (M // 2) + S // 2 + 1, S * M], jnp.int32)
    return q, pool[0], pool[1], jnp.asarray(table, jnp.int32), lengths


def portable(q, k, v, table, lengths):
    return paged_attention(q, k, v, 0, table, (lengths - 1)[:, None], lengths)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "K{}N{}H{}S{}M{}".format(*s))
def test_the_pallas_kernel_equals_the_portable_path(backend, shape):
    q, k, v, table, lengths = case(*shape)
    kernel = decode_kernel(backend, interpret=True)
    got = paged_attention(q, k, v, 0, table, (lengths - 1)[:, None], lengths, kernel=kernel)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(portable(q, k, v, table, lengths)),
                               rtol=0, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_the_pallas_kernel_in_bf16(backend):
    """bf16 pools and queries, as on an accelerator: within bf16's rounding of the output."""
    q, k, v, table, lengths = case(2, 8, 128, 16, 4, dtype=jnp.bfloat16)
    got = paged_attention(q, k, v, 0, table, (lengths - 1)[:, None], lengths,
                          kernel=decode_kernel(backend, interpret=True))
    want = portable(q, k, v, table, lengths)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0, atol=2e-2)


def test_which_path_each_backend_takes():
    assert attention_path("auto", "tpu") == "pallas"
    assert attention_path("auto", "gpu") == attention_path("auto", "cpu") == "portable"
    assert attention_path("pallas", "gpu") == "pallas"
    assert attention_path("portable", "tpu") == "portable"
    with pytest.raises(ValueError, match="'pallas' needs a TPU or GPU backend"):
        attention_path("pallas", "cpu")
    assert attention_path("pallas", "cpu", interpret=True) == "pallas"
    with pytest.raises(ValueError, match="not one of auto, portable, pallas"):
        attention_path("flash", "tpu")
    with pytest.raises(ValueError, match="PagedConfig.attention='flash'"):
        PagedConfig(attention="flash")


CFG = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=16, attention_block=8)


@pytest.mark.slow
def test_the_engine_generates_through_the_kernel():
    """Greedy rows of ragged lengths, more than the slots (3 slots, 4 rows), decoded through
    the TPU kernel (interpret mode) and through the portable path: the same tokens, logprobs
    within the kernel's bf16 products. (Interpret mode is slow: one page-table width.)"""
    model = nnx.jit(lambda: Qwen3(CFG, rngs=nnx.Rngs(0)))()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 250, n).tolist() for n in (5, 11, 2, 8)]
    params = SamplingParams(greedy=True, max_new_tokens=4)
    options = PagedConfig(page_size=8, budget_tokens=16 * 8, max_rows=3, steps_per_sync=4,
                          prefill_chunk=16, attention="portable")
    want = JaxSampler(model, kv_cache="paged", paged=options).generate(prompts, params)
    kernel = JaxSampler(model, kv_cache="paged", paged=dataclasses.replace(
        options, attention="pallas", pallas_interpret=True))
    assert kernel.engine.attention == "pallas"
    got = kernel.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        # The TPU kernel multiplies in one bf16 pass (module doc of paged_attention).
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=2e-3)
    with pytest.raises(ValueError, match="needs a TPU or GPU backend"):
        JaxSampler(model, kv_cache="paged", paged=dataclasses.replace(
            options, attention="pallas"))


def test_the_plan_prices_the_path():
    """A decode step through the kernel gathers no keys and values and forms no full scores
    (where the decode step is the larger temporary: many short rows)."""
    arch = ModelConfig(vocab_size=151_936, hidden_size=2560, intermediate_size=9728,
                       num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       dtype="bfloat16")
    args = (arch, 4096, 2048, 16, 4)
    width = ro.paged_width(2048, 16)
    gathered = 2 * 4096 * width * 2 * 128 * 2 + 4096 * 8 * width * (4 + 2)
    assert ro.paged_temporaries(*args, attention="portable") - \
        ro.paged_temporaries(*args, attention="pallas") == gathered
    settings = ro.RolloutSettings.of_config(load_train_config(TPU_CONFIG))
    assert settings.attention == "auto" and attention_path(settings.attention, "tpu") == "pallas"
