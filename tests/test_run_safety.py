"""A `routeweaver` command that fails on an existing run leaves it as it was: one line on
stderr naming what is wrong, exit code 2, and no file of the run rewritten or deleted (its
config.yaml, tokenizer, metrics and checkpoints). One finished two-step run is shared by the
module; each test works on its own copy."""

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint import truncate_arrays
from test_train_loop import run_env, train_cmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory, compile_cache) -> Path:
    """A finished 2-step run (full train state and policy steps 1 and 2); read-only."""
    out = tmp_path_factory.mktemp("finished") / "run"
    done = subprocess.run(train_cmd(out, "steps=2"), capture_output=True, text=True,
                          timeout=900, env=run_env(compile_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints" / "state").iterdir()) == ["2"]
    return out


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    """A copy of the finished run that a test may damage."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


@pytest.fixture
def env(compile_cache) -> dict[str, str]:
    return run_env(compile_cache)


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under `root`: relative path -> (mtime in ns, sha256), so a file rewritten
    with the same bytes counts as changed too."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def routeweaver(*argv: object, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jax_routeweaver.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=600, env=env)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The error line of a failed command, checking it is the whole of stderr."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("routeweaver: error: "), done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("kind", ["bad data file", "other model shape"])
def test_a_failed_start_leaves_the_run_untouched(run_dir, tmp_path, env, kind):
    if kind == "bad data file":
        bad = tmp_path / "bad.jsonl"
        bad.write_text("not json\n")
        change, message = f"data.source={bad}", f"{bad}:1: invalid JSON"
    else:  # the resume restores a state saved by a model of another shape
        change = "model.random.intermediate_size=96"
        message = f"{run_dir / 'checkpoints' / 'state' / '2'}: cannot restore the train state"
    before = snapshot(run_dir)
    line = one_line_error(subprocess.run(train_cmd(run_dir, "steps=3", change),
                                         capture_output=True, text=True, timeout=600, env=env))
    assert message in line
    assert snapshot(run_dir) == before  # config.yaml, tokenizer, checkpoints, metrics


def test_resume_from_a_truncated_train_state_is_one_line(run_dir, env):
    step_dir = run_dir / "checkpoints" / "state" / "2"
    truncate_arrays(step_dir / "train_state")
    before = snapshot(run_dir)
    line = one_line_error(subprocess.run(train_cmd(run_dir, "steps=3"), capture_output=True,
                                         text=True, timeout=600, env=env))
    assert f"checkpoint {step_dir}: unreadable (truncated or corrupt: " in line
    assert snapshot(run_dir) == before


def test_fewer_steps_than_the_run_has_is_one_line(run_dir, env):
    before = snapshot(run_dir)
    line = one_line_error(subprocess.run(train_cmd(run_dir, "steps=1"), capture_output=True,
                                         text=True, timeout=600, env=env))
    assert f"{run_dir}: the run already has 2 steps, more than steps=1" in line
    assert "steps > 2 to continue" in line and "new out_dir" in line
    assert snapshot(run_dir) == before


def test_export_of_truncated_params_is_one_line(run_dir, tmp_path, env):
    policy = run_dir / "checkpoints" / "policy"
    truncate_arrays(policy / "2" / "params")
    before = snapshot(run_dir)
    line = one_line_error(routeweaver("export-hf", policy, tmp_path / "hf", env=env))
    assert f"checkpoint {policy / '2'}: unreadable (truncated or corrupt: " in line
    assert snapshot(run_dir) == before
    assert not (tmp_path / "hf").exists()
