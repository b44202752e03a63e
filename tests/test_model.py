"""Qwen3/Qwen2/Llama forward parity with transformers (fp32), KV cache, scan/remat, chunked
logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tiny_models import make_hf_model

from jax_routeweaver.models.config import ConfigError, ModelConfig
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import KVCache, init_cache, token_logprobs

PARITY_CASES = {
    "tied-mha-h32-theta1e4": dict(tie_word_embeddings=True, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=32, rope_theta=1e4),
    "untied-gqa2-h64-theta1e6": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     rope_theta=1e6),
    "tied-gqa4-h32-theta5e6": dict(tie_word_embeddings=True, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=32, rope_theta=5e6),
    "untied-gqa4-h64-theta5e6": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                     rope_theta=5e6),
    "yarn": dict(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64}),
    "linear": dict(rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
LLAMA_CASES = {
    "llama-gqa4-llama3rope": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                  rope_theta=5e5, rope_scaling={
                                      "rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32}),
    "llama-tied-default": dict(tie_word_embeddings=True, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, rope_theta=1e4),
}
# Qwen2 (random q/k/v biases): Qwen2.5-3B's kind (tied, GQA, no head_dim field, theta 1e6), and
# an untied one with an explicit head_dim.
QWEN2_CASES = {
    "qwen2-tied-gqa2-theta1e6": dict(tie_word_embeddings=True, num_attention_heads=4,
                                     num_key_value_heads=2, rope_theta=1e6),
    "qwen2-untied-gqa4-h32-theta1e4": dict(num_attention_heads=8, num_key_value_heads=2,
                                           head_dim=32, rope_theta=1e4),
}


def padded_batch(vocab: int, seed: int = 0):
    """Left-padded batch: tokens, positions, mask `[4, 24]`, rows with 0, 5, 11, 23 pads."""
    rng = np.random.default_rng(seed)
    B, T = 4, 24
    tokens = rng.integers(0, vocab, (B, T))
    mask = np.ones((B, T), np.int64)
    for row, pads in enumerate((0, 5, 11, 23)):
        mask[row, :pads] = 0
        tokens[row, :pads] = 0
    positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    return tokens, positions, mask


def torch_logits(hf_model, tokens, positions, mask) -> np.ndarray:
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(positions))
    return out.logits.float().numpy()


def jax_logits(model, tokens, positions, mask) -> np.ndarray:
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    return np.asarray(logits)


@pytest.mark.integration
@pytest.mark.parametrize(("arch", "overrides"),
                         [("qwen3", c) for c in PARITY_CASES.values()]
                         + [("llama", c) for c in LLAMA_CASES.values()]
                         + [("qwen2", c) for c in QWEN2_CASES.values()],
                         ids=[*PARITY_CASES, *LLAMA_CASES, *QWEN2_CASES])
def test_logit_parity_with_transformers(tmp_path, arch, overrides):
    hf_model = make_hf_model(tmp_path, arch=arch, **overrides)
    model = load_hf(tmp_path)
    assert model.config.rope_theta == overrides["rope_theta"]
    tokens, positions, mask = padded_batch(model.config.vocab_size)
    ref = torch_logits(hf_model, tokens, positions, mask)
    ours = jax_logits(model, tokens, positions, mask)
    valid = mask.astype(bool)
    assert np.abs(ours - ref)[valid].max() <= 1e-4


def test_rope_theta_changes_logits(tmp_path):
    """Guards against the rope base being ignored (a bug seen in another JAX Qwen3)."""
    make_hf_model(tmp_path / "a", rope_theta=1e4)
    make_hf_model(tmp_path / "b", rope_theta=5e6)
    tokens, positions, mask = padded_batch(256)
    a = jax_logits(load_hf(tmp_path / "a"), tokens, positions, mask)
    b = jax_logits(load_hf(tmp_path / "b"), tokens, positions, mask)
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.slow
def test_right_padding_matches_unpadded(tiny_hf_dir):
    model = load_hf(tiny_hf_dir)
    tokens, _, _ = padded_batch(256)
    row = tokens[:1, :10]
    alone = jax_logits(model, row, np.arange(10)[None], np.ones((1, 10)))
    padded = np.concatenate([row, np.zeros((1, 6), row.dtype)], 1)
    mask = np.concatenate([np.ones((1, 10)), np.zeros((1, 6))], 1)
    out = jax_logits(model, padded, np.arange(16)[None], mask)
    np.testing.assert_allclose(out[:, :10], alone, atol=1e-5)


def assert_same_loss_and_grads(base, other, tol: float) -> None:
    """Σ token logprobs of a padded batch, and every parameter's gradient, agree."""
    from flax import nnx

    args = tuple(jnp.asarray(a) for a in padded_batch(256))

    def loss(model):
        return token_logprobs(model, *args, chunk_size=8).sum()

    la, ga = nnx.value_and_grad(loss)(base)
    lb, gb = nnx.value_and_grad(loss)(other)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for (pa, a), (_, b) in zip(nnx.to_flat_state(ga), nnx.to_flat_state(gb), strict=True):
        np.testing.assert_allclose(a[...], b[...], rtol=tol, atol=tol, err_msg=str(pa))


@pytest.mark.slow
@pytest.mark.parametrize("runtime", [dict(scan_layers=False), dict(remat="full"),
                                     dict(remat="dots")])
def test_scan_and_remat_do_not_change_results(tiny_hf_dir, runtime):
    assert_same_loss_and_grads(load_hf(tiny_hf_dir), load_hf(tiny_hf_dir, **runtime), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", [dict(remat="full", remat_groups=2),
                                     dict(remat="none", remat_groups=4),
                                     dict(remat="full", remat_groups=2, scan_layers=False)])
def test_layer_groups_do_not_change_results(tmp_path, runtime):
    """Grouped (nested) remat recomputes, never changes: loss and every gradient as one scan
    (fp32 summation order differs, gradients up to ~70 here: 1e-4, not bit equality)."""
    make_hf_model(tmp_path, num_hidden_layers=4)
    other = load_hf(tmp_path, **runtime)
    assert other.config.remat_groups == runtime["remat_groups"]
    assert_same_loss_and_grads(load_hf(tmp_path), other, 1e-4)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    """A saved tiny tied Qwen2 checkpoint (random q/k/v biases), shared by the module."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_hf_model(path, arch="qwen2", tie_word_embeddings=True)
    return path


@pytest.fixture(params=["qwen3", "qwen2"])
def decoder_dir(request):
    """The tiny Qwen3 checkpoint, then the tiny Qwen2 one."""
    return request.getfixturevalue("tiny_hf_dir" if request.param == "qwen3"
                                   else "tiny_qwen2_dir")


@pytest.mark.slow
@pytest.mark.parametrize(("empty_cache", "block"), [(False, 512), (False, 5), (True, 5)])
def test_kv_cache_decode_matches_full_forward(decoder_dir, empty_cache, block):
    """Prefill a left-padded prompt then feed tokens one by one: same logits as one pass,
    whether the prefill reads the cache's slots (blocked or dense) or, told the cache is
    empty, attends among its own tokens in causal blocks (Qwen3 and Qwen2)."""
    model = load_hf(decoder_dir, attention_block=block, causal_parts=3)
    tokens, positions, mask = padded_batch(256)
    full = jax_logits(model, tokens, positions, mask)
    P = 16
    cache = init_cache(model.config, batch=4, max_len=32)
    hidden, cache = model.hidden_states(jnp.asarray(tokens[:, :P]), jnp.asarray(positions[:, :P]),
                                        jnp.asarray(mask[:, :P]), cache,
                                        empty_cache=empty_cache)
    steps = [np.asarray(model.logits(hidden))]
    for t in range(P, tokens.shape[1]):
        logits, cache = model(jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]),
                              jnp.asarray(mask[:, t:t + 1]), cache)
        steps.append(np.asarray(logits))
    assert isinstance(cache, KVCache) and int(cache.index) == tokens.shape[1]
    stepwise = np.concatenate(steps, axis=1)
    valid = mask.astype(bool)
    assert np.abs(stepwise - full)[valid].max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_softmax(tiny_hf_dir, temperature):
    model = load_hf(tiny_hf_dir)
    tokens, positions, mask = padded_batch(256)
    args = tuple(jnp.asarray(a) for a in (tokens, positions, mask))
    logits = jax_logits(model, *args)
    full = jax.nn.log_softmax(jnp.asarray(logits) / temperature, axis=-1)
    expected = np.take_along_axis(np.asarray(full)[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    for chunk in (5, 8, 24, 512):  # 5 does not divide T=24: exercises the padded tail
        got = np.asarray(token_logprobs(model, *args, temperature=temperature,
                                        chunk_size=chunk))
        assert got.shape == tokens.shape and np.all(got[:, 0] == 0)
        np.testing.assert_allclose(got[:, 1:], expected, atol=1e-5)


@pytest.mark.slow
def test_chunked_logprobs_gradient_equals_full(tiny_hf_dir):
    from flax import nnx

    model = load_hf(tiny_hf_dir)
    tokens, positions, mask = padded_batch(256)
    args = tuple(jnp.asarray(a) for a in (tokens, positions, mask))
    weights = jnp.asarray(mask[:, 1:], jnp.float32)

    def chunked(m):
        return (token_logprobs(m, *args, chunk_size=7)[:, 1:] * weights).sum()

    def full(m):
        logp = jax.nn.log_softmax(m(*args)[0], axis=-1)[:, :-1]
        picked = jnp.take_along_axis(logp, args[0][:, 1:, None], -1)[..., 0]
        return (picked * weights).sum()

    ga = nnx.grad(chunked)(model)
    gb = nnx.grad(full)(model)
    for (path, a), (_, b) in zip(nnx.to_flat_state(ga), nnx.to_flat_state(gb), strict=True):
        np.testing.assert_allclose(a[...], b[...], atol=1e-5, err_msg=str(path))


def test_bf16_compute_is_close_to_fp32(tiny_hf_dir):
    tokens, positions, mask = padded_batch(256)
    f32 = jax_logits(load_hf(tiny_hf_dir), tokens, positions, mask)
    bf16 = load_hf(tiny_hf_dir, dtype="float32", compute_dtype="bfloat16")
    assert bf16.config.param_dtype == "float32" and bf16.config.dtype == "bfloat16"
    out = jax_logits(bf16, tokens, positions, mask)
    assert out.dtype == np.float32
    valid = mask.astype(bool)
    assert np.abs(out - f32)[valid].max() < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("self_attention", [False, True])
def test_block_attention_matches_dense_on_long_sequences(self_attention):
    """Past ATTENTION_BLOCK queries, attention runs block by block (memory linear in T):
    same values and gradients (for q, k and v) as the dense [B, T, S] computation, padding
    included; with `self_attention` the blocks above the causal diagonal are skipped."""
    from jax_routeweaver.models import qwen3 as q3

    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, q3.ATTENTION_BLOCK + 77, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    valid = jnp.asarray(np.arange(T)[None] < np.array([[T - 150], [T]]))
    mask = q3.AttentionMask(valid, jnp.arange(T), jnp.arange(T))
    blocked = lambda q, k, v: q3.attention(q, k, v, mask, self_attention=self_attention,
                                           causal_parts=4)
    dense = lambda q, k, v: q3.grouped_attention(q, k, v, mask.dense())
    np.testing.assert_allclose(blocked(q, k, v), dense(q, k, v), atol=1e-5)
    weight = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    loss = lambda f: lambda *qkv: (f(*qkv) * weight).sum()
    for g_block, g_dense in zip(jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v),
                                jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(g_block, g_dense, atol=1e-4)


def test_self_attention_blocks_skip_the_upper_triangle():
    """The causal-prefix path compiles to fewer FLOPs than reading every key in every block."""
    from jax_routeweaver.models import qwen3 as q3

    B, T, N, K, H = 1, 1024, 2, 1, 16
    q = jnp.zeros((B, T, N, H))
    k = v = jnp.zeros((B, T, K, H))
    mask = q3.AttentionMask(jnp.ones((B, T), bool), jnp.arange(T), jnp.arange(T))

    def flops(f):
        return jax.jit(f).lower(q, k, v).compile().cost_analysis()["flops"]

    # (The blocked path without `self_attention` is a loop, which cost analysis counts once;
    # the dense computation is the same work in one piece.)
    full = flops(lambda q, k, v: q3.grouped_attention(q, k, v, mask.dense()))
    causal = flops(lambda q, k, v: q3.attention(q, k, v, mask, 128, self_attention=True,
                                                causal_parts=8))
    # 8 blocks of 128: (1 + ... + 8) / 64 = 0.5625 of the score blocks
    assert causal < 0.65 * full, (causal, full)


@pytest.mark.slow
@pytest.mark.parametrize("self_attention", [False, True])
@pytest.mark.parametrize("block", [7, 64])
def test_attention_block_size_changes_memory_not_values(block, self_attention):
    """`ModelConfig.attention_block` (any size, uneven splits included) gives the logits of
    the default block; a block below 1 is a config error."""
    from jax_routeweaver.models import qwen3 as q3

    rng = np.random.default_rng(1)
    B, T, N, K, H = 2, 150, 4, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
    valid = jnp.asarray(np.arange(T)[None] < np.array([[T - 40], [T]]))
    mask = q3.AttentionMask(valid, jnp.arange(T), jnp.arange(T))
    np.testing.assert_allclose(q3.attention(q, k, v, mask, block, self_attention=self_attention,
                                            causal_parts=8),
                               q3.grouped_attention(q, k, v, mask.dense()), atol=1e-5)
    with pytest.raises(ConfigError, match="attention_block=0"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4, attention_block=0)


def gather_batch(vocab: int, seed: int = 0):
    """Right-padded rows `[4, 24]` (lengths 24, 19, 13, 2) and 5 gathered positions per row
    inside each row (repeats allowed)."""
    rng = np.random.default_rng(seed)
    lengths = (24, 19, 13, 2)
    tokens = rng.integers(0, vocab, (4, 24))
    mask = np.arange(24)[None] < np.asarray(lengths)[:, None]
    positions = np.broadcast_to(np.arange(24), (4, 24))
    gather = np.stack([rng.integers(0, n, 5) for n in lengths])
    return [jnp.asarray(a) for a in (tokens, positions, mask, gather)]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", [dict(), dict(scan_layers=False, remat="full"),
                                     dict(attention_block=4, causal_parts=3)])
def test_gathered_hidden_states_equal_the_full_pass(tiny_hf_dir, runtime):
    """`gather`: the last layer run at the gathered positions only gives the full pass's
    final hidden states there, and the same gradient of a loss on them (blocked queries,
    unrolled layers and remat included)."""
    from flax import nnx

    model = load_hf(tiny_hf_dir, **runtime)
    tokens, positions, mask, gather = gather_batch(model.config.vocab_size)
    weight = jnp.asarray(np.random.default_rng(1).normal(
        size=(*gather.shape, model.config.hidden_size)), jnp.float32)

    def full(m):
        h, _ = m.hidden_states(tokens, positions, mask)
        return jnp.take_along_axis(h, gather[..., None], axis=1)

    def gathered(m):
        return m.hidden_states(tokens, positions, mask, gather=gather)[0]

    a, b = nnx.jit(full)(model), nnx.jit(gathered)(model)
    assert b.shape == (*gather.shape, model.config.hidden_size)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    ga = nnx.jit(nnx.grad(lambda m: (full(m) * weight).sum()))(model)
    gb = nnx.jit(nnx.grad(lambda m: (gathered(m) * weight).sum()))(model)
    for (path, x), (_, y) in zip(nnx.to_flat_state(ga), nnx.to_flat_state(gb), strict=True):
        # fp32 summation order differs: tolerance relative to the gradient's scale (~20)
        scale = float(np.abs(x[...]).max())
        np.testing.assert_allclose(y[...], x[...], rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=str(path))


def test_gathered_hidden_states_with_layer_groups_fall_back(tmp_path):
    """Grouped remat keeps its groups: the full pass, gathered after (same values)."""
    make_hf_model(tmp_path, num_hidden_layers=4)
    model = load_hf(tmp_path, remat="full", remat_groups=2)
    tokens, positions, mask, gather = gather_batch(model.config.vocab_size)
    h, _ = model.hidden_states(tokens, positions, mask)
    g, _ = model.hidden_states(tokens, positions, mask, gather=gather)
    np.testing.assert_allclose(g, jnp.take_along_axis(h, gather[..., None], axis=1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("empty_cache", "block"), [(True, 512), (True, 5), (False, 5)])
def test_gathered_prefill_fills_the_same_cache(tiny_hf_dir, empty_cache, block):
    """A prefill that keeps only its last position (the sampler's) writes every layer's keys
    and values as the full prefill does, and gives the same last-position logits."""
    model = load_hf(tiny_hf_dir, attention_block=block, causal_parts=3)
    tokens, positions, mask = (jnp.asarray(a) for a in padded_batch(model.config.vocab_size))
    B, T = tokens.shape
    caches, last = [], []
    for gather in (None, jnp.full((B, 1), T - 1)):
        cache = init_cache(model.config, batch=B, max_len=T + 8)
        h, cache = model.hidden_states(tokens, positions, mask, cache, empty_cache=empty_cache,
                                       gather=gather)
        caches.append(cache)
        last.append(model.logits(h[:, -1]))
    np.testing.assert_allclose(last[1], last[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches[0], caches[1], strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
