"""A stand-in for a pretrained router: a random-init router distilled from a sentence encoder.

Not part of the paper's method. The paper starts RL from a pretrained Qwen3, whose state at
the mode decision already depends on what the question means, while none of the three mode
declarations is preferred. A random-init router has neither property's first half: its
decision state hardly depends on the question, so RL moves every question's mode together
(bench/RESULTS.md, issue 5's rounds). No pretrained router can be downloaded here, so
``model.init: stand-in`` gives the tiny router both properties before RL, from text alone
(no labels, rewards, domains or worker outcomes):

* the decision state ``h(q) [D]`` (final-normed, at the position whose logits choose the mode
  word, i.e. after the declarations' common prefix ``<mode>``) is pulled towards a target
  direction ``t(q)`` built from the question's all-MiniLM-L6-v2 embedding ``e(q)``::

      c(q) = U_k^T (e(q) - mean e)           the first k principal components (train split)
      t(q) = Q [c(q) / rms(c), common]       Q [D, k+1]: a fixed random orthonormal basis
      L_align = mean_q (1 - cos(h(q), t(q)))

  so questions the encoder finds alike get alike decision states, and the shared part of
  the state (``common``) is a fixed share of it rather than nearly all of it;

* the three declarations stay open: with ``p(m | q) = softmax_m(h(q) . w_m)`` over the first
  token ``w_m`` of each declaration's mode word (the choice a constrained sampler makes
  there)::

      L_mode = mean_q KL(uniform || p(. | q)) = mean_q (-log 3 - mean_m log p(m | q))

* the same for the first worker choice of each mode: the state ``h_m(q)`` at the position
  whose logits choose the first route's worker (the forced arm's context for mode ``m``:
  declaration, rulebook, then the route's common prefix up to the worker id) is pulled
  towards the same ``t(q)``, and the choice among the offered workers' tokens is kept
  uniform::

      L_workers = mean_{q,m} [ (1 - cos(h_m(q), t(q))) + KL(uniform || p(. | q, m)) ]

  (without it the worker choice, made several hundred tokens after the question, keeps
  the random init's question-blind state, and RL picks one worker for every question).

* each mode executed as the simulated pool was designed to reward it (single: one call;
  multi: three workers and the majority answer; agentic: plan -> execute -> verify ->
  summarize), by behaviour cloning of ``demonstrations`` protocol-valid episodes whose mode
  and workers are drawn uniformly at random (`rl.run.demonstrations`, `rl.run.cloning`), so the
  prior says nothing about *which* mode or worker to choose::

      L_bc = - mean over the demonstrations' decision tokens of log π(token | prefix)

``L = L_align + mode_weight * L_mode + worker_weight * L_workers + bc_weight * L_bc``,
minimised by AdamW over all the router's weights (each step: ``batch_size`` questions and
``bc_batch`` demonstrations of similar length).
The result is an HF directory cached under ``cache_dir/<key>/`` where the key hashes the
architecture, the tokenizer's vocabulary, the question texts, the `StandInConfig` fields, the
seed, `VERSION`, the first question's worker contexts and the first demonstrations' tokens;
a later run with the same inputs loads it instead of training.

Diagnostics (`stand_in.json`, from held-out questions, with the random init's for
comparison): ``align`` (mean cosine to the target), ``domain_share`` (share of the decision
state's variance between domain means; the domains are used here only, never in training),
``probe`` (nearest-domain-centroid accuracy, centroids from the train split), ``common``
(|mean h|^2 / mean |h|^2), and the mode distribution (mean, the largest probability any
question gives one mode, mean entropy over log 3); ``workers`` holds the same for the
worker-choice states (pooled over the modes) and their worker distribution; ``bc_nll`` the
mean negative log-likelihood of the held-out questions' demonstrations' decision tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_routeweaver.data.records import Record
from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import save_hf
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sentence_encoder import Embedder
from jax_routeweaver.models.tokenizer import cache_root as project_cache
from jax_routeweaver.rl.run import cloning
from jax_routeweaver.routing.episodes.episode import EnvFactory, Trajectory
from jax_routeweaver.routing.protocol import grammar as g
from jax_routeweaver.routing.protocol import prompts

VERSION = 3  # bump when the objective changes: old caches are then not reused
REPORT_FILE = "stand_in.json"
# One record -> per mode: (context ids ending just before the first route's worker choice,
# the offered workers' choice token ids there).
WorkerContexts = Callable[[Record], Sequence[tuple[Sequence[int], Sequence[int]]]]
LENGTH_MULTIPLE = 64  # prompts are padded to one length, a multiple of this
HELD_DEMOS = 100  # demonstrations of held-out questions, for the diagnostics
FINGERPRINT_DEMOS = 8  # demonstrations that enter the cache key
# Demonstrated episodes of some questions (`rl.run.demonstrations.demonstrations` bound to the run).
Demonstrate = Callable[[Sequence[Record]], list[Trajectory]]


def cache_root(configured: str) -> Path:
    """``configured``, else ``$ROUTEWEAVER_CACHE/stand_in``, else
    ``~/.cache/jax_routeweaver/stand_in``."""
    return Path(configured) if configured else project_cache() / "stand_in"


def decision_inputs(tokenizer: Any, questions: Sequence[str]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Right-padded ``tokens [N, L]``, ``mask [N, L]``, ``last [N]`` (the decision position:
    the selector prompt followed by the declarations' common prefix) and the three mode
    words' first token ids (single, multi, agentic; must differ, else ValueError)."""
    decls = [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
             for m in g.MODES]
    prefix, firsts = branch(decls)
    if len(firsts) != len(decls):
        raise ValueError(f"the mode declarations' first differing tokens {firsts} are not "
                         "distinct: the stand-in's mode term needs one choice position")
    rows = [prompts.selector_prompt_ids(tokenizer, q) + prefix for q in questions]
    tokens, mask, last = pad_rows(rows, tokenizer.pad_token_id or 0)
    return tokens, mask, last, firsts


def branch(sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(common prefix, the distinct tokens that follow it, in first-seen order) of token
    sequences: where a constrained sampler over them makes its first decision."""
    common = 0
    while all(len(s) > common and s[common] == sequences[0][common] for s in sequences):
        common += 1
    nexts: list[int] = []
    for s in sequences:
        if len(s) > common and s[common] not in nexts:
            nexts.append(s[common])
    return list(sequences[0][:common]), nexts


def env_worker_contexts(make_env: EnvFactory, tokenizer: Any, workers: int) -> WorkerContexts:
    """`WorkerContexts` from the run's own episode factory: for each mode, the forced arm's
    prompt (declaration, rulebook) and the first action's choices (`Grammar.choice`, i.e.
    ``rollout.constrained`` with a fixed ``task_text``) up to where they branch. ValueError
    when the first action is not a finite choice or does not branch into ``workers``
    options (one per offered worker)."""

    def contexts(record: Record) -> list[tuple[list[int], list[int]]]:
        out = []
        for mode in g.MODES:
            prompt, env = make_env(record.replace(forced_mode=str(mode)), 0)
            traj = Trajectory(record=record, repeat=0, prompt_ids=prompt)
            ids = prompt + env.start(traj)
            turn = env.next_turn(traj)
            choices = turn.grammar.choices if turn is not None and turn.grammar else ()
            if not choices:
                raise ValueError("stand-in worker terms need finite first actions "
                                 "(rollout.constrained with rollout.task_text); set "
                                 "model.stand_in.worker_weight=0 otherwise")
            prefix, tokens = branch([tokenizer.encode(c, add_special_tokens=False)
                                     for c in choices])
            if len(tokens) != workers:
                raise ValueError(f"stand-in: the first {mode} action branches into "
                                 f"{len(tokens)} tokens, expected one per worker ({workers})")
            out.append((ids + prefix, tokens))
        return out

    return contexts


def pad_rows(rows: Sequence[Sequence[int]], pad: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded ``tokens [N, L]``, ``mask [N, L]`` (L a multiple of `LENGTH_MULTIPLE`)
    and each row's last position ``[N]``."""
    length = -(-max(len(r) for r in rows) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    tokens = np.full((len(rows), length), pad, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = r, True
    return tokens, mask, np.asarray([len(r) - 1 for r in rows], np.int32)


def worker_inputs(records: Sequence[Record], contexts: WorkerContexts, pad: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``tokens [N, M, L]``, ``mask [N, M, L]``, ``last [N, M]`` of the worker-choice
    contexts (M modes) and the choice tokens ``[M, W]``; ValueError unless every question
    offers the same choice tokens per mode."""
    per_record = [list(contexts(r)) for r in records]
    modes = len(per_record[0])
    choices = [tuple(c) for _, c in per_record[0]]
    for r, ctx in zip(records, per_record, strict=True):
        if [tuple(c) for _, c in ctx] != choices:
            raise ValueError(f"stand-in: question {r.sample_id!r} offers other worker choice "
                             f"tokens than the first question ({choices})")
    tokens, mask, last = pad_rows([list(ids) for ctx in per_record for ids, _ in ctx], pad)
    n = len(records)
    return (tokens.reshape(n, modes, -1), mask.reshape(n, modes, -1), last.reshape(n, modes),
            np.asarray(choices, np.int32))


def targets(embeddings: np.ndarray, train: np.ndarray, *, dims: int, common: float,
            hidden: int, seed: int) -> np.ndarray:
    """Unit target directions ``[N, hidden]`` from encoder embeddings ``[N, E]`` (see the
    module doc); the mean and principal axes come from the rows in ``train`` only."""
    k = min(dims, hidden - 1, embeddings.shape[1], len(train) - 1)
    if k < 1:
        raise ValueError(f"stand-in: no principal component to distil (dims {dims}, hidden "
                         f"{hidden}, {len(train)} training questions)")
    mean = embeddings[train].mean(0)
    _, _, vt = np.linalg.svd(embeddings[train] - mean, full_matrices=False)
    coords = (embeddings - mean) @ vt[:k].T  # [N, k]
    coords /= np.sqrt(np.mean(np.square(coords[train])) * k)  # rms norm 1 over train rows
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((hidden, k + 1)))  # [D, k+1] orthonormal
    full = np.concatenate([coords, np.full((len(coords), 1), common)], axis=1)
    t = full @ basis.T
    return (t / np.linalg.norm(t, axis=1, keepdims=True)).astype(np.float32)


def decision_states(model: Qwen3, tokens: jax.Array, mask: jax.Array, last: jax.Array
                    ) -> jax.Array:
    """``h [B, D]`` fp32: the final-normed hidden state at each row's ``last`` position."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    h, _ = model.hidden_states(tokens, positions, mask, gather=last[:, None])
    return h[:, 0].astype(jnp.float32)


def mode_logprobs(model: Qwen3, h: jax.Array, firsts: jax.Array) -> jax.Array:
    """``log p(m | q) [B, 3]``: the constrained choice among the mode words' first tokens."""
    return choice_logprobs(model, h, firsts)


def choice_logprobs(model: Qwen3, h: jax.Array, choices: jax.Array) -> jax.Array:
    """``log p(c | state) [..., C]``: the constrained choice among the tokens ``choices
    [..., C]`` (broadcast against the leading dimensions of the states ``h [..., D]``)."""
    w = jnp.moveaxis(model.head_weight()[:, choices], 0, -1).astype(jnp.float32)  # [..., C, D]
    return jax.nn.log_softmax(jnp.sum(h[..., None, :] * w, axis=-1), axis=-1)


def _cos_loss(h: jax.Array, target: jax.Array) -> jax.Array:
    cos = jnp.sum(h * target, -1) / (jnp.linalg.norm(h, axis=-1) + 1e-6)
    return jnp.mean(1.0 - cos)


def _uniform_kl(logp: jax.Array) -> jax.Array:
    """mean KL(uniform || p) over rows of ``logp [..., C]``."""
    return jnp.mean(-jnp.log(logp.shape[-1]) - jnp.mean(logp, -1))


def objective(model: Qwen3, batch: dict[str, jax.Array], firsts: jax.Array,
              mode_weight: float, worker_weight: float, bc_weight: float = 0.0
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``L_align + mode_weight * L_mode + worker_weight * L_workers + bc_weight * L_bc``
    over a batch (module doc) and its parts. ``batch``: tokens, mask, last, target; for the
    worker terms, w_tokens ``[B, M, L]``, w_mask, w_last ``[B, M]`` and w_choices
    ``[B, M, W]`` (M worker contexts per question); for cloning, the demonstrations'
    d_tokens, d_mask, d_index, d_valid (`cloning.Rows.take`)."""
    h = decision_states(model, batch["tokens"], batch["mask"], batch["last"])
    align = _cos_loss(h, batch["target"])
    mode = _uniform_kl(mode_logprobs(model, h, firsts))
    parts = {"align": align, "mode": mode}
    total = align + mode_weight * mode
    if "w_tokens" in batch:
        b, m, length = batch["w_tokens"].shape
        hw = decision_states(model, batch["w_tokens"].reshape(b * m, length),
                             batch["w_mask"].reshape(b * m, length),
                             batch["w_last"].reshape(b * m)).reshape(b, m, -1)
        parts["worker_align"] = _cos_loss(hw, batch["target"][:, None, :])
        parts["worker"] = _uniform_kl(choice_logprobs(model, hw, batch["w_choices"]))
        total += worker_weight * (parts["worker_align"] + parts["worker"])
    if "d_tokens" in batch:
        parts["bc"] = cloning.loss(model, batch)
        total += bc_weight * parts["bc"]
    return total, parts


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything the stand-in is trained and judged on (host arrays, ``N`` questions)."""

    tokens: np.ndarray  # [N, L] int32
    mask: np.ndarray  # [N, L] bool
    last: np.ndarray  # [N] int32
    firsts: tuple[int, ...]  # the three mode words' first tokens
    target: np.ndarray  # [N, D] unit f32
    domains: np.ndarray  # [N] str, for the diagnostics only
    train: np.ndarray  # row indices trained on
    held: np.ndarray  # row indices kept for the diagnostics
    # The worker-choice contexts (None without them): [N, M, Lw], [N, M, Lw], [N, M], [M, W]
    w_tokens: np.ndarray | None = None
    w_mask: np.ndarray | None = None
    w_last: np.ndarray | None = None
    worker_choices: np.ndarray | None = None
    # The demonstrations (None without them) and which of their rows are trained on / held
    demos: cloning.Rows | None = None
    demo_train: np.ndarray | None = None
    demo_held: np.ndarray | None = None

    def batch(self, rows: np.ndarray, rng: np.random.Generator | None = None
              ) -> dict[str, np.ndarray]:
        """The objective's arrays for question rows ``rows``: with `rng`, one worker context
        per question (a mode drawn uniformly; a third of the cost of all three), else all."""
        out = {"tokens": self.tokens[rows], "mask": self.mask[rows], "last": self.last[rows],
               "target": self.target[rows]}
        if self.w_tokens is not None:
            assert self.w_mask is not None and self.w_last is not None
            assert self.worker_choices is not None
            modes = self.w_tokens.shape[1]
            pick = rng.integers(0, modes, (len(rows), 1)) if rng is not None \
                else np.broadcast_to(np.arange(modes), (len(rows), modes))
            r = np.asarray(rows)[:, None]
            out.update(w_tokens=self.w_tokens[r, pick], w_mask=self.w_mask[r, pick],
                       w_last=self.w_last[r, pick], w_choices=self.worker_choices[pick])
        return out


def split(n: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-out, train) row indices of ``n`` questions, sorted (a seeded permutation)."""
    order = np.random.default_rng(seed).permutation(n)
    n_held = round(holdout * n)
    return np.sort(order[:n_held]), np.sort(order[n_held:])


def demo_questions(records: Sequence[Record], settings: Any, seed: int
                   ) -> tuple[list[Record], list[Record]]:
    """The questions demonstrated: ``settings.demonstrations`` of the training split (a
    seeded draw) and up to `HELD_DEMOS` held-out ones, for the diagnostics."""
    held, train = split(len(records), settings.holdout, seed)
    pick = np.random.default_rng(seed + 2).permutation(train)[:settings.demonstrations]
    return [records[i] for i in pick], [records[i] for i in held[:HELD_DEMOS]]


def build_inputs(tokenizer: Any, records: Sequence[Record], embeddings: np.ndarray, *,
                 hidden: int, settings: Any, seed: int,
                 worker_contexts: WorkerContexts | None = None,
                 demos: tuple[Sequence[Trajectory], Sequence[Trajectory]] | None = None
                 ) -> Inputs:
    """Tokenised decision prompts (and worker-choice contexts), targets, the train /
    held-out split (`split`) and the packed demonstrations (``demos``: those of training
    questions, those of held-out ones; `demo_questions`)."""
    tokens, mask, last, firsts = decision_inputs(tokenizer, [r.question for r in records])
    held, train = split(len(records), settings.holdout, seed)
    target = targets(embeddings, train, dims=settings.dims, common=settings.common,
                     hidden=hidden, seed=seed)
    domains = np.asarray([str(getattr(r.domain, "value", r.domain)) for r in records])
    pad = tokenizer.pad_token_id or 0
    workers = worker_inputs(records, worker_contexts, pad) \
        if worker_contexts is not None else (None, None, None, None)
    rows = demo_train = demo_held = None
    if demos is not None and len(demos[0]):
        rows = cloning.pack([*demos[0], *demos[1]], pad)
        demo_train = np.arange(len(demos[0]))
        demo_held = np.arange(len(demos[0]), len(demos[0]) + len(demos[1]))
    return Inputs(tokens, mask, last, tuple(firsts), target, domains, train, held, *workers,
                  rows, demo_train, demo_held)


def distil(model: Qwen3, inputs: Inputs, settings: Any, *, seed: int
           ) -> tuple[Qwen3, list[dict[str, float]]]:
    """Train ``model`` on the objective for ``settings.steps`` AdamW steps of
    ``settings.batch_size`` training questions (seeded order) and, with demonstrations,
    ``settings.bc_batch`` of them (`cloning.length_batches`, seeded). Returns the trained
    model and the per-step losses."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(settings.lr, weight_decay=0.0))
    opt_state = tx.init(params)
    firsts = jnp.asarray(inputs.firsts, jnp.int32)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]
             ) -> tuple[Any, Any, dict[str, jax.Array]]:
        def loss(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            return objective(nnx.merge(graphdef, p), batch, firsts, settings.mode_weight,
                             settings.worker_weight, settings.bc_weight)
        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value, **parts}

    rng = np.random.default_rng(seed + 1)
    batch = min(settings.batch_size, len(inputs.train))
    history, order, demo_batches = [], np.empty(0, np.int64), []
    for _ in range(settings.steps):
        if len(order) < batch:  # epochs of the training questions in a seeded order
            order = np.concatenate([order, rng.permutation(inputs.train)])
        rows, order = order[:batch], order[batch:]
        arrays = inputs.batch(rows, rng)
        if inputs.demos is not None and inputs.demo_train is not None:
            if not demo_batches:  # epochs of the demonstrations, batches of similar length
                demo_batches = cloning.length_batches(inputs.demos, inputs.demo_train,
                                                      settings.bc_batch, rng)
            arrays |= inputs.demos.take(demo_batches.pop())
        params, opt_state, out = step(params, opt_state, arrays)
        history.append({k: float(v) for k, v in out.items()})
    return nnx.merge(graphdef, params), history


@nnx.jit(static_argnames=("temperature",))
def _states(model: Qwen3, tokens: jax.Array, mask: jax.Array, last: jax.Array,
            choices: jax.Array, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    h = decision_states(model, tokens, mask, last)
    return h, choice_logprobs(model, h / temperature, choices)


def run_states(model: Qwen3, tokens: np.ndarray, mask: np.ndarray, last: np.ndarray,
               choices: np.ndarray, chunk: int, *, temperature: float = 1.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """States ``[N, D]`` at ``last`` and the log-probabilities ``[N, C]`` of the choice
    tokens ``choices [N, C]`` there (logits divided by ``temperature``), in fixed-size chunks
    (one compiled shape per architecture and row length)."""
    hs, lps = [], []
    for s in range(0, len(tokens), chunk):
        part = np.arange(s, min(s + chunk, len(tokens)))
        pad = np.concatenate([part, np.repeat(part[-1:], chunk - len(part))])
        h, lp = _states(model, tokens[pad], mask[pad], last[pad], choices[pad],
                        temperature=temperature)
        hs.append(np.asarray(h)[:len(part)])
        lps.append(np.asarray(lp)[:len(part)])
    return np.concatenate(hs), np.concatenate(lps)


def state_stats(h: np.ndarray, dom: np.ndarray, target: np.ndarray, h_train: np.ndarray,
                dom_train: np.ndarray, logp: np.ndarray) -> dict[str, Any]:
    """align, domain_share, probe, common (module doc) of held-out states ``h [N, D]`` and the
    choice distribution ``exp(logp) [N, C]`` (mean, max, entropy over log C)."""
    unit = h / np.linalg.norm(h, axis=1, keepdims=True)
    names = sorted(set(dom_train))
    centroids = np.stack([h_train[dom_train == d].mean(0) for d in names])
    nearest = np.asarray(names)[np.argmin(
        ((h[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)]
    total = np.sum((h - h.mean(0)) ** 2)
    between = sum(np.sum(dom == d) * np.sum((h[dom == d].mean(0) - h.mean(0)) ** 2)
                  for d in set(dom))
    p = np.exp(logp)
    return {
        "questions": len(h),
        "align": float(np.mean(np.sum(unit * target, 1))),
        "domain_share": float(between / total) if total > 0 else 0.0,
        "probe": float(np.mean(nearest == dom)),
        "common": float(np.sum(h.mean(0) ** 2) / np.mean(np.sum(h ** 2, 1))),
        "p_mean": [float(v) for v in p.mean(0)],
        "p_max": float(p.max()),
        "entropy": float(np.mean(-(p * logp).sum(1)) / np.log(p.shape[1])),
    }


def diagnostics(model: Qwen3, inputs: Inputs, *, chunk: int = 64) -> dict[str, Any]:
    """The module doc's diagnostics on the held-out questions (all questions if none held):
    the mode decision's (``mode_p_*`` / ``mode_entropy`` for its choice), under ``workers``
    the worker choices' pooled over the modes, and ``bc_nll`` of the held-out
    demonstrations (the last two when the inputs have them)."""
    rows = inputs.held if len(inputs.held) else inputs.train
    firsts = np.broadcast_to(np.asarray(inputs.firsts, np.int32), (len(inputs.tokens), 3))

    def run(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return run_states(model, inputs.tokens[idx], inputs.mask[idx], inputs.last[idx],
                          firsts[idx], chunk)

    h, logp = run(rows)
    h_train, _ = run(inputs.train)
    stats = state_stats(h, inputs.domains[rows], inputs.target[rows], h_train,
                        inputs.domains[inputs.train], logp)
    out = {k: v for k, v in stats.items() if k not in ("p_mean", "p_max", "entropy")}
    out.update(mode_p_mean=stats["p_mean"], mode_p_max=stats["p_max"],
               mode_entropy=stats["entropy"])
    if inputs.w_tokens is not None:
        assert inputs.w_mask is not None and inputs.w_last is not None
        assert inputs.worker_choices is not None
        modes = inputs.w_tokens.shape[1]

        def run_workers(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            flat = (len(idx) * modes, -1)
            choices = np.broadcast_to(inputs.worker_choices[None],
                                      (len(idx), *inputs.worker_choices.shape))
            return run_states(model, inputs.w_tokens[idx].reshape(flat),
                              inputs.w_mask[idx].reshape(flat),
                              inputs.w_last[idx].reshape(-1), choices.reshape(flat), chunk)

        hw, logpw = run_workers(rows)
        hw_train, _ = run_workers(inputs.train)
        out["workers"] = state_stats(
            hw, np.repeat(inputs.domains[rows], modes),
            np.repeat(inputs.target[rows], modes, axis=0), hw_train,
            np.repeat(inputs.domains[inputs.train], modes), logpw)
    if inputs.demos is not None and inputs.demo_held is not None and len(inputs.demo_held):
        out["bc_nll"] = demo_nll(model, inputs.demos, inputs.demo_held)
    return out


@nnx.jit
def _demo_nll(model: Qwen3, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return cloning.nll(model, batch)


def demo_nll(model: Qwen3, demos: cloning.Rows, rows: np.ndarray, chunk: int = 8) -> float:
    """Mean negative log-likelihood per decision token of the demonstrations ``rows``."""
    total, count = 0.0, 0.0
    for batch in cloning.length_batches(demos, rows, chunk, np.random.default_rng(0)):
        t, c = _demo_nll(model, demos.take(batch))
        total, count = total + float(t), count + float(c)
    return total / max(count, 1.0)


def cache_key(config: ModelConfig, tokenizer: Any, records: Sequence[Record],
              settings: Any, seed: int, worker_contexts: WorkerContexts | None = None,
              demonstrate: Demonstrate | None = None) -> str:
    """A hex key of everything the stand-in depends on (see the module doc); the worker
    contexts enter through the first question's (the rulebook, catalog and grammar are the
    same for every question, whose texts are keyed already), the demonstrations through
    those of the first `FINGERPRINT_DEMOS` questions (their tokens follow the environment,
    the pool's replies and the scripts)."""
    cfg = dataclasses.asdict(config)
    fields = {k: v for k, v in dataclasses.asdict(settings).items() if k != "cache_dir"}
    contexts = None if worker_contexts is None or not records else \
        [[list(ids), list(choices)] for ids, choices in worker_contexts(records[0])]
    parts = [json.dumps(cfg, sort_keys=True, default=str),
             json.dumps(sorted(tokenizer.get_vocab().items())),
             json.dumps([r.question for r in records]),
             json.dumps(fields, sort_keys=True), str(seed), str(VERSION),
             json.dumps(contexts)]
    if demonstrate is not None and settings.demonstrations > 0:
        demos = demonstrate(records[:FINGERPRINT_DEMOS])
        parts.append(json.dumps([[t.prompt_ids, t.response_ids, t.policy_mask] for t in demos]))
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


def ensure_stand_in(config: ModelConfig, build: Callable[[], Qwen3], tokenizer: Any,
                    records: Sequence[Record], settings: Any, *, seed: int,
                    worker_contexts: WorkerContexts | None = None,
                    demonstrate: Demonstrate | None = None,
                    log: Callable[[str], None] | None = None) -> Path:
    """The cached stand-in's HF directory for the random-init router of architecture
    ``config`` (``build()`` makes that router, called only when the cache misses; the
    stand-in is distilled from it and saved atomically). ``worker_contexts``: the first
    worker choice's contexts per mode (None: the mode decision only). ``demonstrate``:
    demonstrated episodes of given questions (None, or ``settings.demonstrations`` 0: no
    cloning). ``log(str)`` gets progress."""
    say = log or (lambda _msg: None)
    root = cache_root(settings.cache_dir)
    path = root / cache_key(config, tokenizer, records, settings, seed, worker_contexts,
                            demonstrate)
    if (path / REPORT_FILE).is_file():
        say(f"stand-in: reusing {path}")
        return path
    model = build()
    t0 = time.perf_counter()
    say(f"stand-in: distilling {len(records)} questions' encoder embeddings into the router "
        f"({settings.steps} steps; cached in {path})")
    embeddings = Embedder(cache_dir=root / "embeddings").embed([r.question for r in records])
    demos = None
    if demonstrate is not None and settings.demonstrations > 0:
        train_q, held_q = demo_questions(records, settings, seed)
        demos = (demonstrate(train_q), demonstrate(held_q))
        say(f"stand-in: {len(demos[0])} demonstrated episodes to clone "
            f"({len(demos[1])} held out)")
    inputs = build_inputs(tokenizer, records, embeddings, hidden=model.config.hidden_size,
                          settings=settings, seed=seed, worker_contexts=worker_contexts,
                          demos=demos)
    before = diagnostics(model, inputs)
    trained, history = distil(model, inputs, settings, seed=seed)
    after = diagnostics(trained, inputs)
    report = {"version": VERSION, "seed": seed, "settings": dataclasses.asdict(settings),
              "seconds": round(time.perf_counter() - t0, 1), "before": before, "after": after,
              "loss_first": history[0], "loss_last": history[-1]}
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        save_hf(trained, tmp, tokenizer=tokenizer)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        try:
            tmp.rename(path)
        except OSError:  # another process finished the same key first: keep theirs
            if not (path / REPORT_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"stand-in: built in {report['seconds']} s; held-out decision states: domain share "
        f"{before['domain_share']:.3f} -> {after['domain_share']:.3f}, probe "
        f"{before['probe']:.2f} -> {after['probe']:.2f}, mode p max {after['mode_p_max']:.2f}")
    if "workers" in after:
        w0, w1 = before["workers"], after["workers"]
        say(f"stand-in: worker-choice states: common {w0['common']:.3f} -> "
            f"{w1['common']:.3f}, align {w0['align']:.2f} -> {w1['align']:.2f}, worker p max "
            f"{w1['p_max']:.2f}")
    if "bc_nll" in after:
        say(f"stand-in: held-out demonstrations' decision tokens: nll {before['bc_nll']:.2f} "
            f"-> {after['bc_nll']:.2f} nats")
    return path


def read_report(path: Path) -> dict[str, Any]:
    """The stand-in's `stand_in.json` (settings, timings, diagnostics before and after)."""
    return json.loads((path / REPORT_FILE).read_text())
