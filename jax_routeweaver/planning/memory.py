"""Per-device memory plan of one RL update for real model shapes — no weights, no accelerator.

:func:`memory_plan` builds the policy abstractly (``nnx.eval_shape``), places its parameters
on a mesh of (fake) CPU devices by the train rules, and **compiles, never runs**, the
trainer's own jitted programs for one batch of the configured shapes:

* the optimizer step (policy loss over micro-batches under ``lax.scan``, the support loss when
  on, global-norm clip, AdamW), with the train state donated as in training;
* the logprob pass (the frozen reference's, or the old policy's), micro-batch by micro-batch.

It then reads XLA's memory analysis of the partitioned (per-device) programs: arguments
(params, optimizer state, reference params, batch), outputs, the bytes outputs alias from
donated arguments, and temporaries (activations under the remat policy, gradient
accumulators, logit chunks, attention blocks). Per device, a program needs about
``arguments + outputs − aliased + temporaries``, plus what stays resident while it runs:
the frozen reference during the update, the policy and its optimizer state during the
reference's logprob pass. The plan's peak is the larger of the two.

This prices the trainer only; :mod:`jax_routeweaver.planning.rollout` prices the rollout
engine (the in-process sampler's replica and KV cache, or a co-located vLLM server) and
:mod:`jax_routeweaver.planning.step` the whole step as three phases, and searches the settings
that make it fit a :class:`Target`.

These are XLA:CPU's buffer assignments of the same SPMD program. TPU and GPU compilers fuse
and schedule differently (and XLA:CPU may keep fp32 copies where a TPU computes in bf16), so
the numbers are an estimate: :data:`HEADROOM` is kept free when deciding what fits.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import TRAIN_RULES, Rules, make_mesh, param_specs
from jax_routeweaver.rl.core import losses
from jax_routeweaver.rl.core.estimators import ESTIMATORS
from jax_routeweaver.rl.core.support import SupportBatch
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import StepBatch, Trainer

GIB = 2**30
HEADROOM = 0.10  # share of device memory kept free for what the CPU estimate misses


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to plan for: ``devices`` accelerators of ``memory_gib`` each over ``hosts``
    hosts (processes; each runs its own rollout engine on its ``devices / hosts`` devices),
    ``kind`` "tpu" or "gpu" (the vLLM sidecar is planned on GPUs only), the mesh
    ``(data, fsdp, tensor)`` a plain plan uses, and ``meshes``: the meshes the whole-step
    search tries, in order of preference (empty: ``mesh`` alone)."""

    name: str
    devices: int
    memory_gib: float
    mesh: tuple[int, int, int]
    kind: str = "gpu"
    hosts: int = 1
    meshes: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("tpu", "gpu"):
            raise ValueError(f"Target {self.name!r}: kind={self.kind!r}, expected 'tpu' or "
                             "'gpu'")
        if self.hosts < 1 or self.devices % self.hosts:
            raise ValueError(f"Target {self.name!r}: hosts={self.hosts} must divide "
                             f"devices={self.devices}")
        for mesh in (self.mesh, *self.meshes):
            known = math.prod(n for n in mesh if n != -1)
            if (known != self.devices) if -1 not in mesh else (self.devices % known):
                raise ValueError(f"Target {self.name!r}: mesh {mesh} does not use its "
                                 f"{self.devices} devices")

    @property
    def search_meshes(self) -> tuple[tuple[int, int, int], ...]:
        return self.meshes or (self.mesh,)

    @property
    def local_devices(self) -> int:
        return self.devices // self.hosts


# JAX sees one device per TPU v5e chip (16 GiB HBM; a v5e-16 slice is 4 hosts x 4 chips) and
# per v5p chip (95 GiB; v5p-8 is 4 chips on one host). The H200's usable memory is what CUDA
# reports on the project's lent machine. Tensor parallelism of 4 is the most Qwen3-4B's 8 KV
# heads allow with a whole head per device that a v5e host's 4 chips also hold.
TARGETS: dict[str, Target] = {
    "v5e-16": Target("TPU v5e-16", 16, 16.0, (1, 16, 1), "tpu", hosts=4,
                     meshes=((1, 16, 1), (1, 4, 4))),
    "v5p-8": Target("TPU v5p-8", 4, 95.0, (1, 4, 1), "tpu", meshes=((1, 4, 1), (1, 1, 4))),
    "a100-80gb-x8": Target("8x A100-80GB", 8, 80.0, (1, 8, 1), "gpu",
                           meshes=((1, 8, 1), (1, 2, 4))),
    "h200": Target("1x H200", 1, 139.0, (1, 1, 1), "gpu"),
    "h200-x2": Target("2x H200", 2, 139.0, (1, 2, 1), "gpu", meshes=((1, 2, 1), (1, 1, 2))),
}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The arrays of one optimizer step. ``rows``: trajectories per optimizer step (queries
    × K / mini-batches); ``length``: tokens per row (prompt + response, padded);
    ``policy_tokens``: width of the gathered policy-token index (≤ length);
    ``rows_per_device``: rows of one micro-batch on each batch shard; ``support_queries``
    (0 = off) queries × 3 declaration rows of ``support_length`` tokens in chunks of
    ``support_chunk``."""

    rows: int
    length: int
    policy_tokens: int
    rows_per_device: int = 1
    support_queries: int = 0
    support_length: int = 2048
    support_chunk: int = 12

    def __post_init__(self) -> None:
        for name in ("rows", "length", "policy_tokens", "rows_per_device", "support_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepShape.{name}={getattr(self, name)} must be >= 1")
        if self.policy_tokens > self.length:
            raise ValueError(f"StepShape.policy_tokens={self.policy_tokens} > length "
                             f"{self.length}")


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """XLA's memory analysis of one compiled program, bytes per device."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    compile_s: float

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @classmethod
    def of(cls, compiled: jax.stages.Compiled, compile_s: float) -> ProgramMemory:
        ma = compiled.memory_analysis()
        if ma is None:
            raise RuntimeError("this XLA backend gives no memory analysis")
        return cls(int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                   int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes), compile_s)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One planned configuration. ``params`` / ``optimizer`` / ``reference``: bytes per
    device of the train state's parts (from their shardings); ``critic``: the critic's
    params and optimizer state with ``algo.estimator: ppo_gae`` (0 without a critic);
    ``update`` / ``logprobs``: the two programs; ``peak``: the larger need, each program with
    what stays resident beside it (the reference and the critic during the update; the
    policy, optimizer state and critic during the reference pass). The critic's own update
    is taken to need what the policy's does (the same backbone and rows; its head has one
    output instead of the vocabulary) with the policy's state resident in place of its own,
    which is the same size: the update phase covers it."""

    mesh: tuple[int, int, int]
    remat: str
    remat_groups: int
    causal_parts: int
    dtype: str
    shape: StepShape
    micro_batch: int
    params: int
    optimizer: int
    reference: int
    update: ProgramMemory
    logprobs: ProgramMemory
    critic: int = 0

    @property
    def peak(self) -> int:
        return max(self.update.peak + self.reference + self.critic,
                   self.logprobs.peak + self.params + self.optimizer + self.critic)

    def fits(self, memory_gib: float, headroom: float = HEADROOM) -> bool:
        return self.peak <= memory_gib * GIB * (1.0 - headroom)

    def as_dict(self) -> dict[str, Any]:
        gib = lambda b: round(b / GIB, 2)
        return {
            "mesh": list(self.mesh), "remat": self.remat,
            "remat_groups": self.remat_groups, "causal_parts": self.causal_parts,
            "dtype": self.dtype,
            "rows": self.shape.rows, "length": self.shape.length,
            "policy_tokens": self.shape.policy_tokens, "micro_batch": self.micro_batch,
            "rows_per_device": self.shape.rows_per_device,
            "support_queries": self.shape.support_queries,
            "params_gib": gib(self.params), "optimizer_gib": gib(self.optimizer),
            "reference_gib": gib(self.reference), "critic_gib": gib(self.critic),
            "update": {k: gib(v) for k, v in _program_fields(self.update).items()}
            | {"compile_s": round(self.update.compile_s, 1)},
            "logprobs": {k: gib(v) for k, v in _program_fields(self.logprobs).items()}
            | {"compile_s": round(self.logprobs.compile_s, 1)},
            "peak_gib": gib(self.peak),
        }


def _program_fields(p: ProgramMemory) -> dict[str, int]:
    return {"arguments": p.arguments, "outputs": p.outputs, "aliased": p.aliased,
            "temporaries": p.temporaries, "peak": p.peak}


def abstract_policy(cfg: ModelConfig, mesh: Mesh, rules: Rules = TRAIN_RULES
                    ) -> tuple[Any, nnx.State]:
    """``(graphdef, params)`` of a :class:`Qwen3` of ``cfg`` with every parameter a
    ``jax.ShapeDtypeStruct`` carrying its train sharding on ``mesh`` (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    specs = param_specs(abstract, rules, mesh)
    graphdef, params = nnx.split(abstract, nnx.Param)
    for path, var in nnx.to_flat_state(params):
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype,
                                           sharding=NamedSharding(mesh, specs[tuple(path)])))
    return graphdef, params


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ``ShapeDtypeStruct``s (the largest shard
    of each leaf, which is every shard's size for even splits)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.shape if leaf.sharding is None else leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def memory_plan(model: ModelConfig, shape: StepShape, *, mesh_shape: Sequence[int],
                devices: Sequence[jax.Device], optim: OptimConfig, loss: LossConfig,
                temperature: float = 0.8, rules: Rules = TRAIN_RULES,
                critic: bool = False) -> MemoryPlan:
    """Compile one update and one logprob pass of ``model`` for ``shape`` on a mesh of
    ``devices`` (fake CPU devices are fine) and return their per-device memory. The
    micro-batch is ``shape.rows_per_device`` × the batch shards; ``loss``'s own
    ``micro_batch_size`` is replaced by it. With ``loss.group_by_length`` the same work runs
    as one call per micro-batch at its own length (at most ``shape.length``) and a separate
    optimizer step, each holding less at once: this plan is then an upper bound. ``critic``:
    the run trains a critic (``ppo_gae``), priced as a second copy of the params and their
    AdamW state (see :class:`MemoryPlan`)."""
    mesh = make_mesh(tuple(mesh_shape), devices)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = shape.rows_per_device * shards
    if shape.rows % micro:
        raise ValueError(f"{shape.rows} rows per optimizer step do not split into "
                         f"micro-batches of {micro} ({shape.rows_per_device} per device x "
                         f"{shards} batch shards)")
    loss = dataclasses.replace(loss, micro_batch_size=micro, support_chunk=shape.support_chunk)
    graphdef, params = abstract_policy(model, mesh, rules)
    trainer = Trainer.for_shapes(graphdef, params, optim, loss, temperature=temperature,
                                 mesh=mesh, rules=rules)
    m = shape.rows // micro

    def rows(width: int, dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((m, micro, width), dtype,
                                    sharding=trainer.micro_batch_sharding(3))

    tokens, positions = rows(shape.length, jnp.int32), rows(shape.length, jnp.int32)
    mask, index = rows(shape.length, jnp.bool_), rows(shape.policy_tokens, jnp.int32)
    per_token = lambda: rows(shape.policy_tokens, jnp.float32)
    clean = jax.ShapeDtypeStruct((m, micro), jnp.bool_, sharding=trainer.micro_batch_sharding(2))
    batch = StepBatch(tokens, positions, mask, index, per_token(), per_token(), per_token(),
                      clean, None, per_token() if loss.kl_coef > 0 else None)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
    counts = losses.SegmentCounts(scalar, scalar, scalar)
    support = _support_shapes(shape, mesh) if shape.support_queries else None

    t = time.perf_counter()
    update = trainer.lower_update(batch, counts, support,
                                  num_queries=shape.support_queries).compile()
    update_mem = ProgramMemory.of(update, time.perf_counter() - t)
    t = time.perf_counter()
    logp = trainer.lower_logprobs(trainer.ref_params, tokens, positions, mask, index).compile()
    logp_mem = ProgramMemory.of(logp, time.perf_counter() - t)
    return MemoryPlan(
        mesh=tuple(mesh.shape[a] for a in ("data", "fsdp", "tensor")), remat=model.remat,
        remat_groups=model.remat_groups, causal_parts=model.causal_parts, dtype=model.dtype,
        shape=shape, micro_batch=micro, params=bytes_per_device(params),
        optimizer=bytes_per_device(trainer.state.opt_state),
        reference=bytes_per_device(trainer.ref_params), update=update_mem, logprobs=logp_mem,
        critic=bytes_per_device((params, trainer.state.opt_state)) if critic else 0)


def _support_shapes(shape: StepShape, mesh: Mesh) -> SupportBatch:
    """Abstract support rows (replicated, as the trainer passes them), declarations of 8
    tokens (``<mode>`` word ``</mode>`` with the Qwen3 vocabulary)."""
    rows = 3 * shape.support_queries
    chunks = -(-rows // shape.support_chunk)
    rep = NamedSharding(mesh, P())
    arr = lambda *s, dtype: jax.ShapeDtypeStruct((chunks, shape.support_chunk, *s), dtype,
                                                 sharding=rep)
    width = 8
    return SupportBatch(arr(shape.support_length, dtype=jnp.int32),
                        arr(shape.support_length, dtype=jnp.int32),
                        arr(shape.support_length, dtype=jnp.bool_), arr(width, dtype=jnp.int32),
                        arr(width, dtype=jnp.float32), arr(dtype=jnp.int32),
                        arr(dtype=jnp.int32))


# ---------------------------------------------------------------------------- from a config
PROMPT_TOKENS = 6144  # the original's max_prompt_length; rows are prompt + response


def config_shape(cfg: Any, *, rows_per_device: int = 1, length: int | None = None,
                 policy_tokens: int | None = None) -> StepShape:
    """The :class:`StepShape` of one optimizer step of a ``TrainConfig``: batch × K rows
    over the PPO mini-batches, ``length`` (default prompt 6144 + the protocol's response
    length) and ``policy_tokens`` (default the whole response: the worst case), the support
    rows when the support loss is on."""
    rows, rem = divmod(cfg.data.batch_size * cfg.data.group_size,
                       cfg.algo.loss.ppo_mini_batches)
    if rem:
        raise ValueError(f"data.batch_size x data.group_size does not split into "
                         f"algo.loss.ppo_mini_batches={cfg.algo.loss.ppo_mini_batches}")
    response = cfg.rollout.protocol.response_length
    length = length or PROMPT_TOKENS + response
    support_length = -(-(cfg.algo.support_max_prompt + 8) // 64) * 64
    return StepShape(rows=rows, length=length, policy_tokens=policy_tokens or min(response, length),
                     rows_per_device=rows_per_device,
                     support_queries=cfg.data.batch_size if cfg.algo.support else 0,
                     support_length=support_length, support_chunk=cfg.algo.loss.support_chunk)


def config_mesh(cfg: Any, devices: int) -> tuple[int, int, int]:
    """A ``TrainConfig``'s mesh ``(data, fsdp, tensor)`` on ``devices`` devices, its -1 entry
    resolved (ValueError naming the mesh when it does not use exactly those devices)."""
    mesh = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    known = math.prod(n for n in mesh if n != -1)
    resolved = tuple(devices // known if n == -1 else n for n in mesh)
    if devices % known or math.prod(resolved) != devices:
        raise ValueError(f"mesh (data, fsdp, tensor) = {mesh} does not use {devices} devices")
    return resolved  # type: ignore[return-value]


def plan_config(cfg: Any, arch: ModelConfig, target: Target, shape: StepShape, *,
                devices: Sequence[jax.Device], remat: str,
                mesh: tuple[int, int, int] | None = None,
                remat_groups: int | None = None) -> MemoryPlan:
    """:func:`memory_plan` of a ``TrainConfig`` (optimizer, loss, temperature, dtypes and the
    model's runtime options from it) for ``arch`` with ``remat`` on ``target``'s mesh, or on
    ``mesh`` and with ``remat_groups`` when given (the whole-step search's candidates)."""
    if len(devices) < target.devices:
        raise ValueError(f"planning {target.name} needs {target.devices} devices, have "
                         f"{len(devices)}")
    runtime = {**cfg.model.runtime(), "remat": remat}
    if remat_groups is not None:
        runtime["remat_groups"] = remat_groups
    model = arch.replace(param_dtype=cfg.model.param_dtype, dtype=cfg.model.dtype, **runtime)
    return memory_plan(model, shape, mesh_shape=mesh or target.mesh,
                       devices=list(devices)[:target.devices], optim=cfg.optim,
                       loss=cfg.algo.loss, temperature=cfg.rollout.temperature,
                       critic=ESTIMATORS[cfg.algo.estimator].critic)
