"""Two runs of the embedded default that differ in one setting: the shared part of the
benches that time a sampler option (`prefix_reuse.py`, `choice_decoding.py`).

Each arm runs `routeweaver train` on configs/quickstart.yaml for ``steps`` steps (deterministic,
same seeds); a row holds the medians over the steps after the first (which compiles), the first
step's time and the mean task reward. `report` prints the rows and the reference arm's rollout
and step time over the other's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from suite import write_bench_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.rl.run.loop import train  # noqa: E402
from jax_routeweaver.rl.run.train_config import load_train_config  # noqa: E402

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# metric key -> column title; every row has these medians.
MEDIANS = {"time/rollout_s": "rollout s", "time/sampler_s": "sampler s", "time/step_s": "step s"}


def parse_args(doc: str, extra: dict[str, dict[str, Any]] | None = None) -> argparse.Namespace:
    """--steps (>= 2: the first compiles and is left out), --json, any `extra` options
    (flag -> add_argument keywords) and config overrides for both runs."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    for flag, kwargs in (extra or {}).items():
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is left out)")
    return args


def run(out: Path, steps: int, extra: list[str]) -> list[dict]:
    """Per-step metrics of a quiet quickstart run with `extra` overrides."""
    overrides = [f"out_dir={out}", f"steps={steps}", "logging.progress=false",
                 "logging.tensorboard=false", "logging.plots=false", *extra]
    cfg = load_train_config(QUICKSTART, overrides)
    return train(cfg, console=Console(quiet=True)).metrics


def median(records: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in records[1:])


def run_arms(arms: list[tuple[str, list[str]]], steps: int, overrides: list[str],
             medians: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per (name, extra overrides) arm; `medians` adds metric -> column title."""
    keys = {**MEDIANS, **(medians or {})}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in arms:
            records = run(Path(tmp) / name.replace(" ", "_"), steps, [*overrides, *extra])
            rows.append({"arm": name, **{key: median(records, key) for key in keys},
                         "time/first_step_s": records[0]["time/step_s"],
                         "task_reward": statistics.mean(r["reward/mean"] for r in records)})
    return rows


def report(rows: list[dict[str, Any]], *, bench: str, reference: str, title: str,
           json_path: str | None, config: dict[str, Any],
           medians: dict[str, str] | None = None) -> dict[str, float]:
    """Print the rows and the ratios first arm / second arm (rollout and step time); write
    them to `json_path` too when given. Returns the ratios."""
    cols = {**MEDIANS, **(medians or {})}
    table = Table(title=f"{title}, median of steps 2..{config['steps']}")
    for col in ("arm", *cols.values(), "step 1 s", "mean task reward"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["arm"], *(f"{r[key]:.2f}" for key in cols),
                      f"{r['time/first_step_s']:.2f}", f"{r['task_reward']:.3f}")
    console = Console()
    console.print(table)
    first, second = rows
    ratios = {f"{what}_ratio": first[f"time/{what}_s"] / second[f"time/{what}_s"]
              for what in ("rollout", "step")}
    console.print(f"{first['arm']} / {second['arm']}: rollout time "
                  f"{ratios['rollout_ratio']:.2f}x, step time {ratios['step_ratio']:.2f}x")
    if json_path:
        write_bench_json(json_path, bench, reference, rows, ratios, config)
    return ratios
