"""Does a trained run route by the question? Issue 42's quickstart checks, from run files.

For each run directory (``metrics.jsonl``) and, optionally, `routeweaver eval favourites`
outputs (``favourites.json``) it prints:

* the reward change: mean ``reward/mean`` of the last 10 steps minus the first 10 (Δ);
* per domain, the most chosen mode over the last 10 steps (``mode/share_by_domain``) against
  the domain's measured favourite, and how many domains match;
* per domain, the most frequent first worker over the last 10 steps
  (``workers/first_by_domain``: the first call of every row) and its share, the most called
  worker overall (``workers/share_by_domain``), against the pool's most skilled worker for
  that domain at medium difficulty (`routing.simulated.profiles.DEFAULT_PROFILES`), and how
  many distinct first workers lead.

Never pass/fail: the numbers go to bench/RESULTS.md.

    .venv/bin/python bench/quickstart_routing.py --runs runs/q0 runs/q1 \
        --favourites eval/fav_q0 eval/fav_q1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.data.records import Domain  # noqa: E402
from jax_routeweaver.rl.reports.metrics import window_mean  # noqa: E402
from jax_routeweaver.rl.reports.run_log import read_metrics  # noqa: E402
from jax_routeweaver.routing.simulated.profiles import DEFAULT_PROFILES  # noqa: E402

MODES = ("single", "multi", "agentic")
WINDOW = 10


def best_skilled(domain: str) -> str:
    """The pool's most skilled worker on `domain` at medium difficulty."""
    return max(DEFAULT_PROFILES, key=lambda w: DEFAULT_PROFILES[w].p_correct(domain, "medium"))


def top(records: list[dict], prefix: str, names: list[str]) -> tuple[str, float]:
    """(name, share) of the largest last-window mean of ``prefix + name``."""
    shares = {n: window_mean(records, prefix + n, last=WINDOW) for n in names}
    shares = {n: v for n, v in shares.items() if v == v}  # drop NaN (never logged)
    if not shares:
        return "-", float("nan")
    name = max(shares, key=shares.get)
    return name, shares[name]


def report(run: Path, favourites: Path | None) -> None:
    records = read_metrics(run / "metrics.jsonl")
    first = window_mean(records, "reward/mean", first=WINDOW)
    last = window_mean(records, "reward/mean", last=WINDOW)
    fav = {}
    if favourites is not None:
        data = json.loads((favourites / "favourites.json").read_text())
        fav = {f["domain"]: f for f in data["favourites"]}
    workers = sorted(DEFAULT_PROFILES)
    print(f"## {run}  ({len(records)} steps)")
    print(f"reward first {first:.3f} last {last:.3f} delta {last - first:+.3f}")
    print("| domain | top mode (share) | favourite (margin, >2se) | match | top first worker "
          "(share) | top worker (share) | most skilled |")
    print("|---|---|---|---|---|---|---|")
    matches, leaders = 0, set()
    for domain in (d.value for d in Domain):
        mode, share = top(records, f"mode/share_by_domain/{domain}/", list(MODES))
        first_w, fshare = top(records, f"workers/first_by_domain/{domain}/", workers)
        worker, wshare = top(records, f"workers/share_by_domain/{domain}/", workers)
        leaders.add(first_w)
        f = fav.get(domain)
        if f is not None:
            matches += mode == f["mode"]
            favourite = f"{f['mode']} ({f['margin']:+.3f}, {'yes' if f['significant'] else 'no'})"
            match = "yes" if mode == f["mode"] else "no"
        else:
            favourite, match = "-", "-"
        print(f"| {domain} | {mode} ({share:.2f}) | {favourite} | {match} | {first_w} "
              f"({fshare:.2f}) | {worker} ({wshare:.2f}) | {best_skilled(domain)} |")
    if fav:
        print(f"domains whose top mode is the favourite: {matches} of {len(Domain)}")
    print(f"distinct top first workers across domains: {len(leaders)}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--favourites", type=Path, nargs="*", default=[],
                   help="one favourites output directory per run (same order), or none")
    args = p.parse_args()
    if args.favourites and len(args.favourites) != len(args.runs):
        p.error(f"--favourites: {len(args.favourites)} directories for {len(args.runs)} runs")
    for i, run in enumerate(args.runs):
        report(run, args.favourites[i] if args.favourites else None)


if __name__ == "__main__":
    main()
