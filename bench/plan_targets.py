"""The whole RL step's per-device memory on every named target, and the settings that fit
(`jax_routeweaver.planning.step`): generates README's memory table.

For each target it compiles (on fake CPU devices, never runs) the trainer's update and
logprob pass for every (mesh, layer groups) candidate of the target, searches the rollout
engines' settings beside them, and writes every figure to a JSON (default
`bench/plan_targets.json`): the compiled trainer figures per target, the plans chosen, the
command, machine and date. `--write-readme` rewrites README's block between
`<!-- plan-table:begin -->` and `<!-- plan-table:end -->` from that JSON;
`--from-json` skips the compiles and redoes only the search (formulas) and the table from the
recorded trainer figures. Targets given with `--targets` are merged into an existing JSON, so
targets may run one process at a time.

    .venv/bin/python bench/plan_targets.py [--targets all] [--write-readme] [--from-json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_JSON = ROOT / "bench" / "plan_targets.json"
DEFAULT_CONFIG = "configs/paper/main_alpha0.yaml"
DEFAULT_ARCH = "configs/paper/qwen3-4b-instruct-2507.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG, help="training config (YAML)")
    p.add_argument("--arch", default=DEFAULT_ARCH, help="the router's HF config.json")
    p.add_argument("--targets", default="all",
                   help="comma-separated target names (see planning/memory.py TARGETS) or 'all'")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="figures in and out")
    p.add_argument("--from-json", action="store_true",
                   help="no compiles: search again from the trainer figures in --json")
    p.add_argument("--write-readme", action="store_true",
                   help="rewrite README.md's plan-table block from --json")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return p.parse_args(argv)


def target_names(text: str) -> list[str]:
    from jax_routeweaver.planning.memory import TARGETS

    names = list(TARGETS) if text == "all" else [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"--targets: unknown {unknown}; expected some of {sorted(TARGETS)}")
    return names


def load_record(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {"targets": {}}


def compile_target(name: str, cfg: Any, arch: Any) -> tuple[list[Any], float]:
    """The target's compiled trainer figures and the seconds it took."""
    import jax

    from jax_routeweaver.planning import step as sp
    from jax_routeweaver.planning.memory import TARGETS, config_shape, plan_config

    target = TARGETS[name]
    shape = config_shape(cfg)
    t = time.perf_counter()
    trainers = sp.compile_trainers(
        target, lambda mesh, groups: plan_config(cfg, arch, target, shape,
                                                 devices=jax.devices("cpu"),
                                                 remat=cfg.model.remat, mesh=mesh,
                                                 remat_groups=groups),
        lambda line: print(line, flush=True))
    return trainers, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = target_names(args.targets)
    if not args.from_json:
        # Fake CPU devices: the flag is read when the CPU backend starts (first jax use).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=16"
    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.planning import step as sp
    from jax_routeweaver.planning.table import (
        read_block,
        record_table,
        replace_block,
        search_choices,
    )
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(ROOT / args.config, args.overrides)
    arch = ModelConfig.from_hf(ROOT / args.arch)
    record = load_record(args.json)
    if not args.from_json:
        record.update(config=args.config, arch=args.arch, overrides=args.overrides,
                      date=args.date, machine=f"{platform.machine()}, {os.cpu_count()} cores",
                      command=" ".join(["python", "bench/plan_targets.py",
                                        *map(shlex.quote, sys.argv[1:] if argv is None
                                             else argv)]))
    for name in names:
        entry = record["targets"].setdefault(name, {})
        if args.from_json:
            if "trainers" not in entry:
                raise SystemExit(f"{args.json}: no trainer figures for {name}; run without "
                                 "--from-json first")
            trainers = [sp.TrainFigures.from_dict(d) for d in entry["trainers"]]
        else:
            trainers, seconds = compile_target(name, cfg, arch)
            entry.update(trainers=[t.as_dict() for t in trainers], seconds=round(seconds, 1),
                         command=record["command"], date=args.date)
            print(f"{name}: {len(trainers)} trainer candidates in {seconds:.0f} s", flush=True)
        entry["choices"] = search_choices(name, cfg, arch, trainers)
        args.json.write_text(json.dumps(record, indent=1) + "\n")  # after every target
    table = record_table(record)
    print(table)
    if args.write_readme:
        args.readme.write_text(replace_block(args.readme.read_text(), table))
        print(f"rewrote the plan table in {args.readme}")
    elif read_block(args.readme.read_text()) != table:
        print(f"{args.readme}'s plan table differs from this one: --write-readme rewrites it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
