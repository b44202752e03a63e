"""Demonstrated episodes (rl/run/demonstrations.py) and their cloning rows (rl/run/cloning.py): the
designed strategies through the real environment and the simulated pool."""

from __future__ import annotations

import collections
import io
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rewards.reward import score_batch
from jax_routeweaver.rl.run import builders, cloning
from jax_routeweaver.rl.run.demonstrations import (
    AGENTIC_LAYERS,
    MULTI_CALLS,
    Pick,
    Script,
    ScriptedSampler,
    demonstrations,
)
from jax_routeweaver.rl.run.routeweaver_run import env_config, reward_config
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.routing.episodes.episode import SOURCE_ENV, SOURCE_FORCED, SOURCE_POLICY
from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs
from jax_routeweaver.routing.protocol.answers import extract_answer
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import Grammar

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@pytest.fixture(scope="module")
def run():
    """The quickstart's questions (150), simulated pool, pruned tokenizer and episode factory."""
    cfg = load_train_config(QUICKSTART, ["model.init=random", "data.synthetic_queries=150"])
    records = builders.build_records(cfg, Console(file=io.StringIO()))
    pool = builders.build_pool(cfg, records)
    tokenizer = builders.build_tokenizer(cfg, records, pool)
    make_env = routeweaver_envs(tokenizer, pool, env_config(cfg, tokenizer.eos_token_id))
    return cfg, records, pool, tokenizer, make_env


@pytest.fixture(scope="module")
def demos(run):
    _cfg, records, pool, tokenizer, make_env = run
    return demonstrations(records, make_env, pool, tokenizer, pool.worker_ids(), seed=0)


@pytest.mark.slow
def test_each_mode_is_executed_as_designed(run, demos):
    _, records, _, tokenizer, _ = run
    assert [t.record.sample_id for t in demos] == [r.sample_id for r in records]
    modes = collections.Counter(t.mode for t in demos)
    assert set(modes) == {"single", "multi", "agentic"} and min(modes.values()) > 30, modes
    for t in demos:
        assert t.finish == "answer" and t.violation is None and not t.infra_failed
        roles = [c.role for c in t.calls]
        workers = [c.worker for c in t.calls]
        if t.mode == "single":
            assert len(t.calls) == 1
        elif t.mode == "multi":
            assert len(t.calls) == MULTI_CALLS and len(set(workers)) == MULTI_CALLS
            # the majority answer of the replies (the first seen on ties)
            answers = [extract_answer(c.text) for c in t.calls]
            counts = collections.Counter(answers)
            top = max(counts.values())
            if all(a is not None and len(a) <= 32 for a in answers):
                assert t.answer == next(a for a in answers if counts[a] == top)
        else:
            assert roles == [role for role, _ in AGENTIC_LAYERS]
            written = tokenizer.decode([i for i, s in zip(t.response_ids, t.token_source,
                                                          strict=True) if s != SOURCE_ENV])
            assert re.findall(r'role="(\w+)" refs="([^"]*)"', written) == list(AGENTIC_LAYERS)
            if t.summarizer_answer and len(t.summarizer_answer) <= 32 \
                    and "\n" not in t.summarizer_answer:
                assert t.answer == t.summarizer_answer


def test_modes_and_workers_are_drawn_evenly(demos):
    free = [t for t in demos if not t.forced]
    assert 0.3 < len(free) / len(demos) < 0.7
    first = collections.Counter(t.calls[0].worker for t in demos)
    assert len(first) == 6 and max(first.values()) < 3 * min(first.values()), first
    # A free episode declares its mode itself (policy tokens before the span's end).
    for t in free[:10]:
        assert sum(t.policy_mask[:t.mode_span_end]) == 1


def test_decision_tokens_are_the_branching_ones(run, demos):
    """Policy mask 1 exactly on tokens the grammar gave a choice at: one token for a single
    route (the worker digit), several for an agentic route (worker, role, refs)."""
    for t in demos:
        assert len(t.policy_mask) == len(t.response_ids) == len(t.token_source)
        for m, source in zip(t.policy_mask, t.token_source, strict=True):
            assert (m == 1) == (source == SOURCE_POLICY)
    single = next(t for t in demos if t.mode == "single" and t.forced)
    # the worker digit, then the answer (one candidate, so forced): one decision
    assert sum(single.policy_mask) == 1
    assert any(s == SOURCE_FORCED for s in single.token_source)


def test_demonstrations_are_deterministic_and_seeded(run, demos):
    _cfg, records, pool, tokenizer, make_env = run
    again = demonstrations(records[:20], make_env, pool, tokenizer, pool.worker_ids(), seed=0)
    assert [t.response_ids for t in again] == [t.response_ids for t in demos[:20]]
    other = demonstrations(records[:20], make_env, pool, tokenizer, pool.worker_ids(), seed=1)
    assert [t.response_ids for t in other] != [t.response_ids for t in demos[:20]]
    with pytest.raises(ValueError, match="not distinct"):
        demonstrations([records[0], records[0]], make_env, pool, tokenizer,
                       pool.worker_ids(), seed=0)


@pytest.mark.slow
def test_the_designed_strategies_pay_as_the_pool_intends(run, demos):
    """With random workers, agentic beats single on MATH/CODE/REASON and loses on RECALL:
    the margins the mode decision should later follow."""
    cfg, *_ = run
    rewards = score_batch(demos, reward_config(cfg), workers=1)
    by = collections.defaultdict(list)
    for t, r in zip(demos, rewards, strict=True):
        by[(t.record.domain.value, t.mode)].append(r.r_task)
    mean = {k: np.mean(v) for k, v in by.items()}
    reasoning = np.mean([mean[(d, "agentic")] - mean[(d, "single")]
                         for d in ("MATH", "CODE", "REASON")])
    assert reasoning > 0.15, mean
    assert mean[("RECALL", "agentic")] < mean[("RECALL", "single")], mean


def test_scripted_sampler_writes_the_pick_with_the_grammar_counts(run):
    _, _, _, tokenizer, _ = run
    options = ['<route model="worker_1">a</route>', '<route model="worker_2">a</route>']
    grammar = Grammar.choice(options)
    [out] = ScriptedSampler(tokenizer).generate([[1]], SamplingParams(),
                                                [Pick(grammar, options[1])])
    assert out.token_ids == tokenizer.encode(options[1], add_special_tokens=False)
    assert sorted(set(out.allowed)) == [1, 2] and out.allowed.count(2) == 1
    with pytest.raises(ValueError, match="Pick"):
        ScriptedSampler(tokenizer).generate([[1]], SamplingParams(), [grammar])
    with pytest.raises(ValueError, match="no route"):
        Script("single", True, ["worker_3"]).choose(options, demos_traj(run))  # not offered


def demos_traj(run):
    from jax_routeweaver.routing.episodes.episode import Trajectory
    return Trajectory(record=run[1][0], repeat=0, prompt_ids=[])


@pytest.mark.slow
def test_cloning_rows_and_loss(run, demos):
    cfg, _records, _pool, tokenizer, _ = run
    rows = cloning.pack(demos[:12], tokenizer.pad_token_id)
    for i, t in enumerate(demos[:12]):
        n = len(t.prompt_ids) + len(t.response_ids)
        assert rows.lengths[i] == n and rows.mask[i].sum() == n
        picked = rows.index[i][rows.valid[i] > 0]
        assert list(picked) == [len(t.prompt_ids) + j for j, m in enumerate(t.policy_mask) if m]
    batches = cloning.length_batches(rows, np.arange(12), 4, np.random.default_rng(0))
    assert sorted(np.concatenate(batches).tolist()) == list(range(12))
    for b in batches:  # similar lengths: each batch a slice of the sorted order
        assert rows.take(b)["d_tokens"].shape[1] % cloning.BUCKET == 0
    # The loss is the mean negative log-likelihood of the decision tokens, by hand.
    model = builders.build_policy(cfg, make_mesh((1, -1, 1)), tokenizer)
    batch = rows.take(np.arange(3))
    logits, _ = model(jnp.asarray(batch["d_tokens"]),
                      jnp.broadcast_to(jnp.arange(batch["d_tokens"].shape[1]),
                                       batch["d_tokens"].shape), jnp.asarray(batch["d_mask"]))
    logp = np.asarray(logits) - np.log(np.exp(np.asarray(logits)).sum(-1, keepdims=True))
    want = [-logp[r, p - 1, batch["d_tokens"][r, p]]
            for r in range(3) for p, v in zip(batch["d_index"][r], batch["d_valid"][r],
                                              strict=True) if v]
    np.testing.assert_allclose(float(cloning.loss(model, batch)), np.mean(want), rtol=1e-4)
    with pytest.raises(ValueError, match="without a decision"):
        empty = demos[0].__class__(record=demos[0].record, repeat=0, prompt_ids=[1, 2])
        empty.add_env([3])
        cloning.pack([empty], 0)
