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

``L = L_align + mode_weight * L_mode``, minimised by AdamW over all the router's weights.
The result is an HF directory cached under ``cache_dir/<key>/`` where the key hashes the
architecture, the tokenizer's vocabulary, the question texts, the `StandInSection` fields, the
seed and `VERSION`; a later run with the same inputs loads it instead of training.

Diagnostics (`stand_in.json`, from held-out questions, with the random init's for
comparison): ``align`` (mean cosine to the target), ``domain_share`` (share of the decision
state's variance between domain means; the domains are used here only, never in training),
``probe`` (nearest-domain-centroid accuracy, centroids from the train split), ``common``
(|mean h|^2 / mean |h|^2), and the mode distribution (mean, the largest probability any
question gives one mode, mean entropy over log 3).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
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
from jax_routeweaver.routing import grammar as g
from jax_routeweaver.routing import prompts

VERSION = 1  # bump when the objective changes: old caches are then not reused
REPORT_FILE = "stand_in.json"
LENGTH_MULTIPLE = 64  # prompts are padded to one length, a multiple of this


def cache_root(configured: str) -> Path:
    """``configured``, else ``$ROUTEWEAVER_CACHE/stand_in``, else
    ``~/.cache/jax_routeweaver/stand_in``."""
    if configured:
        return Path(configured)
    base = os.environ.get("ROUTEWEAVER_CACHE")
    return Path(base) / "stand_in" if base else \
        Path.home() / ".cache" / "jax_routeweaver" / "stand_in"


def decision_inputs(tokenizer: Any, questions: Sequence[str]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Right-padded ``tokens [N, L]``, ``mask [N, L]``, ``last [N]`` (the decision position:
    the selector prompt followed by the declarations' common prefix) and the three mode
    words' first token ids (single, multi, agentic; must differ, else ValueError)."""
    decls = [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
             for m in g.MODES]
    common = 0
    while all(len(d) > common and d[common] == decls[0][common] for d in decls):
        common += 1
    firsts = [d[common] for d in decls]
    if len(set(firsts)) != len(firsts):
        raise ValueError(f"the mode declarations' first differing tokens {firsts} are not "
                         "distinct: the stand-in's mode term needs one choice position")
    rows = [prompts.selector_prompt_ids(tokenizer, q) + decls[0][:common] for q in questions]
    length = -(-max(len(r) for r in rows) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    pad = tokenizer.pad_token_id or 0
    tokens = np.full((len(rows), length), pad, np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], mask[i, :len(r)] = r, True
    last = np.asarray([len(r) - 1 for r in rows], np.int32)
    return tokens, mask, last, firsts


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
    w = model.head_weight()[:, firsts].astype(jnp.float32)  # [D, 3]
    return jax.nn.log_softmax(h @ w, axis=-1)


def objective(model: Qwen3, tokens: jax.Array, mask: jax.Array, last: jax.Array,
              target: jax.Array, firsts: jax.Array, mode_weight: float
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``L_align + mode_weight * L_mode`` over a batch (module doc) and its two parts."""
    h = decision_states(model, tokens, mask, last)
    cos = jnp.sum(h * target, -1) / (jnp.linalg.norm(h, axis=-1) + 1e-6)
    align = jnp.mean(1.0 - cos)
    mode = jnp.mean(-jnp.log(3.0) - jnp.mean(mode_logprobs(model, h, firsts), -1))
    return align + mode_weight * mode, {"align": align, "mode": mode}


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


def build_inputs(tokenizer: Any, records: Sequence[Record], embeddings: np.ndarray, *,
                 hidden: int, settings: Any, seed: int) -> Inputs:
    """Tokenised decision prompts, targets and the train / held-out split (seeded)."""
    tokens, mask, last, firsts = decision_inputs(tokenizer, [r.question for r in records])
    order = np.random.default_rng(seed).permutation(len(records))
    n_held = round(settings.holdout * len(records))
    held, train = np.sort(order[:n_held]), np.sort(order[n_held:])
    target = targets(embeddings, train, dims=settings.dims, common=settings.common,
                     hidden=hidden, seed=seed)
    domains = np.asarray([str(getattr(r.domain, "value", r.domain)) for r in records])
    return Inputs(tokens, mask, last, tuple(firsts), target, domains, train, held)


def distil(model: Qwen3, inputs: Inputs, settings: Any, *, seed: int
           ) -> tuple[Qwen3, list[dict[str, float]]]:
    """Train ``model`` on the objective for ``settings.steps`` AdamW steps of
    ``settings.batch_size`` training questions (seeded order). Returns the trained model and
    the per-step losses."""
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(settings.lr, weight_decay=0.0))
    opt_state = tx.init(params)
    firsts = jnp.asarray(inputs.firsts, jnp.int32)

    @jax.jit
    def step(params: Any, opt_state: Any, tokens: jax.Array, mask: jax.Array, last: jax.Array,
             target: jax.Array) -> tuple[Any, Any, dict[str, jax.Array]]:
        def loss(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            return objective(nnx.merge(graphdef, p), tokens, mask, last, target, firsts,
                             settings.mode_weight)
        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value, **parts}

    rng = np.random.default_rng(seed + 1)
    batch = min(settings.batch_size, len(inputs.train))
    history, order = [], np.empty(0, np.int64)
    for _ in range(settings.steps):
        if len(order) < batch:  # epochs of the training questions in a seeded order
            order = np.concatenate([order, rng.permutation(inputs.train)])
        rows, order = order[:batch], order[batch:]
        params, opt_state, out = step(params, opt_state, inputs.tokens[rows],
                                      inputs.mask[rows], inputs.last[rows], inputs.target[rows])
        history.append({k: float(v) for k, v in out.items()})
    return nnx.merge(graphdef, params), history


def diagnostics(model: Qwen3, inputs: Inputs, *, chunk: int = 64) -> dict[str, Any]:
    """The module doc's diagnostics on the held-out questions (all questions if none held)."""
    rows = inputs.held if len(inputs.held) else inputs.train
    firsts = jnp.asarray(inputs.firsts, jnp.int32)

    @jax.jit
    def states(tokens: jax.Array, mask: jax.Array, last: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
        h = decision_states(model, tokens, mask, last)
        return h, mode_logprobs(model, h, firsts)

    def run(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hs, lps = [], []
        for s in range(0, len(idx), chunk):
            part = idx[s:s + chunk]
            pad = np.concatenate([part, np.repeat(part[-1:], chunk - len(part))])
            h, lp = states(inputs.tokens[pad], inputs.mask[pad], inputs.last[pad])
            hs.append(np.asarray(h)[:len(part)])
            lps.append(np.asarray(lp)[:len(part)])
        return np.concatenate(hs), np.concatenate(lps)

    h, logp = run(rows)
    h_train, _ = run(inputs.train)
    unit = h / np.linalg.norm(h, axis=1, keepdims=True)
    dom, dom_train = inputs.domains[rows], inputs.domains[inputs.train]
    names = sorted(set(dom_train))
    centroids = np.stack([h_train[dom_train == d].mean(0) for d in names])
    nearest = np.asarray(names)[np.argmin(
        ((h[:, None, :] - centroids[None]) ** 2).sum(-1), axis=1)]
    total = np.sum((h - h.mean(0)) ** 2)
    between = sum(np.sum(dom == d) * np.sum((h[dom == d].mean(0) - h.mean(0)) ** 2)
                  for d in set(dom))
    p = np.exp(logp)
    return {
        "questions": len(rows),
        "align": float(np.mean(np.sum(unit * inputs.target[rows], 1))),
        "domain_share": float(between / total) if total > 0 else 0.0,
        "probe": float(np.mean(nearest == dom)),
        "common": float(np.sum(h.mean(0) ** 2) / np.mean(np.sum(h ** 2, 1))),
        "mode_p_mean": [float(v) for v in p.mean(0)],
        "mode_p_max": float(p.max()),
        "mode_entropy": float(np.mean(-(p * logp).sum(1)) / np.log(3.0)),
    }


def cache_key(config: ModelConfig, tokenizer: Any, records: Sequence[Record],
              settings: Any, seed: int) -> str:
    """A hex key of everything the stand-in depends on (see the module doc)."""
    cfg = dataclasses.asdict(config)
    fields = {k: v for k, v in dataclasses.asdict(settings).items() if k != "cache_dir"}
    parts = [json.dumps(cfg, sort_keys=True, default=str),
             json.dumps(sorted(tokenizer.get_vocab().items())),
             json.dumps([r.question for r in records]),
             json.dumps(fields, sort_keys=True), str(seed), str(VERSION)]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


def ensure_stand_in(config: ModelConfig, build: Callable[[], Qwen3], tokenizer: Any,
                    records: Sequence[Record], settings: Any, *, seed: int,
                    log: Callable[[str], None] | None = None) -> Path:
    """The cached stand-in's HF directory for the random-init router of architecture
    ``config`` (``build()`` makes that router, called only when the cache misses; the
    stand-in is distilled from it and saved atomically). ``log(str)`` gets progress."""
    say = log or (lambda _msg: None)
    root = cache_root(settings.cache_dir)
    path = root / cache_key(config, tokenizer, records, settings, seed)
    if (path / REPORT_FILE).is_file():
        say(f"stand-in: reusing {path}")
        return path
    model = build()
    t0 = time.perf_counter()
    say(f"stand-in: distilling {len(records)} questions' encoder embeddings into the router "
        f"({settings.steps} steps; cached in {path})")
    embeddings = Embedder(cache_dir=root / "embeddings").embed([r.question for r in records])
    inputs = build_inputs(tokenizer, records, embeddings, hidden=model.config.hidden_size,
                          settings=settings, seed=seed)
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
    return path


def read_report(path: Path) -> dict[str, Any]:
    """The stand-in's `stand_in.json` (settings, timings, diagnostics before and after)."""
    return json.loads((path / REPORT_FILE).read_text())
