"""Multi-host runtime: ``jax.distributed`` set up from the environment, and host-side helpers.

Every host runs the same ``routeweaver train`` command; :func:`initialize` joins them into
one JAX runtime whose mesh spans all hosts' devices:

* Cloud TPU pod slices, SLURM (one task per host) and the other clusters JAX detects
  (Kubernetes, Open MPI): automatic, from the platform's own variables;
* anywhere else (bare machines, a Kubernetes job without JAX's detection): the explicit
  ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID``; ``JAX_LOCAL_DEVICE_IDS`` (JAX's own variable) picks this host's devices.

``ROUTEWEAVER_DISTRIBUTED`` = ``auto`` (default: join when one of the above is present),
``on`` (always call ``jax.distributed.initialize``, failing loudly if nothing is found) or
``off`` (single process). On CPU (tests, the quickstart) collectives between processes go
through gloo.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

MODES = ("auto", "on", "off")
_EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where this process stands: ``process_id`` of ``num_processes``, and how it joined
    ("single", "explicit" or "detected")."""

    process_id: int = 0
    num_processes: int = 1
    how: str = "single"

    @property
    def is_main(self) -> bool:
        """Process 0 writes logs, plots and exports."""
        return self.process_id == 0


def _detected(env: Mapping[str, str]) -> bool:
    """A multi-host launch JAX can configure itself from (TPU pod slice, SLURM step with
    more than one task, Open MPI, a Kubernetes indexed job)."""
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts:
        return True
    if int(env.get("SLURM_NTASKS", env.get("SLURM_STEP_NUM_TASKS", "1")) or 1) > 1:
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return "JOB_COMPLETION_INDEX" in env and "JAX_NUM_PROCESSES" in env


def initialize(env: Mapping[str, str] | None = None) -> Runtime:
    """Join the multi-host runtime described by ``env`` (default ``os.environ``); idempotent.

    Must run before anything touches a JAX backend. Raises ValueError naming the variable
    for a bad mode or an incomplete explicit setup."""
    env = os.environ if env is None else env
    mode = env.get("ROUTEWEAVER_DISTRIBUTED", "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"ROUTEWEAVER_DISTRIBUTED={mode!r}: expected one of {MODES}")
    if jax.distributed.is_initialized():
        return Runtime(jax.process_index(), jax.process_count(), "already")
    if mode == "off":
        return Runtime()
    given = [k for k in _EXPLICIT if env.get(k)]
    if given:
        missing = [k for k in _EXPLICIT if not env.get(k)]
        if missing:
            raise ValueError(f"{', '.join(given)} set but {', '.join(missing)} missing: the "
                             "explicit multi-host setup needs all three")
        try:
            num, pid = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except ValueError as e:
            raise ValueError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers ({e})") from e
        if not 0 <= pid < num:
            raise ValueError(f"JAX_PROCESS_ID={pid} not in [0, JAX_NUM_PROCESSES={num})")
        _cpu_collectives()
        jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], num, pid)
        return Runtime(pid, num, "explicit")
    if mode == "on" or _detected(env):
        _cpu_collectives()
        jax.distributed.initialize()
        return Runtime(jax.process_index(), jax.process_count(), "detected")
    return Runtime()


def _cpu_collectives() -> None:
    # Cross-process collectives on the CPU backend need an implementation (none by default);
    # harmless on TPU/GPU, whose collectives are their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order; ``[obj]`` single-process."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    gathered = multihost_utils.process_allgather(padded)
    return [pickle.loads(gathered[i, :int(n)].tobytes()) for i, n in enumerate(sizes.ravel())]


def host_share(records: list[Any], process: int, processes: int) -> list[Any]:
    """The queries process ``process`` of ``processes`` rolls out: every ``processes``-th,
    from its index (all K rollouts of a query stay on one host, so its group is whole)."""
    return list(records[process::processes])


def rows_per_host(batch_size: int, group_size: int, hosts: int) -> int:
    """The rollouts of the largest host share of a step (`host_share` of ``batch_size``
    queries over ``hosts``, K = ``group_size`` each): ``ceil(batch / hosts) x K``, what one
    host's sampler runs at once in a step's first round (the run sizes its sampler by it and
    the memory plan prices it)."""
    return -(-batch_size // hosts) * group_size


def merge_host_shares(shares: list[list[Any]], group_size: int) -> list[Any]:
    """Trajectories of all hosts (``shares[p]``: process p's, K per query, in its queries'
    order) back in batch order: query j is process ``j % P``'s ``(j // P)``-th."""
    groups = [[share[i:i + group_size] for i in range(0, len(share), group_size)]
              for share in shares]
    total = sum(len(g) for g in groups)
    return [t for j in range(total) for t in groups[j % len(shares)][j // len(shares)]]
