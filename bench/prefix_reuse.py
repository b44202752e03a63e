"""Rollout time of the embedded default with and without prefix reuse in the JAX sampler.

Runs `routeweaver train` on configs/quickstart.yaml twice for ``--steps`` steps, once with
``rollout.prefix_cache_mb=0`` (the reference: every turn prefills its whole context) and once
with ``--mb`` MB of prefix cache (a turn prefills only the tokens after the earlier turns'
cached keys and values). Both runs are deterministic and sample from the same seeds; their
tokens may still part where reused and recomputed keys differ in the last float bits. Prints
the median rollout and step time over the steps after the first (which compiles), the reused
tokens per step, and the ratios full / reuse.

    .venv/bin/python bench/prefix_reuse.py [--steps 6] [--mb 1024] [--json PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from suite import write_bench_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.rl.loop import train  # noqa: E402
from jax_routeweaver.rl.train_config import load_train_config  # noqa: E402

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def run(out: Path, steps: int, extra: list[str]) -> list[dict]:
    overrides = [f"out_dir={out}", f"steps={steps}", "logging.progress=false",
                 "logging.tensorboard=false", "logging.plots=false", *extra]
    cfg = load_train_config(QUICKSTART, overrides)
    return train(cfg, console=Console(quiet=True)).metrics


def median(records: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mb", type=float, default=1024.0, help="prefix cache of the reuse run")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is left out)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("full prefill", ["rollout.prefix_cache_mb=0"]),
                            ("prefix reuse", [f"rollout.prefix_cache_mb={args.mb}"])):
            records = run(Path(tmp) / name.replace(" ", "_"), args.steps,
                          [*args.overrides, *extra])
            rows.append({"sampler": name, "rollout_s": median(records, "time/rollout_s"),
                         "step_s": median(records, "time/step_s"),
                         "reused_tokens": median(records, "rollout/prefix_tokens"),
                         "task_reward": statistics.mean(r["reward/mean"] for r in records)})
    table = Table(title=f"quickstart rollouts, median of steps 2..{args.steps}")
    for col in ("sampler", "rollout s", "step s", "reused tokens / step", "mean task reward"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["sampler"], f"{r['rollout_s']:.2f}", f"{r['step_s']:.2f}",
                      f"{r['reused_tokens']:.0f}", f"{r['task_reward']:.3f}")
    console = Console()
    console.print(table)
    full, reuse = rows
    ratios = {"rollout_full_over_reuse": full["rollout_s"] / reuse["rollout_s"],
              "step_full_over_reuse": full["step_s"] / reuse["step_s"]}
    console.print(f"rollout time full / reuse: {ratios['rollout_full_over_reuse']:.2f}x; "
                  f"step time: {ratios['step_full_over_reuse']:.2f}x")
    if args.json:
        write_bench_json(args.json, "prefix_reuse", "full prefill every turn "
                         "(rollout.prefix_cache_mb=0)", rows, ratios,
                         {"steps": args.steps, "mb": args.mb, "overrides": args.overrides})


if __name__ == "__main__":
    main()
