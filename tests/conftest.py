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

# The files that take longest on 2 cores (minutes each; bench/RESULTS.md, "Test suite time"),
# collected first: `make test` hands whole files to two workers in collection order
# (`--dist loadfile --no-loadscope-reorder`), and a long file that started last would leave
# the other worker idle at the end.
LONGEST_FIRST = ("test_train_loop.py", "test_sidecar_train.py", "test_vllm_sidecar.py",
                 "test_stand_in.py", "test_distributed.py", "test_trainer.py", "test_plan.py",
                 "test_run_safety.py", "test_router_r1_train.py", "test_episode_routeweaver.py",
                 "test_sidecar_bf16.py", "test_serve.py", "test_eval.py", "test_favourites.py",
                 "test_plan_step.py", "test_cli.py", "test_unprivileged.py",
                 "test_workers_vllm.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`LONGEST_FIRST` first, in that order; the rest after, as collected (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


@pytest.fixture(scope="session", autouse=True)
def vllm_cache(tmp_path_factory):
    """One vLLM cache for the session's servers (later ones skip vLLM's model inspection),
    unless the environment names one."""
    if "VLLM_CACHE_ROOT" in os.environ:
        yield
        return
    os.environ["VLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("vllm_cache"))
    yield
    del os.environ["VLLM_CACHE_ROOT"]


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent XLA compilation cache shared by the whole session (settings restored
    afterwards): a test that builds a program an earlier one built (another sampler or trainer
    of the same tiny model, a resumed run) loads it instead of compiling. Yields its directory;
    a subprocess gets it through the environment variables JAX_COMPILATION_CACHE_DIR and
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0."""
    from jax._src import compilation_cache  # reset: JAX reads the settings once

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    old = {k: jax.config.values[k] for k in keys}
    path = tmp_path_factory.mktemp("xla_cache")
    jax.config.update(keys[0], str(path))
    jax.config.update(keys[1], 0.0)
    compilation_cache.reset_cache()
    yield path
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


@pytest.fixture
def no_compile_cache():
    """Compile for real in this test (for tests that count compilations)."""
    from jax._src import compilation_cache

    old = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", old)
    compilation_cache.reset_cache()
