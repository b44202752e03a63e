"""Multi-host sampler refresh: gathered to host memory (before) vs resharded on device (now).

Part 1 (measured): two processes x 4 CPU devices (jax.distributed on localhost, gloo), a
random router FSDP-sharded for training over all 8 devices; each host refreshes its sampler
copy (tensor parallel over 2 of its devices) the former way, `tree_to_host` (the whole model
gathered into host memory on every host, then placed on the host's sampler mesh), and the new
way, `rl.run.replica.HostReplicas.refresh`. Printed: seconds per refresh (median of 5 after a
warm-up) and the ratio new / before. CPU devices share one host's memory, so this shows the
cost of the host round trip, not an accelerator's interconnect.

Part 2 (counted, `rl.run.replica.refresh_bytes`): bytes one refresh moves per host for Qwen3-4B
(fp32 params) on multi-host targets.

    .venv/bin/python bench/replica_refresh.py [--shape mid]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, vocab_size=4096),
    "mid": dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                num_kv_heads=4, head_dim=64, vocab_size=32768),
}
ARCH = ROOT / "configs" / "paper" / "qwen3-4b-instruct-2507.json"
TARGETS = (  # (name, devices per host, sampler tensor degree)
    ("TPU v5e-16 (4 hosts x 4 chips)", 4, 4),
    ("TPU v5p-16 (2 hosts x 4 chips)", 4, 4),
    ("2 x (8 x A100-80GB)", 8, 8),
)


def worker(shape: str, out: str) -> None:
    """One process: time both refreshes; process 0 writes the medians to `out`."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.models.sharding import (
        SAMPLE_RULES,
        create_sharded,
        make_mesh,
        param_specs,
        tree_to_host,
    )
    from jax_routeweaver.rl.run.distributed import initialize
    from jax_routeweaver.rl.run.replica import HostReplicas, param_bytes

    runtime = initialize()
    cfg = ModelConfig(max_position_embeddings=1024, tie_word_embeddings=True, **SHAPES[shape])
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)), make_mesh((1, -1, 1)))
    params = nnx.state(model, nnx.Param)
    replicas = HostReplicas(model, tensor=2)
    local = make_mesh((1, 2, 2), devices=jax.local_devices())
    shardings = {p: jax.sharding.NamedSharding(local, s)
                 for p, s in param_specs(model, SAMPLE_RULES, mesh=local).items()}

    def before() -> None:
        host = dict(nnx.to_flat_state(tree_to_host(params)))
        placed = {p: jax.device_put(v.get_value(), shardings[p]) for p, v in host.items()}
        jax.block_until_ready(placed)

    def now() -> None:
        jax.block_until_ready(replicas.refresh(params))

    times = {}
    for name, fn in (("before", before), ("now", now)):
        fn()  # warm-up: compiles
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - started)
        times[name] = statistics.median(runs)
    if runtime.is_main:
        Path(out).write_text(json.dumps({**times, "bytes": param_bytes(model)}))


def measure(shape: str, work: Path) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "refresh.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--worker", shape, str(out)],
        env={**env, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
             "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
             "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) for i in range(2)]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"worker exited with {p.returncode}")
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="mid", choices=list(SHAPES))
    p.add_argument("--worker", nargs=2, metavar=("SHAPE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import tempfile

    sys.path.insert(0, str(ROOT))
    from flax import nnx

    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.rl.run.replica import param_bytes, refresh_bytes

    with tempfile.TemporaryDirectory(prefix="replica_refresh_") as tmp:
        r = measure(args.shape, Path(tmp))
    print(f"{args.shape} router ({r['bytes'] / 2**20:.0f} MiB fp32), 2 processes x 4 CPU "
          f"devices, sampler tensor 2: refresh before {r['before']:.3f} s, now "
          f"{r['now']:.3f} s, ratio now / before {r['now'] / r['before']:.2f}x")
    cfg = dataclasses.replace(ModelConfig.from_hf(ARCH), param_dtype="float32")  # the trainer's
    nbytes = param_bytes(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    gib = 2**30
    print(f"\nQwen3-4B ({ARCH.name}, {nbytes / gib:.1f} GiB of {cfg.param_dtype} params), per "
          "host per refresh (GiB): host memory | device received")
    for name, per_host, tensor in TARGETS:
        old = refresh_bytes(nbytes, devices_per_host=per_host, tensor=tensor,
                            gather_to_host=True)
        new = refresh_bytes(nbytes, devices_per_host=per_host, tensor=tensor,
                            gather_to_host=False)
        print(f"  {name}: before {old.host_memory / gib:.1f} | {old.device_received / gib:.1f}"
              f"; now {new.host_memory / gib:.1f} | {new.device_received / gib:.1f}")


if __name__ == "__main__":
    main()
