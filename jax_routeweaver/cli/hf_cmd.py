"""`routeweaver import-hf` and `export-hf`: convert between Hugging Face checkpoints and
policy checkpoint steps."""

from __future__ import annotations

import argparse
from pathlib import Path

from jax_routeweaver.cli.common import (
    Command,
    add_mesh_argument,
    optional_mesh,
    parse_size,
)

DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------------------ import-hf
def _import_hf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("ckpt_dir", type=Path, metavar="CKPT_DIR", help="policy checkpoint directory")
    p.add_argument("--step", type=int, default=0, help="step to save as (default: 0)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: float32)")
    add_mesh_argument(p)


def _import_hf(args: argparse.Namespace) -> int:
    from jax_routeweaver.models.hf import CheckpointError, load_hf
    from jax_routeweaver.rl.run.checkpoint import has_tokenizer, list_steps, save_policy

    existing = list_steps(args.ckpt_dir)
    if args.step in existing:  # checked before the (possibly long) load
        raise CheckpointError(f"{args.ckpt_dir}: step {args.step} already exists "
                              f"(steps: {existing})")
    model = load_hf(args.hf_dir, mesh=optional_mesh(args.mesh), dtype=args.dtype)
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
    add_mesh_argument(p)


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
    from jax_routeweaver.rl.run.checkpoint import TOKENIZER_DIR, restore_policy

    check_output_dir(args.hf_dir, args.overwrite)  # before the (possibly long) restore
    model, step = restore_policy(args.ckpt_dir, args.step, mesh=optional_mesh(args.mesh),
                                 dtype=args.dtype)
    tokenizer = args.ckpt_dir / TOKENIZER_DIR
    tokenizer = tokenizer if tokenizer.is_dir() else None
    save_hf(model, args.hf_dir, tokenizer=tokenizer, max_shard_bytes=args.max_shard_size,
            untie=args.untie)
    note = "with tokenizer" if tokenizer else "no tokenizer stored"
    print(f"exported {args.ckpt_dir} step {step} -> {args.hf_dir} "
          f"({model.config.param_dtype}, {note})")
    return 0


IMPORT_HF = Command("import-hf", "convert a Hugging Face checkpoint into a policy checkpoint step",
                    _import_hf_arguments, _import_hf)
EXPORT_HF = Command("export-hf", "write a policy checkpoint step as a Hugging Face checkpoint",
                    _export_hf_arguments, _export_hf)
