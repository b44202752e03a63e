"""HF interop: round trips, sharded checkpoints, tied heads, and clear errors on bad input."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from tiny_models import make_hf_model
from transformers import AutoModelForCausalLM

from jax_routeweaver.models.config import ConfigError, ModelConfig
from jax_routeweaver.models.hf import CheckpointError, load_hf, save_hf
from jax_routeweaver.models.sharding import TRAIN_RULES, make_mesh, param_specs


def hf_state(path) -> dict[str, np.ndarray]:
    """All tensors of a saved checkpoint dir (single file or index-sharded)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same_logits(a, b, vocab=256):
    tokens = torch.tensor(np.random.default_rng(1).integers(0, vocab, (2, 12)))
    with torch.no_grad():
        np.testing.assert_allclose(a(tokens).logits.numpy(), b(tokens).logits.numpy(),
                                   atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, arch, tied):
    """Every tensor (Qwen2's q/k/v biases included) comes back bit-identical under its HF
    name, and transformers loads the export as the original's class, with its logits."""
    original = make_hf_model(tmp_path / "src", arch=arch, tie_word_embeddings=tied)
    model = load_hf(tmp_path / "src")
    save_hf(model, tmp_path / "out")
    before, after = hf_state(tmp_path / "src"), hf_state(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert ("lm_head.weight" in after) is (not tied)
    assert ("model.layers.1.self_attn.v_proj.bias" in after) is (arch == "qwen2")
    for name in before:
        assert before[name].dtype == after[name].dtype
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert (tmp_path / "out" / "generation_config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(original)
    same_logits(original, reloaded)


def test_sharded_export_writes_index_and_reloads(tmp_path):
    original = make_hf_model(tmp_path / "src")
    model = load_hf(tmp_path / "src")
    save_hf(model, tmp_path / "out", max_shard_bytes=100_000)
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in hf_state(
        tmp_path / "src").values())
    same_logits(original, AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval())
    # ... and our loader reads the index-sharded layout back, onto a mesh.
    again = load_hf(tmp_path / "out", mesh=make_mesh((2, 2, 2)))
    for (path, a), (_, b) in zip(_flat(model), _flat(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _flat(model):
    from flax import nnx

    return [(p, v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def test_load_hf_sharded_checkpoint_written_by_transformers(tmp_path):
    original = make_hf_model()
    original.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    mesh = make_mesh((2, 2, 2))
    model = load_hf(tmp_path, mesh=mesh)
    specs = param_specs(model, TRAIN_RULES)
    for path, value in _flat(model):
        assert value.sharding.spec == specs[tuple(path)], path
    save_hf(model, tmp_path / "out")
    same_logits(original, AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval())


def test_untied_export_of_tied_model(tmp_path):
    original = make_hf_model(tmp_path / "src", tie_word_embeddings=True)
    save_hf(load_hf(tmp_path / "src"), tmp_path / "out", untie=True)
    state = hf_state(tmp_path / "out")
    np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    same_logits(original, AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval())


def test_tied_checkpoint_that_stores_its_head(tmp_path):
    make_hf_model(tmp_path, tie_word_embeddings=True)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].copy()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_hf(tmp_path)  # identical copy: accepted
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_hf(tmp_path)


def test_bf16_load_and_export(tmp_path):
    make_hf_model(tmp_path / "src")
    model = load_hf(tmp_path / "src", dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16
    save_hf(model, tmp_path / "out")
    state = hf_state(tmp_path / "out")
    assert all(str(a.dtype) == "bfloat16" for a in state.values())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16


def test_tokenizer_files_are_written(tmp_path):
    make_hf_model(tmp_path / "src")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    save_hf(load_hf(tmp_path / "src"), tmp_path / "out", tokenizer=tmp_path / "tok")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"


# ------------------------------------------------------------------------------- bad input
def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("changes", "message"), [
    ({"frobnicate": 1}, "unsupported config field.*frobnicate"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures=.*MistralForCausalLM"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope type 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "needs 'factor'"),
    ({"num_attention_heads": 3}, "not a multiple of num_key_value_heads"),
])
def test_unsupported_config_is_a_clear_error(tmp_path, changes, message):
    make_hf_model(tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ConfigError, match=message) as err:
        load_hf(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_old_style_rope_keys_are_read(tmp_path):
    make_hf_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config["rope_theta"] = 5e6
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    config["torch_dtype"] = config.pop("dtype")
    cfg = ModelConfig.from_hf(config)
    assert cfg.rope_theta == 5e6 and cfg.rope_type == "linear"


def test_missing_tensor(tmp_path):
    make_hf_model(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj"):
        load_hf(tmp_path)


def test_extra_tensor(tmp_path):
    make_hf_model(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.rotary.inv_freq"] = np.zeros(4, np.float32)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unmapped tensor.*rotary.inv_freq"):
        load_hf(tmp_path)


def test_wrong_shape(tmp_path):
    make_hf_model(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"k_proj.weight' has shape \[32, 64\], expected \[64, 64\]"):
        load_hf(tmp_path)


def test_corrupt_safetensors(tmp_path):
    make_hf_model(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="corrupt or unreadable") as err:
        load_hf(tmp_path)
    assert str(f) in str(err.value)


def test_missing_weights_file(tmp_path):
    make_hf_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_hf(tmp_path)
