"""Test harness: 8 fake CPU devices (set before jax is imported) and tiny random HF models."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import jax
import pytest
from tiny_models import make_hf_model


@pytest.fixture(scope="session")
def devices():
    assert jax.device_count() == 8, "tests need 8 fake CPU devices (XLA_FLAGS set too late?)"
    return jax.devices()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A saved tiny untied Qwen3 checkpoint, shared by the session (read-only by convention)."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    make_hf_model(path)
    return path
