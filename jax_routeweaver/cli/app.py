"""The `routeweaver` command line: the parser over every subcommand (`COMMANDS`) and `main`,
which runs one and turns expected failures into one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from jax_routeweaver.cli.common import PROG, Command, one_line
from jax_routeweaver.cli.cost_cmd import CALIBRATE_COST
from jax_routeweaver.cli.data_cmd import DATA
from jax_routeweaver.cli.eval_cmd import EVAL
from jax_routeweaver.cli.hf_cmd import EXPORT_HF, IMPORT_HF
from jax_routeweaver.cli.plan_cmd import PLAN
from jax_routeweaver.cli.sandbox_cmd import SANDBOX
from jax_routeweaver.cli.selfcheck_cmd import SELFCHECK
from jax_routeweaver.cli.serve_cmd import SERVE, SIMULATE_WORKERS
from jax_routeweaver.cli.train_cmd import TRAIN, WARM_START
from jax_routeweaver.rewards.sandbox import SandboxError

EXIT_ERROR = 2

UnraisableHook = Callable[["sys.UnraisableHookArgs"], object]

COMMANDS: tuple[Command, ...] = (IMPORT_HF, EXPORT_HF, TRAIN, WARM_START, SELFCHECK, SANDBOX,
                                 PLAN, CALIBRATE_COST, DATA, EVAL, SERVE,
                                 SIMULATE_WORKERS)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The `routeweaver` parser: -v/--verbose, --traceback and one subcommand per entry of
    `commands`, whose `run` becomes the parsed namespace's `run`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Train LLM routers with RL in JAX/Flax.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show library logs (orbax, jax)")
    parser.add_argument("--traceback", action="store_true",
                        help="on error, raise with the full traceback instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def _quiet_libraries(verbose: bool) -> None:
    # Orbax logs through absl at WARNING for routine things (read-only managers); a CLI user
    # only needs our one-line summary unless asked.
    level = logging.INFO if verbose else logging.ERROR
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(level)
    if not verbose and not getattr(sys.unraisablehook, "drops_orbax_leftovers", False):
        sys.unraisablehook = _drop_orbax_leftovers(sys.unraisablehook)


def _orbax_leftover(args: sys.UnraisableHookArgs) -> bool:
    """Whether `args` reports a read orbax abandoned when another array of a checkpoint could
    not be read: orbax closes its event loop under the reads still in flight, which then fail
    to call back into it from tensorstore threads ("Event loop is closed"), and their
    coroutines raise again when collected. The CheckpointError naming the checkpoint has
    said what is wrong."""
    if args.object is None:
        return args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed"
    code = getattr(args.object, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _drop_orbax_leftovers(hook: UnraisableHook) -> UnraisableHook:
    """`hook` minus the reports `_orbax_leftover` recognizes (unraisable: they would print
    tracebacks around the one-line error, at any time until the process exits)."""

    def quiet(args: sys.UnraisableHookArgs) -> None:
        if not _orbax_leftover(args):
            hook(args)

    quiet.drops_orbax_leftovers = True  # type: ignore[attr-defined]
    return quiet


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `routeweaver` command line; returns the exit code (argparse errors: 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) and usage errors (2): return, so callers get a code
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    _quiet_libraries(args.verbose)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
            PermissionError, SandboxError) as e:
        # CheckpointError, ConfigError and ShardingError are ValueErrors; SandboxError says
        # what the host lacks for the code sandbox.
        if args.traceback:
            raise
        # A refused run names every problem on its one line: let it be long.
        limit = 4000 if type(e).__name__ == "PreflightError" else 1000
        print(f"{PROG}: error: {one_line(e, limit)}", file=sys.stderr)
        return EXIT_ERROR
