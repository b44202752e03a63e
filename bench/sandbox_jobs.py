"""Sandbox jobs launched from a trainer-sized process: what each isolation level costs per job.

Prints, never fails on speed. The process first holds `--hold-gb` GiB of XLA buffers (the
quickstart's trainer peaks at about 2.5-3 GiB resident), then runs `--jobs` short programs at
once through `Sandbox.arun` (as the episode runner's executor feedback does), with
`--workers` children at a time, under each isolation level this host gives:

- `full`: the bubblewrap jail plus a job cgroup (memory, tasks, CPU over the whole job);
- `namespaces`: the jail alone;
- `none` (the reference): a plain child of the same interpreter in a private temporary
  directory, the cost of running a program at all.

Each row is the median of `--repeats` batches; "x none" is the ratio to the reference.

    .venv/bin/python bench/sandbox_jobs.py [--jobs 24 --workers 2 --hold-gb 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from jax_routeweaver.rewards.sandbox import Sandbox, SandboxError


def _batch_seconds(box: Sandbox, jobs: int, repeats: int) -> float:
    async def batch():
        return await asyncio.gather(*(box.arun(f"print(sum(range({i} * 1000)))")
                                      for i in range(jobs)))

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = asyncio.run(batch())
        times.append(time.perf_counter() - start)
        if not all(r.ok for r in results):
            raise SystemExit(f"a job failed: {[r for r in results if not r.ok][:1]}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hold-gb", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    n = int(args.hold_gb * 2**30 / 4 / 16)
    held = [jnp.full((n,), i, jnp.float32) for i in range(16)]  # touched, resident
    jax.block_until_ready(held)
    rows: list[tuple[str, float | str]] = []
    for level in ("full", "namespaces", "none"):
        box = Sandbox(args.workers, isolation=level)
        try:
            box.run("print(1)")  # set-up and probe, outside the timing
            rows.append((level, _batch_seconds(box, args.jobs, args.repeats)))
        except SandboxError as exc:
            rows.append((level, f"not available: {exc}"))
        finally:
            box.close()
    reference = dict(rows)["none"]

    table = Table(title=f"{args.jobs} short jobs at once, {args.workers} workers, "
                        f"{args.hold_gb:g} GiB held, {os.cpu_count()} CPUs")
    for col in ("isolation", "s / batch", "ms / job", "x none"):
        table.add_column(col, justify="left" if col == "isolation" else "right")
    for name, seconds in rows:
        if isinstance(seconds, str):
            table.add_row(name, seconds, "", "")
            continue
        ratio = f"{seconds / reference:.2f}" if isinstance(reference, float) else "n/a"
        table.add_row(name, f"{seconds:.2f}", f"{1000 * seconds / args.jobs:.0f}", ratio)
    Console().print(table)


if __name__ == "__main__":
    main()
