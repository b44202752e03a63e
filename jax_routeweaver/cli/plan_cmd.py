"""`routeweaver plan`: per-device memory of the train step for a config's real shapes on
named machines, compiled on fake CPU devices (the config's settings, or a search for what
fits)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from jax_routeweaver.cli.common import Command, parse_mesh


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="training config (YAML)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, as for `routeweaver train`")
    p.add_argument("--arch", type=Path,
                   help="the router's HF config.json (default: model.path/config.json)")
    p.add_argument("--target", action="append", default=[],
                   help="a named machine (v5e-16, v5p-8, a100-80gb-x8, h200, h200-x2) or "
                        "'all'; repeatable (default: all, unless --devices is given)")
    p.add_argument("--devices", type=int, help="a custom target: this many devices ...")
    p.add_argument("--memory-gib", type=float, default=80.0, help="... of this memory each")
    p.add_argument("--mesh", type=parse_mesh,
                   help="mesh data,fsdp,tensor to plan (default: the config's mesh on the "
                        "target's devices)")
    p.add_argument("--hosts", type=int, default=1,
                   help="hosts of the custom target (each runs its own rollout engine)")
    p.add_argument("--kind", choices=("gpu", "tpu"), default="gpu",
                   help="the custom target's accelerators (vLLM is searched on GPUs only)")
    p.add_argument("--remat", default="",
                   help="comma-separated remat policies to plan (default: the config's)")
    p.add_argument("--rows-per-device", type=int, default=1,
                   help="rows of one micro-batch on each batch shard (default 1)")
    p.add_argument("--length", type=int, help="tokens per row (default: 6144 prompt + "
                   "rollout.protocol.response_length)")
    p.add_argument("--policy-tokens", type=int,
                   help="policy tokens per row (default: the whole response, the worst case)")
    p.add_argument("--search", action="store_true",
                   help="search each target's meshes, layer groups and rollout-engine "
                        "settings for what makes the whole step fit (planning/step.py)")
    p.add_argument("--markdown", action="store_true",
                   help="with --search: also print the table as Markdown (README's format)")
    p.add_argument("--json", type=Path, help="also write the plans as JSON here")


def _plan_targets(args: argparse.Namespace) -> list[Any]:
    """The targets `routeweaver plan` was asked for (a custom one with --devices)."""
    from jax_routeweaver.planning.memory import TARGETS, Target

    if args.devices:
        mesh = args.mesh or (1, args.devices, 1)
        return [Target(f"{args.devices} devices", args.devices, args.memory_gib, mesh,
                       kind=args.kind, hosts=args.hosts)]
    names = [n for t in args.target or ["all"] for n in t.split(",")]
    names = list(TARGETS) if "all" in names else names
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"--target {unknown[0]!r}: expected one of {sorted(TARGETS)} or 'all'")
    return [TARGETS[n] for n in names]


def _plan(args: argparse.Namespace) -> int:
    import json
    import os

    targets = _plan_targets(args)
    needed = max(t.devices for t in targets)
    # Fake CPU devices stand in for the accelerators; XLA reads the flag when the CPU
    # backend starts, i.e. before the first jax.devices() of this process.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={needed}"

    import jax
    from rich.console import Console

    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.planning.memory import config_shape
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(args.config, args.overrides)
    arch_path = args.arch or Path(cfg.model.path) / "config.json"
    arch = ModelConfig.from_hf(arch_path)
    devices = jax.devices("cpu")
    if len(devices) < needed:
        raise ValueError(f"the CPU backend has {len(devices)} devices, the plan needs {needed}: "
                         f"run with XLA_FLAGS=--xla_force_host_platform_device_count={needed}")
    shape = config_shape(cfg, rows_per_device=args.rows_per_device, length=args.length,
                         policy_tokens=args.policy_tokens)
    console = Console()
    if not console.is_terminal:  # a log file or pipe: keep the table's columns whole
        console = Console(width=180)
    console.print(f"{args.config}: {arch_path} ({arch.num_layers} layers, hidden "
                  f"{arch.hidden_size}, vocab {arch.vocab_size}); {shape.rows} rows x "
                  f"{shape.length} tokens per optimizer step, {shape.policy_tokens} policy "
                  f"tokens per row, {shape.rows_per_device} row(s) per device per micro-batch, "
                  f"support rows for {shape.support_queries} queries; params "
                  f"{cfg.model.param_dtype}, compute {cfg.model.dtype}")
    run = _plan_search if args.search else _plan_configured
    rows = run(args, cfg, arch, targets, shape, devices, console)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _plan_configured(args: argparse.Namespace, cfg: Any, arch: Any, targets: list[Any],
                     shape: Any, devices: list[Any], console: Any) -> list[dict]:
    """`routeweaver plan`: the config's own settings (its mesh resolved on each target's
    devices, or --mesh) per remat policy, with the three phases of the step."""
    from rich.table import Table

    from jax_routeweaver.planning import step as sp
    from jax_routeweaver.planning.memory import GIB, HEADROOM, config_mesh, plan_config
    from jax_routeweaver.planning.rollout import RolloutSettings, RolloutShape, replica_dtype

    settings = RolloutSettings.of_config(cfg)
    remats = [r for r in args.remat.split(",") if r] or [cfg.model.remat]
    table = Table("target", "mesh", "remat", "params", "optimizer", "reference",
                  "update peak", "logprob peak", f"rollout ({settings.engine})",
                  "phases: update / reference / rollout", "need / have (GiB)", "fits",
                  title=f"per-device memory (XLA:CPU estimate for the trainer, formulas for "
                        f"the rollout engine: {settings.label()}; need = the largest phase, "
                        f"planning/step.py; fits = under {1 - HEADROOM:.0%} of device memory)")
    rows = []
    gib = lambda b: f"{b / GIB:.1f}"
    for target in targets:
        rollout = RolloutShape.of_config(cfg, target.hosts, args.length)
        for remat in remats:
            plan = plan_config(cfg, arch, target, shape, devices=devices, remat=remat,
                               mesh=args.mesh or config_mesh(cfg, target.devices))
            step = sp.step_plan(target, sp.TrainFigures.of(plan), settings,
                                arch.replace(dtype=cfg.model.dtype), rollout,
                                replica_dtype(cfg))
            label = remat if plan.remat_groups == 1 else f"{remat} ({plan.remat_groups} groups)"
            phases = step.phases
            table.add_row(target.name, "x".join(map(str, plan.mesh)), label, gib(plan.params),
                          gib(plan.optimizer), gib(plan.reference), gib(plan.update.peak),
                          gib(plan.logprobs.peak), gib(step.rollout.resident),
                          " / ".join(gib(phases[k]) for k in ("update", "reference",
                                                                "rollout")),
                          f"{step.need / GIB:.1f} / {target.memory_gib:g}",
                          "yes" if step.fits else "no")
            rows.append({"target": target.name, "devices": target.devices,
                         "memory_gib": target.memory_gib, "fits": step.fits,
                         **plan.as_dict(), "step": step.as_dict()})
    console.print(table)
    return rows


def _plan_search(args: argparse.Namespace, cfg: Any, arch: Any, targets: list[Any],
                 shape: Any, devices: list[Any], console: Any) -> list[dict]:
    """`routeweaver plan --search`: per target and rollout engine, the settings that fit."""
    from rich.table import Table

    from jax_routeweaver.planning import step as sp
    from jax_routeweaver.planning.table import engine_name, markdown_table

    table = Table("target", "engine", "trainer", "rollout settings",
                  "phases: update / reference / rollout (GiB)", "need / limit", "fits",
                  "full rows", title="whole-step search (planning/step.py)")
    records = []
    for target in targets:
        trainers, plans = sp.search_config(cfg, arch, target, shape, devices=devices,
                                           length=args.length, log=console.print)
        choices = [p.as_dict() for p in plans]
        for c in choices:
            p = c["phases_gib"]
            table.add_row(c["target"], engine_name(c), c["trainer"],
                          c["rollout_settings"],
                          f"{p['update']:.1f} / {p['reference']:.1f} / {p['rollout']:.1f}",
                          f"{c['need_gib']:.1f} / {c['limit_gib']:.1f}",
                          "yes" if c["fits"] else "no", str(c["full_rows"]))
            if c["fits"]:
                console.print(f"{c['target']}, {engine_name(c)}: "
                              + " ".join(c["overrides"]))
        records.append({"target": target.name, "trainers": [t.as_dict() for t in trainers],
                        "choices": choices})
    console.print(table)
    if args.markdown:
        print(markdown_table([c for r in records for c in r["choices"]]))
    return records


PLAN = Command("plan", "per-device memory of the train step for a config's real shapes on "
               "named machines (compiled on fake CPU devices, no weights)", _plan_arguments,
               _plan)
