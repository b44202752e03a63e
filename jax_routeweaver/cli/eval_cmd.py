"""`routeweaver eval`: its subcommands `run` (a router checkpoint over evaluation sets),
`baselines`, `compare` (the whole comparison table), `favourites` (the favoured mode per
domain) and `report` (several evaluations side by side)."""

from __future__ import annotations

import argparse
from pathlib import Path

from jax_routeweaver.cli.common import Command

BASELINES = ("random", "largest", "oracle", "knn", "mlp")  # = eval.baselines.BASELINE_NAMES


def parse_routers(text: str) -> tuple[str, ...]:
    """'random,knn' -> ('random', 'knn'): distinct baseline names."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in BASELINES]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"invalid routers {text!r}: expected distinct, "
                                         f"comma-separated names from {','.join(BASELINES)}")
    return names


def _eval_sets_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, as for `routeweaver train` (put them before "
                        "--sets)")
    p.add_argument("--sets", required=True, nargs="+", action="extend", metavar="SET",
                   help="record files (.jsonl/.parquet, e.g. from `data prepare`) or "
                        "synthetic[:N[:SEED]] for the simulated pool (N default 100, SEED "
                        "default data.synthetic_seed+1)")


def _cache_arguments(p: argparse.ArgumentParser, default_cache: str) -> None:
    p.add_argument("--replay", choices=("record", "replay", "off"), default="record",
                   help="worker cache: record (default; answer hits, record misses), "
                        "replay (offline; a miss is an error) or off")
    p.add_argument("--cache", type=Path, default=None,
                   help=f"worker cache file (default: {default_cache})")
    p.add_argument("--limit", type=int, default=None,
                   help="evaluate only the first N questions over all sets (a router "
                        "evaluated later without it evaluates only the rest)")


def _worker_temperature_argument(p: argparse.ArgumentParser) -> None:
    from jax_routeweaver.routing.pools.workers import DEFAULT_TEMPERATURE

    p.add_argument("--worker-temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help="sampling temperature of HTTP workers (default "
                        f"{DEFAULT_TEMPERATURE}, the paper's)")


def _baseline_arguments(p: argparse.ArgumentParser, *, train_required: bool) -> None:
    p.add_argument("--train-sets", required=train_required, nargs="+", action="extend",
                   default=[], metavar="SET",
                   help="what kNN and MLP learn from: record files or synthetic[:N[:SEED]] "
                        "(SEED default data.synthetic_seed, the router's training "
                        "questions); questions also in --sets are left out")
    p.add_argument("--routers", type=parse_routers, default=BASELINES, metavar="R,R,...",
                   help=f"single-round baselines (default: {','.join(BASELINES)})")
    p.add_argument("--largest-worker", default=None, metavar="ID",
                   help="the worker of the 'largest' baseline (default: the priciest by "
                        "the price table)")
    p.add_argument("--k", type=int, default=10, help="neighbours of the kNN router "
                                                     "(default 10)")
    p.add_argument("--lambda-cost", type=float, default=0.0,
                   help="kNN/MLP cost penalty per USD: argmax p - lambda*cost (default 0)")


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="eval_command", metavar="SUBCOMMAND", required=True)
    run = sub.add_parser(
        "run", help="evaluate a router checkpoint greedily over evaluation sets",
        description="Run a router checkpoint greedily (workers at temperature 0.2) over "
                    "evaluation sets; writes OUT/rows.jsonl (resumable), summary.json/.md, "
                    "mode_shares.png and accuracy_vs_cost.png.")
    _eval_sets_argument(run)
    run.add_argument("--checkpoint", required=True,
                     help="a training run directory (latest policy step), an orbax policy "
                          "checkpoint directory, one policy step directory, or a Hugging Face "
                          "directory")
    run.add_argument("--config", type=Path, default=None,
                     help="training config (YAML) whose model, rollout, workers and reward "
                          "sections to use (default: the checkpoint's run config.yaml)")
    run.add_argument("--out", type=Path, required=True, help="output directory")
    run.add_argument("--force-mode", choices=("single", "multi", "agentic"), default=None,
                     help="inject this mode's declaration in every episode (the "
                          "fixed-paradigm baselines)")
    _cache_arguments(run, "OUT/worker_cache.jsonl")
    run.add_argument("--batch-size", type=int, default=0,
                     help="episodes sampled together (default: data.batch_size x "
                          "data.group_size)")
    run.add_argument("--name", default="", help="the router's name in rows and tables")
    _worker_temperature_argument(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(eval_run=_eval_run)

    base = sub.add_parser(
        "baselines", help="single-round baselines (random, largest, oracle, kNN, MLP) on "
                          "evaluation sets",
        description="Route every evaluation question to one worker, once, with the "
                    "single-round baselines; workers, sets and scorers as `eval run`. "
                    "Writes OUT/<router>/rows.jsonl and the summary files of `eval run` "
                    "per router (inputs of `eval report --runs`).")
    _eval_sets_argument(base)
    base.add_argument("--config", type=Path, required=True,
                      help="training config (YAML) or training run directory: its workers "
                           "and data sections")
    base.add_argument("--out", type=Path, required=True, help="output directory")
    _baseline_arguments(base, train_required=False)
    _cache_arguments(base, "OUT/worker_cache.jsonl")
    _worker_temperature_argument(base)
    base.set_defaults(eval_run=_eval_baselines)

    cmp = sub.add_parser(
        "compare", help="the whole comparison table: a router free and forced to each "
                        "mode, Router-R1, the baselines, one worker cache",
        description="Evaluate a router checkpoint free (OUT/router) and forced to single, "
                    "multi and agentic (OUT/forced_<mode>), optionally a Router-R1 "
                    "checkpoint (OUT/router_r1), and the single-round baselines "
                    "(OUT/<baseline>), all on the same questions through one worker cache; "
                    "then write OUT/comparison.md/.json and the plots.")
    _eval_sets_argument(cmp)
    cmp.add_argument("--checkpoint", required=True,
                     help="the RouteWeaver router (as for `eval run`)")
    cmp.add_argument("--config", type=Path, default=None,
                     help="its training config (default: the checkpoint's run config.yaml)")
    cmp.add_argument("--out", type=Path, required=True, help="output directory")
    _baseline_arguments(cmp, train_required=False)
    cmp.add_argument("--router-r1", default=None, metavar="CHECKPOINT",
                     help="a Router-R1 checkpoint to add as the row router_r1")
    cmp.add_argument("--router-r1-config", type=Path, default=None,
                     help="its training config (default: the checkpoint's run config.yaml); "
                          "KEY=VALUE overrides do not apply to it")
    _cache_arguments(cmp, "OUT/worker_cache.jsonl, shared by every row")
    cmp.add_argument("--batch-size", type=int, default=0,
                     help="episodes sampled together (default: data.batch_size x "
                          "data.group_size)")
    _worker_temperature_argument(cmp)
    cmp.add_argument("--no-progress", action="store_true", help="no progress bar")
    cmp.set_defaults(eval_run=_eval_compare)

    fav = sub.add_parser(
        "favourites", help="measure which execution mode the worker pool favours per domain "
                           "(forced rollouts of the run's training questions)",
        description="Run the first N training questions of each domain forced to single, "
                    "multi and agentic, K episodes each, with the router sampling at "
                    "rollout.temperature, and report E[reward | domain, mode] (reward = "
                    "(1-alpha) r_task + alpha r_eff) and per worker, the favourite mode per "
                    "domain and its margin. It measures the given policy's own execution of "
                    "each mode (docs/favourites.md). Optionally writes OUT/favourites.json "
                    "and OUT/favourites.md.")
    fav.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                     help="config overrides, as for `routeweaver train` (e.g. reward.alpha=1 "
                          "algo.estimator=comet_gdpo)")
    fav.add_argument("--config", type=Path, default=None,
                     help="training config (YAML); required unless --checkpoint is inside a "
                          "training run directory (its config.yaml)")
    fav.add_argument("--checkpoint", default=None,
                     help="a router checkpoint as for `eval run` (default: the config's "
                          "initial policy, model.init)")
    fav.add_argument("--per-domain", type=int, default=20, metavar="N",
                     help="questions per domain: the first N of the run's training questions "
                          "(default 20)")
    fav.add_argument("--samples", type=int, default=4, metavar="K",
                     help="episodes per question and mode (default 4)")
    fav.add_argument("--seed", type=int, default=0,
                     help="the router's sampling seed (default 0)")
    fav.add_argument("--out", type=Path, default=None,
                     help="write favourites.json and favourites.md here")
    fav.add_argument("--no-progress", action="store_true", help="no progress bar")
    fav.set_defaults(eval_run=_eval_favourites)

    rep = sub.add_parser(
        "report", help="compare several evaluation output directories (Table 1, Figure 3/4)",
        description="Build the comparison table (comparison.md/.json) and the accuracy-vs-"
                    "cost and mode-share plots from several `eval run` / `eval baselines` "
                    "output directories.")
    rep.add_argument("--runs", required=True, nargs="+", type=Path, metavar="DIR",
                     help="evaluation output directories (each with rows.jsonl)")
    rep.add_argument("--out", type=Path, required=True, help="output directory")
    rep.set_defaults(eval_run=_eval_report)


def _eval(args: argparse.Namespace) -> int:
    return args.eval_run(args)


def _check_sets(args: argparse.Namespace) -> None:
    odd = [s for s in [*args.sets, *getattr(args, "train_sets", [])]
           if "=" in s and not Path(s).exists()]
    if odd:
        raise ValueError(f"sets {odd}: look like config overrides; put KEY=VALUE overrides "
                         "before --sets / --train-sets")


def _eval_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.evaluate import EvalConfig, evaluate
    from jax_routeweaver.rl.run.router_checkpoint import checkpoint_config
    from jax_routeweaver.rl.run.train_config import load_train_config

    _check_sets(args)
    cfg = load_train_config(checkpoint_config(args.checkpoint, args.config), args.overrides)
    options = EvalConfig(
        checkpoint=str(args.checkpoint), sets=tuple(args.sets), out_dir=str(args.out),
        force_mode=args.force_mode, replay=args.replay,
        cache=str(args.cache) if args.cache else "", limit=args.limit,
        batch_size=args.batch_size, name=args.name,
        worker_temperature=args.worker_temperature, progress=not args.no_progress)
    result = evaluate(cfg, options, console=Console())
    print(f"evaluated {result.evaluated} questions ({len(result.rows)} in the dump) -> "
          f"{result.out_dir}")
    return 0


def _eval_baselines(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.compare import BaselineConfig, run_baselines
    from jax_routeweaver.eval.report import console_table
    from jax_routeweaver.rl.run.loop import CONFIG_FILE
    from jax_routeweaver.rl.run.train_config import load_train_config

    _check_sets(args)
    config = args.config / CONFIG_FILE if args.config.is_dir() else args.config
    cfg = load_train_config(config, args.overrides)
    options = BaselineConfig(
        sets=tuple(args.sets), out_dir=str(args.out), train_sets=tuple(args.train_sets),
        routers=args.routers, largest_worker=args.largest_worker, replay=args.replay,
        cache=str(args.cache) if args.cache else "", limit=args.limit, k=args.k,
        lambda_cost=args.lambda_cost, worker_temperature=args.worker_temperature)
    console = Console()
    results = run_baselines(cfg, options, console=console)
    console.print(console_table({name: r.summary for name, r in results.items()}))
    print(f"wrote {', '.join(str(r.out_dir) for r in results.values())}")
    return 0


def _eval_compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.compare import CompareConfig, run_comparison
    from jax_routeweaver.rl.run.router_checkpoint import checkpoint_config
    from jax_routeweaver.rl.run.train_config import load_train_config

    _check_sets(args)
    cfg = load_train_config(checkpoint_config(args.checkpoint, args.config), args.overrides)
    r1_cfg = None
    if args.router_r1:
        r1_cfg = load_train_config(checkpoint_config(args.router_r1, args.router_r1_config,
                                                      "--router-r1-config"))
    elif args.router_r1_config is not None:
        raise ValueError("--router-r1-config without --router-r1")
    options = CompareConfig(
        checkpoint=str(args.checkpoint), sets=tuple(args.sets), out_dir=str(args.out),
        train_sets=tuple(args.train_sets), routers=args.routers,
        router_r1=str(args.router_r1 or ""), largest_worker=args.largest_worker,
        replay=args.replay, cache=str(args.cache) if args.cache else "", limit=args.limit,
        batch_size=args.batch_size, k=args.k, lambda_cost=args.lambda_cost,
        worker_temperature=args.worker_temperature, progress=not args.no_progress)
    summaries = run_comparison(cfg, options, r1_cfg=r1_cfg, console=Console())
    print(f"compared {len(summaries)} routers -> {args.out}")
    return 0


def _eval_favourites(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.favourites import (
        check_options,
        measure_favourites,
        modes_table,
        workers_table,
        write_outputs,
    )
    from jax_routeweaver.rl.run.router_checkpoint import checkpoint_config
    from jax_routeweaver.rl.run.train_config import load_train_config

    if args.checkpoint is None and args.config is None:
        raise ValueError("--config is required without --checkpoint (or give --checkpoint "
                         "inside a training run directory)")
    config = args.config if args.checkpoint is None \
        else checkpoint_config(args.checkpoint, args.config)
    cfg = load_train_config(config, args.overrides)
    check_options(cfg, per_domain=args.per_domain, samples=args.samples)  # before any build
    console = Console()
    result = measure_favourites(
        cfg, checkpoint=None if args.checkpoint is None else str(args.checkpoint),
        per_domain=args.per_domain, samples=args.samples, seed=args.seed, console=console,
        progress=not args.no_progress)
    console.print(modes_table(result))
    console.print(workers_table(result))
    if args.out is not None:
        paths = write_outputs(result, args.out)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _eval_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.report import console_table, load_summaries, write_comparison

    summaries: dict = {}
    for run in args.runs:
        for name, summary in load_summaries(run).items():
            if name in summaries:
                raise ValueError(f"router {name!r} appears in two runs ({run}); give the "
                                 "evaluations distinct --name")
            summaries[name] = summary
    paths = write_comparison(summaries, args.out)
    Console().print(console_table(summaries))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


EVAL = Command("eval", "evaluate routers: `eval run` runs a checkpoint over evaluation sets, "
               "`eval baselines` the single-round baselines, `eval compare` the whole "
               "comparison table, `eval favourites` measures the favoured mode per domain, "
               "`eval report` compares several evaluations", _eval_arguments, _eval)
