"""Model helpers of the tests: place an already built model on a mesh (the package builds
models born sharded, `models.sharding.create_sharded`, or loads them onto a mesh,
`models.hf.load_hf(mesh=...)`)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jax_routeweaver.models.sharding import TRAIN_RULES, Rules, param_specs


def shard_model(module: nnx.Module, mesh: Mesh, rules: Rules = TRAIN_RULES) -> nnx.Module:
    """Place every parameter of `module` (in place) on `mesh` by `rules`; returns the module."""
    specs = param_specs(module, rules, mesh)
    state = nnx.state(module, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(var[...], NamedSharding(mesh, specs[tuple(path)])))
    nnx.update(module, state)
    return module
