"""The pretrained stand-in (rl/run/stand_in.py): targets, the objective, the cache, the config."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from rich.console import Console

from jax_routeweaver.config import ConfigError
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.rl.run import builders, routeweaver_run, stand_in
from jax_routeweaver.rl.run.train_config import StandInConfig, load_train_config
from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol import prompts

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
QUIET = Console(file=io.StringIO())


def one_device():
    """A mesh of one device: the quickstart's CPU machine has one, and distilling on the
    tests' eight simulated devices takes about twice as long on the same two cores."""
    return make_mesh((1, 1, 1), jax.devices()[:1])


def small_settings(tmp_path: Path) -> list[str]:
    """The module's small stand-in settings, cached under `tmp_path`."""
    return ["model.init=stand-in", f"model.stand_in.cache_dir={tmp_path / 'cache'}",
            "data.synthetic_queries=60", "model.stand_in.steps=40",
            "model.stand_in.batch_size=16", "model.stand_in.dims=8",
            "model.stand_in.demonstrations=24", "model.stand_in.bc_batch=4"]


def config(tmp_path: Path, *extra: str):
    return load_train_config(QUICKSTART, [*small_settings(tmp_path), *extra])


@pytest.fixture(scope="module")
def run_parts(tmp_path_factory):
    """The quickstart's questions (60), pool and pruned tokenizer."""
    cfg = config(tmp_path_factory.mktemp("parts"))
    records = builders.build_records(cfg, QUIET)
    tokenizer = builders.build_tokenizer(cfg, records, builders.build_pool(cfg, records))
    return records, tokenizer


def random_router(cfg, tokenizer):
    return builders.build_policy(dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, init="random",
                                       stand_in=StandInConfig())), make_mesh((1, -1, 1)),
        tokenizer)


@pytest.mark.slow
def test_decision_inputs_end_where_the_mode_word_is_chosen(run_parts):
    records, tokenizer = run_parts
    tokens, mask, last, firsts = stand_in.decision_inputs(
        tokenizer, [r.question for r in records[:3]])
    decls = [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
             for m in g.MODES]
    assert firsts == [d[3] for d in decls]  # after the shared "<", "mode", ">"
    for i, r in enumerate(records[:3]):
        prompt = prompts.selector_prompt_ids(tokenizer, r.question)
        n = len(prompt) + 3
        assert last[i] == n - 1 and mask[i].sum() == n
        assert list(tokens[i, :n]) == prompt + decls[0][:3]
    assert tokens.shape[1] % stand_in.LENGTH_MULTIPLE == 0


def test_targets_are_unit_directions_with_the_configured_shared_part():
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((50, 20)).astype(np.float32)
    train = np.arange(40)
    t = stand_in.targets(emb, train, dims=6, common=0.5, hidden=16, seed=3)
    assert t.shape == (50, 16)
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, rtol=1e-5)
    # The shared direction: rms(component) 1 against common 0.5, so |mean t|^2 is about
    # 0.5^2 / (1 + 0.5^2) of the mean |t|^2 over the training rows.
    share = np.sum(t[train].mean(0) ** 2) / np.mean(np.sum(t[train] ** 2, 1))
    assert 0.12 < share < 0.3, share
    # Seeded: the same inputs give the same targets, another seed another basis.
    np.testing.assert_array_equal(t, stand_in.targets(emb, train, dims=6, common=0.5,
                                                      hidden=16, seed=3))
    assert not np.allclose(t, stand_in.targets(emb, train, dims=6, common=0.5, hidden=16,
                                               seed=4))
    # Alike embeddings get alike targets: cosine of targets follows the embeddings' order.
    near = emb[0] + 0.01 * rng.standard_normal(20)
    t2 = stand_in.targets(np.vstack([emb, near[None]]), train, dims=6, common=0.0,
                          hidden=16, seed=3)
    assert t2[0] @ t2[-1] > max(t2[0] @ t2[j] for j in range(1, 50))
    with pytest.raises(ValueError, match="no principal component"):
        stand_in.targets(emb, np.arange(1), dims=6, common=0.5, hidden=16, seed=0)


def _contexts(cfg, tokenizer, records):
    pool = builders.build_pool(cfg, list(records))
    config = routeweaver_run.env_config(cfg, tokenizer.eos_token_id)
    make_env = routeweaver_envs(tokenizer, pool, config)
    return stand_in.env_worker_contexts(make_env, tokenizer, len(pool.worker_ids()))


def test_worker_contexts_end_where_the_first_worker_is_chosen(run_parts, tmp_path):
    records, tokenizer = run_parts
    cfg = config(tmp_path)
    contexts = _contexts(cfg, tokenizer, records)(records[0])
    assert len(contexts) == len(g.MODES)
    selector = prompts.selector_prompt_ids(tokenizer, records[0].question)
    task = cfg.rollout.task_text
    for mode, (ids, choices) in zip(g.MODES, contexts, strict=True):
        assert ids[:len(selector)] == selector and len(choices) == 6 == len(set(choices))
        assert f"<mode>{mode.value}</mode>" in tokenizer.decode(ids[len(selector):])
        for k, token in enumerate(choices):
            # the context and choice k start worker k's route, canonically tokenised
            route = f'<route model="worker_{k + 1}"'
            full = f'{route}>{task}</route>' if mode != g.Mode.AGENTIC else \
                f'{route} role="planner" refs="">{task}</route>'
            canonical = tokenizer.encode(full, add_special_tokens=False)
            n = _shared(ids, canonical)
            assert n >= 1 and canonical[n] == token, (mode, k)
    # Every question offers the same choices; a free-text task has no finite first action.
    tokens, mask, last, choices = stand_in.worker_inputs(records[:3], _contexts(
        cfg, tokenizer, records), tokenizer.pad_token_id)
    assert tokens.shape[:2] == (3, 3) and choices.shape == (3, 6) and last.shape == (3, 3)
    assert mask.sum(-1).tolist() == (last + 1).tolist()
    free = config(tmp_path, "model.stand_in.worker_weight=0", "rollout.task_text=",
                  "model.stand_in.demonstrations=0")
    with pytest.raises(ValueError, match="finite first actions"):
        _contexts(free, tokenizer, records)(records[0])


def _shared(ids, canonical):
    """Length of the longest suffix of ids that is a prefix of canonical."""
    for n in range(min(len(ids), len(canonical)), 0, -1):
        if ids[-n:] == canonical[:n]:
            return n
    return 0


def test_branch_finds_the_first_decision():
    assert stand_in.branch([[1, 2, 3, 9], [1, 2, 4, 9], [1, 2, 3, 8], [1, 2, 5]]) == \
        ([1, 2], [3, 4, 5])
    assert stand_in.branch([[7, 1], [7, 2]]) == ([7], [1, 2])


@pytest.mark.slow
def test_the_objective_values_by_hand(run_parts, tmp_path):
    """L_align = 1 - cos(h, t), L_mode = KL(uniform || softmax(h . w_m)) and the worker
    terms the same at each mode's first worker choice."""
    records, tokenizer = run_parts
    cfg = config(tmp_path)
    model = random_router(cfg, tokenizer)
    tokens, mask, last, firsts = stand_in.decision_inputs(
        tokenizer, [r.question for r in records[:4]])
    w_tokens, w_mask, w_last, choices = stand_in.worker_inputs(
        records[:4], _contexts(cfg, tokenizer, records), tokenizer.pad_token_id)
    h = np.asarray(stand_in.decision_states(model, tokens, mask, last))
    target = np.eye(h.shape[1], dtype=np.float32)[:4]
    mode_only = {"tokens": tokens, "mask": mask, "last": last, "target": target}
    batch = {**mode_only, "w_tokens": w_tokens, "w_mask": w_mask, "w_last": w_last,
             "w_choices": np.broadcast_to(choices, (4, *choices.shape))}
    loss, parts = stand_in.objective(model, batch, jax.numpy.asarray(firsts), 2.0, 0.5)
    head = np.asarray(model.head_weight())

    def align_and_kl(states, targets, tokens_):
        cos = (states * targets).sum(-1) / np.linalg.norm(states, axis=-1)
        logits = np.einsum("...d,...cd->...c", states, np.moveaxis(head[:, tokens_], 0, -1))
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return np.mean(1 - cos), np.mean(-np.log(logp.shape[-1]) - logp.mean(-1))

    align, kl = align_and_kl(h, target, np.asarray(firsts))
    hw = np.stack([np.asarray(stand_in.decision_states(model, w_tokens[:, m], w_mask[:, m],
                                                       w_last[:, m])) for m in range(3)], 1)
    w_align, w_kl = align_and_kl(hw, target[:, None, :], choices)
    np.testing.assert_allclose(float(parts["align"]), align, rtol=1e-4)
    np.testing.assert_allclose(float(parts["mode"]), kl, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(float(parts["worker_align"]), w_align, rtol=1e-4)
    np.testing.assert_allclose(float(parts["worker"]), w_kl, rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(float(loss), align + 2.0 * kl + 0.5 * (w_align + w_kl),
                               rtol=1e-4)
    # Without worker contexts the objective is the mode decision's alone.
    loss0, parts0 = stand_in.objective(model, mode_only, jax.numpy.asarray(firsts), 2.0, 0.5)
    assert set(parts0) == {"align", "mode"}
    np.testing.assert_allclose(float(loss0), align + 2.0 * kl, rtol=1e-4)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The stand-in of `config`'s settings built by the real `warm-start` command in its own
    process on one CPU device, as a user runs it: (the cache's parent, the command's
    output)."""
    tmp = tmp_path_factory.mktemp("built")
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "jax_routeweaver.cli", "warm-start",
                           "--config", str(QUICKSTART), *small_settings(tmp)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, done.stdout


@pytest.mark.slow
def test_built_once_then_reused_and_loaded_by_the_run(built, run_parts, capsys, monkeypatch):
    tmp_path, printed = built
    assert "distilling 60 questions" in printed and "domain_share" in printed
    assert "bc_nll" in printed
    records, tokenizer = run_parts
    cfg = config(tmp_path)
    [path] = [p for p in (tmp_path / "cache").iterdir() if p.name != "embeddings"]
    report = stand_in.read_report(path)
    before, after = report["before"], report["after"]
    # Distilled on held-out questions: states aligned with the encoder's, no mode preferred,
    # and the shared part of the decision state well below the random init's.
    assert after["align"] > before["align"] + 0.3, report
    assert after["mode_p_max"] < 0.45 and after["mode_entropy"] > 0.97, after
    assert after["common"] < before["common"], report
    # Likewise at the first worker choice of each mode, with the six workers kept open.
    w0, w1 = before["workers"], after["workers"]
    assert w1["align"] > w0["align"] + 0.3 and w1["common"] < w0["common"], report
    assert w1["p_max"] < 0.35 and w1["entropy"] > 0.97, w1
    assert report["loss_last"]["loss"] < report["loss_first"]["loss"]
    # Cloning the demonstrations: their held-out decision tokens became likelier.
    assert after["bc_nll"] < before["bc_nll"] - 1.0, (before["bc_nll"], after["bc_nll"])
    assert report["loss_last"]["bc"] < report["loss_first"]["bc"]
    assert report["settings"]["steps"] == 40
    assert not list((tmp_path / "cache").glob(".building-*"))
    # Reused by the run, which trains nothing and computes with the cached weights: the
    # decision states the builder measured on its held-out questions.
    monkeypatch.setattr(stand_in, "distil", lambda *a, **k: pytest.fail("retrained"))
    lines: list[str] = []
    model = builders.build_policy(cfg, one_device(), tokenizer, records, log=lines.append)
    assert any("reusing" in line for line in lines)
    again = stand_in.diagnostics(model, _inputs(cfg, records, tokenizer))
    for key in ("align", "common", "mode_p_max", "mode_entropy"):
        assert again[key] == pytest.approx(after[key], rel=1e-4, abs=1e-6), key
    # The command again, here: it reuses the cache too.
    from jax_routeweaver.cli.app import main

    assert main(["warm-start", "--config", str(QUICKSTART), *small_settings(tmp_path)]) == 0
    second = capsys.readouterr().out
    assert "reusing" in second and "distilling" not in second and str(path) in second
    # Not a random-init router: one line naming the field, exit non-zero, nothing built.
    assert main(["warm-start", "--config", str(QUICKSTART), "model.init=/nonexistent",
                 "model.random={}"]) != 0
    assert "model.init" in capsys.readouterr().err
    # Any field that changes the result changes the key (the cache directory is not one).
    key = lambda c: stand_in.cache_key(model.config, tokenizer, records, c.model.stand_in,
                                       c.seed)
    assert key(config(tmp_path, "model.stand_in.common=0.3")) != key(cfg)
    assert key(config(tmp_path, "model.stand_in.demonstrations=12")) != key(cfg)
    assert key(config(tmp_path, "seed=1")) != key(cfg)
    assert key(config(tmp_path / "elsewhere")) == key(cfg)
    # The demonstrations enter the key through their tokens: another pool, another key.
    demo = lambda c: builders_demonstrate(c, records, tokenizer)
    with_demos = lambda c, d: stand_in.cache_key(model.config, tokenizer, records,
                                                 c.model.stand_in, c.seed, demonstrate=d)
    assert with_demos(cfg, demo(cfg)) != with_demos(cfg, None)
    assert with_demos(cfg, demo(config(tmp_path, "workers.seed=3"))) != \
        with_demos(cfg, demo(cfg))


def builders_demonstrate(cfg, records, tokenizer):
    """The run's `demonstrate` as `builders.stand_in_path` binds it."""
    from jax_routeweaver.rl.run.demonstrations import demonstrations

    pool = builders.build_pool(cfg, records, check=False)
    make_env = routeweaver_envs(tokenizer, pool, routeweaver_run.env_config(
        cfg, tokenizer.eos_token_id))
    return lambda qs: demonstrations(qs, make_env, pool, tokenizer, pool.worker_ids(),
                                     seed=cfg.seed)


def _inputs(cfg, records, tokenizer):
    root = stand_in.cache_root(cfg.model.stand_in.cache_dir)
    from jax_routeweaver.models.sentence_encoder import Embedder
    emb = Embedder(cache_dir=root / "embeddings").embed([r.question for r in records])
    return stand_in.build_inputs(tokenizer, records, emb, hidden=64,
                                 settings=cfg.model.stand_in, seed=cfg.seed,
                                 worker_contexts=_contexts(cfg, tokenizer, records))


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROUTEWEAVER_CACHE", str(tmp_path))
    assert stand_in.cache_root("") == tmp_path / "stand_in"
    assert stand_in.cache_root("/x/y") == Path("/x/y")
    monkeypatch.delenv("ROUTEWEAVER_CACHE")
    assert stand_in.cache_root("") == Path.home() / ".cache" / "jax_routeweaver" / "stand_in"


@pytest.mark.parametrize("overrides, key", [
    (["model.init=random", "model.stand_in.steps=10"], "model.stand_in"),
    (["model.init=stand-in", "model.stand_in.steps=0"], "model.stand_in.steps"),
    (["model.init=stand-in", "model.stand_in.holdout=1"], "model.stand_in.holdout"),
    (["model.init=stand-in", "rollout.task_text=", "model.stand_in.demonstrations=0"],
     "model.stand_in.worker_weight"),
    (["model.init=stand-in", "rollout.task_text="], "model.stand_in.demonstrations"),
    (["model.init=stand-in", "model.stand_in.worker_weight=-1"], "model.stand_in.worker_weight"),
    (["model.init=stand-in", "rollout.answer_choices=false"], "model.stand_in.demonstrations"),
    (["model.init=stand-in", "model.stand_in.bc_batch=0"], "model.stand_in.bc_batch"),
])
def test_bad_stand_in_settings_name_the_field(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_train_config(QUICKSTART, overrides)


def test_demonstrations_refuse_a_paid_pool(run_parts, tmp_path):
    """The demonstrated episodes would call a channel file's workers: refused before any
    call, naming the field (the simulated pool only)."""
    records, tokenizer = run_parts
    channels = Path(__file__).resolve().parents[1] / "configs" / "channels" / "reference.yaml"
    cfg = config(tmp_path, f"workers.pool={channels}")
    with pytest.raises(ValueError, match=r"model\.stand_in\.demonstrations=24: .*simulated"):
        builders.stand_in_path(cfg, make_mesh((1, -1, 1)), tokenizer, records)
    assert not (tmp_path / "cache").exists()
