"""Rollout time of the embedded default with choice grammars decoded on device vs on the host.

Runs `routeweaver train` on configs/quickstart.yaml twice for ``--steps`` steps: once with
``rollout.device_choices=false`` (the reference: the host matchers make every step's mask, one
host round trip per generated token) and once with ``true`` (the tries travel to the device as
arrays and a turn runs in one loop). Both sample the same tokens from the same seeds, so the
two runs take the same steps. Prints the median rollout, sampler and step time over the steps
after the first (which compiles) and the ratios host / device.

    .venv/bin/python bench/choice_decoding.py [--steps 6] [--json PATH] [key=value ...]
"""

from __future__ import annotations

from quickstart_ab import parse_args, report, run_arms


def main() -> None:
    args = parse_args(__doc__)
    rows = run_arms([("host masks", ["rollout.device_choices=false"]),
                     ("on device", ["rollout.device_choices=true"])],
                    args.steps, args.overrides)
    report(rows, bench="choice_decoding", reference="host masks, one round trip per token "
           "(rollout.device_choices=false)", title="quickstart rollouts", json_path=args.json,
           config={"steps": args.steps, "overrides": args.overrides})


if __name__ == "__main__":
    main()
