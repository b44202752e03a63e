"""bench/suite.py end to end: quick sizes on the two cheapest benches (model, episodes), a
bench that fails, one that times out, and an unknown bench name."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.integration]
RATIOS = {"model": {"forward_backward_ours_over_transformers",
                    "greedy_decode_ours_over_transformers"},
          "episodes": {"wall_over_bound"}}


def run_suite(*args: str) -> subprocess.CompletedProcess:
    """The suite as a user runs it; the benches get this machine's single CPU device, not the
    8 fake ones conftest.py sets up."""
    env = dict(os.environ, COLUMNS="200")
    flags = env.pop("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    if flags.strip():
        env["XLA_FLAGS"] = flags.strip()
    return subprocess.run([sys.executable, "bench/suite.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_quick_suite_writes_json_and_markdown(tmp_path):
    run = run_suite("--quick", "--only", "episodes", "model", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(tmp_path / "report.md") in "".join(run.stdout.split())

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["suite"]["quick"] is True
    assert list(report["benches"]) == ["model", "episodes"]  # the suite's order, not --only's
    for name, ratios in RATIOS.items():
        entry = report["benches"][name]
        assert entry["status"] == "ok" and entry["bench"] == name, entry
        assert entry["command"].startswith(f"bench/{name}.py") and entry["reference"]
        assert set(entry["ratios"]) == ratios
        assert all(math.isfinite(v) and v > 0 for v in entry["ratios"].values()), entry
        assert entry["rows"] and entry["seconds"] > 0
    model = report["benches"]["model"]
    assert model["config"]["layers"] == 2  # --quick sizes reached the bench
    assert [r["ratio_ours_over_ref"] for r in model["rows"]] == list(model["ratios"].values())
    assert all(r["ours_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in model["rows"])
    (row,) = report["benches"]["episodes"]["rows"]
    assert row["episodes"] == 256 and row["bound_s"] == pytest.approx(2 * row["latency_s"])
    assert row["wall_s"] / row["bound_s"] == pytest.approx(row["wall_over_bound"])

    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["memory_gib"] > 0 and machine["cpu_model"]
    assert machine["versions"]["jax"] and machine["versions"]["torch"]
    assert len(machine["git"]["commit"]) == 40 and isinstance(machine["git"]["dirty"], bool)

    md = (tmp_path / "report.md").read_text()
    for heading in ("## Machine", "## Summary", "## model", "## episodes"):
        assert f"\n{heading}\n" in md
    assert f"| CPU | {machine['cpu_model']}, {machine['cpu_count']} cores" in md
    assert f"jax {machine['versions']['jax']}" in md and machine["git"]["commit"] in md
    assert "Reference: transformers Qwen3ForCausalLM" in md and "Reference: critical-path" in md
    for name, ratios in RATIOS.items():
        for ratio in ratios:
            assert f"- {ratio}: {report['benches'][name]['ratios'][ratio]:.3g}x" in md
    assert "| forward+backward | 4 | 64 |" in md  # a row of model's table
    assert "greedy decode" in (tmp_path / "logs" / "model.log").read_text()


def test_failing_bench_is_reported_and_the_next_one_runs(tmp_path):
    run = run_suite("--quick", "--only", "model", "episodes", "--out", str(tmp_path),
                    "--bench-args", "model=--no-such-flag")
    assert run.returncode == 1, run.stdout + run.stderr
    benches = json.loads((tmp_path / "report.json").read_text())["benches"]
    failed, ok = benches["model"], benches["episodes"]
    assert failed["status"] == "failed" and failed["returncode"] == 2
    assert failed["error"] == "exited with status 2"
    assert "unrecognized arguments: --no-such-flag" in failed["output_tail"]
    assert "--no-such-flag" in failed["command"] and "ratios" not in failed
    assert ok["status"] == "ok" and math.isfinite(ok["ratios"]["wall_over_bound"])
    md = (tmp_path / "report.md").read_text()
    assert "| model | **failed**: exited with status 2 |" in md
    assert "unrecognized arguments: --no-such-flag" in md and "- wall_over_bound: " in md


def test_timeout_interrupts_the_bench(tmp_path):
    run = run_suite("--only", "episodes", "--timeout", "1", "--out", str(tmp_path))
    assert run.returncode == 1, run.stdout + run.stderr
    entry = json.loads((tmp_path / "report.json").read_text())["benches"]["episodes"]
    assert entry["status"] == "failed" and entry["error"] == "timed out after 1 s"
    assert entry["seconds"] < 60  # SIGINT ended it, no grace period ran out


@pytest.mark.parametrize("args, message", [
    (["--only", "nosuch"], "invalid choice: 'nosuch'"),
    (["--bench-args", "nosuch=--x"], "expected NAME=ARGS with NAME one of"),
    (["--only", "model", "--skip", "model"], "leave no bench to run"),
])
def test_bad_selection_is_a_usage_error(tmp_path, args, message):
    run = run_suite(*args, "--out", str(tmp_path))
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not (tmp_path / "report.json").exists()
