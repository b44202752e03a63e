"""Mesh sharding: rules -> specs, sharded forward equals unsharded, clear rule errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from model_helpers import shard_model
from test_model import jax_logits, padded_batch

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.sharding import (
    SAMPLE_RULES,
    TRAIN_RULES,
    ShardingError,
    batch_sharding,
    create_sharded,
    logical_to_spec,
    make_mesh,
)

# What TRAIN_RULES must give for the stacked Qwen3 parameters (written out, not derived).
EXPECTED_TRAIN = {
    "embed": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm": P(None),
    "layers.q_proj": P(None, "fsdp", "tensor", None),
    "layers.k_proj": P(None, "fsdp", "tensor", None),
    "layers.v_proj": P(None, "fsdp", "tensor", None),
    "layers.o_proj": P(None, "tensor", None, "fsdp"),
    "layers.gate_proj": P(None, "fsdp", "tensor"),
    "layers.up_proj": P(None, "fsdp", "tensor"),
    "layers.down_proj": P(None, "tensor", "fsdp"),
    "layers.attn_norm": P(None, None),
    "layers.mlp_norm": P(None, None),
    "layers.q_norm": P(None, None),
    "layers.k_norm": P(None, None),
}


def follows(value, spec) -> bool:
    """The array's sharding is the one `spec` names (P() and P(None,) are the same)."""
    return value.sharding.is_equivalent_to(NamedSharding(value.sharding.mesh, spec), value.ndim)


def params(model):
    return {".".join(map(str, p)): v[...] for p, v in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
def test_sharded_forward_equals_unsharded(tiny_hf_dir, devices):
    mesh = make_mesh((2, 2, 2))
    plain = load_hf(tiny_hf_dir)
    sharded = load_hf(tiny_hf_dir, mesh=mesh)
    tokens, positions, mask = padded_batch(256)
    expected = jax_logits(plain, tokens, positions, mask)
    inputs = [jax.device_put(jnp.asarray(a), batch_sharding(mesh)) for a in
              (tokens, positions, mask)]
    got, _ = nnx.jit(lambda m, *a: m(*a))(sharded, *inputs)
    valid = mask.astype(bool)
    assert np.abs(np.asarray(got) - expected)[valid].max() <= 1e-5
    # Gradients through the sharded model agree too.
    def loss(m, t, p, a):
        return token_logprobs(m, t, p, a, chunk_size=8).sum()
    g_plain = nnx.grad(loss)(plain, *[jnp.asarray(a) for a in (tokens, positions, mask)])
    g_sharded = nnx.jit(nnx.grad(loss))(sharded, *inputs)
    for name, a in params(g_plain).items():
        np.testing.assert_allclose(np.asarray(params(g_sharded)[name]), np.asarray(a),
                                   rtol=1e-4, atol=1e-5, err_msg=name)


def test_every_parameter_follows_the_rules(tiny_hf_dir):
    mesh = make_mesh((2, 2, 2))
    model = load_hf(tiny_hf_dir, mesh=mesh)
    got = params(model)
    assert set(got) == set(EXPECTED_TRAIN)
    for name, value in got.items():
        assert follows(value, EXPECTED_TRAIN[name]), name
        # Each device really holds only its shard.
        divisor = [1 if ax is None else 2 for ax in EXPECTED_TRAIN[name]]
        shard_shape = tuple(d // k for d, k in zip(value.shape, divisor, strict=False))
        assert value.addressable_shards[0].data.shape == shard_shape, name


def test_sample_rules_replicate_over_fsdp(tiny_hf_dir):
    mesh = make_mesh((1, 4, 2))
    model = shard_model(load_hf(tiny_hf_dir), mesh, SAMPLE_RULES)
    specs = {n: v.sharding.spec for n, v in params(model).items()}
    assert specs["layers.q_proj"] == P(None, None, "tensor", None)
    assert specs["embed"] == P("tensor", None)
    assert all("fsdp" not in str(s) for s in specs.values())


@pytest.mark.slow
def test_create_sharded_births_params_sharded(devices):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    mesh = make_mesh((2, 2, 2))
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), mesh)
    reference = Qwen3(cfg, rngs=nnx.Rngs(0))
    for name, value in params(model).items():
        assert follows(value, EXPECTED_TRAIN[name]), name
        np.testing.assert_allclose(np.asarray(value), np.asarray(params(reference)[name]),
                                   rtol=1e-6, atol=1e-8)


def test_rule_collision_is_an_error():
    rules = {**TRAIN_RULES, "mlp": "fsdp"}
    with pytest.raises(ShardingError, match="'fsdp' used by both logical axes 'embed' and 'mlp'"):
        logical_to_spec(("layers", "embed", "mlp"), rules, name="layers.gate_proj")


def test_non_dividing_axis_is_an_error(tmp_path):
    from tiny_models import make_hf_model

    make_hf_model(tmp_path, num_attention_heads=4, num_key_value_heads=1)
    with pytest.raises(ShardingError, match=r"layers\.k_proj: dimension 2 \('kv_heads'\) has "
                                            r"size 1, not divisible by mesh axes \('tensor',\)"):
        load_hf(tmp_path, mesh=make_mesh((2, 2, 2)))


def test_unknown_logical_axis_and_mesh_errors(devices):
    with pytest.raises(ShardingError, match="logical axis 'experts' has no rule"):
        logical_to_spec(("experts",), TRAIN_RULES, name="moe")
    with pytest.raises(ShardingError, match="needs 12 devices, have 8"):
        make_mesh((2, 3, 2))
    with pytest.raises(ShardingError, match="unknown"):
        make_mesh({"data": 2, "pipeline": 4})
    assert make_mesh({"fsdp": -1, "tensor": 2}).shape == {"data": 1, "fsdp": 4, "tensor": 2}
