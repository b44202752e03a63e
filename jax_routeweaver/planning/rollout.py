"""Per-device memory of the rollout engine beside the trainer: the engine's settings, what one
step rolls out, and the formulas that price the engine's weights, KV memory and temporaries.

:mod:`jax_routeweaver.planning.step` adds these to the trainer's compiled figures to price the
whole step.

The rollout engine, per device, by ``rollout.sampler`` / ``rollout.kv_cache``:

* ``jax``, both caches: a weights **replica** in the trainer's ``param_dtype`` (today's
  ``JaxSampler`` keeps the policy's arrays as they are: ``update_weights`` requires equal
  dtypes; :func:`replica_dtype` is the one place to change if an engine casts), laid out by
  ``SAMPLE_RULES`` (tensor parallel, replicated over data and fsdp) on the sampler's mesh: the
  training mesh on one host, each host's own devices with the same tensor degree when it
  divides them (else 1) on several (``rl.run.replica.sampler_mesh_shape``). The replica stays
  between rollouts (``kept``).
* ``jax`` + ``dense``: every row of a host's first round at once (``ceil(batch / hosts) x K``),
  each with a ``prompt + max_new_tokens``-slot cache: ``rows x (prompt + max_new_tokens) x 2 x
  L x K x H x bytes`` (bytes of the compute dtype), rows split over the sampler mesh's batch
  shards and KV heads over tensor; freed after each call (not ``kept``). The sampler's
  buckets pad further (prompt 6,144 -> 8,192), so this is a lower bound of the dense cache.
* ``jax`` + ``paged`` (``sampling.paged_engine``, whose layout this follows): a page pool of
  ``budget_tokens`` tokens (``budget_tokens x 2 x L x K x H x bytes``), its KV heads split over
  tensor and **replicated** over the batch axes (every device holds every row's pages and
  decodes every slot), or with ``budget_tokens`` 0 ``memory_fraction`` of what one device has
  free when the sampler starts (device memory - the policy - the replica: the optimizer state
  and the reference come later), at most ``max_rows`` rows of ``max_position_embeddings``.
  Allocated once with the slots' ``[max_rows, V]`` fp32 logits, and both **kept** through the
  update. ``max_rows`` decode slots and the engine's prefill calls bound its temporaries
  (:func:`paged_temporaries`).
* the dense cache adds :func:`decode_temporaries`. Both are formulas (the engines' programs
  are not compiled here); each is one function to swap.
* ``vllm`` co-located on the trainer's GPUs: the server takes ``share`` of each GPU it uses
  (``--gpu-memory-utilization`` in ``rollout.vllm.extra_args``; vLLM's own default 0.9 when
  absent) while rollouts run, and holds it through the update unless it sleeps
  (``rollout.vllm.sleep_level`` 1 or 2: vLLM sleep mode moves the weights to host memory (1)
  or drops them (2) and drops the KV cache; both leave :data:`VLLM_SLEEP_RESIDUE_GIB` on the
  GPU). Its KV cache is the share less its weights (``rollout.vllm.dtype``, split over
  ``--tensor-parallel-size``) and :data:`VLLM_OVERHEAD_GIB`; vLLM refuses to start unless it
  holds one ``max_model_len`` row. A server without ``--tensor-parallel-size`` runs on one GPU:
  the plan is that GPU's (the worst device). **Time sharing** (sleep 1/2) returns memory to
  the trainer only if the trainer returns it too: JAX's default GPU allocator keeps its
  high-water mark, so the trainer must run with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (and
  no ``XLA_PYTHON_CLIENT_MEM_FRACTION`` cap below its peak); otherwise plan sleep 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax.numpy as jnp
from flax import nnx

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.paged_attention import attention_path
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, Rules
from jax_routeweaver.planning.memory import GIB, PROMPT_TOKENS, Target
from jax_routeweaver.rl.run.distributed import rows_per_host
from jax_routeweaver.sampling.paged_options import MIN_WIDTH, PREFILL_TOKENS, PagedConfig

Engine = Literal["dense", "paged", "vllm"]
ENGINES: tuple[Engine, ...] = ("dense", "paged", "vllm")

# vLLM's own default for --gpu-memory-utilization (the project's paper configs pass 0.30).
VLLM_DEFAULT_SHARE = 0.9
# Inside vLLM's share besides weights and KV: the activations of its profiling run (logits of
# up to max_num_seqs rows, one max_num_batched_tokens forward) and non-torch allocations. An
# estimate for a ~4B model; vLLM logs the real figure at start-up ("model weights take ...,
# non_torch_memory ..., PyTorch activation peak ...").
VLLM_OVERHEAD_GIB = 2.0
# What a sleeping vLLM server keeps on its GPU (CUDA context, allocations outside its sleep
# pool); an estimate.
VLLM_SLEEP_RESIDUE_GIB = 1.0
# Full copies of a [rows, vocab] fp32 array while a token is sampled (logits, scaled logits,
# probabilities, the top-p keep mask).
SAMPLING_COPIES = 4


# ---------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """The rollout engine's settings (one ``engine``'s fields are used, the rest ignored):
    ``paged``: ``page_size``, ``budget_tokens`` (0: ``memory_fraction`` of the free memory),
    ``max_rows``, ``attention`` (its decode attention's path, resolved for the target's
    kind: `models.paged_attention.attention_path`); ``vllm``: ``share``
    (``--gpu-memory-utilization``), ``tensor`` (``--tensor-parallel-size``), ``sleep_level``,
    ``dtype`` (the served weights')."""

    engine: Engine
    page_size: int = 16
    budget_tokens: int = 0
    memory_fraction: float = 0.5
    max_rows: int = 64
    attention: str = "auto"
    share: float = VLLM_DEFAULT_SHARE
    tensor: int = 1
    sleep_level: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"RolloutSettings.engine={self.engine!r}: expected one of "
                             f"{ENGINES}")
        if not 0 < self.share <= 1:
            raise ValueError(f"RolloutSettings.share={self.share}: must be in (0, 1]")
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"RolloutSettings.sleep_level={self.sleep_level}: expected 0, 1 "
                             "or 2")
        for name in ("page_size", "max_rows", "tensor"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutSettings.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def of_config(cls, cfg: Any) -> RolloutSettings:
        """The settings of a ``TrainConfig``'s ``rollout`` section."""
        r = cfg.rollout
        if r.sampler == "vllm":
            args = tuple(r.vllm.extra_args)
            share = vllm_flag(args, "--gpu-memory-utilization")
            tensor = vllm_flag(args, "--tensor-parallel-size")
            return cls("vllm", share=VLLM_DEFAULT_SHARE if share is None else float(share),
                       tensor=1 if tensor is None else int(tensor),
                       sleep_level=r.vllm.sleep_level, dtype=r.vllm.dtype)
        p = r.paged
        return cls(r.kv_cache, page_size=p.page_size, budget_tokens=p.budget_tokens,
                   memory_fraction=p.memory_fraction, max_rows=p.max_rows,
                   attention=p.attention)

    def label(self) -> str:
        """Short text for tables."""
        if self.engine == "vllm":
            tp = f", tp {self.tensor}" if self.tensor > 1 else ""
            return f"share {self.share:.2f}, sleep {self.sleep_level}{tp}"
        if self.engine == "paged":
            budget = f"{self.budget_tokens:,} tokens" if self.budget_tokens \
                else f"{self.memory_fraction:g} of free memory"
            return f"max_rows {self.max_rows}, pool {budget} (pages of {self.page_size})"
        return "all rows of the first round at once"

    def overrides(self) -> list[str]:
        """``key=value`` overrides that select these settings."""
        if self.engine == "vllm":
            args = [f"--gpu-memory-utilization={self.share:.2f}"]
            if self.tensor > 1:
                args.append(f"--tensor-parallel-size={self.tensor}")
            return ["rollout.sampler=vllm", f"rollout.vllm.extra_args=[{','.join(args)}]",
                    f"rollout.vllm.sleep_level={self.sleep_level}"]
        out = ["rollout.sampler=jax", f"rollout.kv_cache={self.engine}"]
        if self.engine == "paged":
            out += [f"rollout.paged.max_rows={self.max_rows}",
                    f"rollout.paged.budget_tokens={self.budget_tokens}",
                    f"rollout.paged.page_size={self.page_size}"]
        return out


def vllm_flag(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in vLLM server arguments (``["--f", "v"]``, ``["--f=v"]`` or one
    string holding several); None when absent. A flag without a value is a ValueError."""
    words = [w for a in args for w in shlex.split(str(a))]
    for i, word in enumerate(words):
        if word == flag:
            if i + 1 >= len(words) or words[i + 1].startswith("--"):
                raise ValueError(f"rollout.vllm.extra_args: {flag} has no value in {list(args)}")
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    """What one step rolls out. ``rows``: rows a host's first round decodes at once
    (``ceil(batch / hosts) x K``); ``prompt``: prompt tokens; ``max_new_tokens``: the per-turn
    decode cap; ``row_tokens``: the longest row (prompt + response window: the paged pool's
    unit); ``max_model_len``: vLLM's."""

    rows: int
    prompt: int
    max_new_tokens: int
    row_tokens: int
    max_model_len: int

    @classmethod
    def of_config(cls, cfg: Any, hosts: int = 1, length: int | None = None) -> RolloutShape:
        """A ``TrainConfig``'s rollout on ``hosts`` hosts; ``length`` (default 6,144 prompt +
        the protocol's response length) is the longest row, its prompt what the response
        leaves of it."""
        response = cfg.rollout.protocol.response_length
        row_tokens = length or PROMPT_TOKENS + response
        rows = rows_per_host(cfg.data.batch_size, cfg.data.group_size, hosts)
        return cls(rows=rows, prompt=max(1, row_tokens - response),
                   max_new_tokens=cfg.rollout.max_new_tokens, row_tokens=row_tokens,
                   max_model_len=cfg.rollout.vllm.max_model_len)


# ---------------------------------------------------------------------------- formulas
def kv_bytes_per_token(arch: ModelConfig, dtype: str) -> int:
    """Keys and values of one token over all layers: ``2 x L x K x H x bytes``."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * jnp.dtype(dtype).itemsize


def replica_dtype(cfg: Any) -> str:
    """The dtype the in-process sampler keeps its weights in: the policy's ``param_dtype``
    (``JaxSampler`` copies the trainer's arrays unchanged)."""
    return str(cfg.model.param_dtype)


def sharded_param_bytes(arch: ModelConfig, dtype: str, rules: Rules,
                        axis_sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of ``arch``'s parameters in ``dtype`` laid out by ``rules`` on a
    mesh of ``axis_sizes`` (``{"data": 1, "fsdp": 4, "tensor": 4}``); no devices needed. A
    sharded dimension the mesh does not divide is a ValueError naming the parameter."""
    total = 0
    for name, shape, axes, itemsize in _param_shapes(arch.replace(param_dtype=dtype)):
        local = []
        for dim, logical in zip(shape, axes, strict=True):
            target = rules.get(logical) if logical is not None else None
            mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
            split = math.prod(axis_sizes.get(a, 1) for a in mesh_axes)
            if dim % split:
                raise ValueError(f"{name}: dimension {logical!r} of size {dim} does not split "
                                 f"over mesh axes {mesh_axes} ({split})")
            local.append(dim // split)
        total += math.prod(local) * itemsize
    return total


@functools.cache
def _param_shapes(arch: ModelConfig) -> tuple[tuple[str, tuple[int, ...],
                                                    tuple[str | None, ...], int], ...]:
    """(name, shape, logical axes, itemsize) of every parameter of a :class:`Qwen3` of
    ``arch`` (built abstractly once per config)."""
    abstract = nnx.eval_shape(lambda: Qwen3(arch, rngs=nnx.Rngs(0)))
    return tuple((".".join(map(str, path)), tuple(var.shape),
                  tuple(var.get_metadata().get("logical_axes") or (None,) * var.ndim),
                  jnp.dtype(var.get_value().dtype).itemsize)
                 for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))


def decode_temporaries(arch: ModelConfig, rows: int, context: int, prompt: int,
                       tensor: int) -> int:
    """Bytes per device the dense sampler's programs need beyond weights and cache, a formula
    after its code (`sampling.dense_steps`; checked against XLA's compiled temporaries of a
    scaled router in `tests/test_plan_step.py`): the larger of

    * a decode step of ``rows`` rows (this device's) over ``context`` cache slots: the sampled
      logits ``rows x V`` fp32, :data:`SAMPLING_COPIES` times, and one layer's attention
      scores and probabilities ``2 x rows x (N / tensor) x context`` fp32;
    * the prefill of the ``rows`` rows of ``prompt`` tokens together (a group prefills at
      once): per row the MLP's three ``prompt x F / tensor`` intermediates (compute dtype),
      four fp32 ``prompt x D`` residual-stream copies, and one attention block's scores and
      probabilities ``2 x (N / tensor) x block x prompt`` fp32.
    """
    act = jnp.dtype(arch.dtype).itemsize
    decode = SAMPLING_COPIES * rows * arch.vocab_size * 4
    decode += 2 * rows * (arch.num_heads // tensor) * context * 4
    block = min(arch.attention_block, prompt)
    prefill = rows * (3 * prompt * (arch.intermediate_size // tensor) * act
                      + 4 * prompt * arch.hidden_size * 4
                      + 2 * (arch.num_heads // tensor) * block * prompt * 4)
    return max(decode, prefill)


def paged_width(row_tokens: int, page_size: int) -> int:
    """Key slots the paged engine's attention reads per row for a ``row_tokens``-token row:
    its page table's width, a power of two of pages (at least ``MIN_WIDTH``), times
    ``page_size``."""
    pages = -(-row_tokens // page_size)
    return max(MIN_WIDTH, 1 << (pages - 1).bit_length()) * page_size


def paged_temporaries(arch: ModelConfig, max_rows: int, row_tokens: int, page_size: int,
                      tensor: int, prefill_chunk: int = PagedConfig.prefill_chunk,
                      attention: str = "portable") -> int:
    """Bytes per device the paged engine's programs need beyond weights and pool, a formula
    after its code (`sampling.paged_engine`, `models.paged_attention`). With ``W`` =
    :func:`paged_width` key slots per row, attention in the compute dtype ``a`` bytes, the
    larger of

    * a decode step of all ``max_rows`` slots (every device runs every slot): the sampled
      logits ``max_rows x V`` fp32, :data:`SAMPLING_COPIES` times; on the ``portable`` path
      one layer's gathered keys and values ``2 x max_rows x W x (K / tensor) x H x a`` and its
      scores ``max_rows x (N / tensor) x W`` fp32 and probabilities in ``a`` (``pallas``: the
      kernel reads the pages in place, a block at a time, so none of these);
    * a prefill call of ``T`` = ``PREFILL_TOKENS`` tokens (``T / prefill_chunk`` rows of one
      chunk, the engine's cap): one layer's gathered keys and values for those rows, the
      chunk's scores ``T x (N / tensor) x W`` fp32 and probabilities in ``a`` (the chunk is
      at most one attention block), the MLP's three ``T x F / tensor`` intermediates and four
      fp32 ``T x D`` residual copies.
    """
    act = jnp.dtype(arch.dtype).itemsize
    width = paged_width(row_tokens, page_size)
    heads, kv = arch.num_heads // tensor, max(1, arch.num_kv_heads // tensor)
    decode = SAMPLING_COPIES * max_rows * arch.vocab_size * 4
    if attention == "portable":
        decode += (2 * max_rows * width * kv * arch.head_dim * act
                   + max_rows * heads * width * (4 + act))
    tokens = PREFILL_TOKENS
    rows = max(1, tokens // prefill_chunk)
    prefill = (2 * rows * width * kv * arch.head_dim * act
               + tokens * heads * width * (4 + act)
               + 3 * tokens * (arch.intermediate_size // tensor) * act
               + 4 * tokens * arch.hidden_size * 4)
    return max(decode, prefill)


@dataclasses.dataclass(frozen=True)
class SamplerMesh:
    """The in-process sampler's mesh, as axis sizes: ``batch`` shards (data x fsdp) and
    ``tensor``."""

    batch: int
    tensor: int

    @classmethod
    def of(cls, target: Target, train_mesh: Sequence[int]) -> SamplerMesh:
        """One host: the training mesh. Several: each host's devices, tensor parallel over the
        training mesh's tensor degree when it divides them (else 1), as
        ``rl.run.replica.sampler_mesh_shape``."""
        data, fsdp, tensor = train_mesh
        if target.hosts == 1:
            return cls(data * fsdp, tensor)
        local = target.local_devices
        tensor = tensor if local % tensor == 0 else 1
        return cls(local // tensor, tensor)


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """The rollout engine per device (bytes): ``weights`` (the JAX replica, or vLLM's
    weights), ``kv`` (cache or page pool), ``temporaries`` (decode/prefill; vLLM's
    overhead), ``kept`` (what stays through the update and the reference pass),
    ``resident`` (all of it while rollouts run), ``kv_tokens`` (tokens the KV memory holds,
    over the engine's whole mesh), ``shards`` (the batch shards those tokens split over: a
    row lives on one), ``row_tokens`` (the longest row the engine must hold) and ``rows``
    (decode slots; 0 = bounded by the KV memory only)."""

    engine: Engine
    weights: int
    kv: int
    temporaries: int
    kept: int
    resident: int
    kv_tokens: int
    shards: int
    row_tokens: int
    rows: int

    @property
    def full_rows(self) -> int:
        """Full-length rows in flight at once: what each shard's KV memory holds, times the
        shards, at most ``rows``."""
        n = self.kv_tokens // self.shards // self.row_tokens * self.shards
        return min(n, self.rows) if self.rows else n

    @property
    def holds_a_row(self) -> bool:
        """A shard's KV memory holds one full-length row (else a long row never finishes)."""
        return self.kv_tokens // self.shards >= self.row_tokens


def rollout_memory(settings: RolloutSettings, arch: ModelConfig, shape: RolloutShape,
                   mesh: SamplerMesh, *, memory_bytes: int, params: int,
                   param_dtype: str, backend: str = "gpu") -> RolloutMemory:
    """The engine of ``settings`` per device. ``memory_bytes``: one device's memory (vLLM's
    share and the paged pool's ``memory_fraction`` are of it); ``params``: the policy's bytes
    per device (what is allocated when the sampler starts, before the optimizer state and the
    reference); ``param_dtype``: the JAX replica's dtype (:func:`replica_dtype`); ``backend``:
    the target's kind ("tpu", "gpu"), which the paged ``attention`` path depends on."""
    if settings.engine == "vllm":
        return _vllm_memory(settings, arch, shape, memory_bytes)
    if arch.num_kv_heads % mesh.tensor:
        raise ValueError(f"the sampler's tensor degree {mesh.tensor} does not divide the "
                         f"{arch.num_kv_heads} KV heads")
    replica = sharded_param_bytes(arch, param_dtype, SAMPLE_RULES,
                                  {"fsdp": mesh.batch, "tensor": mesh.tensor})
    per_token = kv_bytes_per_token(arch, arch.dtype) // mesh.tensor  # this device's heads
    if settings.engine == "dense":
        rows = -(-shape.rows // mesh.batch)
        slots = shape.prompt + shape.max_new_tokens
        kv = rows * slots * per_token
        temps = decode_temporaries(arch, rows, slots, shape.prompt, mesh.tensor)
        return RolloutMemory("dense", replica, kv, temps, kept=replica,
                             resident=replica + kv + temps, kv_tokens=rows * slots * mesh.batch,
                             shards=mesh.batch, row_tokens=slots, rows=shape.rows)
    page = settings.page_size
    if settings.budget_tokens:
        pages = settings.budget_tokens // page
    else:
        free = memory_bytes - params - replica
        tokens = min(int(settings.memory_fraction * max(0, free)) // per_token,
                     settings.max_rows * arch.max_position_embeddings)
        pages = tokens // page
    kv = pages * page * per_token
    logits = settings.max_rows * arch.vocab_size * 4  # the slots' next-token logits, kept
    temps = paged_temporaries(arch, settings.max_rows, shape.row_tokens, page, mesh.tensor,
                              attention=attention_path(settings.attention, backend))
    return RolloutMemory("paged", replica, kv + logits, temps, kept=replica + kv + logits,
                         resident=replica + kv + logits + temps, kv_tokens=pages * page,
                         shards=1, row_tokens=shape.row_tokens, rows=settings.max_rows)


def _vllm_memory(settings: RolloutSettings, arch: ModelConfig, shape: RolloutShape,
                 memory_bytes: int) -> RolloutMemory:
    if arch.num_kv_heads % settings.tensor:
        raise ValueError(f"--tensor-parallel-size {settings.tensor} does not divide the "
                         f"{arch.num_kv_heads} KV heads")
    share = int(settings.share * memory_bytes)
    weights = sharded_param_bytes(arch, settings.dtype, SAMPLE_RULES,
                                  {"tensor": settings.tensor})
    overhead = min(int(VLLM_OVERHEAD_GIB * GIB), max(0, share - weights))
    kv = max(0, share - weights - overhead)
    per_token = kv_bytes_per_token(arch, settings.dtype) // settings.tensor
    kept = share if settings.sleep_level == 0 else min(share, int(VLLM_SLEEP_RESIDUE_GIB * GIB))
    return RolloutMemory("vllm", weights, kv, overhead, kept=kept, resident=share,
                         kv_tokens=kv // per_token, shards=1, row_tokens=shape.max_model_len,
                         rows=0)
