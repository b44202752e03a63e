"""Prefix reuse: `PrefixStore` lookups, and a JaxSampler that reuses earlier calls' KV caches
generating what one that prefills every prompt in full generates."""

from __future__ import annotations

import numpy as np
import pytest

from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.sharding import SAMPLE_RULES, make_mesh
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.prefix_cache import BLOCK, PrefixStore, block_hashes

BUCKETS = (16, 32, 64, 128, 256)
GREEDY = SamplingParams(greedy=True, max_new_tokens=8)


def seq(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


class FakeArray:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes


# ---------------------------------------------------------------------------- the store
def test_block_hashes_chain_over_whole_blocks():
    a, b = seq(0, 40), seq(0, 40)
    b[20] += 1  # inside the second block
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 40 // BLOCK == 2
    assert ha[0] == hb[0] and ha[1] != hb[1]
    c = seq(1, 16) + a[16:]  # same second block after a different first: a different chain
    assert block_hashes(c)[1] != ha[1]


def test_match_takes_the_longest_prefix_from_one_group():
    store = PrefixStore(10**6)
    base = seq(0, 64)
    store.add(FakeArray(100), FakeArray(100), [np.array(base[:40]), np.array(seq(2, 50))],
              [7, 3])
    store.add(FakeArray(100), FakeArray(100), [np.array([*base[:60], 1, 2])], [5])
    prompts = [[*base[:60], 9, 9, 9], seq(3, 30), base[:50]]
    m = store.match(prompts)
    # The newer group holds 60 tokens of prompt 0 and 49 of prompt 2 (capped at len - 1).
    assert m.group.start == (5,)
    assert m.lengths.tolist() == [60, 0, 49] and m.starts.tolist()[::2] == [5, 5]
    store.count(m)
    assert store.hits == 2 and store.reused == 109
    assert store.match([seq(4, 40)]) is None


def test_budget_evicts_oldest_and_skips_groups_too_big():
    store = PrefixStore(1000)
    for i in range(3):
        store.add(FakeArray(200), FakeArray(200), [np.array(seq(i, 20))], [0])
    assert len(store) == 2 and store.nbytes == 800
    assert store.match([[*seq(0, 20), 1]]) is None  # the first group was evicted
    assert store.match([[*seq(2, 20), 1]]).lengths.tolist() == [20]
    store.add(FakeArray(600), FakeArray(600), [np.array(seq(9, 20))], [0])
    assert len(store) == 2 and store.match([[*seq(9, 20), 1]]) is None
    store.clear()
    assert len(store) == 0 and store.match([[*seq(2, 20), 1]]) is None
    with pytest.raises(ValueError, match="budget"):
        PrefixStore(-1)


# ---------------------------------------------------------------------------- the sampler
@pytest.fixture(scope="module")
def model(tiny_hf_dir):
    return load_hf(tiny_hf_dir)


def two_turns(sampler: JaxSampler, params: SamplingParams) -> tuple[list, list]:
    """Turn 1 on three prompts (one 70 tokens long), then turn 2: each prompt + its completion +
    some new tokens, plus one unrelated prompt (a row with nothing to reuse)."""
    first = [seq(10, 70), seq(11, 35), seq(12, 20)]
    out1 = sampler.generate(first, params)
    second = [p + c.token_ids + seq(20 + i, 5 + 3 * i)
              for i, (p, c) in enumerate(zip(first, out1, strict=True))] + [seq(30, 9)]
    return out1, sampler.generate(second, params)


SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize(("params", "mesh_shape"),
                         [(GREEDY, None), (SAMPLED, None), (GREEDY, (1, 2, 2))],
                         ids=["greedy", "sampled", "greedy-sharded"])
def test_reuse_generates_what_full_prefill_does(model, devices, params, mesh_shape):
    mesh = None if mesh_shape is None else make_mesh(mesh_shape, devices[:4])
    kw = dict(prompt_buckets=BUCKETS, mesh=mesh, rules=SAMPLE_RULES)
    full = JaxSampler(model, kv_cache="dense", **kw)
    reuse = JaxSampler(model, kv_cache="dense", prefix_cache_mb=64, **kw)
    a1, a2 = two_turns(full, params)
    b1, b2 = two_turns(reuse, params)
    # Rows 0-2 of turn 2 reused their turn-1 rows: the 70-token one needs only the last bucket
    # of 16 columns (prompt bucket 128 -> tail 16 covers its 5 new + 8 generated tokens).
    assert reuse.prefix_store.hits == 3
    assert reuse.prefix_store.reused > 70 + 35
    assert full.prefix_store.hits == 0
    for x, y in zip(a1 + a2, b1 + b2, strict=True):
        assert x.token_ids == y.token_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-5)


@pytest.mark.slow
def test_no_reuse_without_a_shorter_tail_and_the_store_empties_on_new_weights(model):
    sampler = JaxSampler(model, kv_cache="dense", prompt_buckets=BUCKETS, prefix_cache_mb=64)
    sampler.generate([seq(1, 40)], GREEDY)
    # A 100-token newcomer needs the whole prompt bucket: nothing is reused.
    sampler.generate([[*seq(1, 40), 5], seq(7, 100)], GREEDY)
    assert sampler.prefix_store.hits == 0 and len(sampler.prefix_store) == 2
    sampler.update_weights(model, 1)
    assert len(sampler.prefix_store) == 0
    sampler.generate([seq(1, 40)], GREEDY)
    sampler.reseed(3)
    assert len(sampler.prefix_store) == 0


def test_negative_budget_is_a_config_error():
    with pytest.raises(ValueError, match="rollout.prefix_cache_mb"):
        load_train_config("configs/quickstart.yaml", ["rollout.prefix_cache_mb=-1"])
