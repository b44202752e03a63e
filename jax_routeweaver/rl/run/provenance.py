"""What a run was made from, so its results can be traced: code, config and data.

`provenance(cfg)` returns the fields `run.json` records next to the resolved config:

* ``project``: the package version and, when the package is imported from a git checkout,
  its commit and whether the working tree had uncommitted changes (``dirty``); ``commit`` is
  None outside a checkout (an installed wheel) or without git;
* ``config_sha256``: sha256 of the resolved config as canonical JSON (sorted keys, secrets
  redacted as in every config dump), so two runs share it exactly when their configs match;
* ``files``: sha256 and size of every input file the config names: the data file
  (``data.source`` unless "synthetic"), the worker channel file (``workers.pool`` unless
  "simulated") and a ``reward.c_ref`` that names a cost-reference file. Synthetic data is
  fully determined by the config, so it has no file to hash.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
from pathlib import Path
from typing import Any

from jax_routeweaver.config import redact_secrets, to_dict
from jax_routeweaver.rl.run.train_config import TrainConfig

__all__ = ["config_sha256", "file_sha256", "git_state", "provenance"]

PACKAGE = "jax_routeweaver"
_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> dict[str, Any]:
    """{"path", "sha256", "bytes"} of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"path": str(path), "sha256": digest.hexdigest(), "bytes": size}


def config_sha256(cfg: TrainConfig) -> str:
    """sha256 of the resolved config as canonical JSON, secrets redacted."""
    text = json.dumps(redact_secrets(to_dict(cfg)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def git_state(directory: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding `directory`; (None, None) when it is not
    in one or git is unavailable."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit.strip(), None if status is None else bool(status.strip())


def _input_files(cfg: TrainConfig) -> list[Path]:
    files = []
    if cfg.data.source != "synthetic":
        files.append(Path(cfg.data.source))
    if cfg.workers.pool != "simulated":
        files.append(Path(cfg.workers.pool))
    c_ref = cfg.reward.c_ref
    if isinstance(c_ref, str) and c_ref.strip():
        try:
            float(c_ref)
        except ValueError:
            files.append(Path(c_ref.strip()))
    return files


def provenance(cfg: TrainConfig) -> dict[str, Any]:
    """The module doc's fields for `cfg`. A named input file that is missing is an
    OSError (the run could not have read it either)."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit, dirty = git_state(Path(__file__).resolve().parent)
    return {"project": {"name": PACKAGE, "version": version, "commit": commit, "dirty": dirty},
            "config_sha256": config_sha256(cfg),
            "files": [file_sha256(p) for p in _input_files(cfg)]}
