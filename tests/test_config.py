"""ModelConfig: HF config.json reading, writing, rope frequencies and runtime options."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jax_routeweaver.models.config import ConfigError, ModelConfig

QWEN3_4B_2507 = {  # the shape of Qwen3-4B-Instruct-2507's config.json (older key style)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
    "max_position_embeddings": 262144, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_reads_qwen3_4b_instruct_2507():
    cfg = ModelConfig.from_hf(QWEN3_4B_2507)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        36, 2560, 32, 8, 128)
    assert cfg.rope_theta == 5e6 and cfg.rope_type == "default"
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.vocab_size == 151936


def test_to_hf_round_trips():
    cfg = ModelConfig.from_hf(QWEN3_4B_2507)
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again == cfg
    # transformers reads what we write, with the same rope base.
    hf = Qwen3Config(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    assert hf.rope_parameters["rope_theta"] == 5e6 and hf.head_dim == 128


@pytest.mark.parametrize(("cls", "rope"), [
    (Qwen3Config, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    (Qwen3Config, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                   "beta_fast": 16, "truncate": False}),
    (LlamaConfig, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    (Qwen3Config, {"rope_type": "linear", "factor": 4.0}),
])
def test_rope_frequencies_match_transformers(cls, rope):
    """Full-size head_dim 128: the scaled regions (ramps, wavelength bands) are all exercised."""
    hf = cls(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
             rope_parameters={**rope, "rope_theta": 5e5})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, torch.device("cpu"))
    d = hf.to_dict()
    d["architectures"] = ["LlamaForCausalLM" if cls is LlamaConfig else "Qwen3ForCausalLM"]
    ours, our_scale = ModelConfig.from_hf(d).rope_inv_freq()
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert our_scale == pytest.approx(scale)


@pytest.mark.parametrize(("field", "value"), [("remat", "sometimes"), ("dtype", "int8"),
                                              ("param_dtype", "fp32"), ("causal_parts", 0)])
def test_bad_runtime_options(field, value):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(QWEN3_4B_2507, **{field: value})


@pytest.mark.parametrize("groups", [0, 5])
def test_remat_groups_must_divide_the_layers(groups):
    with pytest.raises(ConfigError, match=f"remat_groups={groups} must be >= 1 and divide "
                                          "num_layers=36"):
        ModelConfig.from_hf(QWEN3_4B_2507, remat_groups=groups)
    assert ModelConfig.from_hf(QWEN3_4B_2507, remat_groups=6).remat_groups == 6


def test_missing_or_malformed_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="hidden_size=None must be a positive integer"):
        ModelConfig.from_hf({**QWEN3_4B_2507, "hidden_size": None})
