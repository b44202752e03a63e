"""The learner: exact micro-batching (1 device and the 8-device mesh), the support gradient,
the sampler-vs-trainer gap, donation safety, and that an update moves the policy the way the
advantages say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3, token_logprobs
from jax_routeweaver.models.sharding import create_sharded, make_mesh
from jax_routeweaver.rl.core import losses
from jax_routeweaver.rl.core.support import support_batch
from jax_routeweaver.rl.learner.curriculum import ExplorationConfig
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch, param_groups
from jax_routeweaver.sampling.base import SamplingParams
from jax_routeweaver.sampling.jax_sampler import JaxSampler

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256,
                  tie_word_embeddings=False)


def model(seed: int = 0, mesh=None) -> Qwen3:
    if mesh is None:
        return Qwen3(CFG, rngs=nnx.Rngs(seed))
    return create_sharded(lambda: Qwen3(CFG, rngs=nnx.Rngs(seed)), mesh)


def random_batch(n: int = 8, length: int = 32, seed: int = 0,
                 min_length: int | None = None) -> dict[str, np.ndarray]:
    """Right-padded rows of ``min_length`` (default length/2) to ``length`` tokens: a prompt,
    then response tokens partly masked (env tokens)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (n, length)).astype(np.int32)
    lengths = rng.integers(min_length or length // 2, length + 1, n)
    attention = np.arange(length)[None] < lengths[:, None]
    prompt = rng.integers(4, 10, n)
    response = (attention & (np.arange(length)[None] >= prompt[:, None])
                & (rng.random((n, length)) < 0.8)).astype(np.float32)
    span = prompt + 3
    mode_mask = (response > 0) & (np.arange(length)[None] < span[:, None]) \
        & (np.arange(n) % 2 == 0)[:, None]
    advantages = rng.normal(size=(n, length)).astype(np.float32) * response
    return dict(tokens=tokens, positions=np.broadcast_to(np.arange(length), (n, length))
                .astype(np.int32).copy(), attention_mask=attention, response_mask=response,
                mode_mask=mode_mask.astype(np.float32), advantages=advantages,
                clean=(np.arange(n) != 3))


def flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def assert_grads_close(a, b, rtol: float = 1e-6) -> None:
    ga, gb = flat(a), flat(b)
    scale = np.abs(ga).max()
    assert scale > 0
    assert np.abs(ga - gb).max() <= rtol * scale + 1e-12, np.abs(ga - gb).max() / scale


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["segment", "global"])
def test_one_micro_batch_equals_eight(reduction):
    batch = random_batch()
    one = Trainer(model(), OptimConfig(), LossConfig(reduction=reduction, micro_batch_size=0))
    eight = Trainer(model(), OptimConfig(), LossConfig(reduction=reduction, micro_batch_size=1))
    g1, m1 = one.gradients(UpdateBatch(**batch))
    g8, m8 = eight.gradients(UpdateBatch(**batch))
    assert_grads_close(g1, g8)
    np.testing.assert_allclose(float(m1["loss/total"]), float(m8["loss/total"]), rtol=1e-5)


@pytest.mark.slow
def test_ppo_diagnostics_do_not_depend_on_micro_batching():
    """pg_clipfrac and ppo_kl are mini-batch means: eight micro-batches' shares add up to the
    one micro-batch's value (they were averaged, i.e. divided by the micro-batch count)."""
    batch = random_batch()
    old = np.asarray(batch["response_mask"]) * np.random.default_rng(3).normal(
        0.0, 0.5, batch["response_mask"].shape).astype(np.float32)
    out = [Trainer(model(), OptimConfig(), LossConfig(micro_batch_size=mb)).update(UpdateBatch(
                    **batch, old_logp=old)) for mb in (0, 1)]
    assert out[0]["ppo/pg_clipfrac"] > 0.05
    for key in ("ppo/pg_clipfrac", "ppo/pg_clipfrac_lower", "ppo/ppo_kl", "loss/total"):
        np.testing.assert_allclose(out[0][key], out[1][key], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_micro_batching_on_the_8_device_mesh(devices):
    mesh = make_mesh((2, 4, 1))
    batch = random_batch(n=16)
    ref = Trainer(model(), OptimConfig(), LossConfig(micro_batch_size=0))
    sharded = Trainer(model(mesh=mesh), OptimConfig(), LossConfig(micro_batch_size=8),
                      mesh=mesh)
    assert sharded.row_multiple() == 8
    g_ref, _ = ref.gradients(UpdateBatch(**batch))
    g_mesh, _ = sharded.gradients(UpdateBatch(**batch))
    assert_grads_close(g_ref, g_mesh)
    leaf = jax.tree.leaves(sharded.state.params)[0]
    assert len(leaf.sharding.device_set) > 1  # really sharded
    # A micro-batch's rows are split over the 8 batch shards: 4 rows cannot be.
    with pytest.raises(ValueError, match="micro_batch_size=4 must be a multiple"):
        Trainer(model(mesh=mesh), OptimConfig(), LossConfig(micro_batch_size=4), mesh=mesh)


@pytest.mark.slow
def test_gradient_matches_direct_autodiff_of_the_loss():
    """The accumulated gradient equals jax.grad of the textbook objective written out."""
    batch = random_batch(seed=3)
    trainer = Trainer(model(), OptimConfig(), LossConfig(micro_batch_size=2, kl_coef=0.01))
    graphdef, params = nnx.split(model(), nnx.Param)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    old = token_logprobs(nnx.merge(graphdef, params), b["tokens"], b["positions"],
                         b["attention_mask"], temperature=0.8)

    def objective(p):
        logp = token_logprobs(nnx.merge(graphdef, p), b["tokens"], b["positions"],
                              b["attention_mask"], temperature=0.8)
        resp = b["response_mask"] * b["clean"][:, None]
        mode = b["mode_mask"] * resp
        ratio = jnp.exp(logp - jax.lax.stop_gradient(old))
        adv = b["advantages"]
        tok = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
        tok = jnp.where(adv < 0, jnp.minimum(tok, -adv * 3.0), tok)
        n_mode = (b["mode_mask"] * b["response_mask"]).sum()
        n_all = b["response_mask"].sum()
        d = old - logp  # reference = initial policy = old here
        kl = jnp.exp(d) - d - 1
        return ((tok * mode).sum() / n_mode + (tok * (resp - mode)).sum() / (n_all - n_mode)
                + 0.01 * (kl * resp).sum() / n_all)

    want = jax.grad(objective)(params)
    got, _ = trainer.gradients(UpdateBatch(**batch))
    assert_grads_close(want, got, rtol=1e-5)


def support_rows(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Five random selector prompts and three declarations shaped like `<mode>m</mode>`; the
    third's word is two tokens (42, 43), like `ag` + `entic`."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(5, CFG.vocab_size, n)) for n in (9, 14, 11, 6, 13)]
    return prompts, [[1, 2, 3, 40, 4, 5, 6], [1, 2, 3, 41, 4, 5, 6], [1, 2, 3, 42, 43, 4, 5, 6]]


def declaration_logprobs(policy, prompts, decls) -> tuple[jax.Array, np.ndarray]:
    """(token logprobs ``[Q * 3, W]``, the content span of each declaration ``[Q * 3, W]``
    bool) of each declaration after each prompt: one unchunked forward of all Q x 3 rows,
    right-padded (causal attention, so the padding changes no scored position)."""
    pairs = [(prompt, decl) for prompt in prompts for decl in decls]
    width = max(len(prompt) + len(decl) for prompt, decl in pairs)
    ids, mask, span = (np.zeros((len(pairs), width), t) for t in (np.int32, bool, bool))
    for r, (prompt, decl) in enumerate(pairs):
        n = len(prompt) + len(decl)
        ids[r, :n], mask[r, :n] = prompt + decl, True
        span[r, len(prompt) + 3: n - 3] = True
    pos = np.broadcast_to(np.arange(width), ids.shape)
    return token_logprobs(policy, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)), span


def declaration_scores(policy, prompts, decls) -> jax.Array:
    """``[Q, 3]`` summed content-span logprobs of each declaration after each prompt (the
    reference the chunked support pass must match)."""
    lp, span = declaration_logprobs(policy, prompts, decls)
    return jnp.where(span, lp, 0.0).sum(1).reshape(len(prompts), len(decls))


@pytest.mark.slow
def test_support_gradient_equals_full_graph():
    """Chunked two-pass support gradient == autodiff through one unchunked forward."""
    prompts, decls = support_rows(seed=0)
    sb = support_batch(prompts, decls, pad_id=0, chunk=4, length_multiple=8)
    assert sb.tokens.shape[:2] == (4, 4)  # 15 rows padded to 16, chunks of 4
    trainer = Trainer(model(seed=1), OptimConfig(), LossConfig(support_chunk=4),
                      declarations=ExplorationConfig(support_lambda0=0.5, support_floor=0.3))
    graphdef, params = nnx.split(model(seed=1), nnx.Param)

    def weighted(p):
        scores = declaration_scores(nnx.merge(graphdef, p), prompts, decls)
        part, _ = losses.support_loss(scores, rho=0.8, lambda0=0.5, floor=0.3)
        return part.coef * part.value()

    want = jax.jit(jax.grad(weighted))(params)
    got, metrics = trainer._support_grad(trainer.state.params, sb, jnp.float32(0.8), 5)
    assert_grads_close(want, got, rtol=1e-5)
    assert float(metrics["support/lambda"]) == pytest.approx(0.4)


@pytest.mark.slow
def test_support_pass_logs_the_mode_distribution():
    """The teacher-forced scores give π_M per query: π̄ over all, free and forced queries,
    and the first scored token's probability (docs/metrics.md's mode/pibar_all, free|forced/pi,
    mode/pi1), recomputed here from plain per-row forwards."""
    prompts, decls = support_rows(seed=0)
    forced = [True, False, False, True, False]
    sb = support_batch(prompts, decls, pad_id=0, chunk=4, length_multiple=8, forced=forced)
    trainer = Trainer(model(seed=1), OptimConfig(), LossConfig(support_chunk=4))
    graphdef, params = nnx.split(model(seed=1), nnx.Param)
    lp, span = declaration_logprobs(nnx.merge(graphdef, params), prompts, decls)
    lp = np.asarray(lp)
    scores = np.where(span, lp, 0.0).sum(1).reshape(5, 3)
    firsts = lp[np.arange(len(lp)), span.argmax(1)].reshape(5, 3)  # the span's first token
    pi = np.exp(scores) / np.exp(scores).sum(1, keepdims=True)
    _, metrics = trainer._support_grad(trainer.state.params, sb, jnp.float32(0.8), 5)
    f = np.array(forced)
    for m, name in enumerate(losses.MODES):
        assert float(metrics[f"mode/pibar_all_{name}"]) == pytest.approx(pi[:, m].mean(), rel=1e-4)
        assert float(metrics[f"forced/pi_{name}"]) == pytest.approx(pi[f, m].mean(), rel=1e-4)
        assert float(metrics[f"free/pi_{name}"]) == pytest.approx(pi[~f, m].mean(), rel=1e-4)
        assert float(metrics[f"mode/pi1_{name}"]) == pytest.approx(
            np.exp(firsts[:, m]).mean(), rel=1e-4)
    entropy = -(pi * np.log(pi)).sum(1).mean()
    assert float(metrics["mode/entropy_mean"]) == pytest.approx(entropy, rel=1e-4)


def test_an_arm_without_queries_has_no_mode_distribution():
    scores = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    out = losses.mode_probability_metrics(scores, scores, jnp.array([False, False]))
    assert float(out["free/pi_agentic"]) == pytest.approx(0.525)
    assert np.isnan(float(out["forced/pi_agentic"]))
    assert float(out["mode/pi1_single"]) == pytest.approx(0.3)


@pytest.mark.slow
def test_constrained_support_scores_the_grammar_choice():
    """With `constrained`, a declaration scores what a `Grammar.choice` sampler draws: the
    mode word's first token against the three first tokens (softmax over the model's own
    logits at that position), its forced continuation (43 after 42) at probability 1."""
    prompts, decls = support_rows(seed=3)
    sb = support_batch(prompts, decls, pad_id=0, chunk=4, length_multiple=8, constrained=True)
    trainer = Trainer(model(seed=1), OptimConfig(), LossConfig(support_chunk=4),
                      declarations=ExplorationConfig(support_lambda0=0.5, support_floor=0.45))
    graphdef, params = nnx.split(model(seed=1), nnx.Param)

    def scores(p):
        out = []
        for prompt in prompts:
            ids = jnp.asarray([prompt + decls[0]])
            logits, _ = nnx.merge(graphdef, p)(ids, jnp.arange(ids.shape[1])[None],
                                               jnp.ones_like(ids, bool))
            first = logits[0, len(prompt) + 2, jnp.asarray([40, 41, 42])]  # predicts token 3
            out.append(jax.nn.log_softmax(first))
        return jnp.stack(out)

    def weighted(p):
        part, _ = losses.support_loss(scores(p), rho=0.8, lambda0=0.5, floor=0.45)
        return part.coef * part.value()

    want = jax.jit(jax.grad(weighted))(params)
    got, metrics = trainer._support_grad(trainer.state.params, sb, jnp.float32(0.8), 5)
    assert_grads_close(want, got, rtol=1e-5)
    pibar = np.exp(np.asarray(scores(params))).mean(0)
    np.testing.assert_allclose([float(metrics[f"support/pibar_{m}"]) for m in losses.MODES],
                               pibar, rtol=1e-5)
    # (Every mode sits near 1/3 here, so the 0.45 floor makes every hinge active.)
    # Unconstrained, the two-token word is scored against the whole vocabulary twice and
    # looks rarer than the grammar makes it.
    _, plain = trainer._support_grad(trainer.state.params,
                                     support_batch(prompts, decls, pad_id=0, chunk=4,
                                                   length_multiple=8), jnp.float32(0.8), 5)
    assert float(plain["support/pibar_agentic"]) < 0.2 * float(metrics["support/pibar_agentic"])


@pytest.mark.slow
def test_update_raises_logprob_of_advantaged_tokens_and_keeps_caller_arrays():
    policy = model()
    before = np.asarray(policy.embed.get_value()).copy()
    trainer = Trainer(policy, OptimConfig(lr=1e-2), LossConfig(kl_coef=0.0))
    batch = random_batch()
    batch["advantages"] = np.abs(batch["advantages"]) + batch["response_mask"]  # all positive
    lp0 = trainer.logprobs(trainer.state.params, batch["tokens"], batch["positions"],
                           batch["attention_mask"])
    for _ in range(3):
        metrics = trainer.update(UpdateBatch(**batch))
    lp1 = trainer.logprobs(trainer.state.params, batch["tokens"], batch["positions"],
                           batch["attention_mask"])
    m = (batch["response_mask"] > 0) & batch["clean"][:, None]
    assert float(((lp1 - lp0) * m).sum() / m.sum()) > 0.1
    assert trainer.step == 3
    assert np.isfinite(metrics["grad/norm"]) and metrics["grad/norm"] > 0
    # Donation consumed the trainer's copies, never the caller's module.
    for leaf in jax.tree.leaves(nnx.state(policy)):
        np.asarray(leaf)
    np.testing.assert_array_equal(before, np.asarray(policy.embed.get_value()))


@pytest.mark.slow
def test_sampler_logprobs_match_the_trainer():
    """The gap diagnostic is ~0 when the sampler serves the trainer's weights."""
    policy = model(seed=2)
    sampler = JaxSampler(policy, pad_id=0)
    trainer = Trainer(policy, OptimConfig(), LossConfig(), temperature=0.8)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    outs = sampler.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=12, seed=0))
    length = 32
    tokens = np.zeros((2, length), np.int32)
    attention = np.zeros((2, length), bool)
    response = np.zeros((2, length), np.float32)
    sampler_lp = np.zeros((2, length), np.float32)
    for i, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        ids = p + list(c.token_ids)
        tokens[i, :len(ids)] = ids
        attention[i, :len(ids)] = True
        response[i, len(p):len(ids)] = 1
        sampler_lp[i, len(p):len(ids)] = c.logprobs
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (2, length)).copy()
    metrics = trainer.update(UpdateBatch(
        tokens, positions, attention, response, np.zeros_like(response),
        np.zeros_like(response), np.ones(2, bool), sampler_logp=sampler_lp))
    assert metrics["logprob/sampler_gap_max"] < 1e-4
    assert np.isfinite(metrics["loss/total"])


@pytest.mark.slow
def test_gathered_positions_give_the_same_gradient():
    """Computing logprobs only at the policy tokens (the head skips prompt/env tokens) is the
    same objective as the full [N, L] layout."""
    batch = random_batch(seed=5)
    trainer = Trainer(model(), OptimConfig(), LossConfig(micro_batch_size=4, kl_coef=0.01))
    full, m_full = trainer.gradients(UpdateBatch(**batch))
    at_policy, m_g = trainer.gradients(UpdateBatch(**gathered(batch)))
    assert_grads_close(full, at_policy, rtol=1e-5)
    np.testing.assert_allclose(float(m_full["loss/total"]), float(m_g["loss/total"]),
                               rtol=1e-5)


@pytest.mark.slow
def test_ppo_mini_batches_are_sequential_steps_against_the_pre_update_policy():
    """Two mini-batches = two optimizer steps on the row halves, each with its own token
    denominators and the ratio taken against the logprobs *before* the first step."""
    batch = random_batch(n=8)
    optim = OptimConfig(lr=1e-2)
    split = Trainer(model(), optim, LossConfig(ppo_mini_batches=2, micro_batch_size=2))
    assert split.row_multiple() == 4
    metrics = split.update(UpdateBatch(**batch))
    assert metrics["optim/steps"] == 2 and split.step == 2
    # The second step sees a moved policy: its ratios are not 1.
    assert metrics["ppo/ppo_kl"] != 0.0

    by_hand = Trainer(model(), optim, LossConfig(micro_batch_size=2))
    old = np.asarray(by_hand.logprobs(by_hand.state.params, batch["tokens"],
                                      batch["positions"], batch["attention_mask"]))
    for half in (slice(0, 4), slice(4, 8)):
        by_hand.update(UpdateBatch(**{k: v[half] for k, v in batch.items()}, old_logp=old[half]))
    np.testing.assert_allclose(flat(split.state.params), flat(by_hand.state.params),
                               rtol=0, atol=1e-6)

    epochs = Trainer(model(), optim, LossConfig(ppo_epochs=3))
    assert epochs.update(UpdateBatch(**batch))["optim/steps"] == 3 and epochs.step == 3
    with pytest.raises(ValueError, match="do not split into 2 mini-batches"):
        split.update(UpdateBatch(**{k: v[:5] for k, v in batch.items()}))
    with pytest.raises(ValueError, match="ppo_mini_batches=0"):
        LossConfig(ppo_mini_batches=0)


def gathered(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The batch with its per-token arrays at the policy tokens only (``index``)."""
    resp = batch["response_mask"] > 0
    width = int(resp.sum(1).max())
    index = np.ones((resp.shape[0], width), np.int32)
    valid = np.zeros((resp.shape[0], width), np.float32)
    for i, row in enumerate(resp):
        pos = np.flatnonzero(row)
        index[i, :len(pos)], valid[i, :len(pos)] = pos, 1
    take = lambda x: np.take_along_axis(x, index, axis=1) * valid
    return dict(tokens=batch["tokens"], positions=batch["positions"],
                attention_mask=batch["attention_mask"], response_mask=valid,
                mode_mask=take(batch["mode_mask"]), advantages=take(batch["advantages"]),
                clean=batch["clean"], index=index)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["full", "gathered"])
def test_group_by_length_gives_the_same_gradient_and_update(layout):
    """Length-sorted micro-batches, each cut to its own bucket, are the same objective: the
    same gradient, loss and optimizer step as padding every row to the longest."""
    batch = random_batch(n=8, length=256, seed=7, min_length=16)
    if layout == "gathered":
        batch = gathered(batch)
    plain = Trainer(model(), OptimConfig(lr=1e-2), LossConfig(micro_batch_size=4, kl_coef=0.01))
    grouped = Trainer(model(), OptimConfig(lr=1e-2),
                      LossConfig(micro_batch_size=4, kl_coef=0.01, group_by_length=True))
    groups = grouped.length_groups(batch["attention_mask"])
    lengths = batch["attention_mask"].sum(1)
    # Sorted, every row once, each group cut at a bucket that still holds its rows.
    assert sorted(np.concatenate([rows for rows, _ in groups])) == list(range(8))
    assert [lengths[rows].max() for rows, _ in groups] == sorted(
        lengths[rows].max() for rows, _ in groups)
    assert all(lengths[rows].max() <= cut <= 256 for rows, cut in groups)
    assert len({cut for _, cut in groups}) > 1 and min(cut for _, cut in groups) < 256

    g_plain, m_plain = plain.gradients(UpdateBatch(**batch))
    g_grouped, m_grouped = grouped.gradients(UpdateBatch(**batch))
    assert_grads_close(g_plain, g_grouped, rtol=1e-5)
    for key in ("loss/total", "loss/pg_mode", "loss/pg_inner", "loss/kl", "grad/norm"):
        np.testing.assert_allclose(float(m_grouped[key]), float(m_plain[key]), rtol=1e-5)

    sampler_logp = np.asarray(plain.logprobs(plain.state.params, batch["tokens"],
                                             batch["positions"], batch["attention_mask"],
                                             batch.get("index")))
    lp_grouped = grouped.logprobs(grouped.state.params, batch["tokens"], batch["positions"],
                                  batch["attention_mask"], batch.get("index"))
    m = batch["response_mask"] > 0
    np.testing.assert_allclose(lp_grouped[m], sampler_logp[m], rtol=0, atol=1e-5)
    m_plain = plain.update(UpdateBatch(**batch, sampler_logp=sampler_logp))
    m_grouped = grouped.update(UpdateBatch(**batch, sampler_logp=sampler_logp))
    # The loss pass's logprobs come back in the rows' own order.
    assert m_grouped["logprob/sampler_gap_max"] < 1e-5
    np.testing.assert_allclose(m_grouped["loss/total"], m_plain["loss/total"], rtol=1e-5)
    # Adam divides by |g|: where a gradient is ~0 its float noise moves a weight by up to
    # lr (measured: a 5e-8 gradient, against 0.13 at most, moved a weight by 1.5e-4), so the
    # bound is a twentieth of lr (a wrong gradient moves weights by ~lr).
    np.testing.assert_allclose(flat(grouped.state.params), flat(plain.state.params),
                               rtol=0, atol=5e-4)
    assert grouped.step == plain.step == 1


@pytest.mark.slow
def test_group_by_length_on_the_8_device_mesh(devices):
    mesh = make_mesh((2, 4, 1))
    batch = random_batch(n=16, length=256, seed=8, min_length=16)
    ref = Trainer(model(), OptimConfig(), LossConfig(micro_batch_size=0))
    sharded = Trainer(model(mesh=mesh), OptimConfig(),
                      LossConfig(micro_batch_size=8, group_by_length=True), mesh=mesh)
    assert len({cut for _, cut in sharded.length_groups(batch["attention_mask"])}) == 2
    g_ref, _ = ref.gradients(UpdateBatch(**batch))
    g_mesh, _ = sharded.gradients(UpdateBatch(**batch))
    assert_grads_close(g_ref, g_mesh, rtol=1e-5)
    sharded.update(UpdateBatch(**batch))
    leaf = jax.tree.leaves(sharded.state.params)[0]
    assert len(leaf.sharding.device_set) > 1 and sharded.step == 1


@pytest.mark.slow
def test_group_by_length_keeps_the_scan_when_cutting_saves_little():
    """Rows of about one length: the cut would save under GROUP_MIN_SAVING of the padded
    tokens, so the trainer runs the one-dispatch scan (no per-micro-batch calls)."""
    batch = random_batch(n=8, length=128, seed=9, min_length=100)
    trainer = Trainer(model(), OptimConfig(),
                      LossConfig(micro_batch_size=4, kl_coef=0.0, group_by_length=True))
    assert trainer.length_groups(batch["attention_mask"]) is None
    calls = []
    trainer._accumulate = lambda *a: calls.append(a)  # would record any grouped call
    metrics = trainer.update(UpdateBatch(**batch))
    assert not calls and trainer.step == 1 and np.isfinite(metrics["loss/total"])
    # Widely spread rows do get cut.
    spread = random_batch(n=8, length=256, seed=7, min_length=16)
    assert trainer.length_groups(spread["attention_mask"]) is not None


@pytest.mark.slow
def test_question_floor_gradient_equals_full_graph_and_weights_with_rho():
    """The per-question mode floor joins the support pass: its chunked gradient equals
    autodiff of λ0·ρ·L_support + λ_q·(1 − ρ)·L_floor through unchunked forwards; at ρ = 1
    only the support term acts, at ρ = 0 only the floor."""
    prompts, decls = support_rows(seed=0)
    sb = support_batch(prompts, decls, pad_id=0, chunk=4, length_multiple=8)
    trainer = Trainer(model(seed=1), OptimConfig(), LossConfig(support_chunk=4),
                      declarations=ExplorationConfig(support_lambda0=0.5, support_floor=0.3,
                                                     question_floor=0.3,
                                                     question_floor_weight=2.0))
    graphdef, params = nnx.split(model(seed=1), nnx.Param)

    def scores(p):
        return declaration_scores(nnx.merge(graphdef, p), prompts, decls)

    def floor_by_hand(s):  # mean over queries and modes of max(0, log δ − log π)
        logp = jax.nn.log_softmax(s, axis=-1)
        return jnp.maximum(0.0, jnp.log(0.3) - logp).mean()

    def weighted(p, rho):
        s = scores(p)
        part, _ = losses.support_loss(s, rho=rho, lambda0=0.5, floor=0.3)
        return part.coef * part.value() + 2.0 * (1 - rho) * floor_by_hand(s)

    grad = jax.jit(jax.grad(weighted))
    probs = jax.nn.softmax(jax.jit(scores)(params), axis=-1)
    for rho in (0.0, 0.4, 1.0):
        got, metrics = trainer._support_grad(trainer.state.params, sb, jnp.float32(rho), 5)
        assert_grads_close(grad(params, jnp.float32(rho)), got, rtol=1e-5)
        assert float(metrics["floor/weight"]) == pytest.approx(2.0 * (1 - rho))
        assert float(metrics["floor/min_prob"]) == pytest.approx(float(probs.min()), rel=1e-5)
    # The rows are scored whenever either term has weight: at ρ = 0 (support weight 0) too.
    _, _, kwargs = trainer._support_args(sb, 0.0, 5)
    assert kwargs["with_support"]
    off = Trainer(model(seed=1), OptimConfig(), LossConfig(),
                  declarations=ExplorationConfig(support_lambda0=0.5))
    assert not off._support_args(sb, 0.0, 5)[2]["with_support"]


@pytest.mark.slow
def test_trunk_lr_scale_moves_the_trunk_slower_than_the_head():
    """With trunk_lr_scale s, one AdamW step moves every trunk weight by s times what the
    same step moves it at one rate, and the head (lm_head) by the same amount."""
    rows = random_batch(8)
    batch = UpdateBatch(**rows)
    start = nnx.split(model(seed=2), nnx.Param)[1]
    moved = {}
    for scale in (1.0, 0.1):
        trainer = Trainer(model(seed=2), OptimConfig(lr=1e-2, trunk_lr_scale=scale),
                          LossConfig(micro_batch_size=0))
        trainer.update(batch)
        moved[scale] = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b),
                                    trainer.state.params, start)
    get = lambda scale, *path: np.asarray(
        moved[scale][path[0]][path[1]][...] if len(path) == 2 else moved[scale][path[0]][...])
    np.testing.assert_allclose(get(0.1, "lm_head"), get(1.0, "lm_head"), rtol=1e-4, atol=1e-8)
    assert np.abs(get(1.0, "layers", "q_proj")).max() > 1e-4
    for path in (("layers", "q_proj"), ("layers", "down_proj"), ("embed",), ("final_norm",)):
        np.testing.assert_allclose(get(0.1, *path), 0.1 * get(1.0, *path), rtol=1e-3,
                                   atol=1e-8)


def test_param_groups_name_the_head_tied_or_not():
    untied = param_groups(nnx.split(model(), nnx.Param)[1])
    assert untied["lm_head"].get_value() == "head" and untied["embed"].get_value() == "trunk"
    tied_cfg = ModelConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
    tied = param_groups(nnx.split(Qwen3(tied_cfg, rngs=nnx.Rngs(0)), nnx.Param)[1])
    assert tied["embed"].get_value() == "head"
    assert {v for v in jax.tree.leaves(tied)} == {"head", "trunk"}
    with pytest.raises(ValueError, match="trunk_lr_scale"):
        OptimConfig(trunk_lr_scale=0.0)
