"""Rollout time of the embedded default with choice grammars decoded on device vs on the host.

Runs `routeweaver train` on configs/quickstart.yaml twice for ``--steps`` steps: once with
``rollout.device_choices=false`` (the reference: the host matchers make every step's mask, one
host round trip per generated token) and once with ``true`` (the tries travel to the device as
arrays and a turn runs in one loop). Both sample the same tokens from the same seeds, so the
two runs take the same steps. Prints the median rollout and step time over the steps after
the first (which compiles) and the ratios host / device.

    .venv/bin/python bench/choice_decoding.py [--steps 6] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from prefix_reuse import median, run
from rich.console import Console
from rich.table import Table
from suite import write_bench_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is left out)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, flag in (("host masks", "false"), ("on device", "true")):
            records = run(Path(tmp) / name.replace(" ", "_"), args.steps,
                          [*args.overrides, f"rollout.device_choices={flag}"])
            rows.append({"choices": name, "rollout_s": median(records, "time/rollout_s"),
                         "sampler_s": median(records, "time/sampler_s"),
                         "step_s": median(records, "time/step_s"),
                         "first_step_s": records[0]["time/step_s"],
                         "task_reward": statistics.mean(r["reward/mean"] for r in records)})
    table = Table(title=f"quickstart rollouts, median of steps 2..{args.steps}")
    for col in ("choice grammars", "rollout s", "sampler s", "step s", "step 1 s",
                "mean task reward"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["choices"], f"{r['rollout_s']:.2f}", f"{r['sampler_s']:.2f}",
                      f"{r['step_s']:.2f}", f"{r['first_step_s']:.2f}", f"{r['task_reward']:.3f}")
    console = Console()
    console.print(table)
    host, device = rows
    ratios = {"rollout_host_over_device": host["rollout_s"] / device["rollout_s"],
              "step_host_over_device": host["step_s"] / device["step_s"]}
    console.print(f"rollout time host / device: {ratios['rollout_host_over_device']:.2f}x; "
                  f"step time: {ratios['step_host_over_device']:.2f}x")
    if args.json:
        write_bench_json(args.json, "choice_decoding", "host masks, one round trip per token "
                         "(rollout.device_choices=false)", rows, ratios,
                         {"steps": args.steps, "overrides": args.overrides})


if __name__ == "__main__":
    main()
