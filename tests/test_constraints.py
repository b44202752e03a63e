"""Grammar-constrained decoding in JaxSampler (xgrammar masks, real Qwen3 tokenizer)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, GrammarConstraints, unpack_bitmask
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
    return JaxSampler(model, decode=tokenizer.decode, constraints=constraints)


def prompts(tokenizer, n):
    return [tokenizer.encode(f"Query {i}: pick a mode.", add_special_tokens=False)
            for i in range(n)]


@pytest.mark.parametrize("greedy", [False, True])
def test_random_model_emits_only_valid_selectors(sampler, tokenizer, greedy):
    params = SamplingParams(temperature=1.0, greedy=greedy, max_new_tokens=24, seed=7)
    out = sampler.generate(prompts(tokenizer, 4), params, [SELECTOR] * 4)
    for c in out:
        text = tokenizer.decode(c.token_ids)
        assert re.fullmatch(r"<mode>(single|multi|agentic)</mode>", text), text
        assert c.finish_reason == "grammar"


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


def test_grammar_errors(model, tokenizer, sampler):
    plain = JaxSampler(model)
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


def test_unpack_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-2**31, 2**31, (3, 5), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :150]
    got = np.asarray(unpack_bitmask(jnp.asarray(bitmask), 150))
    np.testing.assert_array_equal(got, expected.astype(bool))
