"""Multi-host: two processes x 4 CPU devices (jax.distributed, localhost coordinator, gloo)
train exactly like one process with 8 devices; the runtime is set up from the environment; the
whole training loop runs on two processes."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jax_routeweaver.models.sharding import to_host
from jax_routeweaver.rl.reports.run_log import read_metrics
from jax_routeweaver.rl.run import distributed
from jax_routeweaver.rl.run.checkpoint import StateCheckpointer, restore_policy

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "SLURM_", "TPU_", "OMPI_", "ROUTEWEAVER_DISTRIBUTED"))}
    env["JAX_PLATFORMS"] = "cpu"
    return {**env, **extra}


def run_two_processes(cmd: list[str], devices_each: int) -> list[str]:
    """Run ``cmd`` as processes 0 and 1 of one jax.distributed runtime (localhost coordinator,
    ``devices_each`` CPU devices per process); their outputs, after asserting both succeeded."""
    port = free_port()
    procs = [subprocess.Popen(
        cmd, env=worker_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                            JAX_PROCESS_ID=str(i),
                            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path, devices):
    run_two_processes([sys.executable, str(HERE / "distributed_worker.py"),
                       str(tmp_path / "two.npz"), str(tmp_path / "two_ckpt")], 4)
    single = subprocess.run(
        [sys.executable, str(HERE / "distributed_worker.py"), str(tmp_path / "one.npz"),
         str(tmp_path / "one_ckpt")],
        env=worker_env(ROUTEWEAVER_DISTRIBUTED="off",
                       XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]

    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    assert int(two["processes"]) == 2 and int(two["local_devices"]) == 4
    assert int(one["processes"]) == 1 and int(one["local_devices"]) == 8
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert two["losses"][1] != two["losses"][0]  # the first step changed the policy
    names = [k for k in one.files if k not in ("losses", "processes", "local_devices")]
    assert names and set(names) == {k for k in two.files
                                    if k not in ("losses", "processes", "local_devices")}
    for k in names:
        np.testing.assert_allclose(two[k], one[k], atol=1e-5, err_msg=k)

    # The orbax checkpoints both processes wrote together read back here (one process, the
    # test's 8 devices) as the parameters process 0 gathered, and the train state is whole.
    restored, step = restore_policy(tmp_path / "two_ckpt" / "policy")
    assert step == 2
    for path, var in nnx.to_flat_state(nnx.state(restored, nnx.Param)):
        np.testing.assert_array_equal(np.asarray(var.get_value()), two[".".join(path)])
    with StateCheckpointer(tmp_path / "two_ckpt" / "state") as states:
        assert states.latest_step() == 2 and states.read_loop() == {"step": 2}


def test_runtime_from_the_environment():
    assert distributed.initialize({"ROUTEWEAVER_DISTRIBUTED": "off"}) == distributed.Runtime()
    # Nothing multi-host in the environment: one process, no jax.distributed call.
    single = distributed.initialize({"SLURM_NTASKS": "1"})
    assert single.num_processes == 1 and single.is_main
    with pytest.raises(ValueError, match="ROUTEWEAVER_DISTRIBUTED='maybe'"):
        distributed.initialize({"ROUTEWEAVER_DISTRIBUTED": "maybe"})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"):
        distributed.initialize({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=2 not in"):
        distributed.initialize({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                "JAX_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="must be integers"):
        distributed.initialize({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two",
                                "JAX_PROCESS_ID": "0"})


@pytest.mark.parametrize("env, multi", [
    ({}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1"}, False),
    ({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}, True),
    ({"SLURM_NTASKS": "2"}, True),
    ({"SLURM_NTASKS": "1"}, False),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, True),
])
def test_multi_host_launches_are_detected(env, multi):
    assert distributed._detected(env) is multi


def test_allgather_and_to_host_single_process():
    assert distributed.allgather_objects({"a": 1}) == [{"a": 1}]
    np.testing.assert_array_equal(to_host(np.arange(3)), np.arange(3))


def test_host_shares_cover_the_batch_and_merge_back_in_order():
    from jax_routeweaver.rl.run.distributed import host_share, merge_host_shares

    queries, k = list("abcdefg"), 3
    for hosts in (1, 2, 3, 4):
        shares = [host_share(queries, p, hosts) for p in range(hosts)]
        assert sorted(q for s in shares for q in s) == queries
        # Each host's trajectories: K per query of its share, in its order.
        rolled = [[f"{q}{i}" for q in share for i in range(k)] for share in shares]
        assert merge_host_shares(rolled, k) == [f"{q}{i}" for q in queries for i in range(k)]


@pytest.mark.slow
def test_two_hosts_run_the_training_loop(tmp_path):
    """`routeweaver train` on two processes x 2 CPU devices: each host rolls out its share of
    the queries with the in-process sampler (a policy replica on its own devices), every host
    trains on the whole batch, and only process 0 writes the config, logs, plots and summary."""
    out = tmp_path / "run"
    quickstart = HERE.parent / "configs" / "quickstart.yaml"
    cmd = [sys.executable, "-m", "jax_routeweaver.cli", "train", "--config", str(quickstart),
           f"out_dir={out}", "model.init=random", "steps=2", "data.batch_size=5",
           "data.group_size=2",
           "data.quotas={MATH: 1, CODE: 1, KNOWLEDGE: 1, REASON: 1, RECALL: 1}",
           "data.synthetic_queries=60",
           "algo.exploration.forced_start_batch=0", "algo.exploration.forced_anneal_steps=1",
           "rollout.max_new_tokens=48", "rollout.prompt_buckets=[256,1024,4096]",
           "logging.progress=false", "logging.tensorboard=false", "checkpoint.full_every=2"]
    outs = run_two_processes(cmd, 2)

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # one writer: no line twice
    for r in records:
        # Process 0 rolled out queries 0, 2, 4 of the five; the update saw all ten rows.
        assert r["rollout/host_queries"] == 3
        assert sum(v for k, v in r.items() if k.startswith("rows/by_domain/")) == 10
        assert r["policy/version"] == r["step"]
    assert (out / "config.yaml").is_file() and (out / "run.json").is_file()
    assert (out / "reward.png").is_file() and (out / "mode_shares.png").is_file()
    assert "reward: first" in outs[0] and "reward: first" not in outs[1]
    model, step = restore_policy(out / "checkpoints" / "policy")
    assert step == 2 and model.config.num_layers == 2


@pytest.mark.slow
@pytest.mark.parametrize(("tensor", "shape"), [(2, (1, 4, 2)), (3, (1, 8, 1)), (-1, (1, 8, 1))])
def test_a_hosts_sampler_copy_is_resharded_on_its_own_devices(devices, tensor, shape):
    """One process of 8 devices: the policy FSDP-sharded for training comes back as the
    sampler's copy on this host's sampler mesh, equal, as device arrays (no host copy)."""
    import jax
    from test_trainer import CFG

    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.models.sharding import create_sharded, make_mesh
    from jax_routeweaver.rl.run.replica import HostReplicas, replica_model

    model = create_sharded(lambda: Qwen3(CFG, rngs=nnx.Rngs(0)), make_mesh((2, 4, 1)))
    replicas = HostReplicas(model, tensor)
    assert tuple(replicas.mesh.shape.values()) == shape
    assert set(replicas.mesh.devices.flat) == set(devices)
    copy = replicas.refresh(nnx.state(model, nnx.Param))
    sampler_model = replica_model(model, copy)
    theirs = dict(nnx.to_flat_state(nnx.state(sampler_model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = theirs[path].get_value()
        assert isinstance(value, jax.Array) and value.sharding.mesh.shape == replicas.mesh.shape
        assert value.sharding.spec == replicas.specs[path]
        np.testing.assert_array_equal(np.asarray(value), np.asarray(var.get_value()))
    with pytest.raises(ValueError, match="are not parameters of the model"):
        replicas.refresh({("nope",): np.zeros(3)})


def test_refresh_bytes_before_and_after():
    from jax_routeweaver.rl.run.replica import refresh_bytes

    gib = 2**30  # a 4B model in fp32 is ~16 GB; a host of 4 devices, sampler tensor 4
    before = refresh_bytes(16 * gib, devices_per_host=4, tensor=4, gather_to_host=True)
    after = refresh_bytes(16 * gib, devices_per_host=4, tensor=4, gather_to_host=False)
    assert before.host_memory == 32 * gib and before.device_received == 16 * gib
    assert after.host_memory == 0 and after.device_received == 16 * gib
    # tensor 3 does not divide 4 devices: every device keeps the whole model
    assert refresh_bytes(gib, devices_per_host=4, tensor=3,
                         gather_to_host=False).device_received == 4 * gib
