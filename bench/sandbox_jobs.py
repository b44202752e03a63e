"""Sandbox jobs launched from a trainer-sized process: the job's cost, and what it is made of.

Prints, never fails on speed. The process first holds `--hold-gb` GiB of XLA buffers (the
quickstart's trainer peaks at about 2.5-3 GiB resident), then runs `--jobs` short programs at
once through `Sandbox.arun` (as the episode runner's executor feedback does), for each of:

- the sandbox as it is (the after-job `kill(-1)` run by a killer that drops to the job's uid
  itself, `--workers` children at a time);
- the reference: the killer started through `subprocess.run(..., user=uid, group=uid,
  extra_groups=[])`, as before, which makes CPython fork the whole process instead of vfork;
- one worker instead of `--workers`.

Each row is the median of `--repeats` batches. Needs root (the uid drop); elsewhere there is
no per-job killer and the script says so.

    .venv/bin/python bench/sandbox_jobs.py [--jobs 24 --workers 2 --hold-gb 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from rich.console import Console
from rich.table import Table

from jax_routeweaver.rewards import sandbox


def _kill_uid_via_user(uid: int) -> None:
    """The reference killer: `kill -9 -1` started with Popen's `user=`."""
    kill = shutil.which("kill", path=sandbox._CHILD_PATH)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([kill, "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       env={"PATH": sandbox._CHILD_PATH}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, cwd="/")


def _batch_seconds(box: sandbox.Sandbox, jobs: int, repeats: int) -> float:
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
    rows = []
    box = sandbox.Sandbox(args.workers)
    box.run("print(1)")  # the isolation probe
    if not box.isolation.uid_drop:
        print(f"no uid drop on this host ({box.isolation}): there is no per-job killer to time")
    now = _batch_seconds(box, args.jobs, args.repeats)
    rows.append((f"as is, {args.workers} workers", now))
    original = sandbox._kill_uid
    sandbox._kill_uid = _kill_uid_via_user
    try:
        rows.append((f"reference: killer via Popen(user=), {args.workers} workers",
                     _batch_seconds(box, args.jobs, args.repeats)))
    finally:
        sandbox._kill_uid = original
    box.close()
    one = sandbox.Sandbox(1)
    rows.append(("as is, 1 worker", _batch_seconds(one, args.jobs, args.repeats)))
    one.close()

    table = Table(title=f"{args.jobs} short jobs at once, {args.hold_gb:g} GiB held, "
                        f"{os.cpu_count()} CPUs")
    for col in ("sandbox", "s / batch", "ms / job", "x as is"):
        table.add_column(col, justify="left" if col == "sandbox" else "right")
    for name, seconds in rows:
        table.add_row(name, f"{seconds:.2f}", f"{1000 * seconds / args.jobs:.0f}",
                      f"{seconds / now:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
