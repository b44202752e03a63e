"""The learned single-round baselines: kNN and MLP routers over query embeddings.

`KNNRouter(k)`, `MLPRouter`: over all-MiniLM-L6-v2 query embeddings
(`models.sentence_encoder`), fitted on the outcomes (`eval.worker_outcomes`) of TRAINING
records only. kNN: p̂_w = success rate of w over the k most cosine-similar training queries
(infra cells left out), ĉ_w = their mean cost of w. MLP: standardised 384-d input -> 128 (ReLU)
-> W logits, p̂ = sigmoid, masked BCE + L2, Adam, fixed seed; ĉ_w = mean training cost of w.
Both choose argmax_w p̂_w − λ·ĉ_w (λ = `lambda_cost`, per USD; 0 = accuracy routing; a call
costs about 1e-5..1e-3 USD, so λ matters from about 1e3); ties go to the lower ĉ, then to
catalog order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_routeweaver.data.records import Record
from jax_routeweaver.eval.worker_outcomes import WorkerOutcomes
from jax_routeweaver.models.sentence_encoder import Embedder

__all__ = ["KNNRouter", "MLPRouter"]


def _pick(p_success: np.ndarray, cost: np.ndarray, lambda_cost: float) -> np.ndarray:
    """argmax_w p̂ − λ ĉ per row [N]; ties -> lower ĉ, then the lower column."""
    score = p_success - lambda_cost * cost
    tied = score >= score.max(axis=1, keepdims=True) - 1e-12
    return np.argmin(np.where(tied, cost, np.inf), axis=1)


def _training_targets(outcomes: WorkerOutcomes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels float32 [R, W], valid mask float32 [R, W], cost USD float64 [R, W]).

    Infra cells (failed call or grading error) are masked: the worker was never judged."""
    return (outcomes.correct.astype(np.float32), (~outcomes.infra).astype(np.float32),
            outcomes.cost_usd.astype(np.float64))


def _masked_mean(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Per-column mean over valid cells [W] (0 where a column has none)."""
    return (values * valid).sum(0) / np.maximum(valid.sum(0), 1.0)


class _EmbeddingRouter:
    """Shared plumbing of the learned routers: embed questions, fit on training outcomes."""

    def __init__(self, embedder: Embedder, lambda_cost: float, name: str) -> None:
        if not lambda_cost >= 0:
            raise ValueError(f"{type(self).__name__}: lambda_cost={lambda_cost} must be >= 0")
        self.embedder, self.lambda_cost, self.name = embedder, float(lambda_cost), name
        self.workers: tuple[str, ...] = ()
        # sample_ids of the training records: evaluation asserts it misses every eval record.
        self.trained_on: frozenset[str] = frozenset()

    def _embed(self, records: Sequence[Record]) -> np.ndarray:
        return np.asarray(self.embedder.embed([r.question for r in records]), np.float32)

    def fit(self, outcomes: WorkerOutcomes) -> _EmbeddingRouter:
        """Fit on the outcomes of TRAINING records; returns self."""
        if not outcomes.records:
            raise ValueError(f"{type(self).__name__}.fit: no training records")
        self._fit(self._embed(outcomes.records), *_training_targets(outcomes))
        self.workers = outcomes.workers
        self.trained_on = frozenset(r.sample_id for r in outcomes.records)
        return self

    def choose(self, records: Sequence[Record]) -> list[str]:
        """argmax_w p̂_w − λ ĉ_w per record (ties: lower ĉ, then catalog order)."""
        if not self.trained_on:
            raise RuntimeError(f"{type(self).__name__}: call fit(training outcomes) first")
        if not records:
            return []
        p_success, cost = self.predict(self._embed(records))
        return [self.workers[j] for j in _pick(p_success, cost, self.lambda_cost)]

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(p̂ success [N, W], ĉ cost USD [N, W]) for query embeddings [N, D]."""
        raise NotImplementedError

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        raise NotImplementedError


class KNNRouter(_EmbeddingRouter):
    """k-NN over unit query embeddings (cosine = dot product): p̂_w = Σ_n valid·correct /
    Σ_n valid over the k nearest training queries (equal similarities: earlier training record
    first), falling back to w's training success rate when no neighbour judged w; ĉ_w = the
    neighbours' mean cost of w (same fallback)."""

    def __init__(self, embedder: Embedder, k: int = 10, *, lambda_cost: float = 0.0,
                 name: str = "knn") -> None:
        super().__init__(embedder, lambda_cost, name)
        if k < 1:
            raise ValueError(f"KNNRouter: k={k} must be >= 1")
        self.k = k

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        self._x, self._labels, self._valid, self._cost = x, labels, valid, cost
        self._prior = _masked_mean(labels, valid)
        self._mean_cost = _masked_mean(cost, valid)

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = min(self.k, len(self._x))
        sims = queries @ self._x.T  # [N, R]
        nearest = np.argsort(-sims, axis=1, kind="stable")[:, :k]  # [N, k]
        valid = self._valid[nearest]  # [N, k, W]
        n_valid = valid.sum(1)  # [N, W]
        judged = n_valid > 0
        p = np.where(judged, (self._labels[nearest] * valid).sum(1) / np.maximum(n_valid, 1),
                     self._prior)
        cost = np.where(judged, (self._cost[nearest] * valid).sum(1) / np.maximum(n_valid, 1),
                        self._mean_cost)
        return p, cost


class MLPRouter(_EmbeddingRouter):
    """Per-worker success probability from a small MLP (JAX + optax), full-batch training.

    p̂ = sigmoid(W2 · relu(W1 x + b1) + b2), x the query embedding [D] standardised per
    dimension with the training queries' mean and std, -> [W];
    loss = Σ valid · BCE(p̂, correct) / Σ valid + l2/2 · (‖W1‖² + ‖W2‖²);
    `steps` full-batch Adam steps at `learning_rate`; init from `seed` (deterministic).
    The labels are single noisy draws per (query, worker): without the L2 term the MLP
    memorises them and routes worse (measured on the simulated pool).
    ĉ_w = mean training cost of w (the MLP predicts success only).
    """

    def __init__(self, embedder: Embedder, *, hidden: int = 128, steps: int = 300,
                 learning_rate: float = 3e-3, l2: float = 0.1, seed: int = 0,
                 lambda_cost: float = 0.0, name: str = "mlp") -> None:
        super().__init__(embedder, lambda_cost, name)
        if hidden < 1 or steps < 1 or not learning_rate > 0 or not l2 >= 0:
            raise ValueError(f"MLPRouter: need hidden >= 1, steps >= 1, learning_rate > 0, "
                             f"l2 >= 0; got {hidden}, {steps}, {learning_rate}, {l2}")
        self.hidden, self.steps = hidden, steps
        self.learning_rate, self.l2, self.seed = learning_rate, l2, seed
        self.final_loss: float | None = None

    def _fit(self, x: np.ndarray, labels: np.ndarray, valid: np.ndarray,
             cost: np.ndarray) -> None:
        # Standardise each embedding dimension on the training queries: unit-norm 384-d
        # vectors have entries around 0.05, which would make the L2 term dominate.
        self._mean = x.mean(0)
        self._scale = x.std(0) + 1e-6
        self._params, self.final_loss = _train_mlp(
            (x - self._mean) / self._scale, labels, valid, hidden=self.hidden, steps=self.steps,
            learning_rate=self.learning_rate, l2=self.l2, seed=self.seed)
        self._mean_cost = _masked_mean(cost, valid)

    def predict(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.asarray(_mlp_probs(self._params, (queries - self._mean) / self._scale),
                       np.float64)
        return p, np.broadcast_to(self._mean_cost, p.shape)


def _mlp_logits(params: Mapping[str, Any], x: Any) -> Any:
    import jax.numpy as jnp

    hidden = jnp.maximum(x @ params["w1"] + params["b1"], 0.0)
    return hidden @ params["w2"] + params["b2"]


def _mlp_probs(params: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    import jax

    return np.asarray(jax.nn.sigmoid(_mlp_logits(params, x)))


def _train_mlp(x: np.ndarray, labels: np.ndarray, valid: np.ndarray, *, hidden: int,
               steps: int, learning_rate: float, l2: float, seed: int
               ) -> tuple[dict[str, Any], float]:
    """Full-batch Adam on the masked BCE + L2 (MLPRouter doc); returns (params, final
    data loss)."""
    import jax
    import jax.numpy as jnp
    import optax

    n_in, n_out = x.shape[1], labels.shape[1]
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    # He init for the ReLU layer, Glorot for the output: a standard, stable start.
    params = {
        "w1": jax.random.normal(k1, (n_in, hidden), jnp.float32) * jnp.sqrt(2.0 / n_in),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, n_out), jnp.float32)
        * jnp.sqrt(2.0 / (hidden + n_out)),
        "b2": jnp.zeros((n_out,), jnp.float32),
    }
    tx = optax.adam(learning_rate)
    xs, ys, ms = (jnp.asarray(a, jnp.float32) for a in (x, labels, valid))
    denominator = jnp.maximum(ms.sum(), 1.0)

    def loss_fn(p: dict[str, Any]) -> tuple[Any, Any]:
        bce = optax.sigmoid_binary_cross_entropy(_mlp_logits(p, xs), ys)
        data = (bce * ms).sum() / denominator
        return data + 0.5 * l2 * ((p["w1"] ** 2).sum() + (p["w2"] ** 2).sum()), data

    def step(carry: tuple[Any, Any], _: Any) -> tuple[tuple[Any, Any], Any]:
        p, opt_state = carry
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), loss

    @jax.jit
    def train(p: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        (p, _), losses = jax.lax.scan(step, (p, tx.init(p)), None, length=steps)
        return p, losses[-1]

    params, last = train(params)
    return jax.device_get(params), float(last)
