"""bench/gpu_check.py's lock check: what it reads from a lock file and what it reports (the
GPU parts themselves run only on a GPU, or with --tiny by hand: bench/RESULTS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_lock_pins_reads_names_and_versions():
    pins = gpu_check.lock_pins(ROOT / "requirements" / "gpu.lock")
    assert pins["jax"] == "0.10.2" and pins["vllm"] == "0.32.0"
    assert all("==" not in v and v for v in pins.values())
    assert len(pins) > 200


def test_the_installed_cpu_lock_passes_and_a_wrong_pin_is_named(tmp_path):
    out = gpu_check.lock_part(ROOT / "requirements" / "cpu.lock")
    assert out["mismatches"] == 0 and out["pins"] > 100
    bad = tmp_path / "bad.lock"
    bad.write_text("# a comment\nflax==0.0.1  # pinned wrong\nnot-a-package-xyz==1.0\n")
    with pytest.raises(RuntimeError) as err:
        gpu_check.lock_part(bad)
    assert "2 of 2 pins" in str(err.value) and "flax==0.0.1 (installed: " in str(err.value)
    assert "not-a-package-xyz==1.0 (installed: missing)" in str(err.value)
