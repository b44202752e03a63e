"""Device mesh `('data', 'fsdp', 'tensor')` and the logical-axis -> mesh-axis rules.

Every parameter carries `logical_axes` metadata (see `models/qwen3.py`). A rules table maps each
logical name to a mesh axis, a tuple of mesh axes, or None (replicated). Two tables ship:
`TRAIN_RULES` (FSDP over `fsdp`, tensor parallel over `tensor`) and `SAMPLE_RULES` (tensor
parallel only; the copy used for generation is replicated over `fsdp`, so decode needs no
all-gather of weights). A mesh axis used twice in one spec, or a mesh axis that does not divide
the dimension it shards, is a `ShardingError` naming the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

TRAIN_RULES: Rules = {
    "batch": ("data", "fsdp"),
    "sequence": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,
    "head_norm": None,
}
SAMPLE_RULES: Rules = {**TRAIN_RULES, "embed": None}


class ShardingError(ValueError):
    """A rules table that cannot shard a parameter on the given mesh."""


def make_mesh(shape: Sequence[int] | Mapping[str, int] = (1, -1, 1),
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `('data', 'fsdp', 'tensor')` mesh; one entry may be -1 (all remaining devices).

    Axis types are Auto (jax 0.10's `make_mesh` defaults to Explicit, which classic GSPMD code
    does not expect).
    """
    if isinstance(shape, Mapping):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ShardingError(f"mesh axes {sorted(unknown)} unknown; expected {MESH_AXES}")
        shape = tuple(shape.get(a, 1) for a in MESH_AXES)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise ShardingError(f"mesh shape {shape} must have {len(MESH_AXES)} entries {MESH_AXES}")
    devices = list(devices if devices is not None else jax.devices())
    if shape.count(-1) > 1:
        raise ShardingError(f"mesh shape {shape}: at most one -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if len(devices) % known:
            raise ShardingError(f"mesh shape {shape} does not divide {len(devices)} devices")
        shape = tuple(len(devices) // known if s == -1 else s for s in shape)
    if math.prod(shape) != len(devices):
        raise ShardingError(f"mesh shape {shape} needs {math.prod(shape)} devices, "
                            f"have {len(devices)}")
    return jax.make_mesh(shape, MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], rules: Rules, *, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None, name: str = "array") -> PartitionSpec:
    """Map logical axis names to a PartitionSpec, checking collisions and divisibility."""
    spec: list[MeshAxes] = []
    used: dict[str, str] = {}
    for i, logical in enumerate(axes):
        if logical is None:
            spec.append(None)
            continue
        if logical not in rules:
            raise ShardingError(f"{name}: logical axis {logical!r} has no rule "
                                f"(rules cover {sorted(rules)})")
        target = rules[logical]
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        for m in mesh_axes:
            if m not in MESH_AXES:
                raise ShardingError(f"{name}: rule {logical!r} -> {m!r}: unknown mesh axis")
            if m in used:
                raise ShardingError(f"{name}: mesh axis {m!r} used by both logical axes "
                                    f"{used[m]!r} and {logical!r} (axes {tuple(axes)})")
            used[m] = logical
        if mesh is not None and shape is not None and mesh_axes:
            size = math.prod(mesh.shape[m] for m in mesh_axes)
            if shape[i] % size:
                raise ShardingError(
                    f"{name}: dimension {i} ({logical!r}) has size {shape[i]}, not divisible "
                    f"by mesh axes {mesh_axes} of size {size}")
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1
                    else mesh_axes)
    return PartitionSpec(*spec)


def param_specs(module: nnx.Module, rules: Rules,
                mesh: Mesh | None = None) -> dict[tuple[str, ...], PartitionSpec]:
    """PartitionSpec of every `nnx.Param` in `module`, keyed by its path."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        axes = var.get_metadata().get("logical_axes")
        name = ".".join(map(str, path))
        if axes is None or len(axes) != var.ndim:
            raise ShardingError(f"{name}: logical_axes {axes} do not match shape "
                                f"{var.shape}")
        out[tuple(path)] = logical_to_spec(axes, rules, mesh=mesh, shape=var.shape,
                                           name=name)
    return out


def _map_params(module: nnx.Module, fn) -> None:
    """Replace each parameter value v at path p by fn(p, v), in place."""
    state = nnx.state(module, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        var.set_value(fn(tuple(path), var[...]))
    nnx.update(module, state)


def create_sharded(constructor, mesh: Mesh, rules: Rules = TRAIN_RULES) -> nnx.Module:
    """Build `constructor()` with every parameter born sharded (never whole on one device)."""
    specs = param_specs(nnx.eval_shape(constructor), rules, mesh)

    @nnx.jit
    def init() -> nnx.Module:
        module = constructor()
        _map_params(module, lambda p, v: jax.lax.with_sharding_constraint(
            v, NamedSharding(mesh, specs[p])))
        return module

    return init()


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Rules = TRAIN_RULES) -> NamedSharding:
    """Sharding for a `[B, ...]` input: batch over the rule for `batch`, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def to_host(x: Any) -> np.ndarray:
    """An array as one numpy array on every process, gathering the shards other processes
    hold when it is sharded across hosts (multi-host `jax.distributed` runs)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def tree_to_host(tree: Any) -> Any:
    """`to_host` on every leaf of a pytree (a multi-host sampler's copy of the weights)."""
    return jax.tree.map(to_host, tree)


def describe(module: nnx.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, sharding spec string) for every parameter (for logs and tests)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        sharding = getattr(var[...], "sharding", None)
        spec = getattr(sharding, "spec", None)
        out[".".join(map(str, path))] = (tuple(var.shape), str(spec))
    return out
