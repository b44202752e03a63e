"""Every command the README shows is one this repository accepts.

Each `routeweaver ...` line of the README's shell blocks (continuations joined, comments cut)
parses with the CLI's own parser, and a `train` / `plan` line's config resolves with its
overrides; each `make X` names a Makefile target. The commands that run for real are run by
their own tests: `make test` is CI itself, `make quickstart` is `test_train_loop`'s quickstart
through the CLI (scaled down), the sidecar command `test_sidecar_train` (as written).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from jax_routeweaver.cli.app import build_parser
from jax_routeweaver.rl.run.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def shell_lines() -> list[str]:
    """The README's shell commands: ```bash blocks, continuations joined, comments cut."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


COMMANDS = [line for line in shell_lines() if line.startswith("routeweaver ")]


def test_the_readme_shows_commands():
    assert len(COMMANDS) >= 10
    assert any("rollout.sampler=vllm" in c for c in COMMANDS)


@pytest.mark.parametrize("line", COMMANDS)
def test_every_routeweaver_command_parses(line):
    argv = [a for a in shlex.split(line)[1:] if a != "..."]  # "...": more of the same, elided
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's exit on an unknown flag or a missing argument
        pytest.fail(f"README command does not parse ({e.code}): {line}")
    config = getattr(args, "config", None)
    if args.command in ("train", "plan") and config is not None:
        # Placeholders (a model directory to fill in) are the reader's; the keys are ours.
        load_train_config(ROOT / config, list(args.overrides))


def test_every_make_target_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    used = {shlex.split(line)[1] for line in shell_lines() if line.startswith("make ")}
    assert used and used <= targets, used - targets
