"""`routeweaver` command line: one subcommand per entry of `COMMANDS`.

A command is a name, a help line, a function adding its arguments and a function running it
(returning the exit code). Heavy imports (jax, orbax, transformers) happen inside the run
functions so `routeweaver --help` stays instant. Expected failures (bad paths, bad checkpoints,
bad arguments) print one line `routeweaver: error: ...` to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jax_routeweaver.rewards.sandbox import Sandbox, SandboxError

PROG = "routeweaver"
DTYPES = ("float32", "bfloat16", "float16")
EXIT_ERROR = 2

UnraisableHook = Callable[["sys.UnraisableHookArgs"], object]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# HF's convention (`max_shard_size="2GB"`): KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: `add_arguments(parser)` declares it, `run(args) -> exit code` runs it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------------------ arg types
def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000, '500MB', '100KB', '1GiB' -> 2**30, '4096' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 2GB, 500MB, 100KB)")
    size = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return size


def parse_mesh(text: str) -> tuple[int, ...]:
    """'1,-1,1' -> (1, -1, 1): the (data, fsdp, tensor) mesh shape, one entry may be -1."""
    try:
        shape = tuple(int(s) for s in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or any(s == 0 or s < -1 for s in shape):
        raise argparse.ArgumentTypeError(
            f"invalid mesh {text!r}: expected data,fsdp,tensor sizes such as 1,-1,1")
    return shape


def _mesh(shape: tuple[int, ...] | None):
    if shape is None:
        return None
    from jax_routeweaver.models.sharding import make_mesh

    return make_mesh(shape)


def _add_mesh(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="D,F,T",
                   help="shard over a (data,fsdp,tensor) device mesh, e.g. 1,-1,1 "
                        "(default: no mesh, one device)")


# ------------------------------------------------------------------------------ import-hf
def _import_hf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="policy checkpoint directory")
    p.add_argument("--step", type=int, default=0, help="step to save as (default: 0)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: float32)")
    _add_mesh(p)


def _import_hf(args: argparse.Namespace) -> int:
    from jax_routeweaver.models.hf import CheckpointError, load_hf
    from jax_routeweaver.rl.checkpoint import has_tokenizer, list_steps, save_policy

    existing = list_steps(args.ckpt_dir)
    if args.step in existing:  # checked before the (possibly long) load
        raise CheckpointError(f"{args.ckpt_dir}: step {args.step} already exists "
                              f"(steps: {existing})")
    model = load_hf(args.hf_dir, mesh=_mesh(args.mesh), dtype=args.dtype)
    tokenizer = args.hf_dir if has_tokenizer(args.hf_dir) else None
    step_dir = save_policy(model, args.ckpt_dir, args.step, tokenizer_dir=tokenizer)
    note = "with tokenizer" if tokenizer else "no tokenizer files found"
    print(f"imported {args.hf_dir} -> {step_dir} ({model.config.param_dtype}, {note})")
    return 0


# ------------------------------------------------------------------------------ export-hf
def _export_hf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="policy checkpoint directory")
    p.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="output directory")
    p.add_argument("--step", type=int, default=None, help="step to export (default: latest)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of the exported tensors (default: as stored)")
    p.add_argument("--untie", action="store_true",
                   help="write lm_head.weight even when embeddings are tied")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("2GB"),
                   metavar="SIZE", help="largest safetensors file, e.g. 2GB, 500MB (default: 2GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty HF_DIR, replacing its safetensors, index, "
                        "config and tokenizer files (default: refuse)")
    _add_mesh(p)


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse to write into `path` if it is not a directory, or is a non-empty one and
    `overwrite` is false (FileExistsError naming it): an export would replace its files."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise FileExistsError(f"{path}: not empty; pass --overwrite to replace the "
                              "checkpoint files in it, or give a new directory")


def _export_hf(args: argparse.Namespace) -> int:
    from jax_routeweaver.models.hf import save_hf
    from jax_routeweaver.rl.checkpoint import TOKENIZER_DIR, restore_policy

    check_output_dir(args.hf_dir, args.overwrite)  # before the (possibly long) restore
    model, step = restore_policy(args.ckpt_dir, args.step, mesh=_mesh(args.mesh),
                                 dtype=args.dtype)
    tokenizer = args.ckpt_dir / TOKENIZER_DIR
    tokenizer = tokenizer if tokenizer.is_dir() else None
    save_hf(model, args.hf_dir, tokenizer=tokenizer, max_shard_bytes=args.max_shard_size,
            untie=args.untie)
    note = "with tokenizer" if tokenizer else "no tokenizer stored"
    print(f"exported {args.ckpt_dir} step {step} -> {args.hf_dir} "
          f"({model.config.param_dtype}, {note})")
    return 0


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
    from jax_routeweaver.rl.loop import train
    from jax_routeweaver.rl.train_config import load_train_config

    cfg = load_train_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(redact_secrets(to_dict(cfg)), sort_keys=False), end="")
        return 0
    if args.dry_run:
        from rich.console import Console

        from jax_routeweaver.rl.distributed import initialize
        from jax_routeweaver.rl.dry_run import dry_run

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
    from jax_routeweaver.rl import loop, stand_in
    from jax_routeweaver.rl.train_config import RANDOM_INITS, load_train_config

    cfg = load_train_config(args.config, args.overrides)
    if cfg.model.init not in RANDOM_INITS:
        raise ValueError(f"model.init: {cfg.model.init!r}; the stand-in is distilled from "
                         "the random-init router (model.init: random or stand-in)")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="stand-in"))
    console = Console()
    records = loop.build_records(cfg, console)
    tokenizer = loop.build_tokenizer(cfg, records, loop.build_pool(cfg, records))
    path = loop.stand_in_path(cfg, make_mesh((1, -1, 1)), tokenizer, records, console.print)
    report = stand_in.read_report(path)
    table = Table(title=f"decision states of {report['after']['questions']} held-out "
                        "questions")
    table.add_column("diagnostic")
    table.add_column("random init", justify="right")
    table.add_column("stand-in", justify="right")
    for key in ("align", "domain_share", "probe", "common", "mode_p_max", "mode_entropy"):
        table.add_row(key, f"{report['before'][key]:.3f}", f"{report['after'][key]:.3f}")
    console.print(table)
    print(f"model.init=stand-in loads {path} (built in {report['seconds']} s)")
    return 0


# ------------------------------------------------------------------------------ plan
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
                        "settings for what makes the whole step fit (rl/step_plan.py)")
    p.add_argument("--markdown", action="store_true",
                   help="with --search: also print the table as Markdown (README's format)")
    p.add_argument("--json", type=Path, help="also write the plans as JSON here")


def _plan_targets(args: argparse.Namespace) -> list[Any]:
    """The targets `routeweaver plan` was asked for (a custom one with --devices)."""
    from jax_routeweaver.rl.plan import TARGETS, Target

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
    from jax_routeweaver.rl.plan import config_shape
    from jax_routeweaver.rl.train_config import load_train_config

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

    from jax_routeweaver.rl import step_plan as sp
    from jax_routeweaver.rl.plan import GIB, HEADROOM, config_mesh, plan_config

    settings = sp.RolloutSettings.of_config(cfg)
    remats = [r for r in args.remat.split(",") if r] or [cfg.model.remat]
    table = Table("target", "mesh", "remat", "params", "optimizer", "reference",
                  "update peak", "logprob peak", f"rollout ({settings.engine})",
                  "phases: update / reference / rollout", "need / have (GiB)", "fits",
                  title=f"per-device memory (XLA:CPU estimate for the trainer, formulas for "
                        f"the rollout engine: {settings.label()}; need = the largest phase, "
                        f"rl/step_plan.py; fits = under {1 - HEADROOM:.0%} of device memory)")
    rows = []
    gib = lambda b: f"{b / GIB:.1f}"
    for target in targets:
        rollout = sp.RolloutShape.of_config(cfg, target.hosts, args.length)
        for remat in remats:
            plan = plan_config(cfg, arch, target, shape, devices=devices, remat=remat,
                               mesh=args.mesh or config_mesh(cfg, target.devices))
            step = sp.step_plan(target, sp.TrainFigures.of(plan), settings,
                                arch.replace(dtype=cfg.model.dtype), rollout,
                                sp.replica_dtype(cfg))
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

    from jax_routeweaver.rl import step_plan as sp

    table = Table("target", "engine", "trainer", "rollout settings",
                  "phases: update / reference / rollout (GiB)", "need / limit", "fits",
                  "full rows", title="whole-step search (rl/step_plan.py)")
    records = []
    for target in targets:
        trainers, plans = sp.search_config(cfg, arch, target, shape, devices=devices,
                                           length=args.length, log=console.print)
        choices = [p.as_dict() for p in plans]
        for c in choices:
            p = c["phases_gib"]
            table.add_row(c["target"], sp.engine_name(c), c["trainer"],
                          c["rollout_settings"],
                          f"{p['update']:.1f} / {p['reference']:.1f} / {p['rollout']:.1f}",
                          f"{c['need_gib']:.1f} / {c['limit_gib']:.1f}",
                          "yes" if c["fits"] else "no", str(c["full_rows"]))
            if c["fits"]:
                console.print(f"{c['target']}, {sp.engine_name(c)}: "
                              + " ".join(c["overrides"]))
        records.append({"target": target.name, "trainers": [t.as_dict() for t in trainers],
                        "choices": choices})
    console.print(table)
    if args.markdown:
        print(sp.markdown_table([c for r in records for c in r["choices"]]))
    return records


# ------------------------------------------------------------------------------ selfcheck
# Every part end to end on CPU, no keys: real Qwen3 tokenizer (offline), a tiny Qwen3 router
# born sharded over the local devices, an orbax policy checkpoint and its restore, HF export
# checked against transformers, a chat-templated generation through the in-process JAX
# sampler, and RouteWeaver episodes of the (random-init, grammar-constrained) router against
# the simulated worker pool.
QUICKSTART_ROUTER = dict(vocab_size=151_936, hidden_size=64, intermediate_size=192, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=5_000_000.0,
                         tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=151_643, eos_token_id=151_645, pad_token_id=151_643)


def _quickstart_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/selfcheck"),
                   help="output directory (default: runs/selfcheck; replaced if it exists)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--queries", type=int, default=4, help="synthetic queries for the episodes")
    p.add_argument("--repeats", type=int, default=2, help="episodes per query")


def _quickstart(args: argparse.Namespace) -> int:
    import shutil

    import jax
    import numpy as np
    import torch
    from flax import nnx
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.models.hf import save_hf
    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.models.sharding import create_sharded, describe, make_mesh
    from jax_routeweaver.models.tokenizer import build_qwen3_tokenizer
    from jax_routeweaver.rl.checkpoint import restore_policy, save_policy
    from jax_routeweaver.sampling.base import SamplingParams
    from jax_routeweaver.sampling.jax_sampler import JaxSampler

    console = Console()
    shutil.rmtree(args.out, ignore_errors=True)
    table = Table("stage", "result")
    tokenizer = build_qwen3_tokenizer()
    tokenizer.save_pretrained(str(args.out / "tokenizer"))
    table.add_row("tokenizer", f"Qwen3, {len(tokenizer):,} tokens (built offline)")

    cfg = ModelConfig(**QUICKSTART_ROUTER)
    mesh = make_mesh((1, -1, 1))
    model = create_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(args.seed)), mesh)
    n_params = sum(int(np.prod(shape)) for shape, _ in describe(model).values())
    table.add_row("router", f"tiny Qwen3, {n_params:,} params on mesh {dict(mesh.shape)}")

    save_policy(model, args.out / "checkpoints", 0, tokenizer_dir=args.out / "tokenizer")
    model, step = restore_policy(args.out / "checkpoints", mesh=mesh)
    table.add_row("orbax", f"saved and restored step {step} ({args.out / 'checkpoints'})")

    messages = [{"role": "user", "content": "Which worker should answer: what is 17 * 23?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    save_hf(model, args.out / "hf", tokenizer=args.out / "tokenizer")
    hf_model = AutoModelForCausalLM.from_pretrained(args.out / "hf").eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    ours, _ = model(*(jax.numpy.asarray(a) for a in ([ids], [list(range(len(ids)))],
                                                     [[1] * len(ids)])))
    diff = float(np.abs(np.asarray(ours) - ref).max())
    table.add_row("HF export", f"{args.out / 'hf'}; transformers logits max |diff| {diff:.2e}")

    sampler = JaxSampler(model, decode=tokenizer.decode, pad_id=cfg.pad_token_id)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=(cfg.eos_token_id,),
                            stop_strings=("</route>", "</answer>"), seed=args.seed)
    out = sampler.generate([ids], params)[0]
    table.add_row("sampler", f"{len(out.token_ids)} tokens, finish={out.finish_reason}, "
                             f"mean logprob {np.mean(out.logprobs):.2f}")
    trajs = _quickstart_episodes(args, tokenizer, model, cfg)
    modes = Counter(t.mode for t in trajs)
    finishes = Counter(t.finish for t in trajs)
    cost = sum(t.cost.cost_usd for t in trajs)
    table.add_row("episodes", f"{len(trajs)} on simulated workers: modes {dict(modes)}, "
                              f"finish {dict(finishes)}, {sum(len(t.calls) for t in trajs)} "
                              f"calls, ${cost:.6f}")
    sandbox_line, sandbox_ok = _sandbox_row()
    table.add_row("sandbox", sandbox_line)
    console.print(table)
    console.print("[bold]generation[/] (random weights: expect noise)",
                  repr(tokenizer.decode(out.token_ids)))
    violations = [t.violation for t in trajs if t.violation is not None]
    return 0 if diff < 1e-4 and not violations and sandbox_ok else 1


def _quickstart_episodes(args: argparse.Namespace, tokenizer, model, cfg) -> list:
    """RouteWeaver episodes of the router against the simulated pool (a simulation of paid
    LLM APIs); grammar constraints keep every action of the random-init router valid."""
    from jax_routeweaver.routing.episode import run_episodes
    from jax_routeweaver.routing.pricing import REFERENCE_PRICES
    from jax_routeweaver.routing.routeweaver_env import EnvConfig, routeweaver_envs
    from jax_routeweaver.routing.simulated import SimulatedWorkerPool
    from jax_routeweaver.routing.synthetic_tasks import synthetic_tasks
    from jax_routeweaver.sampling.base import SamplingParams
    from jax_routeweaver.sampling.constraints import GrammarConstraints
    from jax_routeweaver.sampling.jax_sampler import JaxSampler

    tasks = synthetic_tasks(args.queries, seed=args.seed)
    pool = SimulatedWorkerPool(tasks, seed=args.seed)
    sampler = JaxSampler(model, decode=tokenizer.decode, pad_id=cfg.pad_token_id,
                         constraints=GrammarConstraints(tokenizer, cfg.vocab_size))
    config = EnvConfig(sampling=SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=96,
                                               seed=args.seed), constrained=True)
    return run_episodes(tasks, sampler, pool, routeweaver_envs(tokenizer, pool, config),
                        repeats=args.repeats, prices=REFERENCE_PRICES)


# ------------------------------------------------------------------------------ calibrate-cost
_DUMP_SCHEMA = """\
DUMP is a JSONL file of rollouts, one JSON object per line (blank lines skipped), e.g. the rows
of `Rewards.as_row()`:
  cost_usd       number >= 0: worker cost of the trajectory in USD, at the price table the
                 rollouts were billed at: the reference table (the simulated pool's), or
                 with --channels the channel file's prices (read only for kept rows; may be
                 null otherwise)
  infra_failed   0/1 (or false/true): system failure; the row is skipped
  cost_complete  0/1 (or false/true): every call had usage and a price; 0 rows are skipped
  price_table_version  optional string; if present it must be that table's version
Other fields are ignored. C_ref is the q-quantile (linear interpolation, pos = q·(n−1)) of
cost_usd over the kept rows, correct and wrong alike (docs/algorithm.md, "Efficiency reward")."""


def _calibrate_cost_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _DUMP_SCHEMA
    p.add_argument("dump", type=Path, metavar="DUMP", help="JSONL rollout dump (schema below)")
    p.add_argument("--out", type=Path, default=None,
                   help="cost-reference JSON to write (default: cost_ref.json next to DUMP)")
    p.add_argument("--q", type=_quantile, default=0.95,
                   help="quantile in (0, 1] (default: 0.95, the paper's P95)")
    p.add_argument("--channels", type=Path, default=None, metavar="FILE",
                   help="the channel file the DUMP's rollouts were billed with (the run's "
                        "workers.pool): its prices and price_table_version (required) go in "
                        "the record (default: the reference table of the simulated pool)")


def _quantile(text: str) -> float:
    try:
        q = float(text)
    except ValueError:
        q = float("nan")
    if not 0.0 < q <= 1.0:
        raise argparse.ArgumentTypeError(f"invalid quantile {text!r}: expected 0 < q <= 1")
    return q


def _dump_flag(row: dict, name: str, where: str) -> bool:
    if name not in row:
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[name]
    if value not in (0, 1) or not isinstance(value, int | bool):
        raise ValueError(f"{where}: {name}={value!r} must be 0/1 or false/true")
    return bool(value)


def read_cost_dump(path: Path, price_table_version: str) -> list[dict]:
    """The rows of a `calibrate-cost` DUMP, validated; errors name the file and line."""
    import json
    import math

    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            infra, complete = (_dump_flag(row, n, where)
                               for n in ("infra_failed", "cost_complete"))
            version = row.get("price_table_version", price_table_version)
            if version != price_table_version:
                raise ValueError(f"{where}: price_table_version {version!r} is not the "
                                 f"billing table's {price_table_version!r}")
            cost = row.get("cost_usd")
            if not infra and complete and (
                    isinstance(cost, bool) or not isinstance(cost, int | float)
                    or not math.isfinite(cost) or cost < 0):
                raise ValueError(f"{where}: cost_usd={cost!r} must be a finite number >= 0")
            rows.append({"cost_usd": cost, "infra_failed": infra, "cost_complete": complete})
    return rows


def _billing_table(channels: Path | None) -> tuple[Any, str]:
    """(prices, price_table_version) a cost dump was billed at: the reference table, or the
    channel file's prices under its `price_table_version` (a C_ref is only meaningful under
    a named table, so a file without one is a ValueError)."""
    from jax_routeweaver.routing.channels import load_channels
    from jax_routeweaver.routing.pricing import PRICE_TABLE_VERSION, REFERENCE_PRICES

    if channels is None:
        return REFERENCE_PRICES, PRICE_TABLE_VERSION
    config = load_channels(channels)
    if config.price_table_version is None:
        raise ValueError(f"{channels}: no price_table_version; a C_ref is only meaningful "
                         "under a named price table: give the channel file one")
    return config.prices(), config.price_table_version


def _calibrate_cost(args: argparse.Namespace) -> int:
    import json

    from jax_routeweaver.routing.pricing import c_ref_from_costs

    prices, version = _billing_table(args.channels)
    rows = read_cost_dump(args.dump, version)
    try:
        result = c_ref_from_costs(rows, q=args.q)
    except ValueError as e:
        raise ValueError(f"{args.dump}: {e}") from None
    if args.q != 0.95:
        result = dataclasses.replace(result, statistic=f"P{args.q * 100:g} of per-trajectory "
                                                       "worker cost")
    out = args.out if args.out is not None else args.dump.parent / "cost_ref.json"
    record = result.to_record(prices, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"C_ref = {result.c_ref_usd!r} USD ({result.statistic}; n={result.n_reference_rollouts}"
          f", skipped {result.n_skipped_infra_failed} infra-failed and "
          f"{result.n_skipped_cost_incomplete} cost-incomplete) -> {out}")
    return 0


# ------------------------------------------------------------------------------ data
def _source_list() -> str:
    from jax_routeweaver.data.sources import SOURCES

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


# ------------------------------------------------------------------------------ eval
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
    from jax_routeweaver.routing.workers import DEFAULT_TEMPERATURE

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


def _checkpoint_config(checkpoint: str, config: Path | None, flag: str = "--config") -> Path:
    """`config`, else the training config of the run `checkpoint` belongs to."""
    from jax_routeweaver.eval.evaluate import resolve_checkpoint

    if config is not None:
        return config
    found = resolve_checkpoint(checkpoint).config_file
    if found is None:
        raise ValueError(f"checkpoint {checkpoint} is not inside a training run directory: "
                         f"give its training config with {flag}")
    return found


def _eval_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jax_routeweaver.eval.evaluate import EvalOptions, evaluate
    from jax_routeweaver.rl.train_config import load_train_config

    _check_sets(args)
    cfg = load_train_config(_checkpoint_config(args.checkpoint, args.config), args.overrides)
    options = EvalOptions(
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

    from jax_routeweaver.eval.compare import BaselineOptions, run_baselines
    from jax_routeweaver.eval.report import console_table
    from jax_routeweaver.rl.loop import CONFIG_FILE
    from jax_routeweaver.rl.train_config import load_train_config

    _check_sets(args)
    config = args.config / CONFIG_FILE if args.config.is_dir() else args.config
    cfg = load_train_config(config, args.overrides)
    options = BaselineOptions(
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

    from jax_routeweaver.eval.compare import CompareOptions, run_comparison
    from jax_routeweaver.rl.train_config import load_train_config

    _check_sets(args)
    cfg = load_train_config(_checkpoint_config(args.checkpoint, args.config), args.overrides)
    r1_cfg = None
    if args.router_r1:
        r1_cfg = load_train_config(_checkpoint_config(args.router_r1, args.router_r1_config,
                                                      "--router-r1-config"))
    elif args.router_r1_config is not None:
        raise ValueError("--router-r1-config without --router-r1")
    options = CompareOptions(
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
    from jax_routeweaver.rl.train_config import load_train_config

    if args.checkpoint is None and args.config is None:
        raise ValueError("--config is required without --checkpoint (or give --checkpoint "
                         "inside a training run directory)")
    config = args.config if args.checkpoint is None \
        else _checkpoint_config(args.checkpoint, args.config)
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


# ------------------------------------------------------------------------------ sandbox
def _sandbox_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    c = sub.add_parser("check", help="attack this host's code sandbox and report which "
                                     "guarantees hold (docs/sandbox.md)",
                       description="Probe which isolation levels this host gives, then run "
                                   "each attack of jax_routeweaver/rewards/sandbox/check.py "
                                   "against one level. Exit 1 if a guarantee it promises "
                                   "does not hold, 2 if the level is not available.")
    c.add_argument("--isolation", choices=("full", "namespaces", "none"), default=None,
                   help="the level to attack (default: $ROUTEWEAVER_SANDBOX, else full)")


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


def _sandbox_row() -> tuple[str, bool]:
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
        return _one_line(e, 300), False
    finally:
        box.close()


COMMANDS: tuple[Command, ...] = (
    Command("import-hf", "convert a Hugging Face checkpoint into a policy checkpoint step",
            _import_hf_arguments, _import_hf),
    Command("export-hf", "write a policy checkpoint step as a Hugging Face checkpoint",
            _export_hf_arguments, _export_hf),
    Command("train", "train a router with RL from a YAML config (+ key.sub=value overrides)",
            _train_arguments, _train),
    Command("warm-start", "build (or reuse) the cached stand-in for a pretrained router "
            "that model.init: stand-in loads (docs/stand_in.md)", _warm_start_arguments,
            _warm_start),
    Command("selfcheck", "check every part end to end on CPU in about a minute (tokenizer, "
            "sharded model, orbax, HF export parity, sampler, episodes, code sandbox)",
            _quickstart_arguments, _quickstart),
    Command("sandbox", "the code sandbox: `sandbox check` attacks it on this host and says "
            "which guarantees hold", _sandbox_arguments, _sandbox),
    Command("plan", "per-device memory of the train step for a config's real shapes on "
            "named machines (compiled on fake CPU devices, no weights)", _plan_arguments,
            _plan),
    Command("calibrate-cost", "compute C_ref (P95 of per-trajectory worker cost) from a "
            "rollout dump and write cost_ref.json", _calibrate_cost_arguments, _calibrate_cost),
    Command("data", "data files: `data prepare` builds the paper's training, evaluation and "
            "Router-R1 files from local dataset copies", _data_arguments, _data),
    Command("eval", "evaluate routers: `eval run` runs a checkpoint over evaluation sets, "
            "`eval baselines` the single-round baselines, `eval compare` the whole comparison "
            "table, `eval favourites` measures the favoured mode per domain, `eval report` "
            "compares several evaluations", _eval_arguments, _eval),
)


# ------------------------------------------------------------------------------ main
def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
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
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def _one_line(e: BaseException, limit: int = 1000) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


if __name__ == "__main__":
    sys.exit(main())
