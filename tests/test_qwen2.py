"""Qwen2 (`Qwen2ForCausalLM`, Router-R1's Qwen2.5 policies): the config mapping, the q/k/v biases
in the paged decoder and on a mesh, and the configs we refuse. Logit parity with transformers
and the KV-cache decode are in test_model.py, the HF export round trip in test_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from tiny_models import make_hf_model

from jax_routeweaver.models.config import ConfigError, ModelConfig
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.paged_attention import init_pool
from jax_routeweaver.models.sharding import make_mesh

# Qwen2.5-3B-Instruct's config.json (written by transformers 4.43).
QWEN25_3B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 32768,
    "max_window_layers": 70, "model_type": "qwen2", "num_attention_heads": 16,
    "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_hf_model(path, arch="qwen2", tie_word_embeddings=True)
    return path


def test_qwen25_3b_config_is_read():
    """head_dim from hidden_size / heads, top-level rope_theta, tied head, biases on, no
    q/k-norm; the export is a Qwen2 config that reads back to the same ModelConfig."""
    cfg = ModelConfig.from_hf(QWEN25_3B)
    assert (cfg.architecture, cfg.model_type) == ("Qwen2ForCausalLM", "qwen2")
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (True, False, True)
    assert (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (128, 16, 2)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rms_norm_eps) == (1e6, "default", 1e-6)
    hf = cfg.to_hf()
    assert hf["use_sliding_window"] is False and "attention_bias" not in hf
    assert ModelConfig.from_hf(hf) == cfg


def test_sliding_window_is_refused(tmp_path):
    """A Qwen2 that transformers builds with sliding-window layers: a ValueError naming the
    field and its value, not a model that attends too far."""
    make_hf_model(tmp_path, arch="qwen2", use_sliding_window=True, sliding_window=8,
                  max_window_layers=1)
    with pytest.raises(ValueError, match=r"use_sliding_window=True is not supported") as err:
        load_hf(tmp_path)
    assert isinstance(err.value, ConfigError)


def test_attention_flags_must_match_the_architecture():
    """qk_norm/qkv_bias decide the tensors an export writes: a pair that is not the
    architecture's own would export a checkpoint its HF class cannot load."""
    shape = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=4)
    ModelConfig(**shape, architecture="Qwen2ForCausalLM", qk_norm=False, qkv_bias=True)
    with pytest.raises(ConfigError, match="qk_norm=True, qkv_bias=False do not match "
                                          "architecture Qwen2ForCausalLM"):
        ModelConfig(**shape, architecture="Qwen2ForCausalLM")
    with pytest.raises(ConfigError, match="qkv_bias=True do not match architecture Qwen3"):
        ModelConfig(**shape, qkv_bias=True)


def test_biases_shard_like_their_projections_outputs(qwen2_dir):
    """On a (data, fsdp, tensor) mesh, each bias is split over heads as its projection's
    output dims are, and holds the checkpoint's values."""
    model = load_hf(qwen2_dir, mesh=make_mesh((2, 2, 2)))
    plain = load_hf(qwen2_dir)
    layers = model.layers
    for name in ("q", "k", "v"):
        bias, proj = getattr(layers, f"{name}_bias")[...], getattr(layers, f"{name}_proj")[...]
        assert bias.sharding.spec == PartitionSpec(None, *proj.sharding.spec[2:])
        assert bias.sharding.spec[1] == "tensor"
        np.testing.assert_array_equal(np.asarray(bias),
                                      np.asarray(getattr(plain.layers, f"{name}_bias")[...]))
        assert np.abs(np.asarray(bias)).min() > 0  # the random biases, not zeros


@pytest.mark.slow
def test_paged_decode_matches_full_forward(qwen2_dir):
    """The paged decoder adds the biases too: a prompt prefilled over scattered pages, then
    fed one token at a time, gives the full forward's logits at every position."""
    model = load_hf(qwen2_dir)
    T, P = 20, 12
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    full, _ = model(tokens, positions, jnp.ones((2, T), bool))
    table = jnp.asarray([[3, 7, 1, 9, 2], [4, 5, 6, 8, 0]], jnp.int32)  # 5 pages of 4 slots

    @jax.jit
    def step(pool, t, p, length):
        h, pool = model.hidden_states_paged(t, p, pool, table, jnp.full(2, length))
        return model.logits(h), pool

    logits, pool = step(init_pool(model.config, 10, 4), tokens[:, :P], positions[:, :P], P)
    steps = [logits]
    for t in range(P, T):
        logits, pool = step(pool, tokens[:, t:t + 1], positions[:, t:t + 1], t + 1)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
