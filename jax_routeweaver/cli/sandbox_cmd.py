"""`routeweaver sandbox check`: attack this host's code sandbox and report which guarantees
hold; and selfcheck's one-line summary of the same."""

from __future__ import annotations

import argparse

from jax_routeweaver.cli.common import PROG, Command, one_line
from jax_routeweaver.rewards.sandbox import Sandbox, SandboxError
from jax_routeweaver.rewards.sandbox.isolation import REQUESTS


def _sandbox_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    c = sub.add_parser("check", help="attack this host's code sandbox and report which "
                                     "guarantees hold (docs/sandbox.md)",
                       description="Probe which isolation levels this host gives, then run "
                                   "each attack of jax_routeweaver/rewards/sandbox/check.py "
                                   "against one level. Exit 1 if a guarantee it promises "
                                   "does not hold, 2 if the level is not available.")
    c.add_argument("--isolation", choices=REQUESTS, default=None,
                   help="the level to attack, or the strongest this host gives (default: "
                        "$ROUTEWEAVER_SANDBOX, else full)")


def _sandbox(args: argparse.Namespace) -> int:
    from jax_routeweaver.rewards.sandbox import check

    for level, state in check.levels_available().items():
        print(f"{level:<11} {state}")
    box = Sandbox(2, isolation=args.isolation)
    try:
        report, ok = check.format_report(box, check.check(box))
    finally:
        box.close()
    print(report)
    return 0 if ok else 1


def sandbox_row() -> tuple[str, bool]:
    """selfcheck's line on the code sandbox (the default level, attacked) and whether every
    guarantee it promises holds."""
    from jax_routeweaver.rewards.sandbox import check

    box = Sandbox(2)
    try:
        outcomes = check.check(box)
        _, ok = check.format_report(box, outcomes)
        promised = check.EXPECTED[box.isolation.level]
        held = sum(o.holds for o in outcomes if o.name in promised)
        return (f"isolation {box.isolation.level}: {held}/{len(promised)} promised guarantees "
                f"hold (details: {PROG} sandbox check)"), ok
    except SandboxError as e:
        return one_line(e, 300), False
    finally:
        box.close()


SANDBOX = Command("sandbox", "the code sandbox: `sandbox check` attacks it on this host and "
                  "says which guarantees hold", _sandbox_arguments, _sandbox)
