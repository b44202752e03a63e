"""`routeweaver train` (RL training from a YAML config, or its dry run) and `warm-start`
(build the cached stand-in a pretrained router loads)."""

from __future__ import annotations

import argparse
from pathlib import Path

from jax_routeweaver.cli.common import Command


# ------------------------------------------------------------------------------ train
def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help="YAML config (see configs/; default: the paper defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. optim.lr=1e-5 data.batch_size=16")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (secrets redacted) and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and resolve the config, print devices, mesh, memory per "
                        "device and endpoint reachability, and exit without training "
                        "(exit 1 if a check fails)")
    p.add_argument("--no-memory", action="store_true",
                   help="with --dry-run: skip the compiled memory estimate")


def _train(args: argparse.Namespace) -> int:
    import yaml

    from jax_routeweaver.config import redact_secrets, to_dict
    from jax_routeweaver.rl.run.loop import train
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(redact_secrets(to_dict(cfg)), sort_keys=False), end="")
        return 0
    if args.dry_run:
        from rich.console import Console

        from jax_routeweaver.planning.dry_run import dry_run
        from jax_routeweaver.rl.run.distributed import initialize

        initialize()
        return 0 if dry_run(cfg, Console(), plan=not args.no_memory) else 1
    result = train(cfg)
    print(f"trained {result.last_step} steps -> {result.out_dir}")
    return 0


# ------------------------------------------------------------------------------ warm-start
def _warm_start_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, required=True,
                   help="training config (YAML) whose model.random architecture, "
                        "model.stand_in settings, tokenizer and questions to use")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, as for `routeweaver train`")


def _warm_start(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console
    from rich.table import Table

    from jax_routeweaver.models.sharding import make_mesh
    from jax_routeweaver.rl.run import builders, stand_in
    from jax_routeweaver.rl.run.train_config import RANDOM_INITS, load_train_config

    cfg = load_train_config(args.config, args.overrides)
    if cfg.model.init not in RANDOM_INITS:
        raise ValueError(f"model.init: {cfg.model.init!r}; the stand-in is distilled from "
                         "the random-init router (model.init: random or stand-in)")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="stand-in"))
    console = Console()
    records = builders.build_records(cfg, console)
    tokenizer = builders.build_tokenizer(cfg, records, builders.build_pool(cfg, records))
    path = builders.stand_in_path(cfg, make_mesh((1, -1, 1)), tokenizer, records, console.print)
    report = stand_in.read_report(path)
    table = Table(title=f"decision states of {report['after']['questions']} held-out "
                        "questions")
    table.add_column("diagnostic")
    table.add_column("random init", justify="right")
    table.add_column("stand-in", justify="right")
    for key in ("align", "domain_share", "probe", "common", "mode_p_max", "mode_entropy",
                "bc_nll"):
        if key in report["after"]:  # bc_nll: only with demonstrations
            table.add_row(key, f"{report['before'][key]:.3f}", f"{report['after'][key]:.3f}")
    console.print(table)
    print(f"model.init=stand-in loads {path} (built in {report['seconds']} s)")
    return 0


TRAIN = Command("train", "train a router with RL from a YAML config (+ key.sub=value overrides)",
                _train_arguments, _train)
WARM_START = Command("warm-start", "build (or reuse) the cached stand-in for a pretrained "
                     "router that model.init: stand-in loads (docs/stand_in.md)",
                     _warm_start_arguments, _warm_start)
