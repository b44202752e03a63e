"""The checks that can stop a run, made in its first seconds, before anything is built or written.

`preflight(cfg, console)` makes every check and, when any fails, raises `PreflightError`, one
line naming every problem at once (so a user fixes them in one go, not one per attempt):

    run directory  a resumed run already has more steps than asked (`check_run_dir`)
    worker pool    prices, keys and endpoints (`rl.run.pool_check.check_run_pool`)
    data           the run's records load (`rl.run.builders.build_records`)
    directories    ``out_dir`` and the caches the run fills (the stand-in's, the tokenizer's)
                   exist writable or can be made
    disk           where ``out_dir`` lives holds the checkpoints the run keeps at once
                   (`checkpoint_bytes`)
    sandbox        when the run's rows run programs (`rewards.feedback.runs_programs`), the
                   isolation the run asks for (`run_isolation`) is had on this host; the level
                   is said in one line

The sandbox checked is the one the run's scorers and executors then use
(`rewards.sandbox.configure_default_sandbox`). Nothing here writes a file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from jax_routeweaver.data.records import Record
from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.tokenizer import CACHE_ENV_VAR, cache_root
from jax_routeweaver.rewards.feedback import runs_programs
from jax_routeweaver.rewards.sandbox import (
    ISOLATION_ENV,
    STRONGEST,
    IsolationUnavailable,
    SandboxError,
    configure_default_sandbox,
)
from jax_routeweaver.rl.core.estimators import ESTIMATORS
from jax_routeweaver.rl.run import stand_in
from jax_routeweaver.rl.run.builders import build_records, router_architecture
from jax_routeweaver.rl.run.checkpoint import list_steps
from jax_routeweaver.rl.run.pool_check import SIMULATED, check_run_pool
from jax_routeweaver.rl.run.train_config import TrainConfig

__all__ = [
    "PreflightError",
    "check_run_dir",
    "checkpoint_bytes",
    "preflight",
    "run_isolation",
]

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class PreflightError(ValueError):
    """The run cannot start: the message is one line naming each problem found."""


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse, before anything is built or written, a run directory this config cannot
    continue: ValueError naming `cfg.out_dir` if it resumes and its newest full train state
    is past ``steps`` (the run already trained more steps than asked)."""
    out = Path(cfg.out_dir)
    full = list_steps(out / "checkpoints" / "state") if cfg.checkpoint.resume else []
    if full and full[-1] > cfg.steps:
        raise ValueError(f"{out}: the run already has {full[-1]} steps, more than "
                         f"steps={cfg.steps}; give steps > {full[-1]} to continue it, or a "
                         "new out_dir")


def run_isolation(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The sandbox isolation a run asks for (`Sandbox(isolation=...)`): None when
    ``$ROUTEWEAVER_SANDBOX`` is set (the user's choice, read by the sandbox itself, so that
    a bad value is named as that variable); else "strongest" for the simulated pool, whose
    answers are code the project generates itself; else "full": a real worker's code runs
    only with whole-job limits unless the user lowers the level."""
    env = os.environ if env is None else env
    if env.get(ISOLATION_ENV):
        return None
    return STRONGEST if cfg.workers.pool == SIMULATED else "full"


def checkpoint_bytes(cfg: TrainConfig, arch: ModelConfig) -> int:
    """The bytes the run's checkpoints hold at once at most, from the parameter count P and
    ``model.param_dtype``'s b bytes: ``keep_policy`` + 1 policy checkpoints of P b (a new one
    is written before the oldest goes) and ``keep_full`` + 1 full states of 3 P b (the
    parameters and AdamW's two moments), twice that with a critic (``ppo_gae``)."""
    params = arch.param_count * _ITEMSIZE[cfg.model.param_dtype]
    full = 3 * params * (2 if ESTIMATORS[cfg.algo.estimator].critic else 1)
    c = cfg.checkpoint
    return (c.keep_policy + 1) * params + (c.keep_full + 1) * full


def preflight(cfg: TrainConfig, console: Console) -> list[Record]:
    """Make every check of the module doc; return the run's records. PreflightError, one line
    listing every problem, when any fails."""
    problems = _directory_problems(cfg)
    checks = [check_run_pool] if problems else [check_run_dir, check_run_pool]
    for check in checks:
        try:
            check(cfg)
        except (ValueError, OSError) as e:
            problems.append(str(e))
    try:
        records = build_records(cfg, console)
    except (ValueError, OSError) as e:
        problems.append(f"data.source {cfg.data.source}: {e}")
        records = []
    problems += _disk_problems(cfg)
    feedback = cfg.rollout.dialect == "routeweaver" and cfg.rollout.execution_feedback
    if any(runs_programs(r.scorer_dataset, feedback) for r in records):
        try:
            console.print(escape(configure_default_sandbox(run_isolation(cfg)).describe()),
                          soft_wrap=True)  # one line, whatever the terminal's width
        except IsolationUnavailable as e:
            problems.append(f"sandbox: isolation {e.level!r} is not available on this host: "
                            f"{e.why} (docs/sandbox.md says how to get it; "
                            f"{ISOLATION_ENV}=namespaces accepts less)")
        except SandboxError as e:
            problems.append(str(e))
    if problems:
        raise PreflightError(f"the run cannot start ({len(problems)} problem"
                             f"{'s' if len(problems) > 1 else ''}): "
                             + " | ".join(" ".join(p.split()) for p in problems))
    return records


def _directory_problems(cfg: TrainConfig) -> list[str]:
    """The run's directories that can neither be written nor made."""
    fix = f" (set ${CACHE_ENV_VAR} to a writable directory)"
    wanted = [("out_dir", Path(cfg.out_dir), "")]
    if cfg.model.init == "stand-in":
        wanted.append(("the stand-in cache", stand_in.cache_root(cfg.model.stand_in.cache_dir),
                       fix))
    if cfg.model.tokenizer in ("qwen3", "qwen3-pruned"):
        wanted.append(("the tokenizer cache", cache_root(), fix))
    problems = []
    for what, path, hint in wanted:
        existing = _nearest_existing(path)
        if not os.path.isdir(existing):
            problems.append(f"{what} {path}: {existing} is not a directory")
        elif not os.access(existing, os.W_OK | os.X_OK):
            how = "is not writable" if existing == path else "cannot be made"
            problems.append(f"{what} {path} {how} by uid {os.geteuid()} ({existing} is not "
                            f"writable){hint}")
    return problems


def _disk_problems(cfg: TrainConfig) -> list[str]:
    """Too little free space for the checkpoints where ``out_dir`` lives."""
    try:
        arch, _ = router_architecture(cfg)
    except (ValueError, OSError):  # reported by the data or model checks of the run itself
        return []
    need = checkpoint_bytes(cfg, arch)
    where = _nearest_existing(Path(cfg.out_dir))
    try:
        free = shutil.disk_usage(where).free
    except OSError:  # the directory check says why
        return []
    if free >= need:
        return []
    return [f"out_dir {cfg.out_dir}: {free / 2**30:.2f} GiB free on {where}'s disk, the "
            f"checkpoints kept need about {need / 2**30:.2f} GiB (checkpoint.keep_policy="
            f"{cfg.checkpoint.keep_policy}, keep_full={cfg.checkpoint.keep_full})"]


def _nearest_existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not os.path.exists(path) and path != path.parent:  # False where it may not look
        path = path.parent
    return path
