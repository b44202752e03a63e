"""A trained router from its checkpoint: resolve what a path names (an HF directory, a policy
checkpoint or step, a training run), load the router, its tokenizer and its run's config, and
put it behind the run's sampler. Evaluation (`eval`) and serving (`serving`) load routers
through here; both sit above `rl`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from jax_routeweaver.data.record_files import QuestionLimit
from jax_routeweaver.data.records import Record
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.models.tokenizer import load_tokenizer
from jax_routeweaver.rl.run.builders import (
    build_sampler,
    build_tokenizer,
    counting_tokenizer,
    hf_context,
    question_limit,
)
from jax_routeweaver.rl.run.checkpoint import (
    TOKENIZER_DIR,
    PolicyCheckpointer,
    has_tokenizer,
    list_steps,
    restore_policy,
)
from jax_routeweaver.rl.run.loop import CONFIG_FILE
from jax_routeweaver.rl.run.train_config import TrainConfig
from jax_routeweaver.routing.protocol.calls import WorkerPool
from jax_routeweaver.sampling.sidecar import Sidecar


@dataclasses.dataclass(frozen=True)
class RouterCheckpoint:
    """A resolved router checkpoint. `path`: the HF directory, or the policy checkpoint
    directory holding step `step`. `run_dir`: the training run it belongs to, if any."""
    kind: Literal["hf", "policy"]
    path: Path
    step: int | None
    tokenizer_dir: Path | None
    run_dir: Path | None

    @property
    def config_file(self) -> Path | None:
        """The training config of the run the checkpoint belongs to, if any."""
        return self.run_dir / CONFIG_FILE if self.run_dir is not None else None


def resolve_checkpoint(path: str | os.PathLike[str]) -> RouterCheckpoint:
    """An HF directory, a policy checkpoint directory (latest step), a policy step directory,
    or a run directory (its ``checkpoints/policy``, latest step)."""
    given = Path(path)
    if not given.exists():
        raise FileNotFoundError(f"checkpoint {given}: no such file or directory")
    p = given.absolute()
    if (p / "config.json").is_file():
        return RouterCheckpoint("hf", p, None, p if has_tokenizer(p) else None, None)
    step: int | None = None
    if (p / "checkpoints" / "policy").is_dir():
        policy = p / "checkpoints" / "policy"
    elif p.name.isdigit() and int(p.name) in list_steps(p.parent):
        policy, step = p.parent, int(p.name)
    elif list_steps(p):
        policy = p
    else:
        raise ValueError(f"checkpoint {given}: not a Hugging Face directory (config.json), a "
                         "policy checkpoint directory, a policy step directory or a training "
                         "run directory (checkpoints/policy)")
    if step is None:
        steps = list_steps(policy)
        if not steps:
            raise FileNotFoundError(f"checkpoint {given}: {policy} holds no policy step")
        step = steps[-1]
    run = policy.parent.parent if policy.parent.name == "checkpoints" else None
    run = run if run is not None and (run / CONFIG_FILE).is_file() else None
    tokenizer = next((d for d in (policy / TOKENIZER_DIR,
                                  run / TOKENIZER_DIR if run is not None else None)
                      if d is not None and has_tokenizer(d)), None)
    return RouterCheckpoint("policy", policy, step, tokenizer, run)


def load_router(cfg: TrainConfig, ckpt: RouterCheckpoint, mesh: Any) -> Any:
    """The checkpoint's `Qwen3`, with the config's dtypes and runtime options (as
    `rl.run.builders.build_policy` loads ``model.init``)."""
    m = cfg.model
    runtime = m.runtime()
    if ckpt.kind == "hf":
        return load_hf(ckpt.path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype,
                       **runtime)
    model, _ = restore_policy(ckpt.path, ckpt.step, mesh=mesh, dtype=m.param_dtype,
                              compute_dtype=m.dtype, **runtime)
    return model


def load_router_tokenizer(cfg: TrainConfig, ckpt: RouterCheckpoint, records: list[Record],
                          pool: WorkerPool) -> Any:
    """The checkpoint's own tokenizer; else the config's (`rl.run.builders.build_tokenizer`), except
    a pruned one, which only the training run's text defines."""
    if ckpt.tokenizer_dir is not None:
        return load_tokenizer(ckpt.tokenizer_dir)
    if cfg.model.tokenizer == "qwen3-pruned":
        raise ValueError(f"checkpoint {ckpt.path}: no tokenizer stored with it, and "
                         "model.tokenizer: qwen3-pruned is pruned to the training run's text; "
                         "give the run directory, or set model.tokenizer to the run's "
                         "tokenizer directory")
    return build_tokenizer(cfg, records, pool)


def checkpoint_question_limit(cfg: TrainConfig, ckpt: RouterCheckpoint) -> QuestionLimit:
    """The bound on an evaluation question for the checkpoint's router
    (`rl.run.builders.question_limit`): its positions (the max_position_embeddings of its
    config.json, or of the model config stored with its policy step) and its tokenizer (the
    one stored with it, else the config's; the full Qwen3 one for "qwen3-pruned")."""
    tokenizer = load_tokenizer(ckpt.tokenizer_dir) if ckpt.tokenizer_dir is not None \
        else counting_tokenizer(cfg)
    if ckpt.kind == "hf":
        context, source = hf_context(ckpt.path)
    else:
        with PolicyCheckpointer(ckpt.path, read_only=True) as stored:
            context = stored.read_config(ckpt.step).max_position_embeddings
        source = f"max_position_embeddings={context} of {ckpt.path} step {ckpt.step}"
    return question_limit(cfg, tokenizer, context, source)


def checkpoint_config(checkpoint: str | os.PathLike[str], config: str | os.PathLike[str] | None,
                      flag: str = "--config") -> Path:
    """`config`, else the training config of the run `checkpoint` belongs to (ValueError
    naming `flag` when it belongs to none)."""
    if config is not None:
        return Path(config)
    found = resolve_checkpoint(checkpoint).config_file
    if found is None:
        raise ValueError(f"checkpoint {checkpoint} is not inside a training run directory: "
                         f"give its training config with {flag}")
    return found


@dataclasses.dataclass
class LoadedRouter:
    """A checkpoint's router ready to sample: its tokenizer, its EOS id(s), the run's sampler,
    and the vLLM sidecar behind that sampler (None for the in-process one)."""

    tokenizer: Any
    eos: int | tuple[int, ...]
    sampler: Any
    sidecar: Sidecar | None = None


def load_router_sampler(cfg: TrainConfig, ckpt: RouterCheckpoint, records: list[Record],
                        pool: WorkerPool, rows: int, work_dir: Path) -> LoadedRouter:
    """The checkpoint's router behind the config's sampler (``rollout.sampler``): the
    in-process sampler with `rows` as an exact batch bucket (`rl.run.builders.build_sampler`), or
    the vLLM sidecar booted on an HF export of this very model (policy version 0; its files
    under `work_dir`). `records` / `pool`: for a tokenizer the checkpoint does not store
    (`load_router_tokenizer`). ValueError when the tokenizer outgrows the router's vocab."""
    tokenizer = load_router_tokenizer(cfg, ckpt, records, pool)
    mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
    model = load_router(cfg, ckpt, mesh)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but the router's "
                         f"vocab_size is {model.config.vocab_size}")
    eos = model.config.eos_token_id if model.config.eos_token_id is not None \
        else tokenizer.eos_token_id
    if cfg.rollout.sampler == "vllm":
        sidecar = Sidecar(cfg.rollout.vllm, model, tokenizer, work_dir, seed=cfg.seed)
        return LoadedRouter(tokenizer, eos, sidecar.sampler, sidecar)
    sampler = build_sampler(cfg, model, tokenizer, mesh, rows,
                            pad_id=tokenizer.pad_token_id or 0)
    return LoadedRouter(tokenizer, eos, sampler)


def greedy_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the router's sampling greedy (temperature 0, no top-p/top-k)."""
    rollout = dataclasses.replace(cfg.rollout, temperature=0.0, top_p=1.0, top_k=-1)
    return dataclasses.replace(cfg, rollout=rollout)
