"""The multi-host sampler's copy of the policy, refreshed on device every step.

In a multi-host run every host rolls out its share of the queries with its own copy of the
policy on its own devices: tensor parallel over ``tensor`` of them and replicated over the rest
(`SAMPLE_RULES` on the host's mesh). The trainer's parameters are FSDP-sharded over all hosts.

`HostReplicas` lays the hosts' sampler meshes side by side as one global mesh (its ``data``
axis is the host: row p holds process p's devices in its sampler mesh's order) and gives every
parameter its sampler sharding there. A refresh is a `jax.device_put` of each parameter onto
its sampler sharding: the runtime moves to each device the shard its host's sampler keeps
(gathers of the FSDP shards over the interconnect, device to device), and each host then views
its own shards as arrays on its sampler mesh, without a copy. Nothing passes through host
memory, where the former refresh gathered the whole fp32 model to every host
(`refresh_bytes` counts both). XLA's SPMD partitioner moves a tensor by replicating it and
then slicing (it warns "Involuntary full rematerialization"), so parameters are moved one at
a time: at most one whole tensor is in transit per device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, Rules, make_mesh, param_specs

Flat = dict[tuple[Any, ...], jax.Array]


def host_devices(process: int) -> list[jax.Device]:
    """Process `process`'s devices, in `jax.devices()` order."""
    return [d for d in jax.devices() if d.process_index == process]


def sampler_mesh_shape(local_devices: int, tensor: int) -> tuple[int, int, int]:
    """(1, rest, tensor) of a host's sampler mesh: tensor parallel over ``tensor`` devices when
    that divides the host's count (else, and for -1, over 1), the rest on the fsdp axis."""
    tensor = tensor if tensor > 0 and local_devices % tensor == 0 else 1
    return 1, local_devices // tensor, tensor


class HostReplicas:
    """Every host's sampler copy of a model's parameters, refreshed on device.

    `mesh` is this host's sampler mesh; `refresh(params)` takes the trainer's parameters
    (`{path: array}` or an `nnx.State` of `nnx.Param`s, any sharding) and returns this host's
    copy `{path: array}` placed on `mesh` by `rules`."""

    def __init__(self, model: Qwen3, tensor: int, rules: Rules = SAMPLE_RULES):
        processes = jax.process_count()
        rows = [host_devices(p) for p in range(processes)]
        if len({len(r) for r in rows}) != 1:
            raise ValueError(f"hosts hold different device counts {[len(r) for r in rows]}: "
                             "a sampler copy per host needs equal hosts")
        _, rest, tensor = sampler_mesh_shape(len(rows[0]), tensor)
        self.global_mesh = make_mesh((processes, rest, tensor),
                                     devices=[d for row in rows for d in row])
        self.mesh = Mesh(self.global_mesh.devices[jax.process_index()][None],
                         self.global_mesh.axis_names,
                         axis_types=self.global_mesh.axis_types)
        self.specs = param_specs(model, rules, mesh=self.mesh)
        self._global = {p: NamedSharding(self.global_mesh, s) for p, s in self.specs.items()}
        self._local = {p: NamedSharding(self.mesh, s) for p, s in self.specs.items()}

    def refresh(self, params: Flat | nnx.State) -> Flat:
        """This host's sampler copy of `params` (one collective reshard on device)."""
        flat = _flat(params)
        unknown = sorted(".".join(map(str, p)) for p in set(flat) - set(self._global))
        if unknown:
            raise ValueError(f"HostReplicas.refresh: {unknown[:3]} are not parameters of the "
                             "model the replicas were laid out for")
        out = {}
        for p, value in flat.items():
            # One tensor at a time: XLA's partitioner moves each by replicating it first, so
            # this bounds what is in transit to the largest tensor.
            moved = jax.block_until_ready(jax.device_put(value, self._global[p]))
            out[p] = jax.make_array_from_single_device_arrays(
                moved.shape, self._local[p], [s.data for s in moved.addressable_shards])
        return out


def _flat(params: Flat | nnx.State) -> Flat:
    if isinstance(params, nnx.State):
        return {tuple(p): v.get_value() if isinstance(v, nnx.Variable) else v
                for p, v in nnx.to_flat_state(params)}
    return dict(params)


@dataclasses.dataclass(frozen=True)
class RefreshBytes:
    """Bytes one refresh moves on one host: `host_memory`, written into and read back out of
    its RAM; `device_received`, landing on its devices (from RAM, or from other devices)."""

    host_memory: int
    device_received: int


def refresh_bytes(param_bytes: int, *, devices_per_host: int, tensor: int,
                  gather_to_host: bool) -> RefreshBytes:
    """What one refresh of a model of `param_bytes` (the trainer's dtype) moves on one host
    whose sampler mesh is tensor parallel over ``tensor`` of its ``devices_per_host`` devices
    (each device keeps ``param_bytes / tensor``).

    Gathered to host (the former way): the whole model lands in RAM, then each device's shard
    is copied out of it: host memory ``param_bytes (1 + devices_per_host / tensor)``.
    Resharded on device (`HostReplicas`): host memory 0. Either way each device receives its
    shard (at most; the part it held as an FSDP shard need not move).
    """
    shard = param_bytes / sampler_mesh_shape(devices_per_host, tensor)[2]
    received = int(devices_per_host * shard)
    return RefreshBytes(int(param_bytes + received) if gather_to_host else 0, received)


def param_bytes(model: Qwen3) -> int:
    """Bytes of `model`'s parameters in their dtype."""
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize
               for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def replica_model(model: Qwen3, params: dict) -> Qwen3:
    """``model`` with its parameters replaced by ``params`` (`HostReplicas.refresh`)."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, value in params.items():
        flat[path] = flat[path].replace(value) if isinstance(flat[path], nnx.Variable) \
            else value
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
