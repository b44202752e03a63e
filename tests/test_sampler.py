"""JaxSampler and the sampling protocol, checked against transformers on a tiny random Qwen3."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import make_hf_model

from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, make_mesh
from jax_routeweaver.sampling.base import (
    Completion,
    Sampler,
    SamplingParams,
    apply_stop_strings,
    find_stop_string,
)
from jax_routeweaver.sampling.dense_buckets import (
    left_pad,
    length_groups,
    new_token_bucket,
    pick_bucket,
)
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.sample_ops import sample_logits

PROMPTS = [[5, 9, 100, 42, 17], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_NEW = 12
GREEDY = SamplingParams(greedy=True, max_new_tokens=MAX_NEW)


def letters(ids) -> str:
    """Fake detokeniser: two letters per token, so a stop string can span two tokens."""
    return "".join(chr(97 + t % 26) + chr(65 + t % 7) for t in ids)


@pytest.fixture(scope="module")
def jax_model(tiny_hf_dir) -> Qwen3:
    return load_hf(tiny_hf_dir)


@pytest.fixture(scope="module")
def sampler(jax_model) -> JaxSampler:
    return JaxSampler(jax_model, kv_cache="dense", decode=letters)


@pytest.fixture(scope="module")
def reference(tiny_hf_dir) -> list[tuple[list[int], list[float]]]:
    """transformers greedy `generate`, one prompt at a time (no padding at all): tokens and
    log_softmax(logits) of each."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_NEW, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        tokens = gen.sequences[0, len(p):].tolist()
        assert len(tokens) == MAX_NEW
        logps = [torch.log_softmax(lg[0].float(), -1)[t].item()
                 for lg, t in zip(gen.logits, tokens, strict=True)]
        out.append((tokens, logps))
    return out


def full_logits(model: Qwen3, prompts: list[list[int]],
                completions: list[list[int]]) -> list[np.ndarray]:
    """For each row, logits `[len(completion), V]` predicting each completion token, from one
    full forward (no cache) over the right-padded prompt + completion batch."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(map(len, seqs))
    tokens = np.array([s + [0] * (width - len(s)) for s in seqs])
    mask = np.array([[i < len(s) for i in range(width)] for s in seqs])
    positions = np.broadcast_to(np.arange(width), tokens.shape)
    logits = np.asarray(jax.jit(lambda t, p, m: model(t, p, m)[0])(tokens, positions, mask))
    pairs = enumerate(zip(prompts, seqs, strict=True))
    return [logits[i, len(p) - 1:len(s) - 1] for i, (p, s) in pairs]


# ------------------------------------------------------------------------------ greedy
@pytest.mark.integration
def test_greedy_matches_transformers(sampler, reference):
    out = sampler.generate(PROMPTS, GREEDY)
    assert isinstance(sampler, Sampler)
    for c, (tokens, logps) in zip(out, reference, strict=True):
        assert c.token_ids == tokens
        np.testing.assert_allclose(c.logprobs, logps, atol=1e-4)
        assert (c.finish_reason, c.stop, c.policy_version) == ("length", None, 0)


@pytest.mark.slow
def test_temperature_zero_is_greedy(sampler, reference):
    out = sampler.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    assert [c.token_ids for c in out] == [r[0] for r in reference]


def test_stop_token_ends_row_and_is_included(sampler, reference):
    stop = reference[0][0][4]
    out = sampler.generate(PROMPTS, dataclasses.replace(GREEDY, stop_token_ids=(250, stop)))
    for c, (tokens, logps) in zip(out, reference, strict=True):
        if stop in tokens:
            n = tokens.index(stop) + 1
            assert (c.finish_reason, c.stop) == ("stop_token", stop)
        else:
            n = MAX_NEW
            assert (c.finish_reason, c.stop) == ("length", None)
        assert c.token_ids == tokens[:n]
        np.testing.assert_allclose(c.logprobs, logps[:n], atol=1e-4)
    assert out[0].token_ids[-1] == stop and len(out[0].token_ids) <= 5


def _shortest_hit(tokens: list[int], stops: tuple[str, ...]) -> int | None:
    for n in range(1, len(tokens) + 1):
        if any(s in letters(tokens[:n]) for s in stops):
            return n
    return None


@pytest.mark.slow
@pytest.mark.parametrize("interval", [3, None])
def test_stop_string_cuts_tokens_and_logprobs(sampler, jax_model, reference, interval):
    if interval is not None:  # host checks every 3 steps (the default sampler: every 32)
        sampler = JaxSampler(jax_model, kv_cache="dense", decode=letters,
                             stop_check_interval=interval)
    tokens0 = reference[0][0]
    spanning = letters(tokens0[5:7])[1:3]  # 2nd letter of token 5 + 1st of token 6
    stops = (spanning, "zzzz")
    out = sampler.generate(PROMPTS, dataclasses.replace(GREEDY, stop_strings=stops))
    for c, (tokens, logps) in zip(out, reference, strict=True):
        n = _shortest_hit(tokens, stops)
        if n is None:
            assert (c.token_ids, c.finish_reason, c.stop) == (tokens, "length", None)
            continue
        assert (c.token_ids, c.finish_reason, c.stop) == (tokens[:n], "stop_string", spanning)
        np.testing.assert_allclose(c.logprobs, logps[:n], atol=1e-4)
    assert len(out[0].token_ids) <= 7


@pytest.mark.slow
def test_stop_strings_end_the_device_loop_early(jax_model):
    # Every token's text ends in an upper-case letter A..G: all rows stop at their first token.
    sampler = JaxSampler(jax_model, kv_cache="dense", decode=letters, stop_check_interval=3)
    calls = []
    compiled = sampler._decode
    sampler._decode = lambda *a, **k: calls.append(1) or compiled(*a, **k)
    stops = tuple("ABCDEFG")
    out = sampler.generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=60,
                                                        stop_strings=stops))
    assert [len(c.token_ids) for c in out] == [1, 1, 1]
    assert {c.finish_reason for c in out} == {"stop_string"}
    assert len(calls) == 1  # the host check after the first 3 steps ended generation


@pytest.mark.slow
def test_big_seeds_stay_distinct(sampler):
    params = SamplingParams(max_new_tokens=MAX_NEW, seed=5)
    a = sampler.generate(PROMPTS, params)
    b = sampler.generate(PROMPTS, dataclasses.replace(params, seed=5 + 2**32))
    assert [x.token_ids for x in a] != [x.token_ids for x in b]


def test_stop_strings_need_decode(jax_model):
    with pytest.raises(ValueError, match="decode"):
        JaxSampler(jax_model, kv_cache="dense").generate([[1]], SamplingParams(stop_strings=("x",)))


# ------------------------------------------------------------------------------ stop helper
def test_find_stop_string_spanning_tokens():
    decode = lambda ids: "".join(["ab", "cd", "ef", "gh"][i] for i in ids)
    assert find_stop_string([0, 1, 2, 3], decode, ["de"]) == (3, "de")
    assert find_stop_string([0, 1, 2, 3], decode, ["a"]) == (1, "a")
    assert find_stop_string([0, 1, 2, 3], decode, ["gh"]) == (4, "gh")


def test_find_stop_string_earliest_of_several_and_none():
    decode = lambda ids: "".join(["ab", "cd", "ef", "gh"][i] for i in ids)
    assert find_stop_string([0, 1, 2, 3], decode, ["fg", "c", "zz"]) == (2, "c")
    # Both complete at token 2: the one starting first in the text wins.
    assert find_stop_string([0, 1, 2, 3], decode, ["d", "bc"]) == (2, "bc")
    assert find_stop_string([0, 1, 2, 3], decode, ["zz"]) is None
    assert find_stop_string([], decode, ["a"]) is None
    assert find_stop_string([0, 1], decode, []) is None


def test_find_stop_string_uses_few_decodes():
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return "x" * len(ids)

    assert find_stop_string(list(range(1000)), decode, ["x" * 700]) == (700, "x" * 700)
    assert len(calls) <= 12


def test_apply_stop_strings_cuts_ids_and_logprobs_together():
    decode = lambda ids: "".join(["ab", "cd", "ef", "gh"][i] for i in ids)
    c = Completion([0, 1, 2, 3], [-0.1, -0.2, -0.3, -0.4], "length", None, 7)
    cut = apply_stop_strings(c, decode, ["de"])
    assert (cut.token_ids, cut.logprobs, cut.finish_reason, cut.stop, cut.policy_version) == (
        [0, 1, 2], [-0.1, -0.2, -0.3], "stop_string", "de", 7)
    assert apply_stop_strings(c, decode, ["zz"]) is c
    # A stop string completed only by the final stop token: the token is the reason.
    by_token = Completion([0, 1, 2, 3], [-0.1] * 4, "stop_token", 3)
    assert apply_stop_strings(by_token, decode, ["fg"]).finish_reason == "stop_token"


# ------------------------------------------------------------------------------ sampled
def test_same_seed_same_output_different_seed_differs(sampler):
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    a = sampler.generate(PROMPTS, params)
    b = sampler.generate(PROMPTS, params)
    c = sampler.generate(PROMPTS, dataclasses.replace(params, seed=12))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


@pytest.mark.slow
def test_top_k_one_and_tiny_top_p_equal_greedy(sampler, reference):
    greedy = [r[0] for r in reference]
    top1 = sampler.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=MAX_NEW, seed=0))
    assert [c.token_ids for c in top1] == greedy
    for c, (_, logps) in zip(top1, reference, strict=True):  # temperature 1 = greedy's
        np.testing.assert_allclose(c.logprobs, logps, atol=1e-4)
    tiny_p = sampler.generate(PROMPTS, SamplingParams(temperature=0.7, top_p=1e-6,
                                                      max_new_tokens=MAX_NEW, seed=0))
    assert [c.token_ids for c in tiny_p] == greedy


def test_sampled_logprobs_and_truncation_match_full_forward(sampler, jax_model):
    t, k, p = 0.8, 40, 0.9
    out = sampler.generate(PROMPTS, SamplingParams(temperature=t, top_k=k, top_p=p,
                                                   max_new_tokens=MAX_NEW, seed=5))
    logits = full_logits(jax_model, PROMPTS, [c.token_ids for c in out])
    for c, rows in zip(out, logits, strict=True):
        scaled = rows / t
        logp = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1,
                               keepdims=True)) - scaled.max(-1, keepdims=True)
        want = logp[np.arange(len(c.token_ids)), c.token_ids]
        np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
        for row, tok in zip(scaled, c.token_ids, strict=True):
            order = np.argsort(-row, kind="stable")
            rank = int(np.where(order == tok)[0][0])
            assert rank < k
            probs = np.exp(row[order[:k]] - row[order[:k]].max())
            probs /= probs.sum()
            assert probs[:rank].sum() < p  # inside the nucleus


@pytest.mark.slow
def test_sample_logits_distribution():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)

    def freqs(top_k, top_p, temperature=1.0):
        draw = jax.vmap(lambda key: sample_logits(
            logits, key[None], jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
            greedy=False, truncate=True)[0][0])
        return np.bincount(np.asarray(draw(keys)), minlength=5) / len(keys)

    np.testing.assert_allclose(freqs(0, 1.0), [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)
    np.testing.assert_allclose(freqs(2, 1.0), [5 / 7, 2 / 7, 0, 0, 0], atol=0.03)
    # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15: the three most likely tokens stay.
    np.testing.assert_allclose(freqs(0, 0.8), [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0],
                               atol=0.03)
    # top-p applies to the distribution renormalised after top-k: 5/7 >= 0.7 keeps one.
    np.testing.assert_allclose(freqs(2, 0.7), [1, 0, 0, 0, 0], atol=0)
    tokens, logps = sample_logits(logits, keys[:1], jnp.float32(2.0), jnp.int32(1),
                                  jnp.float32(1.0), greedy=False, truncate=True)
    want = jax.nn.log_softmax(logits / 2.0)[0, 0]  # before truncation, after temperature
    assert int(tokens[0]) == 0 and abs(float(logps[0]) - float(want)) < 1e-6


# ------------------------------------------------------------------------------ sharded
@pytest.mark.slow
def test_sharded_greedy_equals_unsharded(tiny_hf_dir, sampler, devices):
    mesh = make_mesh((2, 2, 2))
    sharded = JaxSampler(load_hf(tiny_hf_dir), kv_cache="dense", mesh=mesh, decode=letters)
    want = sampler.generate(PROMPTS, GREEDY)
    got = sharded.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    embed = sharded.model().embed[...]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    # The KV cache is split over batch (data, fsdp) and kv heads (tensor).
    state = sharded._prefill(sharded._params, *(sharded._put_batch(a) for a in
                                                left_pad(PROMPTS, 4, 32, 0)),
                             sharded._put_batch(np.arange(4) < 3), new_bucket=16)
    want_kv = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, ("data", "fsdp"), None, "tensor", None))
    assert state.cache.k.sharding.is_equivalent_to(want_kv, 5)


# ------------------------------------------------------------------------------ buckets
def test_buckets():
    assert [new_token_bucket(n) for n in (1, 16, 17, 100, 256)] == [16, 16, 32, 128, 256]
    assert [pick_bucket(n, (4, 8)) for n in (1, 4, 5, 8, 9, 17)] == [4, 4, 8, 8, 16, 24]
    tokens, mask, pos, lens = left_pad([[7, 8], [9]], 3, 4, 0)
    assert tokens.tolist() == [[0, 0, 7, 8], [0, 0, 0, 9], [0, 0, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]]
    assert pos.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert lens.tolist() == [2, 1, 1]


def brute_force_cut(lengths, prompt_buckets, batch_buckets, group_cost, compiled=frozenset(),
                    new_shape_cost=0):
    """The cheapest cut by trying every one (2^(n-1) of them)."""
    n, best = len(lengths), None
    for mask in range(2 ** (n - 1)):
        ends = [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        sizes = [e - s for s, e in itertools.pairwise([0, *ends])]
        if max(sizes) > max(batch_buckets):
            continue
        cost = 0
        for s, e in itertools.pairwise([0, *ends]):
            shape = (pick_bucket(e - s, batch_buckets), pick_bucket(lengths[e - 1], prompt_buckets))
            cost += shape[0] * shape[1] + group_cost + (shape not in compiled) * new_shape_cost
        best = min(best or (cost, ends), (cost, ends))
    return best


def test_length_groups_cut_where_padding_pays():
    buckets, batch = (32, 64, 128, 256, 512), (1, 2, 4, 8, 16)
    # Like lengths: one group. Four short rows next to four long ones: two groups, since the
    # short rows padded to 512 would cost 4 x 480 tokens more than a group.
    assert length_groups([100, 110, 120, 125], buckets, batch, 256) == [4]
    assert length_groups([30] * 4 + [500] * 4, buckets, batch, 256) == [4, 8]
    assert length_groups([30] * 4 + [500] * 4, buckets, batch, 10**6) == [8]
    # Five rows would pad to a batch of 8: four plus one is cheaper when groups are free.
    sizes = lambda ends: sorted(e - s for s, e in itertools.pairwise([0, *ends]))
    assert sizes(length_groups([30] * 5, buckets, batch, 0)) == [1, 4]
    # No group beyond the largest batch bucket (equal rows: any order of 16 + 16 + 8).
    assert sizes(length_groups([30] * 40, buckets, batch, 10**6)) == [8, 16, 16]
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 11))
        lengths = sorted(rng.integers(1, 600, n).tolist())
        cost = int(rng.choice([0, 64, 1024, 8192]))
        batch = (1, 2, 4) if rng.random() < 0.5 else (2, 4, 8)
        # Some shapes already compiled, a price on the others.
        shapes = [(b, p) for b in batch for p in buckets]
        compiled = {shapes[k] for k in rng.choice(len(shapes), int(rng.integers(0, 6)))}
        new_cost = int(rng.choice([0, 0, 500, 20000]))
        ends = length_groups(lengths, buckets, batch, cost, compiled, new_cost)
        got = 0
        for s, e in itertools.pairwise([0, *ends]):
            shape = (pick_bucket(e - s, batch), pick_bucket(lengths[e - 1], buckets))
            got += shape[0] * shape[1] + cost + (shape not in compiled) * new_cost
        want = brute_force_cut(lengths, buckets, batch, cost, compiled, new_cost)[0]
        assert got == want, (lengths, cost, batch, compiled, new_cost)


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [True, False])
def test_cutting_a_call_into_groups_keeps_every_rows_tokens(jax_model, greedy):
    """Rows sample from their own streams: one padded group, a group per row and the default
    cut give the same tokens and logprobs (to float noise) for prompts of mixed lengths."""
    prompts = [[3 + i % 50] * n for i, n in enumerate((40, 2, 9, 70, 5, 33, 1, 64))]
    params = SamplingParams(greedy=greedy, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)
    runs = {}
    for name, cost, new_shape in (("one", None, 0), ("rows", 0, 0), ("default", 64, 16384)):
        s = JaxSampler(jax_model, kv_cache="dense", prompt_buckets=(8, 16, 32, 64, 128),
                       group_cost=cost, new_shape_cost=new_shape)
        runs[name] = (s.generate(prompts, params), s.trace_count)
    # Prefill + decode traces: one of each for the single group, and for 0: one per shape.
    assert runs["one"][1] == 2 and runs["rows"][1] > 4
    want = runs["one"][0]
    for name in ("rows", "default"):
        got = runs[name][0]
        assert [c.token_ids for c in got] == [c.token_ids for c in want], name
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    if not greedy:  # the streams do differ between rows
        assert len({tuple(c.token_ids) for c in want}) == len(prompts)


@pytest.mark.slow
def test_calls_settle_on_compiled_shapes(jax_model):
    """A cut that needs new shapes pays their compiles: after 8 rows of 70 tokens ran as one
    (8, 128) group, 4 short + 4 long rows reuse it unless compiles are free, and the tokens are
    the same either way."""
    prompts = [[3 + i] * (5 if i < 4 else 70) for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
    out = {}
    for new_shape_cost in (0, 10**6):
        s = JaxSampler(jax_model, kv_cache="dense", prompt_buckets=(8, 16, 32, 64, 128),
                       group_cost=0, new_shape_cost=new_shape_cost)
        s.generate([[7] * 70] * 8, params)
        traced = s.trace_count
        out[new_shape_cost] = s.generate(prompts, params)
        # Free compiles: (4, 8) + (4, 128), two new shapes of two programs each.
        assert s.trace_count - traced == (4 if new_shape_cost == 0 else 0)
    for a, b in zip(out[0], out[10**6], strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)


def test_shape_state_steers_a_fresh_samplers_cuts(jax_model):
    """What a resumed run restores: with the shapes loaded, a fresh sampler cuts 4 short + 4
    long rows into the two loaded shapes; without them, into one new shape (not two)."""
    prompts = [[3 + i] * (5 if i < 4 else 70) for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
    n = new_token_bucket(MAX_NEW)
    make = lambda: JaxSampler(jax_model, kv_cache="dense", prompt_buckets=(8, 16, 32, 64, 128),
                              group_cost=0, new_shape_cost=10**6)
    loaded, fresh = make(), make()
    loaded.load_shape_state([[4, 8, n], [4, 128, n]])
    loaded.generate(prompts, params)
    fresh.generate(prompts, params)
    assert loaded.shape_state() == [[4, 8, n], [4, 128, n]]
    assert fresh.shape_state() == [[8, 128, n]]


@pytest.mark.slow
def test_no_recompile_within_a_bucket(jax_model):
    s = JaxSampler(jax_model, kv_cache="dense")
    s.generate([[1, 2, 3], [4] * 7, [5]], GREEDY)
    traced = s.trace_count
    assert traced == 2  # one prefill, one decode loop
    # Other prompt lengths (same 32 bucket), batch of 4 (same bucket), other max_new (same 16).
    s.generate([[9] * 20, [3, 1], [2] * 30, [8] * 5], dataclasses.replace(GREEDY,
                                                                         max_new_tokens=9))
    assert s.trace_count == traced
    sampled = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=MAX_NEW, seed=1)
    s.generate(PROMPTS, sampled)
    traced = s.trace_count  # + the sampled loop
    s.generate(PROMPTS, dataclasses.replace(sampled, temperature=0.5, top_k=9, top_p=0.5,
                                            seed=None, stop_token_ids=(3,)))
    s.update_weights(jax_model, 1)
    s.generate(PROMPTS, sampled)
    assert s.trace_count == traced


@pytest.mark.slow
def test_batch_and_prompt_overflow_buckets(jax_model, reference):
    # 3 prompts over batch bucket 2 -> two groups; an 11-token prompt over bucket 4 -> 12.
    s = JaxSampler(jax_model, kv_cache="dense", batch_buckets=(2,), prompt_buckets=(4,))
    assert [c.token_ids for c in s.generate(PROMPTS, GREEDY)] == [r[0] for r in reference]


# ------------------------------------------------------------------------------ weights
@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_seed1")
    make_hf_model(path, seed=1)
    return path


def test_update_weights_changes_outputs_and_version(tiny_hf_dir, other_dir, reference,
                                                    devices):
    other = load_hf(other_dir)
    want = JaxSampler(other, kv_cache="dense").generate(PROMPTS, GREEDY)
    s = JaxSampler(load_hf(tiny_hf_dir), kv_cache="dense", mesh=make_mesh((2, 2, 2)),
                   rules=SAMPLE_RULES)
    assert [c.token_ids for c in s.generate(PROMPTS, GREEDY)] == [r[0] for r in reference]
    traced = s.trace_count
    s.update_weights(other, 3)
    got = s.generate(PROMPTS, GREEDY)
    assert s.policy_version == 3 and {c.policy_version for c in got} == {3}
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.token_ids for c in got] != [r[0] for r in reference]
    assert s.trace_count == traced
    for bad in (3, 2):
        with pytest.raises(ValueError, match="strictly increase"):
            s.update_weights(other, bad)
    # An nnx.State of the params works too (back to the first model).
    s.update_weights(nnx.state(load_hf(tiny_hf_dir), nnx.Param), 4)
    assert [c.token_ids for c in s.generate(PROMPTS, GREEDY)] == [r[0] for r in reference]


def test_update_weights_rejects_other_shapes_and_dtypes(jax_model, tiny_hf_dir):
    s = JaxSampler(jax_model, kv_cache="dense")
    wider = Qwen3(jax_model.config.replace(intermediate_size=96), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"layers\.down_proj.*expected float32\[2, 128, 64\]"):
        s.update_weights(wider, 1)
    with pytest.raises(ValueError, match="bfloat16"):
        s.update_weights(load_hf(tiny_hf_dir, dtype="bfloat16"), 1)
    with pytest.raises(TypeError, match=r"nnx\.Module or nnx\.State"):
        s.update_weights({"embed": 1}, 1)
    assert s.policy_version == 0


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"stop_strings": ("",)}, "stop_strings"),
    ({"stop_strings": "stop"}, "stop_strings"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_tuples():
    p = SamplingParams(stop_token_ids=[1, 2], stop_strings=["a"], top_k=-1)
    assert p.stop_token_ids == (1, 2) and p.stop_strings == ("a",) and not p.top_k_enabled
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    with pytest.raises(ValueError, match="2 token_ids but 1 logprobs"):
        Completion([1, 2], [0.0], "length")
    with pytest.raises(ValueError, match="finish_reason"):
        Completion([1], [0.0], "eos")


def test_bad_prompts_and_constructor(sampler, jax_model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate([[1], []], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0: token ids \[256\]"):
        sampler.generate([[1, 256]], GREEDY)
    assert sampler.generate([], GREEDY) == []
    with pytest.raises(ValueError, match="pad_id"):
        JaxSampler(jax_model, kv_cache="dense", pad_id=-1)
    with pytest.raises(ValueError, match="batch_buckets"):
        JaxSampler(jax_model, kv_cache="dense", batch_buckets=(1, 2), mesh=make_mesh((2, 2, 2)))
