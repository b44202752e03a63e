"""A run's first seconds (`rl.run.preflight`): every problem that can stop it found before anything
is built or written, all named on one line; the sandbox level a run asks for, and "strongest"
falling back to what the host gives, said in one line."""

import math
import os
from pathlib import Path

import pytest
from flax import nnx
from rich.console import Console

from jax_routeweaver.cli.app import main
from jax_routeweaver.data.record_files import write_jsonl
from jax_routeweaver.data.records import Domain
from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.rewards.sandbox import Sandbox, jail, runner
from jax_routeweaver.rewards.sandbox import cgroup as cg
from jax_routeweaver.rl.run.preflight import (
    PreflightError,
    checkpoint_bytes,
    preflight,
    run_isolation,
)
from jax_routeweaver.rl.run.train_config import load_train_config
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def _keep_the_default_sandbox():
    """preflight replaces the process-wide sandbox: put the suite's back afterwards."""
    kept = runner._DEFAULT
    yield
    if runner._DEFAULT is not kept:
        runner._DEFAULT.close()
        runner._DEFAULT = kept


def quick(*overrides: str):
    return load_train_config(QUICKSTART, list(overrides))


def test_the_level_a_run_asks_for():
    assert run_isolation(quick(), env={}) == "strongest"  # the project's own code
    assert run_isolation(quick("workers.pool=channels.yaml"), env={}) == "full"
    # The user's explicit choice wins, for real workers too: the sandbox reads it itself.
    env = {"ROUTEWEAVER_SANDBOX": "namespaces"}
    assert run_isolation(quick("workers.pool=channels.yaml"), env=env) is None


def test_every_problem_is_named_at_once_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("ROUTEWEAVER_SANDBOX", "sideways")
    monkeypatch.setenv("ROUTEWEAVER_CACHE", str(blocker / "cache"))
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["train", "--config", str(QUICKSTART), f"out_dir={blocker / 'run'}",
                 f"workers.pool={tmp_path / 'no_channels.yaml'}",
                 "checkpoint.keep_full=1000000000"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("routeweaver: error: the run cannot start (6 problems): ")
    for piece in (f"out_dir {blocker / 'run'}: {blocker} is not a directory",
                  f"the stand-in cache {blocker / 'cache' / 'stand_in'}: {blocker} is not",
                  f"the tokenizer cache {blocker / 'cache'}: {blocker} is not a directory",
                  "no_channels.yaml",  # the pool's channel file
                  "the checkpoints kept need about",
                  "ROUTEWEAVER_SANDBOX='sideways' is not one of full, namespaces, none, strongest"):
        assert piece in line, (piece, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow
def test_a_run_that_needs_no_sandbox_does_not_check_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUTEWEAVER_SANDBOX", "sideways")
    data = tmp_path / "recall.jsonl"
    write_jsonl(data, [r for r in synthetic_tasks(40, seed=0) if r.domain == Domain.RECALL])
    cfg = quick(f"out_dir={tmp_path / 'run'}", f"data.source={data}", "data.quotas={}")
    records = preflight(cfg, Console(quiet=True))
    assert len(records) == 8 and not (tmp_path / "run").exists()
    with pytest.raises(PreflightError, match="sideways"):  # a CODE row runs programs
        preflight(quick(f"out_dir={tmp_path / 'run'}"), Console(quiet=True))


def test_the_strongest_level_is_said_in_one_line(tmp_path, monkeypatch):
    console = Console(record=True, width=400)
    monkeypatch.delenv("ROUTEWEAVER_SANDBOX", raising=False)
    preflight(quick(f"out_dir={tmp_path / 'run'}"), console)
    lines = [ln for ln in console.export_text().splitlines() if ln.startswith("sandbox:")]
    expected = "full" if os.geteuid() == 0 else ""
    assert len(lines) == 1 and lines[0].startswith(f"sandbox: isolation '{expected}")
    assert "(the strongest this host gives" in lines[0]


def test_strongest_falls_back_to_what_the_host_gives(monkeypatch):
    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    box = Sandbox(1, isolation="strongest")
    try:
        line = box.describe()
        assert box.isolation.level == "none"
        assert set(box.declined) == {"full", "namespaces"}
        assert all(why == "bubblewrap (bwrap) is not installed" for why in box.declined.values())
        assert line == ("sandbox: isolation 'none' (the strongest this host gives; 'full' is "
                        "not: bubblewrap (bwrap) is not installed; 'namespaces' is not: "
                        "bubblewrap (bwrap) is not installed): programs run with this user's "
                        "access to the host (trusted code only)")
        assert box.run("print(6 * 7)").stdout == "42\n"
    finally:
        box.close()
    full = Sandbox(1, isolation="full")
    with pytest.raises(Exception, match="bubblewrap"):  # no fallback unless asked for
        full.isolation  # noqa: B018
    full.close()


@pytest.mark.parametrize("fields", [
    {}, {"tie_word_embeddings": True},
    {"qkv_bias": True, "qk_norm": False, "architecture": "Qwen2ForCausalLM"}])
def test_param_count_is_the_models(fields):
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, **fields)
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    counted = sum(math.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert cfg.param_count == counted


def test_checkpoint_bytes():
    arch = ModelConfig(vocab_size=256, hidden_size=16, intermediate_size=32, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8)
    p = arch.param_count * 4
    cfg = quick("checkpoint.keep_policy=2", "checkpoint.keep_full=1")
    assert checkpoint_bytes(cfg, arch) == 3 * p + 2 * 3 * p
    critic = load_train_config(QUICKSTART.with_name("router_r1_quickstart.yaml"), [
        "checkpoint.keep_policy=2", "checkpoint.keep_full=1", "algo.estimator=ppo_gae",
        "model.param_dtype=float32"])
    assert checkpoint_bytes(critic, arch) == 3 * p + 2 * 6 * p


# ------------------------------------------------------------------ cgroup v2 delegation
# This host mounts its controllers on cgroup v1 (v2 holds none), so a v2 tree with controllers
# cannot exist here: these tests run the layout choice over a directory tree shaped like one
# (the real v1 delegation is tested as an ordinary user in test_unprivileged.py).
def v2_tree(root: Path, *, mine_controllers: str, parent_enabled: str = "",
            real_root: bool = False) -> Path:
    mine = root if real_root else root / "user.slice" / "run-1.scope"
    mine.mkdir(parents=True, exist_ok=True)
    (mine / "cgroup.controllers").write_text(mine_controllers)
    (mine / "cgroup.procs").write_text("101\n102\n")
    (mine / "cgroup.subtree_control").write_text("")
    if not real_root:
        (mine / "cgroup.type").write_text("domain")
        (mine.parent / "cgroup.subtree_control").write_text(parent_enabled)
    return mine


def test_v2_a_delegated_own_cgroup_moves_its_processes_to_a_leaf(tmp_path):
    mine = v2_tree(tmp_path, mine_controllers="cpu memory pids")
    layout, why = cg._v2_layout(mine, "tag")
    assert why == "" and layout.delegated == mine and layout.controllers == ("memory", "pids",
                                                                              "cpu")
    assert set(layout.bases.values()) == {mine / "tag"}
    cg._move_to_leaf(mine)
    assert (mine / cg.LEAF).is_dir()
    assert (mine / cg.LEAF / "cgroup.procs").read_text() == "102"  # written pid by pid


def test_v2_a_writable_parent_takes_a_sibling(tmp_path):
    mine = v2_tree(tmp_path, mine_controllers="memory pids", parent_enabled="memory pids")
    layout, _ = cg._v2_layout(mine, "tag")
    assert layout.delegated is None and set(layout.bases.values()) == {mine.parent / "tag"}


def test_v2_the_real_root_needs_no_leaf(tmp_path):
    mine = v2_tree(tmp_path, mine_controllers="memory pids io", real_root=True)
    layout, _ = cg._v2_layout(mine, "tag")
    assert layout.delegated is None and layout.controllers == ("memory", "pids")


def test_v2_without_the_controllers_says_so(tmp_path):
    mine = v2_tree(tmp_path, mine_controllers="hugetlb")
    layout, why = cg._v2_layout(mine, "tag")
    assert layout is None and "memory and pids controllers are not available" in why
    assert "hugetlb" in why
