"""The paper's ablations on the simulated environment, side by side (never pass/fail).

Runs `routeweaver train` for the full method (configs/quickstart.yaml: COMET-GRPO, segment
reduction, progressive forced-mode curriculum, minimum-support loss) and for each ablation in
configs/ablations/ (wo_comet, wo_progressive, plain GRPO), for several seeds, each in its own
process; then prints the final task reward (mean of the last `--window` steps), the final mode
shares of the free arm and the entropy of those shares, mean ± std over seeds, and how many
distinct modes lead the five domains (the most chosen free mode per domain over the last
window; 1 = one mode for every question).

Reference (paper Table 2): without progressive exploration the policy collapsed to `single`;
without COMET it over-concentrated on `multi`.

    .venv/bin/python bench/ablations.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.data.records import Domain  # noqa: E402
from jax_routeweaver.rl.reports.metrics import window_mean  # noqa: E402
from jax_routeweaver.rl.reports.run_log import read_metrics  # noqa: E402

CONFIGS = {
    "comet (full)": ROOT / "configs" / "quickstart.yaml",
    "wo_comet": ROOT / "configs" / "ablations" / "wo_comet.yaml",
    "wo_progressive": ROOT / "configs" / "ablations" / "wo_progressive.yaml",
    "grpo": ROOT / "configs" / "ablations" / "grpo.yaml",
}
MODES = ("single", "multi", "agentic")


def run(name: str, config: Path, seed: int, out: Path, overrides: list[str],
        reuse: bool) -> list[dict]:
    run_dir = out / name.split()[0] / f"seed{seed}"
    metrics = run_dir / "metrics.jsonl"
    if not (reuse and (run_dir / "run.json").is_file()):
        cmd = [sys.executable, "-m", "jax_routeweaver.cli", "train", "--config", str(config),
               f"seed={seed}", f"out_dir={run_dir}", "checkpoint.resume=false",
               "logging.progress=false", *overrides]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(metrics)


def top_modes(records: list[dict], window: int) -> list[str]:
    """The most chosen free mode of each domain over the last ``window`` steps."""
    leaders = []
    for domain in (d.value for d in Domain):
        shares = {m: window_mean(records, f"mode/share_by_domain/{domain}/{m}", last=window)
                  for m in MODES}
        shares = {m: v for m, v in shares.items() if not math.isnan(v)}
        if shares:
            leaders.append(max(shares, key=shares.get))
    return leaders


def final_stats(records: list[dict], window: int) -> dict[str, float]:
    shares = {m: window_mean(records, f"mode/share_free/{m}", last=window) for m in MODES}
    probs = np.array([0.0 if math.isnan(v) else v for v in shares.values()])
    entropy = float(-(probs[probs > 0] * np.log(probs[probs > 0])).sum())
    return {"reward": window_mean(records, "reward/mean", last=window),
            "reward_first": window_mean(records, "reward/mean", first=window),
            **{f"share/{m}": v for m, v in shares.items()}, "entropy": entropy,
            "leading": float(len(set(top_modes(records, window))))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--window", type=int, default=10, help="steps averaged at the end")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "ablations")
    p.add_argument("--reuse", action="store_true", help="reuse finished runs under --out")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args()

    table = Table("config", "seeds", "reward first", "reward last", *[f"{m}" for m in MODES],
                  "share entropy (nats)", "modes leading a domain",
                  title="ablations (mean ± std over seeds)")
    for name in args.configs:
        stats = [final_stats(run(name, CONFIGS[name], s, args.out, args.overrides, args.reuse),
                             args.window) for s in args.seeds]
        cell = lambda key, fmt=".2f", stats=stats: (
            f"{np.mean([x[key] for x in stats]):{fmt}} ± {np.std([x[key] for x in stats]):{fmt}}")
        table.add_row(name, str(len(stats)), cell("reward_first"), cell("reward"),
                      *[cell(f"share/{m}") for m in MODES], cell("entropy"),
                      cell("leading", ".1f"))
    Console().print(table)


if __name__ == "__main__":
    main()
