"""Policy checkpoints (orbax): bit-identical round trips, sharded restore, dtype casts, step
selection, retention, tokenizer copy and clear errors."""

import gc
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from model_helpers import shard_model

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import CheckpointError
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import (
    SAMPLE_RULES,
    TRAIN_RULES,
    make_mesh,
    param_specs,
)
from jax_routeweaver.rl.run.checkpoint import (
    CONFIG_ITEM,
    PARAMS_ITEM,
    PolicyCheckpointer,
    StateCheckpointer,
    latest_step,
    list_steps,
    restore_policy,
    save_policy,
)


def tiny_config(**changes) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=32, eos_token_id=(1, 2),
                rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    return ModelConfig(**{**base, **changes})


def make_model(seed: int = 0, **changes) -> Qwen3:
    return Qwen3(tiny_config(**changes), rngs=nnx.Rngs(seed))


def flat_params(model: Qwen3) -> dict[tuple, jax.Array]:
    return {tuple(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_bit_identical(a: Qwen3, b: Qwen3) -> None:
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert x.tobytes() == y.tobytes(), k


def logits(model: Qwen3) -> np.ndarray:
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) * 7 % 256
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    out, _ = model(tokens, positions, jnp.ones((2, 6), jnp.int32))
    return np.asarray(out)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_unsharded(tmp_path, tied):
    model = make_model(tie_word_embeddings=tied)
    step_dir = save_policy(model, tmp_path / "ckpt", 3)
    assert step_dir == tmp_path / "ckpt" / "3" and step_dir.is_dir()

    restored, step = restore_policy(tmp_path / "ckpt")
    assert step == 3
    assert restored.config == model.config
    assert (restored.lm_head is None) == tied
    assert_bit_identical(model, restored)
    for v in flat_params(restored).values():
        assert isinstance(v.sharding, SingleDeviceSharding)
    np.testing.assert_array_equal(logits(restored), logits(model))


@pytest.mark.parametrize("rules", [TRAIN_RULES, SAMPLE_RULES], ids=["train", "sample"])
def test_restore_onto_mesh(tmp_path, devices, rules):
    model = make_model()
    save_policy(model, tmp_path, 0)
    mesh = make_mesh((2, 2, 2))
    restored, _ = restore_policy(tmp_path, mesh=mesh, rules=rules)
    assert_bit_identical(model, restored)
    specs = param_specs(restored, rules, mesh)
    sharded = 0
    for path, v in flat_params(restored).items():
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, specs[path]), v.ndim), path
        assert v.sharding.spec == specs[path], path
        sharded += any(axis is not None for axis in specs[path])
    assert sharded >= 5  # the test would be vacuous if everything were replicated


def test_sharded_save_restores_unsharded(tmp_path, devices):
    mesh = make_mesh((2, 2, 2))
    model = shard_model(make_model(seed=1), mesh)
    assert not flat_params(model)[("embed",)].sharding.is_fully_replicated
    save_policy(model, tmp_path, 0)
    restored, _ = restore_policy(tmp_path)
    assert_bit_identical(model, restored)
    assert isinstance(flat_params(restored)[("embed",)].sharding, SingleDeviceSharding)


def test_restore_casts_to_bfloat16(tmp_path):
    model = make_model()
    save_policy(model, tmp_path, 0)
    restored, _ = restore_policy(tmp_path, dtype="bfloat16")
    assert restored.config.param_dtype == restored.config.dtype == "bfloat16"
    want = flat_params(model)
    for path, v in flat_params(restored).items():
        assert v.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(v).view(np.uint16),
                                      np.asarray(want[path].astype(jnp.bfloat16)).view(np.uint16))
    # compute_dtype overrides only the compute dtype; other runtime options pass through.
    mixed, _ = restore_policy(tmp_path, dtype="bfloat16", compute_dtype="float32",
                              scan_layers=False)
    assert (mixed.config.param_dtype, mixed.config.dtype) == ("bfloat16", "float32")
    assert mixed.config.scan_layers is False


@pytest.mark.slow
def test_bfloat16_model_round_trips(tmp_path):
    model = make_model(param_dtype="bfloat16", dtype="bfloat16")
    save_policy(model, tmp_path, 0)
    restored, _ = restore_policy(tmp_path)
    assert restored.config == model.config
    assert_bit_identical(model, restored)


def test_latest_step_and_explicit_step(tmp_path):
    models = {step: make_model(seed=step) for step in (2, 0, 5)}
    for step, model in models.items():  # deliberately not in step order
        save_policy(model, tmp_path, step)
    assert list_steps(tmp_path) == [0, 2, 5]
    assert latest_step(tmp_path) == 5
    latest, step = restore_policy(tmp_path)
    assert step == 5
    assert_bit_identical(models[5], latest)
    older, step = restore_policy(tmp_path, 2)
    assert step == 2
    assert_bit_identical(models[2], older)
    assert latest_step(tmp_path / "missing") is None


def test_keep_retains_latest_saves(tmp_path):
    model = make_model()
    with PolicyCheckpointer(tmp_path, keep=2) as ckpt:
        for step in range(4):
            ckpt.save(model, step, block=step == 3)
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
    assert list_steps(tmp_path) == [2, 3]


def test_config_item_is_self_describing(tmp_path):
    model = make_model()
    step_dir = save_policy(model, tmp_path, 7)
    meta = json.loads((step_dir / CONFIG_ITEM / "metadata").read_text())
    assert meta["hf_config"] == json.loads(json.dumps(model.config.to_hf()))
    assert ModelConfig.from_hf(meta["hf_config"]) == model.config
    assert meta["model_config"]["num_layers"] == 2


def test_tokenizer_is_copied_once(tmp_path):
    first, second = tmp_path / "tok1", tmp_path / "tok2"
    for d, text in ((first, '{"a": 1}'), (second, '{"b": 2}')):
        d.mkdir()
        (d / "tokenizer.json").write_text(text)
        (d / "tokenizer_config.json").write_text("{}")
    ckpt_dir = tmp_path / "ckpt"
    model = make_model()
    save_policy(model, ckpt_dir, 0, tokenizer_dir=first)
    save_policy(model, ckpt_dir, 1, tokenizer_dir=second)
    stored = ckpt_dir / "tokenizer"
    assert sorted(p.name for p in stored.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (stored / "tokenizer.json").read_text() == '{"a": 1}'
    assert list_steps(ckpt_dir) == [0, 1]  # the tokenizer dir is not mistaken for a step

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        save_policy(model, ckpt_dir, 2, tokenizer_dir=empty)
    assert list_steps(ckpt_dir) == [0, 1]  # checked before anything was written


def test_missing_dir_steps_and_step(tmp_path):
    missing = tmp_path / "nope"
    no_dir = re.escape(f"{missing}: no such checkpoint directory")
    with pytest.raises(FileNotFoundError, match=no_dir):
        restore_policy(missing)
    assert not missing.exists()  # restoring never creates anything
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{empty}: no checkpoint steps")):
        restore_policy(empty)
    save_policy(make_model(), tmp_path / "ckpt", 0)
    save_policy(make_model(), tmp_path / "ckpt", 4)
    with pytest.raises(FileNotFoundError, match=r"no step 3 \(available steps: \[0, 4\]\)"):
        restore_policy(tmp_path / "ckpt", 3)


def test_existing_step_is_not_overwritten(tmp_path):
    model = make_model()
    save_policy(model, tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"step 1 already exists"):
        save_policy(make_model(seed=9), tmp_path, 1)
    restored, _ = restore_policy(tmp_path, 1)
    assert_bit_identical(model, restored)


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: (d / "metadata").write_text("{not json"), "corrupt"),
    (lambda d: (d / "metadata").write_text('{"format": 1}'), "not a policy model_config"),
    (lambda d: _edit(d, lambda m: m["model_config"].update(bogus=1)), r"unknown .*\['bogus'\]"),
    (lambda d: _edit(d, lambda m: m["model_config"].pop("vocab_size")), "corrupt model_config"),
    (lambda d: _edit(d, lambda m: m["model_config"].update(hidden_size=32)),
     r"does not match its model_config \(embed has shape \[256, 64\], expected \[256, 32\]"),
    (lambda d: _edit(d, lambda m: m["model_config"].update(tie_word_embeddings=True)),
     r"does not match its model_config \(missing \[\], unexpected \['lm_head'\]"),
    (lambda d: shutil.rmtree(d.parent / "params"), "params: missing"),
    (shutil.rmtree, "missing"),
])
def test_corrupt_config_is_a_checkpoint_error(tmp_path, corrupt, message):
    step_dir = save_policy(make_model(), tmp_path, 0)
    corrupt(step_dir / CONFIG_ITEM)
    with pytest.raises(CheckpointError, match=message):
        restore_policy(tmp_path)


def _edit(item_dir, change) -> None:
    path = item_dir / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def test_bad_arguments(tmp_path):
    save_policy(make_model(), tmp_path, 0)
    with pytest.raises(ValueError, match="not runtime options"):
        restore_policy(tmp_path, num_layers=3)
    with pytest.raises(ValueError, match="must be >= 0"):
        save_policy(make_model(), tmp_path, -1)
    with (pytest.raises(CheckpointError, match="read-only"),
          PolicyCheckpointer(tmp_path, read_only=True) as ckpt):
        ckpt.save(make_model(), 5)


def test_delete_after_drops_the_abandoned_steps(tmp_path):
    model = make_model()
    with PolicyCheckpointer(tmp_path / "ckpt") as ckpt:
        for step in (1, 2, 3):
            ckpt.save(model, step)
        assert ckpt.delete_after(1) == [2, 3]
        assert ckpt.steps() == [1]
        ckpt.save(make_model(seed=1), 2)  # the redone step saves again
        assert ckpt.steps() == [1, 2]


@pytest.mark.slow
def test_train_state_round_trips_with_optimizer_and_shardings(tmp_path, devices):
    """The full train state (params, optax state, step, RNG) restores bit-identically into the
    shardings of a live template; a different model is refused."""
    import optax

    from jax_routeweaver.models.sharding import create_sharded, make_mesh
    from jax_routeweaver.rl.run.checkpoint import StateCheckpointer

    mesh = make_mesh((1, 8, 1))
    params = nnx.state(create_sharded(lambda: make_model(), mesh), nnx.Param)
    tx = optax.adamw(1e-3)
    opt = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt = tx.update(grads, opt, params)
    state = {"params": params, "opt": opt, "step": jnp.int32(7), "rng": jnp.arange(2)}
    with StateCheckpointer(tmp_path / "state") as ckpt:
        ckpt.save(7, state, {"data": {"next_index": 7}})
        template = jax.tree.map(jnp.zeros_like, state)
        restored, loop, step = ckpt.restore(template)
    assert step == 7 and loop == {"data": {"next_index": 7}}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert a.sharding == b.sharding
    other = {**template, "params": nnx.state(make_model(hidden_size=32), nnx.Param)}
    with StateCheckpointer(tmp_path / "state") as ckpt, pytest.raises(CheckpointError):
        ckpt.restore(other)


@pytest.mark.slow
def test_a_step_written_on_8_devices_reads_in_a_1_device_process(tmp_path, devices):
    """What the vLLM worker extension does: `read_step` in a process whose JAX has another
    device count than the trainer that wrote the step (orbax would reuse the saved mesh)."""
    import subprocess
    import sys

    model = shard_model(make_model(seed=3), make_mesh((1, 8, 1)))
    save_policy(model, tmp_path, 5)
    script = ("import sys, numpy as np; from jax_routeweaver.models.policy_step import "
              "read_step; cfg, a = read_step(sys.argv[1]); "
              "np.savez(sys.argv[2], **{'.'.join(k): v for k, v in a.items()})")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = tmp_path / "read.npz"
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "5"), str(out)],
                         env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    read = np.load(out)
    for path, value in flat_params(model).items():
        assert read[".".join(path)].tobytes() == np.asarray(value).tobytes(), path


def truncate_arrays(item_dir) -> None:
    """Cut to half the largest of an orbax item's OCDBT data files (`ocdbt.process_*/d/*`,
    which hold the array bytes): a checkpoint truncated by a full disk or a killed copy."""
    data = max(item_dir.glob("ocdbt.process_*/d/*"), key=lambda f: f.stat().st_size)
    os.truncate(data, data.stat().st_size // 2)


def files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def collect_abandoned_reads() -> None:
    """Collect, within the calling test, the reads orbax abandoned when an array could not
    be read: they report to sys.unraisablehook when collected (the CLI drops those reports),
    which pytest would otherwise pin on whichever later test the collection falls in."""
    gc.collect()


# The abandoned reads' reports, collected here (`collect_abandoned_reads`).
ABANDONED_READS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


@ABANDONED_READS
def test_truncated_policy_step_is_a_one_line_checkpoint_error(tmp_path):
    step_dir = save_policy(make_model(), tmp_path, 4)
    truncate_arrays(step_dir / PARAMS_ITEM)
    before = files(tmp_path)
    with pytest.raises(CheckpointError) as err:
        restore_policy(tmp_path)
    message = str(err.value)
    del err
    collect_abandoned_reads()
    assert message.startswith(f"checkpoint {step_dir}: unreadable (truncated or corrupt: ")
    assert "\n" not in message
    assert files(tmp_path) == before


def state_tree(seed: int = 0) -> dict[str, jax.Array]:
    """A small train state, committed to one device like a live trainer's arrays."""
    device = jax.devices()[0]
    a = jax.random.normal(jax.random.key(seed), (64, 256))
    return {"a": jax.device_put(a, device), "step": jax.device_put(jnp.int32(seed), device)}


@ABANDONED_READS
def test_truncated_train_state_is_a_one_line_checkpoint_error(tmp_path):
    with StateCheckpointer(tmp_path) as ckpt:
        ckpt.save(3, state_tree(), {"data": 3})
    truncate_arrays(tmp_path / "3" / "train_state")
    before = files(tmp_path)
    with StateCheckpointer(tmp_path) as ckpt, pytest.raises(CheckpointError) as err:
        ckpt.restore(state_tree())
    message = str(err.value)
    del err
    collect_abandoned_reads()
    assert message.startswith(f"checkpoint {tmp_path / '3'}: unreadable (truncated or "
                              "corrupt: ")
    assert "\n" not in message
    assert files(tmp_path) == before


@pytest.mark.parametrize("keep", [0, -1])
def test_state_checkpointer_refuses_to_keep_no_state(tmp_path, keep):
    with pytest.raises(ValueError, match=rf"keep={keep}: must keep at least 1"):
        StateCheckpointer(tmp_path / "state", keep=keep)
    assert not (tmp_path / "state").exists()


def test_state_pruning_keeps_the_newest(tmp_path):
    def on_disk() -> list[int]:
        return sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())

    with StateCheckpointer(tmp_path, keep=2) as ckpt:
        for step, kept in ((1, [1]), (2, [1, 2]), (3, [2, 3])):
            ckpt.save(step, state_tree(step), {"data": step})
            assert on_disk() == kept
        ckpt.keep = 0  # never accepted, but pruning must still spare the newest state
        ckpt.save(4, state_tree(4), {"data": 4})
        assert on_disk() == [4]
        state, loop, step = ckpt.restore(state_tree())
    assert (step, loop) == (4, {"data": 4})
    np.testing.assert_array_equal(np.asarray(state["a"]), np.asarray(state_tree(4)["a"]))
