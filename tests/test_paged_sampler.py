"""The paged KV cache: attention over pages, the page allocator, and `JaxSampler(kv_cache=
"paged")` generating what the dense sampler generates (tokens, logprobs, finish reasons) while
sharing prefix pages, keeping an episode's turns and holding memory for live tokens only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import init_pool
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, make_mesh
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, GrammarConstraints
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.paged_cache import PageCache
from jax_routeweaver.sampling.paged_options import PagedConfig

# Vocabulary 320: room for the pruned Qwen3 tokenizer the grammar tests use (316 tokens).
CFG = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, attention_block=8)
PAGE = 8
OPTIONS = PagedConfig(page_size=PAGE, budget_tokens=12 * PAGE, max_rows=4, steps_per_sync=4,
                       prefill_chunk=32)
MAX_NEW = 12
GREEDY = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW, seed=11,
                         stop_token_ids=tuple(range(100, 108)))
MODES = ("single", "multi", "agentic")
IM_END = 292  # <|im_end|> in the pruned tokenizer
BF16_ATOL = 5e-3  # engines' logprob difference in bf16 compute (measured 3e-4, 10/10 rows same)


def letters(ids) -> str:
    """Fake detokeniser: two letters per token (as test_sampler's)."""
    return "".join(chr(97 + t % 26) + chr(65 + t % 7) for t in ids)


def seq(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 250, n).tolist()


# Mixed lengths, more rows (10) than slots (4), more tokens than the pool (96) holds at once.
PROMPTS = [seq(i, n) for i, n in enumerate([5, 16, 1, 11, 9, 14, 3, 16, 7, 12])]


@pytest.fixture(scope="module")
def model() -> Qwen3:
    return nnx.jit(lambda: Qwen3(CFG, rngs=nnx.Rngs(0)))()  # one compile, not one per op


@pytest.fixture(scope="module")
def tokenizer():
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer, prune_tokenizer

    full = build_qwen3_tokenizer()  # the user's cache: built once, then loaded
    return prune_tokenizer(full, [*(f"<mode>{m}</mode>" for m in MODES), "yes please",
                                  "Query 1: pick a mode."])


@pytest.fixture(scope="module")
def constraints(tokenizer) -> GrammarConstraints:
    return GrammarConstraints(tokenizer, CFG.vocab_size)


def dense_sampler(model: Qwen3, **kw) -> JaxSampler:
    # One group shape for every call below: fewer compiles.
    kw = {"decode": letters, **kw}
    return JaxSampler(model, kv_cache="dense", prompt_buckets=(32,), batch_buckets=(16,),
                      group_cost=None, **kw)


def paged_sampler(model: Qwen3, options: PagedConfig = OPTIONS, **kw) -> JaxSampler:
    kw = {"decode": letters, **kw}
    return JaxSampler(model, kv_cache="paged", paged=options, **kw)


@pytest.fixture(scope="module")
def dense(model, constraints) -> JaxSampler:
    return dense_sampler(model, constraints=constraints)


@pytest.fixture(scope="module")
def paged(model, constraints) -> JaxSampler:
    return paged_sampler(model, constraints=constraints)


def assert_same(got, want, atol=1e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert (g.finish_reason, g.stop, g.allowed, g.policy_version) == \
            (w.finish_reason, w.stop, w.allowed, w.policy_version)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=atol)


def assert_no_leak(sampler: JaxSampler) -> None:
    cache = sampler.engine.cache
    assert cache.used == 0 and not cache.rows
    assert cache.free + cache.cached == cache.num_pages


# ------------------------------------------------------------------------------ attention
@pytest.mark.slow
def test_paged_hidden_states_equal_the_dense_pass(model):
    """A prompt run in two chunks over scattered pages (block-wise attention included) gives
    the dense pass's hidden states; `gather` gives the same at the gathered position; invalid
    tokens write nothing."""
    m = model  # attention_block 8: the 13-token chunk and the dense pass run block-wise
    T = 21
    tokens = jnp.asarray([seq(1, T), seq(2, T)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    want, _ = jax.jit(lambda t, p: m.hidden_states(t, p, jnp.ones(t.shape, bool)))(tokens,
                                                                                     positions)
    table = jnp.asarray([[3, 7, 1, 9, 2, 0, 0, 0], [4, 5, 6, 8, 10, 11, 12, 13]], jnp.int32)

    @jax.jit
    def run(pool, t, p, lengths, valid, gather):
        return m.hidden_states_paged(t, p, pool, table, lengths, valid, gather=gather)

    def chunk(pool, a, b, valid=True, gather=None):
        n = b - a
        v = jnp.full((2, n), valid)
        g = jnp.full((2, 1), n - 1 if gather is None else gather)
        full, pool = run(pool, tokens[:, a:b], positions[:, a:b], jnp.array([b, b]), v, g)
        return full, pool

    # Gather at the last position of each chunk; the first chunk's is checked at 12.
    h1, pool = chunk(init_pool(CFG, 20, 4), 0, 13)
    h2, pool2 = chunk(pool, 13, T)
    np.testing.assert_allclose(h1[:, 0], want[:, 12], atol=2e-6)
    np.testing.assert_allclose(h2[:, 0], want[:, -1], atol=2e-6)
    h3, _ = chunk(pool, 13, T, gather=3)
    np.testing.assert_allclose(h3[:, 0], want[:, 16], atol=2e-6)
    _, pool3 = chunk(pool, 13, T, valid=False)
    np.testing.assert_array_equal(pool3.k, pool.k)
    assert not np.array_equal(pool2.k, pool.k)
    # Every written slot holds the dense pass's keys: read back through the page table.
    from jax_routeweaver.models.paged_attention import gather_pages

    k = gather_pages(pool2.k, 0, table)[:, :T]
    assert np.abs(np.asarray(k)).sum(axis=(2, 3)).min() > 0


# ------------------------------------------------------------------------------ allocator
def test_shared_prefix_pages_are_refcounted_and_cached_after_release():
    cache = PageCache(10, 4)
    prefix = list(range(1, 13))  # 3 full pages
    a, b = [*prefix, 50, 51], [*prefix, 60]
    cache.admit("a", a, cache.match(a, len(a) - 1), len(a) + 2)
    assert cache.match(b, len(b) - 1).blocked  # a's prefix pages are not computed yet
    cache.ready("a")
    match = cache.match(b, len(b) - 1)
    assert match.pages == tuple(cache.rows["a"][:3]) and not match.blocked
    cache.admit("b", b, match, len(b) + 3)
    assert cache.used == 4 + 1 and cache._refs[list(match.pages)].tolist() == [2, 2, 2]
    cache.release("a", [*a, 70, 71])  # + 2 generated tokens: its 4th page is full now
    assert cache.used == 4 and cache.cached == 1  # the shared pages are b's still
    cache.release("b", b)  # b's own page is not full: freed, not cached
    assert cache.used == 0 and cache.cached == 4 and cache.free == 6 and not cache.rows
    assert cache.match([*prefix, 7], 13).pages == match.pages  # still matchable


def test_lru_evicts_the_oldest_released_tail_first():
    cache = PageCache(4, 2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    for name, tokens in (("x", x), ("y", y)):
        cache.admit(name, tokens, cache.match(tokens, 0), len(tokens))
        cache.ready(name)
    cache.release("x", x)
    cache.release("y", y)
    assert cache.cached == 4 and cache.free == 0
    cache.admit("z", [9], cache.match([9], 0), 2)  # evicts x's tail page first
    assert cache.match([*x, 0], 4).pages == (cache.match([*x[:2], 0], 2).pages[0],)
    assert len(cache.match([*y, 0], 4).pages) == 2
    cache.invalidate()
    assert cache.cached == 0 and cache.free == 3 and cache.match([*y, 0], 4).pages == ()


def test_grow_fails_without_room_and_allocates_nothing():
    cache = PageCache(3, 2)
    cache.admit("a", [1, 2, 3], cache.match([1, 2, 3], 2), 4)
    assert not cache.grow("a", 8) and len(cache.rows["a"]) == 2
    assert cache.grow("a", 6) and len(cache.rows["a"]) == 3 and cache.peak_used == 3


# ------------------------------------------------------------------------------ equality
@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_paged_generates_what_dense_generates(dense, paged, params):
    """10 mixed-length rows through 4 slots and a pool of 12 pages (96 tokens; all rows at
    once would need 280): same tokens, reasons and logprobs as the dense sampler, rows
    admitted late (greedy: one preempted and resumed too), no page left in use, and fewer KV
    tokens held than the dense groups."""
    want = dense.generate(PROMPTS, params)
    got = paged.generate(PROMPTS, params)
    assert_same(got, want)
    stats = paged.engine.last_call
    assert stats.prefill_launches > 1 and stats.decode_launches > MAX_NEW // 4
    assert_no_leak(paged)
    dense_tokens = max(b * (p + n) for b, p, n in dense.shape_state())
    assert stats.peak_pages * PAGE <= 12 * PAGE < dense_tokens
    if params is SAMPLED:
        assert {c.finish_reason for c in want} == {"stop_token", "length"}
    else:
        assert stats.preemptions > 0


@pytest.mark.slow
def test_sampled_rows_are_the_same_whether_or_not_they_were_preempted(model):
    """Row r's draw at its step t is keyed fold_in(fold_in(key, r), t): a pool so small that
    rows are preempted and resumed (their next logits then come from a prefill) gives the
    same sampled tokens as a pool that holds every row at once."""
    params = dataclasses.replace(SAMPLED, stop_token_ids=(), max_new_tokens=16)
    roomy = paged_sampler(model, dataclasses.replace(OPTIONS, budget_tokens=64 * PAGE,
                                                     max_rows=10))
    want = roomy.generate(PROMPTS, params)
    assert roomy.engine.last_call.preemptions == 0
    tight = paged_sampler(model, dataclasses.replace(OPTIONS, budget_tokens=8 * PAGE))
    got = tight.generate(PROMPTS, params)
    assert tight.engine.last_call.preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert_same(got, want, atol=1e-4)


@pytest.mark.slow
def test_bf16_paged_and_dense_agree():
    """In bf16 compute (the accelerator's dtype; the caches bf16 too) the two engines sum in
    different orders, so a greedy token may flip where two logits tie within bf16's
    rounding. Reported: rows with identical tokens; asserted: every step before a row's
    first flip has logprobs within BF16_ATOL, and most rows agree throughout."""
    model = nnx.jit(lambda: Qwen3(CFG.replace(dtype="bfloat16"), rngs=nnx.Rngs(0)))()
    params = dataclasses.replace(GREEDY, max_new_tokens=MAX_NEW)
    want = dense_sampler(model).generate(PROMPTS, params)
    got = paged_sampler(model).generate(PROMPTS, params)
    same_rows, worst = 0, 0.0
    for g, w in zip(got, want, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False))
                  if a != b), min(len(g.token_ids), len(w.token_ids)))
        same_rows += g.token_ids == w.token_ids
        worst = max(worst, float(np.max(np.abs(np.subtract(g.logprobs[:n], w.logprobs[:n])),
                                        initial=0.0)))
    print(f"bf16: {same_rows}/{len(PROMPTS)} rows with identical tokens; largest logprob "
          f"difference before a flip {worst:.4f}")
    assert worst <= BF16_ATOL
    assert same_rows >= len(PROMPTS) * 0.8


@pytest.mark.slow
def test_stop_strings_match_dense(dense, paged):
    params = dataclasses.replace(GREEDY, stop_strings=("eB", "aA", "q"))
    want, got = dense.generate(PROMPTS, params), paged.generate(PROMPTS, params)
    assert_same(got, want)
    assert "stop_string" in {c.finish_reason for c in got}


@pytest.mark.slow
def test_choice_grammars_match_dense(model, constraints, tokenizer, dense, paged):
    """Finite choices decoded on device from the tries (as the dense sampler does), and with
    host masks every step (`device_choices=False`): the same tokens, allowed counts and
    finish reasons."""
    grammars = [Grammar.choice(MODES), None, Grammar.choice(["yes", "yes please"], True),
                Grammar.choice(MODES, True), None, Grammar.choice(MODES)]
    params = dataclasses.replace(SAMPLED, stop_token_ids=(IM_END,), stop_strings=("q",))
    prompts = PROMPTS[:len(grammars)]
    want = dense.generate(prompts, params, grammars)
    got = paged.generate(prompts, params, grammars)
    assert_same(got, want)
    host = paged_sampler(model, constraints=constraints, device_choices=False)
    assert_same(host.generate(prompts, params, grammars), want)
    for c, g in zip(got, grammars, strict=True):
        assert (c.allowed is None) == (g is None)
        if g is not None and c.finish_reason != "stop_string":
            assert tokenizer.decode(c.token_ids).removesuffix("<|im_end|>") in g.choices
    assert "grammar" in {c.finish_reason for c in got}
    assert_no_leak(paged)
    assert_no_leak(host)


@pytest.mark.slow
def test_xgrammar_host_masks_match_dense(tokenizer, dense, paged):
    """An EBNF grammar (xgrammar matchers, one host round trip per step): the same tokens,
    allowed counts and finish reasons as the dense sampler."""
    grammar = Grammar('root ::= "<mode>" ("single" | "multi" | "agentic") "</mode>"')
    prompts = [tokenizer.encode(f"Query {i}: pick a mode.", add_special_tokens=False)
               for i in range(5)]
    params = dataclasses.replace(SAMPLED, seed=2)
    grammars = [grammar, None, grammar, grammar, None]
    want = dense.generate(prompts, params, grammars)
    got = paged.generate(prompts, params, grammars)
    assert_same(got, want)
    assert "grammar" in {got[i].finish_reason for i in (0, 2, 3)}
    assert_no_leak(paged)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 2)], ids=["1dev", "tensor2"])
def test_mesh_matches_no_mesh(model, paged, devices, shape):
    mesh = make_mesh(shape, devices[:shape[2]])
    sharded = paged_sampler(model, mesh=mesh, rules=SAMPLE_RULES)
    want, got = paged.generate(PROMPTS[:4], GREEDY), sharded.generate(PROMPTS[:4], GREEDY)
    assert_same(got, want)
    kv_heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
    assert sharded.engine._pool.k.sharding.is_equivalent_to(kv_heads, 5)


# ------------------------------------------------------------------------------ sharing
@pytest.mark.slow
def test_rows_share_a_common_prefix(model):
    """4 rows with the same 3-page prefix: the prefix is computed and stored once."""
    sampler = paged_sampler(model)
    prefix = seq(50, 3 * PAGE)
    prompts = [[*prefix, *seq(60 + i, 4)] for i in range(4)]
    params = dataclasses.replace(GREEDY, max_new_tokens=4)
    out = sampler.generate(prompts, params)
    stats = sampler.engine.last_call
    assert stats.prefill_tokens == 3 * PAGE + 4 * 4 and stats.reused_tokens == 3 * 3 * PAGE
    assert stats.allocated_pages == 3 + 4 * 1  # 28 + 4 tokens: one own page each
    assert stats.peak_pages == 3 + 4
    assert_same(out, dense_sampler(model).generate(prompts, params))


def test_next_turn_reuses_the_episodes_pages(model):
    """A turn's prompt + completion stay in their pages: the next turn computes only what is
    past the last full page it shares."""
    sampler = paged_sampler(model)
    first = seq(70, 12)
    params = dataclasses.replace(GREEDY, max_new_tokens=MAX_NEW)
    (c1,) = sampler.generate([first], params)
    assert len(c1.token_ids) == MAX_NEW
    second = [*first, *c1.token_ids, 9, 9, 9, 9]  # 28 tokens, 24 of them in 3 full pages
    (c2,) = sampler.generate([second], dataclasses.replace(params, max_new_tokens=4))
    stats = sampler.engine.last_call
    assert (stats.reused_tokens, stats.prefill_tokens) == (3 * PAGE, 4)
    want = dense_sampler(model).generate([second], dataclasses.replace(params, max_new_tokens=4))
    assert_same([c2], want)


@pytest.mark.slow
def test_weight_update_invalidates_cached_pages(model):
    sampler = paged_sampler(model)
    dense = dense_sampler(model)
    prompt = seq(80, 20)
    sampler.generate([prompt], GREEDY)
    assert sampler.engine.cache.cached > 0
    # Other weights without building a model: every parameter scaled (host arrays).
    other = jax.tree.map(lambda a: np.asarray(a) * 1.5, nnx.state(model))
    sampler.update_weights(other, 1)
    dense.update_weights(other, 1)
    assert sampler.engine.cache.cached == 0
    got = sampler.generate([prompt], GREEDY)
    assert sampler.engine.last_call.reused_tokens == 0
    assert_same(got, dense.generate([prompt], GREEDY))
    assert got[0].policy_version == 1


# ------------------------------------------------------------------------------ errors
def test_a_budget_too_small_for_one_row_names_the_setting(model):
    sampler = paged_sampler(model, dataclasses.replace(OPTIONS, budget_tokens=3 * PAGE))
    with pytest.raises(ValueError, match="budget_tokens=24.*needs 4 pages"):
        sampler.generate([seq(0, 20)], GREEDY)
    with pytest.raises(ValueError, match="budget_tokens=4"):
        paged_sampler(model, dataclasses.replace(OPTIONS, budget_tokens=4))
    with pytest.raises(ValueError, match="kv_cache='paging'"):
        JaxSampler(model, kv_cache="paging")
    with pytest.raises(ValueError, match="max_rows=0"):
        PagedConfig(max_rows=0)
    assert jax.numpy.dtype(sampler.engine._pool.k.dtype) == jnp.float32


def test_options_from_the_train_config_section():
    from jax_routeweaver.rl.run.train_config import PagedCacheConfig

    section = PagedCacheConfig(page_size=32, budget_tokens=4096, memory_fraction=0.25, max_rows=8)
    options = PagedConfig.of(section)
    assert (options.page_size, options.budget_tokens, options.memory_fraction,
            options.max_rows) == (32, 4096, 0.25, 8)
    assert PagedConfig.of(None) == PagedConfig() and PagedConfig.of(options) is options


def test_the_default_pool_on_a_cpu_takes_at_most_its_cap():
    """budget_tokens 0: memory_fraction of the free memory, capped at max_rows rows of
    max_position_embeddings and, on the CPU backend (the host's memory, shared with the
    trainer), at CPU_POOL_BYTES: a suite's worth of default samplers once took a test worker
    past the machine's memory."""
    from jax_routeweaver.sampling.paged_options import (
        CPU_POOL_BYTES,
        kv_bytes_per_token,
        pool_pages,
    )

    wide = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=8,
                       num_heads=8, num_kv_heads=8, head_dim=64,
                       max_position_embeddings=40960)  # 64 rows: 21 GB of fp32 pages
    per_token = kv_bytes_per_token(wide)
    pages = pool_pages(wide, PagedConfig(), device=jax.devices("cpu")[0])
    assert pages * 16 * per_token <= CPU_POOL_BYTES < (pages + 1) * 16 * per_token
    small = wide.replace(num_layers=1, num_kv_heads=1, head_dim=16, num_heads=1,
                         max_position_embeddings=256)
    assert pool_pages(small, PagedConfig(max_rows=4), device=jax.devices("cpu")[0]) == 4 * 16
