"""Does Router-R1's PPO arm learn? Short runs of the Router-R1 quickstart with a critic.

Trains ``configs/router_r1_quickstart.yaml`` with ``algo.estimator=ppo_gae`` (one rollout per
prompt, a critic, GAE, reward-KL in the reward; the simulated pool) for each seed, then prints
per run: the mean ``reward/mean`` and ``r1/em`` of the first and last ``--window`` steps and
the change, the critic's explained variance over the last window, and the wall time. The
reference is the run's own start (the first window). Never pass/fail: the numbers go to
bench/RESULTS.md.

    .venv/bin/python bench/router_r1_ppo.py --seeds 0 1 2 --steps 60 --out /tmp/r1ppo
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402

from jax_routeweaver.rl.reports.metrics import window_mean  # noqa: E402
from jax_routeweaver.rl.run.loop import train  # noqa: E402
from jax_routeweaver.rl.run.train_config import load_train_config  # noqa: E402

CONFIG = ROOT / "configs" / "router_r1_quickstart.yaml"
# One rollout per prompt and 12 prompts a step (4 per domain), two PPO mini-batches for the
# actor and the critic, no KL loss (the KL is in the reward). The critic's lr matches the
# tiny policy's scale (the paper's 1e-5 is for a 3B critic).
PPO = ["algo.estimator=ppo_gae", "data.group_size=1", "data.batch_size=12",
       "data.quotas={MATH: 4, REASON: 4, RECALL: 4}", "data.synthetic_queries=1000",
       "data.repeat=true",
       "algo.loss.kl_coef=0", "algo.loss.ppo_mini_batches=2", "algo.loss.micro_batch_size=6",
       "algo.critic.lr=0.003", "checkpoint.full_every=1000", "logging.progress=false",
       "logging.tensorboard=false", "logging.plots=false"]
KEYS = ("reward/mean", "r1/em", "r1/calls")


def run(seed: int, steps: int, out: Path, extra: list[str]) -> tuple[list[dict], float]:
    cfg = load_train_config(CONFIG, [*PPO, f"seed={seed}", f"steps={steps}",
                                     f"out_dir={out / f'seed{seed}'}", *extra])
    start = time.perf_counter()
    result = train(cfg, console=Console(file=io.StringIO()))
    return result.metrics, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = parser.parse_args()
    w = args.window
    print(f"| seed | {' | '.join(f'{k} first {w} -> last {w} (Δ)' for k in KEYS)} "
          f"| explained var, last {w} | wall |")
    print("|---" * (len(KEYS) + 3) + "|")
    for seed in args.seeds:
        records, wall = run(seed, args.steps, args.out, args.overrides)
        cells = []
        for key in KEYS:
            a, b = window_mean(records, key, first=w), window_mean(records, key, last=w)
            cells.append(f"{a:.3f} -> {b:.3f} ({b - a:+.3f})")
        ev = window_mean(records, "ppo_gae/explained_variance", last=w)
        print(f"| {seed} | {' | '.join(cells)} | {ev:.2f} | {wall / 60:.1f} min |", flush=True)


if __name__ == "__main__":
    main()
