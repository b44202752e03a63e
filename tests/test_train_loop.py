"""`routeweaver train` end to end on the embedded default (scaled down): config handling, the
files a run leaves, and exact resume after SIGKILL."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jax_routeweaver.cli.app import main
from jax_routeweaver.rl.reports.run_log import read_metrics
from jax_routeweaver.rl.run.provenance import config_sha256
from jax_routeweaver.rl.run.train_config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# Four short steps: 5 queries (one per domain) x 2 rollouts, full state every 2 steps; the
# curriculum turns free at step 3 so both arms and the COMET split are exercised; the sampler
# reuses earlier turns' KV caches (off in the quickstart itself). Coarse prompt buckets: a
# short run compiles fewer shapes.
SMALL = ["model.init=random", "steps=4", "data.batch_size=5", "data.group_size=2",
         "checkpoint.full_every=2",
         "data.quotas={MATH: 1, CODE: 1, KNOWLEDGE: 1, REASON: 1, RECALL: 1}",
         "algo.exploration.forced_start_batch=0", "algo.exploration.forced_anneal_steps=2",
         "rollout.max_new_tokens=48", "rollout.prefix_cache_mb=64",
         "rollout.prompt_buckets=[256,1024,4096]", "logging.progress=false",
         "logging.tensorboard=false"]


def train_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jax_routeweaver.cli", "train", "--config", str(QUICKSTART),
            f"out_dir={out}", *SMALL, *extra]


def run_env(compile_cache: Path) -> dict[str, str]:
    """A CPU run's environment that shares the session's compile cache: runs that build the
    same programs load them instead of compiling."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
            "JAX_COMPILATION_CACHE_DIR": str(compile_cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def comparable(records: list[dict]) -> list[dict]:
    """Per-step metrics without wall-clock times."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {QUICKSTART}\noptim:\n  lrr: 0.1\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "did you mean 'lr'" in err


def test_bad_override_value_names_the_key(capsys):
    assert main(["train", "--config", str(QUICKSTART), "optim.lr=fast"]) == 2
    assert "optim.lr" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.task_text=<b>", "without tags"),
    ("rollout.task_text=' lead'", "not start with a space"),
    ("rollout.prompt_buckets=[512,256]", "strictly increasing"),
])
def test_bad_rollout_option_is_a_config_error(override, message, capsys):
    assert main(["train", "--config", str(QUICKSTART), "--print-config", override]) == 2
    err = capsys.readouterr().err
    assert override.split("=")[0] in err and message in err


def test_print_config_resolves_overrides(capsys):
    assert main(["train", "--config", str(QUICKSTART), "--print-config", "optim.lr=0.5",
                 "data.group_size=3"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["optim"]["lr"] == 0.5 and resolved["data"]["group_size"] == 3
    assert resolved["algo"]["estimator"] == "comet_grpo"


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_repeats_the_uninterrupted_run(tmp_path, compile_cache):
    env = run_env(compile_cache)  # the four runs build the same programs
    whole = tmp_path / "whole"
    subprocess.run(train_cmd(whole), check=True, env=env, capture_output=True, timeout=900)
    expected = read_metrics(whole / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4]

    # Kill once step 3 is logged: the process is then inside step 4, and the newest full
    # train state is step 2, so the resumed run redoes steps 3 and 4.
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(killed), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            path = killed / "metrics.jsonl"
            if path.exists() and any(json.loads(line)["step"] == 3
                                     for line in path.read_text().splitlines() if line):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    subprocess.run(train_cmd(killed), check=True, env=env, capture_output=True, timeout=900)
    resumed = read_metrics(killed / "metrics.jsonl")
    assert comparable(resumed) == comparable(expected)

    # checkpoint.init_from: a fresh run started from the whole run's step-2 state (params,
    # optimizer, step; data from batch 2) repeats that run's steps 3 and 4 exactly, as the
    # reference's main arm continues its cold arm.
    source = tmp_path / "cold_state"
    shutil.copytree(whole / "checkpoints" / "state", source)
    shutil.rmtree(source / "4")
    arm = tmp_path / "arm"
    subprocess.run(train_cmd(arm, f"checkpoint.init_from={source}"), check=True, env=env,
                   capture_output=True, timeout=900)
    continued = read_metrics(arm / "metrics.jsonl")
    assert [r["step"] for r in continued] == [3, 4]
    assert [r["curriculum/batch_index"] for r in continued] == [2.0, 3.0]
    assert comparable(continued) == comparable(expected[2:])

    # What a run leaves behind.
    for name in ("config.yaml", "metrics.jsonl", "reward.png", "mode_shares.png", "run.json"):
        assert (whole / name).is_file(), name
    assert sorted(p.name for p in (whole / "checkpoints" / "policy").iterdir()
                  if p.name.isdigit()) == ["3", "4"]
    saved = yaml.safe_load((whole / "config.yaml").read_text())
    assert saved["steps"] == 4 and saved["data"]["group_size"] == 2
    record = json.loads((whole / "run.json").read_text())  # traceable: code, config, data
    assert record["last_step"] == 4 and record["files"] == []  # synthetic, simulated
    assert record["config_sha256"] == config_sha256(load_train_config(QUICKSTART, [
        f"out_dir={whole}", *SMALL]))
    assert record["project"]["name"] == "jax_routeweaver" and "commit" in record["project"]
    last = expected[-1]
    assert last["policy/version"] == 4.0
    assert last["curriculum/rho"] == 0.0 and last["curriculum/forced_share"] == 0.0
    assert expected[0]["curriculum/forced_share"] == 1.0
    assert last["logprob/sampler_gap_max"] < 1e-3
    assert last["adv/identity_error"] < 1e-5
    # Every step's later turns prefilled only their new tokens on the earlier turns' caches.
    assert all(r["rollout/prefix_hits"] > 0 and r["rollout/prefix_tokens"] > 0
               for r in expected)


def test_out_dir_url_is_a_config_error(capsys):
    assert main(["train", "--config", str(QUICKSTART), "--print-config",
                 "out_dir=gs://bucket/run"]) == 2
    assert "out_dir: 'gs://bucket/run': a filesystem path is needed" in capsys.readouterr().err


@pytest.mark.slow
def test_http_workers_serve_every_step(tmp_path, monkeypatch, compile_cache):
    """Workers behind real HTTP (`HttpWorkerPool`, which binds its client to one event loop)
    across steps: the run keeps one loop, so step 2 calls the workers like step 1."""
    from openai_stub import KEY_ENV, PROXY_VARS, SECRET, SimServer, channel_file
    from rich.console import Console

    from jax_routeweaver.rl.run.builders import build_records
    from jax_routeweaver.rl.run.train_config import load_train_config
    from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool

    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(KEY_ENV, SECRET)
    cfg = load_train_config(QUICKSTART, [f"out_dir={tmp_path / 'run'}", *SMALL])
    sim = SimulatedWorkerPool(build_records(cfg, Console(quiet=True)), seed=cfg.workers.seed)
    server = SimServer(sim)
    try:
        channels = channel_file(tmp_path / "channels.yaml", sim, server.url)
        done = subprocess.run(train_cmd(tmp_path / "run", "steps=2",
                                        f"workers.pool={channels}"),
                              capture_output=True, text=True, timeout=600,
                              env=run_env(compile_cache))
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        server.close()
    steps = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episode/worker_calls_mean"] > 0 and r["infra/failed_rate"] == 0
               for r in steps)
    assert len(server.bodies) == sum(r["episode/worker_calls_mean"] * 10 for r in steps)
    assert SECRET not in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.slow
def test_training_rolls_out_on_the_paged_engine(tmp_path, compile_cache):
    """`rollout.kv_cache: paged` through the whole loop: 10 rollouts through 4 decode slots of
    a small page pool (rows admitted as others retire), two steps, every action valid."""
    from jax_routeweaver.rl.reports.run_log import read_metrics

    out = tmp_path / "paged"
    done = subprocess.run(train_cmd(out, "steps=2", "rollout.kv_cache=paged",
                                    "rollout.paged.max_rows=4",
                                    "rollout.paged.budget_tokens=16384"),
                          capture_output=True, text=True, timeout=900,
                          env=run_env(compile_cache))
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["policy/version"] == r["step"] and r["violation/rate"] == 0
        assert sum(v for k, v in r.items() if k.startswith("rows/by_domain/")) == 10
