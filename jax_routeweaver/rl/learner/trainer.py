"""The learner: fp32 train state and one jitted, sharded, donated update per RL step.

One step (docs/algorithm.md, "The policy loss" through "Optimizer") on a packed
:class:`~jax_routeweaver.rl.learner.batch.RolloutBatch`:

1. ``ref_logp`` with the frozen reference params, micro-batch by micro-batch. ``old_logp``
   is recomputed by the trainer, not taken from the sampler (whose logprobs only feed the
   sampler-vs-trainer gap diagnostic). With one optimizer step per batch (ppo_epochs 1, one
   mini-batch, as the original runs) old = current params, so ``old_logp`` is the loss
   pass's own ``stop_gradient(logp)`` — the same numbers as a separate forward, one forward
   cheaper. With ``ppo_mini_batches`` / ``ppo_epochs`` > 1 (verl's ppo_mini_batch_size and
   ppo_epochs) it is one forward with the pre-update params, and the batch is split into
   contiguous mini-batches, each one optimizer step with its own token denominators;
2. per micro-batch, the policy loss parts (PPO dual clip, k3 KL, optional entropy) with
   **mini-batch-global** denominators, so gradients simply add up over micro-batches and one
   micro-batch equals eight (``losses.py`` contract);
3. optionally the minimum-support loss over the batch's queries, whose gradient joins the
   policy gradient before clipping (as the original's hook adds into ``.grad``);
4. optax: global-norm clip, AdamW.

Steps 2–4 are one ``jax.jit`` with params and optimizer state donated; micro-batches run
under ``lax.scan`` so the whole update is one dispatch. With ``loss.group_by_length`` each
mini-batch's rows are sorted by length and every micro-batch runs at its own length bucket
(:func:`length_bucket`): one jitted call per micro-batch accumulates into a donated gradient,
then one jitted call applies it. RL rows differ a lot in length (a single call against a
six-round agentic episode), so short rows stop paying for the longest; the gradient is the
same sum (global denominators), one compile per bucket instead of one per batch shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_routeweaver.models.qwen3 import (
    Qwen3,
    choice_logprobs,
    gathered_logprobs,
    token_logprobs,
)
from jax_routeweaver.models.sharding import TRAIN_RULES, Rules, logical_to_spec, to_host
from jax_routeweaver.rl.core import losses
from jax_routeweaver.rl.core.shapes import length_bucket
from jax_routeweaver.rl.core.support import SupportBatch, support_gradient
from jax_routeweaver.rl.learner.curriculum import ExplorationConfig
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig

GROUP_MIN_SAVING = 0.15
"""``group_by_length`` cuts a batch's micro-batches only when that saves at least this share of
its padded tokens; otherwise the one-dispatch scan runs. At equal work, ten separate calls cost
about 20 % more than one scan over ten micro-batches on CPU (bench/RESULTS.md, quickstart
eleventh round)."""


class TrainState(NamedTuple):
    """Everything a step changes (a pytree): params ``nnx.State`` (fp32), optax state,
    step count (int32 scalar) and the step RNG key (uint32 ``[2]``)."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


class UpdateBatch(NamedTuple):
    """Host arrays of one update, N rows (`RolloutBatch.for_update` builds it from a packed
    rollout). ``tokens, positions, attention_mask [N, L]``; ``clean [N]``; the per-token
    ``response_mask, mode_mask, advantages`` (and ``sampler_logp``, ``old_logp``) ``[N, L]``,
    or ``[N, P]`` at ``index [N, P]`` (the policy tokens' positions). ``old_logp``: the
    behaviour logprobs of the ratio (None: the current params', recomputed);
    ``sampler_logp``: the sampler's, read only by the sampler-vs-trainer gap diagnostic."""

    tokens: np.ndarray
    positions: np.ndarray
    attention_mask: np.ndarray
    response_mask: np.ndarray
    mode_mask: np.ndarray
    advantages: np.ndarray
    clean: np.ndarray
    index: np.ndarray | None = None
    sampler_logp: np.ndarray | None = None
    old_logp: np.ndarray | None = None

    def step_arrays(self, old_logp: np.ndarray | None, ref_logp: np.ndarray | None,
                    rows: np.ndarray | None = None) -> StepBatch:
        """The host arrays in :class:`StepBatch` order (rows ``rows``, default all), with
        the ratio's and the KL's logprobs."""
        pick = lambda a: None if a is None else np.asarray(a) if rows is None \
            else np.asarray(a)[rows]
        return StepBatch(*(pick(a) for a in (
            self.tokens, self.positions, self.attention_mask, self.index, self.response_mask,
            self.mode_mask, self.advantages, self.clean, old_logp, ref_logp)))


class StepBatch(NamedTuple):
    """Device arrays of one update, rows grouped as ``[M, mb, ...]`` (M micro-batches).
    ``tokens, positions, attention_mask [M, mb, L]``; ``index [M, mb, P]`` the positions
    whose logprobs the loss needs (None: all L, then P = L); the per-token arrays
    (``response_mask`` … ``ref_logp``) are ``[M, mb, P]``."""

    tokens: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    index: jax.Array | None
    response_mask: jax.Array
    mode_mask: jax.Array
    advantages: jax.Array
    clean: jax.Array
    old_logp: jax.Array | None
    ref_logp: jax.Array


HEAD, TRUNK = "head", "trunk"


def param_groups(params: Any) -> Any:
    """``params`` with each leaf replaced by its optimizer group: `HEAD` for the output head
    (``lm_head``; the tied ``embed`` when there is none), `TRUNK` for every other weight."""
    tops = {str(getattr(path[0], "key", "")) for path, _ in
            jax.tree_util.tree_flatten_with_path(params)[0]}
    head = "lm_head" if "lm_head" in tops else "embed"
    return jax.tree_util.tree_map_with_path(
        lambda path, _: HEAD if str(getattr(path[0], "key", "")) == head else TRUNK, params)


def scale_groups(factors: dict[str, float]) -> optax.GradientTransformation:
    """Multiply each update by its `param_groups` group's factor (stateless). After AdamW
    this equals a per-group learning rate: optax's ``adamw(lr)`` ends in ``-lr · u``, weight
    decay included. Unlike ``optax.multi_transform``, the optimizer state keeps the plain
    chain's structure, so the moments' shardings and a saved state do not depend on the
    factors."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        groups = param_groups(updates)
        return jax.tree.map(lambda u, group: u * factors[group], updates, groups), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clip, then AdamW (docs/algorithm.md, "Optimizer") at ``lr`` with linear
    warmup over ``warmup_steps``; with ``trunk_lr_scale`` != 1 the trunk's updates are
    scaled by it (`scale_groups`: the trunk at ``lr · trunk_lr_scale``, the head at ``lr``;
    the clip still sees the whole gradient)."""
    lr: float | optax.Schedule = cfg.lr
    if cfg.warmup_steps:
        lr = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    chain.append(optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    if cfg.trunk_lr_scale != 1.0:
        chain.append(scale_groups({HEAD: 1.0, TRUNK: cfg.trunk_lr_scale}))
    return optax.chain(*chain)


def opt_shardings(tx: optax.GradientTransformation, params: Any, mesh: Mesh | None) -> Any:
    """Shardings of ``tx.init(params)``: each moment as its parameter, the rest (step
    counts) replicated; None without a mesh (jit places them)."""
    if mesh is None:
        return None
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params),
                                 params, transform_non_params=lambda _: replicated)


DECLARATIONS = ExplorationConfig()  # the declaration terms' defaults (the paper's)


class Trainer:
    """Owns the train state of one policy and its frozen reference.

    ``model``: the policy (``nnx`` module, fp32 params; placed on ``mesh`` by the caller,
    e.g. ``create_sharded``). The reference params are a copy of the initial params unless
    ``reference`` is given. ``temperature``: logprobs are taken at the rollout temperature,
    as verl divides the actor's logits by it. ``declarations``: the declaration terms' weights
    and floors (``algo.exploration``: the minimum-support loss's λ0 and floor, the
    per-question floor; a run without ``algo.support`` passes λ0 = 0).
    """

    def __init__(self, model: Qwen3, optim: OptimConfig, loss: LossConfig, *,
                 temperature: float = 0.8, mesh: Mesh | None = None,
                 rules: Rules = TRAIN_RULES, seed: int = 0,
                 reference: nnx.State | None = None,
                 declarations: ExplorationConfig = DECLARATIONS):
        graphdef, params = nnx.split(model, nnx.Param)
        self._configure(graphdef, optim, loss, temperature, mesh, rules, declarations)
        # Copies: the step donates its state, which must never delete the caller's arrays
        # (a sampler built from the same module may share them).
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
        self.ref_params = copy(reference if reference is not None else params)
        params = copy(params)
        # Moments are born with their parameter's sharding: plain jit(tx.init) would put
        # the zeros on one device (they do not depend on the input's placement).
        opt_state = jax.jit(self.tx.init, out_shardings=self._opt_shardings(params))(params)
        step, rng = jnp.zeros((), jnp.int32), jax.random.key_data(jax.random.key(seed))
        if mesh is not None:
            # Placed as the update returns them (replicated): left on one device, the second
            # update would see new input shardings and compile the whole step again.
            step, rng = jax.device_put((step, rng), NamedSharding(mesh, P()))
        self.state = TrainState(params, opt_state, step, rng)

    @classmethod
    def for_shapes(cls, graphdef: Any, params: Any, optim: OptimConfig, loss: LossConfig, *,
                   temperature: float = 0.8, mesh: Mesh | None = None,
                   rules: Rules = TRAIN_RULES, reference: Any = None,
                   declarations: ExplorationConfig = DECLARATIONS) -> Trainer:
        """A trainer over abstract arrays, to compile and analyse (``lower_update``,
        ``lower_logprobs``), never to run. ``params``: the policy's ``nnx.State`` of
        ``jax.ShapeDtypeStruct`` carrying their shardings (``reference``: the frozen copy's,
        default the same). Adam's moments get their parameter's sharding, as in
        :meth:`__init__`."""
        self = cls.__new__(cls)
        self._configure(graphdef, optim, loss, temperature, mesh, rules, declarations)
        self.ref_params = params if reference is None else reference
        replicated = None if mesh is None else NamedSharding(mesh, P())
        shardings = self._opt_shardings(params)
        opt_state = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            jax.eval_shape(self.tx.init, params), shardings)
        self.state = TrainState(params, opt_state,
                                jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
                                jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated))
        return self

    def _opt_shardings(self, params: Any) -> Any:
        return opt_shardings(self.tx, params, self.mesh)

    def _configure(self, graphdef: Any, optim: OptimConfig, loss: LossConfig,
                   temperature: float, mesh: Mesh | None, rules: Rules,
                   declarations: ExplorationConfig) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        self.optim_cfg, self.loss_cfg, self.temperature = optim, loss, temperature
        self.declarations = declarations
        self.mesh, self.rules = mesh, rules
        if loss.micro_batch_size % self._shards():
            # Each micro-batch's rows are sharded over the batch axes.
            raise ValueError(f"loss.micro_batch_size={loss.micro_batch_size} must be a multiple "
                             f"of the batch shards (mesh data x fsdp = {self._shards()})")
        self.graphdef = graphdef
        self.tx = make_optimizer(optim)
        self._logprobs = jax.jit(self._logprobs_impl)
        static = ("with_support", "num_queries")
        self._update = jax.jit(self._update_impl, donate_argnums=(0,), static_argnames=static)
        self._grads = jax.jit(self._grads_impl, static_argnames=static)
        # group_by_length: per-micro-batch accumulation, then the shared tail.
        self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=(1,))
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0,), static_argnames=static)
        self._finish = jax.jit(self._finish_impl, static_argnames=static)

    # ------------------------------------------------------------------ public
    @property
    def step(self) -> int:
        return int(self.state.step)

    def model(self) -> Qwen3:
        """The current policy as a module (shares the state's arrays; do not mutate)."""
        return nnx.merge(self.graphdef, self.state.params)

    def micro_batches(self, rows: int) -> int:
        """How many micro-batches ``rows`` (already padded to the multiple) split into."""
        mb = self.loss_cfg.micro_batch_size or rows
        if rows % mb:
            raise ValueError(f"{rows} rows do not split into micro-batches of {mb}")
        return rows // mb

    def row_multiple(self) -> int:
        """Rows must be padded to a multiple of this: mini-batches × micro-batch size (itself
        a multiple of the batch shards; without micro-batching, the shards)."""
        mb = self.loss_cfg.micro_batch_size or self._shards()
        return mb * self.loss_cfg.ppo_mini_batches

    def _shards(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def logprobs(self, params: Any, tokens: np.ndarray, positions: np.ndarray,
                 attention_mask: np.ndarray, index: np.ndarray | None = None) -> jax.Array:
        """Logprobs at the rollout temperature, micro-batch by micro-batch (``lax.map``):
        ``[N, L]`` per token, or ``[N, P]`` at ``index [N, P]`` (see `gathered_logprobs`)."""
        groups = self.length_groups(attention_mask)
        if groups is not None:
            return self._grouped_logprobs(params, groups, tokens, positions, attention_mask,
                                          index)
        m = self.micro_batches(tokens.shape[0])
        args = [self.place_rows(a, m) for a in (tokens, positions, attention_mask)]
        idx = None if index is None else self.place_rows(index, m)
        out = self._logprobs(params, *args, idx)
        return out.reshape(tokens.shape[0], -1)

    def length_groups(self, attention_mask: np.ndarray) -> list[tuple[np.ndarray, int]] | None:
        """The micro-batches of ``group_by_length``: rows ``[N]`` sorted by length (last
        attended position + 1; rows are right-padded), ``micro_batch_size`` at a time, each
        with its :func:`length_bucket` (at most L). Sorting is stable: deterministic. None
        (run the plain scan) when ``group_by_length`` is off or the cut saves less than
        ``GROUP_MIN_SAVING`` of the ``N × L`` padded tokens."""
        if not self.loss_cfg.group_by_length:
            return None
        mask = np.asarray(attention_mask)
        n, width = mask.shape
        lengths = width - np.argmax(mask[:, ::-1], axis=1)
        order = np.argsort(lengths, kind="stable")
        groups = [(rows, min(width, length_bucket(int(lengths[rows].max()))))
                  for rows in order.reshape(self.micro_batches(n), -1)]
        if sum(len(rows) * cut for rows, cut in groups) > (1 - GROUP_MIN_SAVING) * n * width:
            return None
        return groups

    def update(self, batch: UpdateBatch, *, support: SupportBatch | None = None,
               support_rho: float = 0.0, num_queries: int = 0) -> dict[str, float]:
        """``ppo_mini_batches × ppo_epochs`` optimizer steps on ``batch`` (its N rows a
        multiple of :meth:`row_multiple`). ``support``: the batch's declaration rows
        (:func:`~jax_routeweaver.rl.core.support.support_batch`) over ``num_queries`` queries,
        weighted ``λ0 · support_rho``. Returns host metrics (``loss/*``, ``ppo/*``,
        ``grad/*``, ``support/*`` averaged over the optimizer steps,
        ``logprob/sampler_gap_*``, ``optim/steps``)."""
        cfg = self.loss_cfg
        n = batch.tokens.shape[0]
        if n % cfg.ppo_mini_batches:
            raise ValueError(f"{n} rows do not split into {cfg.ppo_mini_batches} mini-batches "
                             f"(pad them to a multiple of row_multiple()={self.row_multiple()})")
        old_logp = batch.old_logp
        if old_logp is None and cfg.optimizer_steps > 1:
            old_logp = to_host(self.logprobs(self.state.params, batch.tokens, batch.positions,
                                             batch.attention_mask, batch.index))
        # The frozen reference's logprobs: one pass per batch, whatever the optimizer steps.
        ref_logp = self._ref_logprobs(batch)
        rows = np.arange(n).reshape(cfg.ppo_mini_batches, -1)
        per_step, trainer_logp = [], None
        for _ in range(cfg.ppo_epochs):
            for part in rows:
                arrays = batch.step_arrays(old_logp, ref_logp, part)
                groups = self.length_groups(arrays.attention_mask)
                if groups is not None:
                    grads, stats, logp = self._grouped_grads(self.state.params, groups, *arrays)
                    sup, rho, kwargs = self._support_args(support, support_rho, num_queries)
                    self.state, metrics = self._apply(self.state, grads, stats, sup, rho,
                                                      **kwargs)
                else:
                    args, kwargs = self._prepare(*arrays, support, support_rho, num_queries)
                    self.state, metrics, logp = self._update(self.state, *args, **kwargs)
                per_step.append(metrics)
                if cfg.optimizer_steps == 1:
                    trainer_logp = to_host(logp).reshape(n, -1)
        per_step = jax.tree.map(to_host, per_step)
        out = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        # An arm without queries this batch has no mode distribution (NaN): left out.
        out = {k: v for k, v in out.items() if np.isfinite(v) or not k.startswith(
            ("free/", "forced/"))}
        out["optim/steps"] = float(len(per_step))
        if batch.sampler_logp is not None:
            # The sampler ran the pre-update params: compare with the trainer's logprobs of
            # those (the first step's own pass, or the recomputed/given old_logp).
            ref = trainer_logp if trainer_logp is not None else np.asarray(old_logp)
            out.update(sampler_gap(batch.sampler_logp, ref, batch.response_mask))
        return out

    def gradients(self, batch: UpdateBatch, *, support: SupportBatch | None = None,
                  support_rho: float = 0.0, num_queries: int = 0
                  ) -> tuple[Any, dict[str, jax.Array]]:
        """The accumulated gradient :meth:`update` would apply (before clipping), and its
        metrics; the state is left unchanged (tests and diagnostics). ``batch.old_logp`` is
        not read: the ratio is taken against the current params."""
        arrays = batch.step_arrays(None, self._ref_logprobs(batch))
        groups = self.length_groups(arrays.attention_mask)
        if groups is not None:
            grads, stats, _ = self._grouped_grads(self.state.params, groups, *arrays)
            sup, rho, kwargs = self._support_args(support, support_rho, num_queries)
            return self._finish(self.state.params, grads, stats, sup, rho, **kwargs)
        args, kwargs = self._prepare(*arrays, support, support_rho, num_queries)
        grads, metrics, _ = self._grads(self.state.params, *args, **kwargs)
        return grads, metrics

    def _ref_logprobs(self, batch: UpdateBatch) -> np.ndarray | None:
        """The reference policy's logprobs for the KL term (None when ``kl_coef`` is 0)."""
        if self.loss_cfg.kl_coef <= 0:
            return None
        return to_host(self.logprobs(self.ref_params, batch.tokens, batch.positions,
                                     batch.attention_mask, batch.index))

    def _prepare(self, tokens, positions, attention_mask, index, response_mask, mode_mask,
                 advantages, clean, old_logp, ref_logp, support, support_rho, num_queries):
        m = self.micro_batches(tokens.shape[0])
        counts = losses.segment_counts(jnp.asarray(response_mask), jnp.asarray(mode_mask))
        put = lambda a: None if a is None else self.place_rows(a, m)
        batch = StepBatch(*(put(a) for a in (
            tokens, positions, attention_mask, index, response_mask, mode_mask, advantages,
            clean, old_logp, ref_logp)))
        sup, rho, kwargs = self._support_args(support, support_rho, num_queries)
        return (batch, counts, sup, rho), kwargs

    def _support_args(self, support, support_rho, num_queries):
        """The declaration rows (None when the declaration terms have no weight at this ρ:
        neither ``λ0·ρ`` nor the per-question floor's ``λ_q·(1 − ρ)``), ``ρ`` and the
        static kwargs."""
        cfg = self.declarations
        weight = cfg.support_lambda0 * support_rho
        if cfg.question_floor > 0:
            weight += cfg.question_floor_weight * (1.0 - support_rho)
        with_support = support is not None and weight > 0
        kwargs = dict(with_support=with_support, num_queries=num_queries if with_support else 0)
        return support if with_support else None, jnp.float32(support_rho), kwargs

    def _grouped_grads(self, params, groups, tokens, positions, attention_mask, index,
                       response_mask, mode_mask, advantages, clean, old_logp, ref_logp
                       ) -> tuple[Any, tuple[dict[str, jax.Array], ...], np.ndarray]:
        """``group_by_length``'s policy gradient: one accumulating call per micro-batch of
        ``groups`` (:meth:`length_groups`), rows cut to the group's length. Returns the summed
        gradient, each call's stats and the loss pass's logprobs ``[N, P]`` in the rows'
        order."""
        counts = losses.segment_counts(jnp.asarray(response_mask), jnp.asarray(mode_mask))
        grads = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype, device=p.sharding), params)
        stats, parts = [], []
        for rows, length in groups:
            cut = lambda a, rows=rows, length=length: self._micro_batch(a, rows, length)
            take = lambda a, rows=rows: self._micro_batch(a, rows)
            per_token = cut if index is None else take
            batch = StepBatch(cut(tokens), cut(positions), cut(attention_mask), take(index),
                              *(per_token(a) for a in (response_mask, mode_mask, advantages)),
                              take(clean), *(per_token(a) for a in (old_logp, ref_logp)))
            grads, mb_stats, mb_logp = self._accumulate(params, grads, batch, counts)
            stats.append(mb_stats)
            parts.append((rows, mb_logp))
        # Read back after the loop: the calls queue up without waiting on each other.
        logp = _gather_rows(parts, tokens.shape[0], np.shape(response_mask)[1])
        return grads, tuple(stats), logp

    def _grouped_logprobs(self, params, groups, tokens, positions, attention_mask,
                          index) -> np.ndarray:
        """:meth:`logprobs` micro-batch by micro-batch of ``groups``."""
        parts = []
        for rows, length in groups:
            cut = [self._micro_batch(a, rows, length) for a in (tokens, positions, attention_mask)]
            parts.append((rows, self._logprobs(params, *cut, self._micro_batch(index, rows))))
        width = tokens.shape[1] if index is None else np.shape(index)[1]
        return _gather_rows(parts, tokens.shape[0], width)

    # ------------------------------------------------------------------ placement
    def _micro_batch(self, a: np.ndarray | None, rows: np.ndarray,
                     length: int | None = None) -> jax.Array | None:
        """Rows ``rows`` of host array ``a`` (its first ``length`` columns), placed as one
        ``[1, len(rows), ...]`` micro-batch; None stays None."""
        if a is None:
            return None
        a = np.asarray(a)[rows]
        return self.place_rows(a if length is None else a[:, :length], 1)

    def place_rows(self, a: np.ndarray | jax.Array, m: int) -> jax.Array:
        """``[N, ...]`` -> ``[M, N/M, ...]`` with the row axis sharded over the batch axes."""
        a = jnp.asarray(a).reshape(m, a.shape[0] // m, *a.shape[1:])
        if self.mesh is None:
            return a
        return jax.device_put(a, self.micro_batch_sharding(a.ndim))

    def micro_batch_sharding(self, ndim: int) -> NamedSharding | None:
        """The sharding of an ``[M, mb, ...]`` micro-batched array (rows over the batch
        axes, the rest replicated); None without a mesh."""
        if self.mesh is None:
            return None
        spec = logical_to_spec(("batch",), self.rules, mesh=self.mesh)
        return NamedSharding(self.mesh, P(None, *spec, *([None] * (ndim - 2))))

    # ------------------------------------------------------------------ compile only
    def lower_update(self, batch: StepBatch, counts: losses.SegmentCounts,
                     support: SupportBatch | None = None, *, num_queries: int = 0
                     ) -> jax.stages.Lowered:
        """The optimizer step lowered for these (abstract) inputs (``[M, mb, ...]`` batch,
        placed with :meth:`micro_batch_sharding`); with ``support``, the support loss too."""
        return self._update.lower(self.state, batch, counts, support, jnp.float32(1.0),
                                  with_support=support is not None,
                                  num_queries=num_queries if support is not None else 0)

    def lower_logprobs(self, params: Any, tokens: Any, positions: Any, attention_mask: Any,
                       index: Any = None) -> jax.stages.Lowered:
        """The logprob pass (reference / old policy) lowered for ``[M, mb, L]`` inputs."""
        return self._logprobs.lower(params, tokens, positions, attention_mask, index)

    # ------------------------------------------------------------------ jitted
    def _policy_logp(self, params: Any, tokens: jax.Array, positions: jax.Array,
                     mask: jax.Array, index: jax.Array | None, *, with_entropy: bool = False,
                     temperature: float | None = None):
        model = nnx.merge(self.graphdef, params)
        t = self.temperature if temperature is None else temperature
        rows = self._row_sharding(tokens)
        if index is None:
            return token_logprobs(model, tokens, positions, mask, temperature=t,
                                  with_entropy=with_entropy, batch_sharding=rows)
        return gathered_logprobs(model, tokens, positions, mask, index, temperature=t,
                                 with_entropy=with_entropy, batch_sharding=rows)

    def _row_sharding(self, tokens: jax.Array) -> NamedSharding | None:
        """Rows over the batch axes inside the model too (see Qwen3.hidden_states); chunks
        whose rows do not divide over the shards stay as placed (replicated)."""
        rows = self.micro_batch_sharding(3)
        if rows is None or tokens.shape[0] % self._shards() != 0:
            return None
        return NamedSharding(rows.mesh, P(*rows.spec[1:]))

    def _logprobs_impl(self, params: Any, tokens: jax.Array, positions: jax.Array,
                       mask: jax.Array, index: jax.Array | None) -> jax.Array:
        return jax.lax.map(lambda xs: self._policy_logp(params, *xs),
                           (tokens, positions, mask, index))

    def _micro_loss(self, params: Any, mb: StepBatch, counts: losses.SegmentCounts
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.loss_cfg
        with_entropy = cfg.entropy_coef != 0.0
        out = self._policy_logp(params, mb.tokens, mb.positions, mb.attention_mask, mb.index,
                                with_entropy=with_entropy)
        logp, entropy = out if with_entropy else (out, None)
        old_logp = jax.lax.stop_gradient(logp) if mb.old_logp is None else mb.old_logp
        parts, raw = losses.policy_loss_parts(
            logp, old_logp, mb.advantages, mb.response_mask, mode_mask=mb.mode_mask,
            clean=mb.clean, ref_logp=mb.ref_logp if cfg.kl_coef > 0 else None, entropy=entropy,
            counts=counts, reduction=cfg.reduction, kl_coef=cfg.kl_coef,
            entropy_coef=cfg.entropy_coef, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            clip_c=cfg.clip_c)
        # Totals are additive over micro-batches; the denominators are global, so each
        # micro-batch's value is its exact share of the mini-batch loss.
        stats = {f"loss/{k}": p.coef * p.value() for k, p in parts.items()}
        stats |= {f"ppo/{k}": v.value() for k, v in raw.items()}
        return losses.combine(parts), (stats, jax.lax.stop_gradient(logp))

    def _support_grad(self, params: Any, sb: SupportBatch, rho: jax.Array, num_queries: int
                      ) -> tuple[Any, dict[str, jax.Array]]:
        """The declaration terms' gradient and metrics (`rl.core.support.support_gradient`: the
        support loss, and the per-question floor when on), each chunk scored by this
        policy."""

        def chunk_logp(p: Any, chunk: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
            tokens, positions, mask, index, span, *options = chunk
            # The original code scores declarations with the plain forward (temperature 1); a
            # constrained sampler draws the mode from the grammar's options only.
            if options:
                lp = choice_logprobs(nnx.merge(self.graphdef, p), tokens, positions, mask,
                                     index, options[0], temperature=1.0,
                                     batch_sharding=self._row_sharding(tokens))
            else:
                lp = self._policy_logp(p, tokens, positions, mask, index, temperature=1.0)
            return lp, span

        cfg = self.declarations
        return support_gradient(params, sb, rho, num_queries, chunk_logp=chunk_logp,
                                lambda0=cfg.support_lambda0, floor=cfg.support_floor,
                                question_floor=cfg.question_floor,
                                question_weight=cfg.question_floor_weight * (1.0 - rho))

    def _policy_grads(self, params: Any, batch: StepBatch, counts: losses.SegmentCounts,
                      acc: Any) -> tuple[Any, tuple[dict[str, jax.Array], jax.Array]]:
        """``acc`` + the policy gradient of ``[M, mb, ...]`` micro-batches (``lax.scan``);
        also each micro-batch's stats ``[M]`` and logprobs ``[M, mb, P]``."""
        grad_fn = jax.grad(self._micro_loss, has_aux=True)

        def body(acc: Any, mb: StepBatch) -> tuple[Any, tuple]:
            g, aux = grad_fn(params, mb, counts)
            return jax.tree.map(jnp.add, acc, g), aux

        return jax.lax.scan(body, acc, batch)

    def _accumulate_impl(self, params: Any, acc: Any, batch: StepBatch,
                         counts: losses.SegmentCounts
                         ) -> tuple[Any, dict[str, jax.Array], jax.Array]:
        acc, (stats, logp) = self._policy_grads(params, batch, counts, acc)
        return acc, stats, logp

    def _grads_impl(self, params: Any, batch: StepBatch, counts: losses.SegmentCounts,
                    support: SupportBatch | None, rho: jax.Array, *, with_support: bool,
                    num_queries: int) -> tuple[Any, dict[str, jax.Array], jax.Array]:
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (stats, logp) = self._policy_grads(params, batch, counts, zeros)
        grads, metrics = self._finish_impl(params, grads, (stats,), support, rho,
                                           with_support=with_support, num_queries=num_queries)
        return grads, metrics, logp

    def _finish_impl(self, params: Any, grads: Any, stats: tuple[dict[str, jax.Array], ...],
                     support: SupportBatch | None, rho: jax.Array, *, with_support: bool,
                     num_queries: int) -> tuple[Any, dict[str, jax.Array]]:
        """Metrics of the policy gradient (``stats``: per micro-batch, in any number of
        ``[M_i]`` parts), plus the support gradient when on."""
        stats = jax.tree.map(lambda *xs: jnp.concatenate(xs), *stats)
        # Every stat is a micro-batch's share of a mini-batch-global mean: shares add up.
        metrics = {k: v.sum() for k, v in stats.items()}
        metrics["loss/total"] = sum(v for k, v in metrics.items() if k.startswith("loss/"))
        metrics["grad/norm_policy"] = optax.tree.norm(grads)
        if with_support:
            sgrads, smetrics = self._support_grad(params, support, rho, num_queries)
            metrics |= smetrics
            metrics["grad/norm_support"] = optax.tree.norm(sgrads)
            grads = jax.tree.map(jnp.add, grads, sgrads)
        metrics["grad/norm"] = optax.tree.norm(grads)
        return grads, metrics

    def _update_impl(self, state: TrainState, batch: StepBatch, counts: losses.SegmentCounts,
                     support: SupportBatch | None, rho: jax.Array, *, with_support: bool,
                     num_queries: int) -> tuple[TrainState, dict[str, jax.Array], jax.Array]:
        """One optimizer step; also returns the loss pass's logprobs ``[M, mb, P]``."""
        grads, metrics, logp = self._grads_impl(state.params, batch, counts, support, rho,
                                          with_support=with_support, num_queries=num_queries)
        return self._optimizer_step(state, grads, metrics), metrics, logp

    def _apply_impl(self, state: TrainState, grads: Any, stats: tuple[dict[str, jax.Array], ...],
                    support: SupportBatch | None, rho: jax.Array, *, with_support: bool,
                    num_queries: int) -> tuple[TrainState, dict[str, jax.Array]]:
        """``group_by_length``'s optimizer step on the accumulated policy gradient."""
        grads, metrics = self._finish_impl(state.params, grads, stats, support, rho,
                                           with_support=with_support, num_queries=num_queries)
        return self._optimizer_step(state, grads, metrics), metrics

    def _optimizer_step(self, state: TrainState, grads: Any, metrics: dict[str, jax.Array]
                        ) -> TrainState:
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["optim/update_norm"] = optax.tree.norm(updates)
        rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1))
        return TrainState(params, opt_state, state.step + 1, rng)


def sampler_gap(sampler_logp: np.ndarray, trainer_logp: np.ndarray,
                response_mask: np.ndarray) -> dict[str, float]:
    """Sampler-vs-trainer logprob gap on policy tokens: mean and max ``|Δ|``. A large gap
    means a broken weight sync or a numerics bug (the sampler's logprobs are never used in
    the loss)."""
    m = np.asarray(response_mask) > 0
    if not m.any():
        return {"logprob/sampler_gap_mean": 0.0, "logprob/sampler_gap_max": 0.0}
    d = np.abs(np.asarray(sampler_logp) - np.asarray(trainer_logp))[m]
    return {"logprob/sampler_gap_mean": float(d.mean()), "logprob/sampler_gap_max": float(d.max())}


def _gather_rows(parts: list[tuple[np.ndarray, jax.Array]], n: int, width: int) -> np.ndarray:
    """``[n, width]`` f32 host array from ``(rows, values)`` parts, ``values`` reshaping to
    ``[len(rows), ≤ width]``; columns past a part's cut length stay 0."""
    out = np.zeros((n, width), np.float32)
    for rows, values in parts:
        values = to_host(values).reshape(len(rows), -1)
        out[rows, :values.shape[1]] = values
    return out
