"""Grammar-constrained decoding in JaxSampler (xgrammar masks, real Qwen3 tokenizer)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.sharding import SAMPLE_RULES, make_mesh
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer, prune_tokenizer
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import (
    ChoiceMatcher,
    Grammar,
    GrammarConstraints,
    allowed_counts,
    choice_tables,
    unpack_bitmask,
)
from jax_routeweaver.sampling.jax_sampler import JaxSampler

SELECTOR = Grammar('root ::= "<mode>" ("single" | "multi" | "agentic") "</mode>"')
ROUTE = Grammar('root ::= "<route model=\\"worker_" [1-3] "\\">" [a-z ]{1,12} "</route>"')
IM_END = 151645


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_qwen3_tokenizer(cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=151_936, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=32)
    return Qwen3(cfg, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def sampler(model, tokenizer):
    constraints = GrammarConstraints(tokenizer, model.config.vocab_size)
    return JaxSampler(model, kv_cache="dense", decode=tokenizer.decode, constraints=constraints)


def prompts(tokenizer, n):
    return [tokenizer.encode(f"Query {i}: pick a mode.", add_special_tokens=False)
            for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [False, True])
def test_random_model_emits_only_valid_selectors(sampler, tokenizer, greedy):
    params = SamplingParams(temperature=1.0, greedy=greedy, max_new_tokens=24, seed=7)
    out = sampler.generate(prompts(tokenizer, 4), params, [SELECTOR] * 4)
    for c in out:
        text = tokenizer.decode(c.token_ids)
        assert re.fullmatch(r"<mode>(single|multi|agentic)</mode>", text), text
        assert c.finish_reason == "grammar"


@pytest.mark.slow
def test_logprobs_are_the_unconstrained_policy(sampler, model, tokenizer):
    """The grammar is a truncation (like top-k): logprobs are log_softmax of the raw logits."""
    ps = prompts(tokenizer, 2)
    out = sampler.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=24, seed=1),
                           [ROUTE, ROUTE])
    for p, c in zip(ps, out, strict=True):
        assert re.fullmatch(r'<route model="worker_[1-3]">[a-z ]{1,12}</route>',
                            tokenizer.decode(c.token_ids))
        ids = jnp.asarray([p + c.token_ids])
        full = token_logprobs(model, ids, jnp.arange(ids.shape[1])[None], jnp.ones_like(ids))
        np.testing.assert_allclose(c.logprobs, np.asarray(full)[0, len(p):], atol=1e-4)


@pytest.mark.slow
def test_unconstrained_rows_and_stop_token_grammars(sampler, tokenizer):
    ps = prompts(tokenizer, 3)
    ending = Grammar('root ::= "<answer>" [0-9]{1,3} "</answer>"', end_with_stop_token=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(IM_END,),
                            seed=3)
    free, selector, answer = sampler.generate(ps, params, [None, SELECTOR, ending])
    assert free.finish_reason in ("length", "stop_token")
    assert selector.finish_reason == "grammar"
    assert answer.finish_reason == "stop_token" and answer.token_ids[-1] == IM_END
    assert re.fullmatch(r"<answer>[0-9]{1,3}</answer>", tokenizer.decode(answer.token_ids[:-1]))


@pytest.mark.slow
def test_grammar_errors(model, tokenizer, sampler):
    plain = JaxSampler(model, kv_cache="dense")
    with pytest.raises(ValueError, match="constraints=GrammarConstraints"):
        plain.generate([[1, 2]], SamplingParams(max_new_tokens=2), [SELECTOR])
    with pytest.raises(ValueError, match="1 grammars for 2 prompts"):
        sampler.generate([[1], [2]], SamplingParams(max_new_tokens=2), [SELECTOR])
    with pytest.raises(ValueError, match="invalid grammar"):
        sampler.generate([[1]], SamplingParams(max_new_tokens=2), [Grammar("root ::= (")])
    with pytest.raises(ValueError, match="needs stop_token_ids"):
        sampler.generate([[1]], SamplingParams(max_new_tokens=2),
                         [Grammar('root ::= "a"', end_with_stop_token=True)])
    with pytest.raises(ValueError, match="constraints built for vocab 151936"):
        small = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=32)
        JaxSampler(Qwen3(small, rngs=nnx.Rngs(0)),
                   constraints=GrammarConstraints(tokenizer, 151_936))


def test_allowed_counts_match_the_unpacked_mask():
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-2**31, 2**31, (4, 5), dtype=np.int64).astype(np.int32)
    for vocab in (150, 160, 129):
        expected = np.asarray(unpack_bitmask(jnp.asarray(bitmask), vocab)).sum(1)
        np.testing.assert_array_equal(allowed_counts(bitmask, vocab), expected)


def test_unpack_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, (3, 5), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :150]
    got = np.asarray(unpack_bitmask(jnp.asarray(bitmask), 150))
    np.testing.assert_array_equal(got, expected.astype(bool))


MODES = ("<mode>single</mode>", "<mode>multi</mode>", "<mode>agentic</mode>")


def test_choice_matcher_bitmask_and_walk():
    m = ChoiceMatcher([[5, 31, 63], [5, 32], [100]])
    row = np.zeros(4, np.int32)

    def allowed():
        m.fill_row(row)
        return set(np.flatnonzero(np.asarray(unpack_bitmask(jnp.asarray(row[None]), 128))[0]))

    assert allowed() == {5, 100}
    assert not m.accept_token(31) and m.accept_token(5)
    assert allowed() == {31, 32}  # bit 31 of word 0 and bit 0 of word 1
    assert m.accept_token(31) and not m.is_terminated()
    assert allowed() == {63}
    assert m.accept_token(63) and m.is_terminated()
    assert not m.accept_token(63)


def test_choice_matcher_prefixes_need_a_stop_token():
    with pytest.raises(ValueError, match="prefix of another"):
        ChoiceMatcher([[1, 2], [1, 2, 3]])
    m = ChoiceMatcher([[1, 2], [1, 2, 3]], stop_token_ids=[9])
    assert m.accept_token(1) and m.accept_token(2)
    assert sorted(m.allowed()) == [3, 9]
    assert m.accept_token(9) and m.is_terminated()


def test_choice_tables_lay_out_each_trie_once():
    a = [[5, 31, 63], [5, 32], [100]]
    rows = [ChoiceMatcher(a), None, ChoiceMatcher(a), ChoiceMatcher([[1, 2], [1]], [9])]
    t = choice_tables(rows, min_nodes=4, min_children=2)
    # Trie a: root, 5, 100, 31, 32, 63 (6 nodes); then the second trie from node 6.
    assert t.start.tolist() == [0, -1, 0, 6]
    assert t.token.shape == (16, 2) and t.child.shape == (16, 2)

    def walk(node, seq):
        for tok in seq:
            (c,) = np.flatnonzero(t.token[node] == tok)
            node = t.child[node, c]
        return node

    for seq in a:  # every option reaches a leaf that ends the row (no stop tokens)
        leaf = walk(0, seq)
        assert t.ends[leaf] and (t.token[leaf] == -1).all() and not t.stop_ok[leaf]
    assert not t.ends[walk(0, [5])] and sorted(t.token[walk(0, [5])]) == [31, 32]
    one, two = walk(6, [1]), walk(6, [1, 2])  # with stop tokens: complete, not ended
    assert t.stop_ok[one] and t.token[one].tolist() == [2, -1] and not t.ends[one]
    assert t.stop_ok[two] and not t.ends[two]
    used = rows[0]
    used.accept_token(5)
    with pytest.raises(ValueError, match="row 0's matcher has already accepted"):
        choice_tables([used])


ROUTES = ('<route model="worker_1">Solve it.</route>', '<route model="worker_2">Solve it.</route>',
          '<route model="worker_2" role="planner">Solve it.</route>', "<answer>42</answer>")


@pytest.mark.slow
@pytest.mark.parametrize(("greedy", "mesh_shape"), [(False, None), (True, None),
                                                   (False, (2, 2, 1))],
                         ids=["sampled", "greedy", "sampled-sharded"])
def test_choice_grammars_decode_on_device_as_with_host_masks(model, tokenizer, devices, greedy,
                                                             mesh_shape):
    """Choice grammars decoded on device (tries as arrays) give what one host round trip per
    token gives: tokens, finish reasons, allowed counts; a few loop runs instead of one per
    token (stop strings still checked every 4 steps)."""
    mesh = None if mesh_shape is None else make_mesh(mesh_shape, devices[:4])
    constraints = GrammarConstraints(tokenizer, model.config.vocab_size)
    kw = dict(decode=tokenizer.decode, constraints=constraints, stop_check_interval=4,
              mesh=mesh, rules=SAMPLE_RULES)
    on_device = JaxSampler(model, kv_cache="dense", **kw)
    on_host = JaxSampler(model, kv_cache="dense", device_choices=False, **kw)
    calls = {"device": 0}
    decode = on_device._decode

    def counted(*args, **kwargs):
        calls["device"] += 1
        return decode(*args, **kwargs)

    on_device._decode = counted
    grammars = [Grammar.choice(ROUTES), None, Grammar.choice(["yes", "yes please"], True),
                Grammar.choice(MODES), Grammar.choice(ROUTES, True), Grammar.choice(MODES)]
    params = SamplingParams(temperature=1.0, greedy=greedy, max_new_tokens=24, seed=5,
                            stop_token_ids=(IM_END,), stop_strings=("please",))
    ps = prompts(tokenizer, len(grammars))
    got, want = on_device.generate(ps, params, grammars), on_host.generate(ps, params, grammars)
    for g, w, grammar in zip(got, want, grammars, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.allowed == w.allowed and (g.allowed is None) == (grammar is None)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)
        if grammar is not None:
            text = tokenizer.decode(g.token_ids)
            assert text in grammar.choices or text.removesuffix("<|im_end|>") in grammar.choices
    assert calls["device"] <= 24 // 4
    assert {c.finish_reason for c in got} >= {"grammar", "length"}


def _uniform_mode_probs(constraints, tokenizer, grammar):
    """Exact probability of each declaration when every step picks uniformly among the
    tokens the grammar's matcher allows (what a zero-logit policy samples)."""
    probs: dict[str, float] = {}

    def walk(prefix, p):
        m = constraints.matcher(grammar)
        for t in prefix:
            assert m.accept_token(t)
        if m.is_terminated():
            text = tokenizer.decode(prefix)
            probs[text] = probs.get(text, 0.0) + p
            return
        bitmask = constraints.fill([m], np.zeros((1, constraints.words), np.int32))
        allowed = np.flatnonzero(np.asarray(unpack_bitmask(jnp.asarray(bitmask),
                                                           constraints.vocab_size))[0])
        for t in allowed.tolist():
            walk([*prefix, t], p / len(allowed))

    walk([], 1.0)
    return probs


@pytest.mark.slow
def test_choice_samples_canonical_tokens_uniformly(tokenizer):
    """In a tiny run's pruned vocabulary (a, ag, age, s, single, m, multi are tokens) a text
    grammar admits 3 first tokens for agentic and 2 for the others, so a uniform policy
    declares agentic 3/7 of the time; a choice grammar admits only canonical tokenizations,
    a third each, and the sampler follows it."""
    tokenizer = prune_tokenizer(tokenizer, [*MODES, "age", "Query 1"])
    constraints = GrammarConstraints(tokenizer, len(tokenizer))
    text = _uniform_mode_probs(constraints, tokenizer, SELECTOR)
    assert text["<mode>agentic</mode>"] == pytest.approx(3 / 7)
    choice = _uniform_mode_probs(constraints, tokenizer, Grammar.choice(MODES))
    assert choice == pytest.approx(dict.fromkeys(MODES, 1 / 3))

    cfg = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32)
    flat = Qwen3(cfg, rngs=nnx.Rngs(0))
    flat.lm_head[...] = jnp.zeros_like(flat.lm_head[...])
    sampler = JaxSampler(flat, kv_cache="dense", decode=tokenizer.decode, constraints=constraints)
    n = 240
    out = sampler.generate([tokenizer.encode(f"Query {i}", add_special_tokens=False)
                            for i in range(n)],
                           SamplingParams(temperature=1.0, max_new_tokens=24, seed=11),
                           [Grammar.choice(MODES)] * n)
    canonical = {tuple(tokenizer.encode(m, add_special_tokens=False)): m for m in MODES}
    assert all(tuple(c.token_ids) in canonical for c in out)
    # Only the mode word's first token is a choice (of 3); every other token is forced.
    for c in out:
        assert c.allowed == [1, 1, 1, 3] + [1] * (len(c.token_ids) - 4)
    shares = {m: sum(canonical[tuple(c.token_ids)] == m for c in out) / n for m in MODES}
    assert all(0.25 <= s <= 0.42 for s in shares.values()), shares  # 1/3 +- 2.7 sd


def test_choice_grammar_text_is_the_same_language():
    g = Grammar.choice(['say "hi"', "a\\b"], end_with_stop_token=True)
    assert g.ebnf == 'root ::= "say \\"hi\\"" | "a\\\\b"'
    assert g.choices == ('say "hi"', "a\\b") and g.end_with_stop_token
    with pytest.raises(ValueError, match="at least one option"):
        Grammar.choice([])
