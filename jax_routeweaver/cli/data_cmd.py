"""`routeweaver data prepare`: the paper's training, cold-start, evaluation, OOD and
Router-R1 files, built from local copies of the source datasets."""

from __future__ import annotations

import argparse
from pathlib import Path

from jax_routeweaver.cli.common import Command


def _source_list() -> str:
    from jax_routeweaver.data.benchmarks import SOURCES

    return "sources (NAME: local copy and the columns read):\n" + "\n".join(
        f"  {s.name}: {s.layout}" for s in SOURCES.values())


def _name_count(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    try:
        count = int(value)
    except ValueError:
        count = -1
    if not sep or not name or count < 0:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: expected NAME=N, N >= 0")
    return name, count


def _data_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    prep = sub.add_parser(
        "prepare", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="build the training, cold-start, evaluation, OOD and Router-R1 files from local "
             "copies of the public datasets",
        description="Build the paper's data files (docs/usage.md, \"Data\") in the record schema "
                    "from local copies of the public datasets (no download).",
        epilog=_source_list())
    prep.add_argument("--source", action="append", default=[], metavar="NAME[.eval]=PATH[#SPLIT]",
                      help="a local copy: an HF `save_to_disk` directory, a Hub snapshot "
                           "folder, or a parquet/arrow/jsonl/json/csv file; #SPLIT picks a "
                           "split of a directory; NAME.eval is a held-out copy the eval, OOD "
                           "and Router-R1 test files draw from (default: NAME's, after the "
                           "training rows). Repeatable")
    prep.add_argument("--out", type=Path, required=True, help="output directory")
    prep.add_argument("--what", default="train,cold_start,eval,ood,router_r1",
                      help="comma-separated files to build (default: all of "
                           "train,cold_start,eval,ood,router_r1)")
    prep.add_argument("--seed", type=int, default=42, help="draw and batch order (default 42)")
    prep.add_argument("--mix", choices=("reference", "paper"), default="reference",
                      help="training mix and batch quotas: reference = census 7/7/7/6/5 "
                           "(SuperGPQA 700, SATBench 600), paper = the summary's 7/7/6/7/5 "
                           "(SATBench 700, SuperGPQA 600) (default: reference)")
    prep.add_argument("--train-batches", type=int, default=100,
                      help="batches of 32 in the training file (default 100 = 3,200 rows)")
    prep.add_argument("--cold-batches", type=int, default=25,
                      help="batches of 32 in the cold-start pool (default 25)")
    prep.add_argument("--eval-count", type=int, default=120,
                      help="rows per benchmark in the evaluation sets (default 120; TACO 100)")
    prep.add_argument("--count", type=_name_count, action="append", default=[],
                      metavar="NAME=N", help="rows of source NAME in each eval/OOD set, e.g. "
                                             "aime=90 (repeatable)")
    prep.add_argument("--router-r1-train", type=int, default=7000,
                      help="Router-R1 training rows per source (default 7000)")
    prep.add_argument("--router-r1-test", type=int, default=100,
                      help="Router-R1 validation rows per source (default 100)")
    prep.add_argument("--format", choices=("parquet", "jsonl"), default="parquet",
                      help="output file format (default parquet)")
    prep.add_argument("--bad-rows", choices=("error", "skip"), default="error",
                      help="malformed source rows: stop with file and row (default), or skip "
                           "and count them")
    prep.set_defaults(data_run=_data_prepare)


def _data(args: argparse.Namespace) -> int:
    return args.data_run(args)


def _data_prepare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from jax_routeweaver.data.prepare import SourceSpec, prepare, write_manifest
    from jax_routeweaver.data.records import Domain

    specs = [SourceSpec.parse(text) for text in args.source]
    what = [w.strip() for w in args.what.split(",") if w.strip()]
    settings = dict(what=what, seed=args.seed, mix=args.mix, train_batches=args.train_batches,
                    cold_batches=args.cold_batches, eval_count=args.eval_count,
                    counts=dict(args.count), router_r1_train=args.router_r1_train,
                    router_r1_test=args.router_r1_test)
    result = prepare(specs, args.out, fmt=args.format, bad_rows=args.bad_rows, **settings)
    manifest = write_manifest(result, args.out, {**settings, "format": args.format,
                                                 "sources": [str(s) for s in specs]})
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    files = Table("file", "rows", *(d.value for d in Domain), "benchmarks",
                  title=f"rows per file and domain (seed {args.seed}, mix {args.mix})")
    for f in result.files:
        files.add_row(str(f.path.relative_to(args.out)), str(f.rows),
                      *(str(f.domains.get(d.value, 0)) for d in Domain),
                      ", ".join(f"{k} {v}" for k, v in sorted(f.datasets.items())))
    console.print(files)
    reads = Table("source", "rows read", "usable", "unusable", "skipped (malformed)",
                  title="sources")
    for key, st in result.sources.items():
        reasons = "; ".join(f"{n} {r}" for r, n in st.reasons.most_common(3))
        reads.add_row(key, str(st.rows), str(st.kept),
                      f"{st.unusable}" + (f" ({reasons})" if reasons else ""), str(st.skipped))
    console.print(reads)
    for st in result.sources.values():
        for message in st.errors:
            console.print(f"skipped: {message}", markup=False)
    console.print(f"wrote {len(result.files)} files and {manifest}", markup=False)
    return 0


DATA = Command("data", "data files: `data prepare` builds the paper's training, evaluation and "
               "Router-R1 files from local dataset copies", _data_arguments, _data)
