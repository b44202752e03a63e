"""The on-disk layout of one orbax policy step, readable without building a model.

A step directory `CKPT_DIR/<step>/` holds two orbax items: `params` (our parameter tree,
StandardSave) and `model_config` (JSON: `config_to_json`). `rl.run.checkpoint.PolicyCheckpointer`
writes and restores steps into a model; `read_step` gives host arrays, for readers that only
map names (the vLLM weight-sync worker extension).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import CheckpointError

FORMAT_VERSION = 1
PARAMS_ITEM = "params"
CONFIG_ITEM = "model_config"


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    """The `model_config` item stored with every step."""
    return {"format": FORMAT_VERSION, "model_config": dataclasses.asdict(cfg),
            "hf_config": cfg.to_hf()}


def config_from_json(meta: Any, where: str) -> ModelConfig:
    """Inverse of `config_to_json`; CheckpointError naming `where` if it is not one."""
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{where}: not a policy model_config (no 'model_config' object)")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format {meta.get('format')!r} is not supported "
                              f"(expected {FORMAT_VERSION})")
    fields = dict(meta["model_config"])
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise CheckpointError(f"{where}: unknown model_config field(s) {unknown}")
    try:
        # JSON turned ModelConfig's tuples (rope_scaling pairs, eos ids) into lists.
        return ModelConfig(**{k: _tuples(v) for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: corrupt model_config ({first_line(e)})") from e


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def first_line(e: BaseException, limit: int = 300) -> str:
    """A short, one-line version of an exception (orbax messages can run to pages)."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    return line if len(line) <= limit else line[:limit] + " ..."



def read_step(step_dir: str | Path) -> tuple[ModelConfig, dict[tuple[str, ...], np.ndarray]]:
    """(config, {parameter path: host array}) of one committed policy step directory.
    CheckpointError naming the directory if it is not a complete step."""
    import orbax.checkpoint as ocp

    step_dir = Path(step_dir).absolute()
    meta = step_dir / CONFIG_ITEM / "metadata"
    if not (step_dir / "commit_success.txt").is_file() or not meta.is_file():
        raise CheckpointError(f"{step_dir}: not a committed policy step")
    try:
        cfg = config_from_json(json.loads(meta.read_text()), str(meta))
        with ocp.StandardCheckpointer() as ckptr:
            # Onto this process's first CPU device, whatever mesh wrote the step: a reader
            # (the vLLM worker extension) rarely has the trainer's device count.
            cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            saved = ckptr.metadata(step_dir / PARAMS_ITEM).item_metadata
            target = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), saved)
            tree = ckptr.restore(step_dir / PARAMS_ITEM, target)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{step_dir}: unreadable ({first_line(e)})") from e
    return cfg, {path: np.asarray(leaf) for path, leaf in flatten(tree).items()}


def flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Nested dict -> {path: leaf}."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {p: leaf for k, v in tree.items() for p, leaf in flatten(v, (*prefix, k)).items()}
