"""One process of the multi-host trainer test (tests/test_distributed.py): joins the runtime
from the environment (``rl.run.distributed.initialize``), builds the tiny policy on the mesh of all
processes' devices, runs two optimizer steps on fixed batches, saves the policy and the full
train state with orbax (every process writes its shards, as orbax expects) under ``argv[2]``,
and writes the losses and the final parameters (gathered) to ``argv[1]`` (process 0 only)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from flax import nnx

from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import create_sharded, make_mesh, to_host
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch
from jax_routeweaver.rl.run.checkpoint import StateCheckpointer, save_policy
from jax_routeweaver.rl.run.distributed import initialize
from jax_routeweaver.rl.run.replica import HostReplicas

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import CFG, random_batch


def main(out: str, ckpt: str) -> None:
    runtime = initialize()
    assert jax.device_count() == 8, jax.device_count()
    mesh = make_mesh((2, 4, 1))
    model = create_sharded(lambda: Qwen3(CFG, rngs=nnx.Rngs(0)), mesh)
    trainer = Trainer(model, OptimConfig(lr=1e-3), LossConfig(micro_batch_size=8), mesh=mesh)
    losses = []
    for step in range(2):
        metrics = trainer.update(UpdateBatch(**random_batch(n=16, seed=step)))
        losses.append(metrics["loss/total"])
    save_policy(trainer.model(), f"{ckpt}/policy", 2)
    with StateCheckpointer(f"{ckpt}/state") as states:
        states.save(2, trainer.state, {"step": 2})
    params = {".".join(map(str, k)): to_host(v.get_value())
              for k, v in nnx.to_flat_state(trainer.state.params)}
    # This host's sampler copy, resharded on device: tensor parallel over 2 of its own devices,
    # equal to the trainer's parameters, and nothing of it on another host's devices.
    replicas = HostReplicas(trainer.model(), tensor=2)
    assert tuple(replicas.mesh.shape.values()) == (1, jax.local_device_count() // 2, 2)
    for k, a in replicas.refresh(trainer.state.params).items():
        assert a.is_fully_addressable and a.sharding.device_set <= set(jax.local_devices())
        np.testing.assert_array_equal(np.asarray(a), params[".".join(map(str, k))])
    if runtime.is_main:
        np.savez(out, losses=np.array(losses), processes=runtime.num_processes,
                 local_devices=jax.local_device_count(), **params)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
