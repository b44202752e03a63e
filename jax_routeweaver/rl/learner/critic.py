"""The critic of Router-R1's PPO (docs/router_r1.md, "PPO with a critic"): a value per policy
token.

Router-R1's critic is the policy's base model with a one-output token-classification head. Here
it is a copy of the policy's backbone (its initial weights) and a linear head on the final-normed
hidden state, ``V = h · w + b``, zero-initialised so the first values are 0. The value of the
policy token at position i is read from the hidden state at i − 1, the state the token was
sampled from (as the policy's logprob is).

The loss is PPO's clipped value loss, a token mean over the mini-batch (global denominator, so
micro-batches add up exactly):

    V_clip = V_old + clip(V − V_old, −c, c)
    L_V    = ½ · Σ_tokens max((V − R)², (V_clip − R)²) / N_tokens

``R`` the GAE returns (``rl/core/gae.py``), ``c`` ``value_clip``. The critic has its own AdamW
(``lr``, ``weight_decay``, ``grad_clip``) and steps with the policy's mini-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_routeweaver.config import bounded
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import to_host
from jax_routeweaver.rl.learner.learner_config import OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, make_optimizer, opt_shardings


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The critic's optimizer and value clip (Router-R1: lr 1e-5, clip 0.5, grad clip 1.0;
    veRL's AdamW defaults otherwise). Used with ``algo.estimator: ppo_gae`` only."""

    lr: float = bounded(1e-5, "(0, inf)")  # the critic's AdamW learning rate
    value_clip: float = bounded(0.5, "(0, inf)")  # |V − V_old| bound of the clipped loss
    grad_clip: float = bounded(1.0, "[0, inf)")  # global grad-norm clip; 0 = off
    weight_decay: float = bounded(0.01, "[0, inf)")  # AdamW's decoupled weight decay

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.value_clip > 0):
            raise ValueError(f"algo.critic.lr={self.lr} and value_clip={self.value_clip} "
                             "must be > 0")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"algo.critic.grad_clip={self.grad_clip} and weight_decay="
                             f"{self.weight_decay} must be >= 0")


class CriticState(NamedTuple):
    """The critic's train state (a pytree): params ``{"backbone": nnx.State, "head":
    {"w": [D], "b": []}}`` (fp32), optax state and step count."""

    params: Any
    opt_state: Any
    step: jax.Array


class Critic:
    """Values and updates of the critic, batched like the policy's `Trainer` (``batching``:
    its micro-batch size, mini-batches and row placement)."""

    def __init__(self, model: Qwen3, cfg: CriticConfig, *, batching: Trainer):
        self.cfg, self.batching = cfg, batching
        graphdef, backbone = nnx.split(model, nnx.Param)
        self.graphdef = graphdef
        hidden = model.config.hidden_size
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        head = {"w": jnp.zeros((hidden,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
        if batching.mesh is not None:  # replicated, as the backbone's arrays are placed
            head = jax.device_put(head, NamedSharding(batching.mesh, P()))
        params = {"backbone": copy(backbone), "head": head}
        self.tx = make_optimizer(OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             grad_clip=cfg.grad_clip))
        shardings = opt_shardings(self.tx, params, batching.mesh)
        opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        self.state = CriticState(params, opt_state, jnp.zeros((), jnp.int32))
        self._values = jax.jit(self._values_impl)
        self._grads = jax.jit(self._grads_impl)
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0,))

    # ------------------------------------------------------------------ public
    def values(self, tokens: np.ndarray, positions: np.ndarray, attention_mask: np.ndarray,
               index: np.ndarray) -> np.ndarray:
        """Values ``[N, P]`` (fp32, host) of the tokens at ``index [N, P]``; inputs
        ``[N, L]``, N a multiple of the policy's micro-batch size."""
        m = self.batching.micro_batches(tokens.shape[0])
        args = [self.batching.place_rows(a, m) for a in (tokens, positions, attention_mask, index)]
        return to_host(self._values(self.state.params, *args)).reshape(tokens.shape[0], -1)

    def update(self, tokens: np.ndarray, positions: np.ndarray, attention_mask: np.ndarray,
               index: np.ndarray, mask: np.ndarray, returns: np.ndarray,
               old_values: np.ndarray) -> dict[str, float]:
        """One optimizer step per policy mini-batch (× ppo_epochs) on the clipped value loss
        over ``mask [N, P]`` (the entries that train). Returns ``critic/*`` means over the
        steps: ``vf_loss``, ``vf_clipfrac`` (share of tokens where the clipped term is the
        larger), ``grad_norm``."""
        loss = self.batching.loss_cfg
        rows = np.arange(tokens.shape[0]).reshape(loss.ppo_mini_batches, -1)
        per_step = []
        for _ in range(loss.ppo_epochs):
            for part in rows:
                m = self.batching.micro_batches(len(part))
                arrays = [self.batching.place_rows(np.asarray(a)[part], m) for a in (
                    tokens, positions, attention_mask, index, mask, returns, old_values)]
                n_tokens = jnp.maximum(jnp.float32(np.asarray(mask)[part].sum()), 1.0)
                grads, stats = self._grads(self.state.params, *arrays, n_tokens)
                self.state, metrics = self._apply(self.state, grads, stats)
                per_step.append(jax.tree.map(to_host, metrics))
        return {k: float(np.mean([s[k] for s in per_step])) for k in per_step[0]}

    # ------------------------------------------------------------------ jitted
    def _value_fn(self, params: Any, tokens: jax.Array, positions: jax.Array,
                  mask: jax.Array, index: jax.Array) -> jax.Array:
        """``[B, P]`` values from the hidden states at ``index − 1``."""
        model = nnx.merge(self.graphdef, params["backbone"])
        h, _ = model.hidden_states(tokens, positions, mask, gather=jnp.maximum(index - 1, 0))
        head = params["head"]
        return jnp.einsum("bpd,d->bp", h.astype(jnp.float32), head["w"]) + head["b"]

    def _values_impl(self, params: Any, tokens: jax.Array, positions: jax.Array,
                     mask: jax.Array, index: jax.Array) -> jax.Array:
        return jax.lax.map(lambda xs: self._value_fn(params, *xs),
                           (tokens, positions, mask, index))

    def _micro_loss(self, params: Any, mb: tuple[jax.Array, ...], n_tokens: jax.Array
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens, positions, attention, index, mask, returns, old = mb
        v = self._value_fn(params, tokens, positions, attention, index)
        clipped = old + jnp.clip(v - old, -self.cfg.value_clip, self.cfg.value_clip)
        plain_sq, clipped_sq = (v - returns) ** 2, (clipped - returns) ** 2
        loss = 0.5 * (jnp.maximum(plain_sq, clipped_sq) * mask).sum() / n_tokens
        clipfrac = ((clipped_sq > plain_sq) * mask).sum() / n_tokens
        return loss, {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac}

    def _grads_impl(self, params: Any, *arrays_and_count: jax.Array
                    ) -> tuple[Any, dict[str, jax.Array]]:
        *arrays, n_tokens = arrays_and_count
        grad_fn = jax.grad(self._micro_loss, has_aux=True)

        def body(acc: Any, mb: tuple[jax.Array, ...]) -> tuple[Any, dict[str, jax.Array]]:
            g, stats = grad_fn(params, mb, n_tokens)
            return jax.tree.map(jnp.add, acc, g), stats

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, stats = jax.lax.scan(body, zeros, tuple(arrays))
        return grads, jax.tree.map(jnp.sum, stats)  # each micro-batch holds its share

    def _apply_impl(self, state: CriticState, grads: Any, stats: dict[str, jax.Array]
                    ) -> tuple[CriticState, dict[str, jax.Array]]:
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return CriticState(params, opt_state, state.step + 1), \
            stats | {"critic/grad_norm": optax.tree.norm(grads)}
