"""`routeweaver` command line: one subcommand per entry of `app.COMMANDS`, one module per
command group (`hf_cmd`, `train_cmd`, `selfcheck_cmd`, `sandbox_cmd`, `plan_cmd`, `cost_cmd`,
`data_cmd`, `eval_cmd`), the parser and `main` in `app`, what they share in `common`.

A command is a name, a help line, a function adding its arguments and a function running it
(returning the exit code). Heavy imports (jax, orbax, transformers) happen inside the run
functions so `routeweaver --help` stays instant. Expected failures (bad paths, bad checkpoints,
bad arguments) print one line `routeweaver: error: ...` to stderr and exit 2.

`main` is exported here because it is the console script's entry point
(`routeweaver = jax_routeweaver.cli:main`).
"""

from jax_routeweaver.cli.app import main

__all__ = ["main"]
