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

from quickstart_ab import parse_args, report, run_arms

REUSED = {"rollout/prefix_tokens": "reused tokens / step"}


def main() -> None:
    args = parse_args(__doc__, {"--mb": {"type": float, "default": 1024.0,
                                         "help": "prefix cache of the reuse run"}})
    rows = run_arms([("full prefill", ["rollout.prefix_cache_mb=0"]),
                     ("prefix reuse", [f"rollout.prefix_cache_mb={args.mb}"])],
                    args.steps, args.overrides, REUSED)
    report(rows, bench="prefix_reuse", reference="full prefill every turn "
           "(rollout.prefix_cache_mb=0)", title="quickstart rollouts", json_path=args.json,
           config={"steps": args.steps, "mb": args.mb, "overrides": args.overrides},
           medians=REUSED)


if __name__ == "__main__":
    main()
