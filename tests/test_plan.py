"""The memory plan (`routeweaver plan`): compiled per-device memory on fake CPU devices, and the
optimizer-state placement it exposed (Adam moments must be sharded like their parameters)."""

import functools
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_trainer import CFG, model, random_batch

from jax_routeweaver.cli.app import main
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import make_mesh
from jax_routeweaver.planning.memory import GIB, StepShape, memory_plan
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.rl.learner.trainer import Trainer, UpdateBatch

PLAN_CFG = CFG.replace(vocab_size=512, num_layers=3)


def moments_and_params(trainer: Trainer):
    """[(moment leaf, its parameter leaf)] for Adam's mu and nu."""
    params = trainer.state.params
    pairs = []
    optax.tree_map_params(trainer.tx, lambda m, p: pairs.append((m, p)),
                          trainer.state.opt_state, params, transform_non_params=lambda x: x)
    return pairs


@pytest.mark.slow
def test_optimizer_moments_are_sharded_like_their_parameters(devices):
    mesh = make_mesh((1, 8, 1))
    trainer = Trainer(model(mesh=mesh), OptimConfig(), LossConfig(micro_batch_size=8), mesh=mesh)
    for when in ("init", "after an update"):
        pairs = moments_and_params(trainer)
        assert len(pairs) == 2 * len(jax.tree.leaves(trainer.state.params)), when
        for moment, param in pairs:
            assert moment.sharding.is_equivalent_to(param.sharding, param.ndim), (
                when, moment.shape, moment.sharding, param.sharding)
        sharded = [m for m, p in pairs if len(p.sharding.device_set) > 1
                   and p.sharding.shard_shape(p.shape) != p.shape]
        assert sharded, "some moments must really be split over the mesh"
        trainer.update(UpdateBatch(**random_batch(n=8)))


@functools.cache
def plan(length=512, *, remat="none", mesh=(1, 8, 1), rows_per_device=1, support_queries=0):
    """A compiled plan (cached: each configuration compiles once per session)."""
    return memory_plan(PLAN_CFG.replace(remat=remat),
                       StepShape(rows=16, length=length, policy_tokens=length // 4,
                                 rows_per_device=rows_per_device,
                                 support_queries=support_queries, support_length=128),
                       mesh_shape=mesh, devices=jax.devices()[:int(np.prod(mesh))],
                       optim=OptimConfig(), loss=LossConfig())


def param_bytes(cfg) -> int:
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size * x.dtype.itemsize
               for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.slow
def test_state_bytes_per_device_follow_the_shardings(devices):
    total = param_bytes(PLAN_CFG)
    one = plan(mesh=(1, 1, 1))
    eight = plan()
    assert one.params == total and one.reference == total
    # FSDP over 8: every matrix is split (norm scales replicated, a few KiB).
    assert total / 8 <= eight.params < total / 8 + 64 * 1024
    # AdamW keeps two moments per parameter (plus replicated step counts).
    assert 2 * eight.params <= eight.optimizer < 2 * eight.params + 1024
    # The step donates its state: the outputs reuse (nearly all) the params + optimizer.
    assert eight.update.aliased >= 0.95 * (eight.params + eight.optimizer)
    # Beside each program stays what it does not take: the reference during the update, the
    # policy and its optimizer state during the reference pass.
    assert eight.peak == max(eight.update.peak + eight.reference,
                             eight.logprobs.peak + eight.params + eight.optimizer)
    assert one.update.arguments > 6 * eight.update.arguments  # the state really is divided


@pytest.mark.slow
def test_a_critic_is_priced_as_a_second_params_and_optimizer_state(devices):
    # ppo_gae trains a critic of the policy's shape beside it: resident in both programs.
    shape = StepShape(rows=16, length=512, policy_tokens=128)
    without = plan()
    with_critic = memory_plan(PLAN_CFG, shape, mesh_shape=(1, 8, 1), devices=jax.devices()[:8],
                              optim=OptimConfig(), loss=LossConfig(), critic=True)
    assert without.critic == 0 and with_critic.critic == without.params + without.optimizer
    assert with_critic.peak == without.peak + with_critic.critic
    assert with_critic.as_dict()["critic_gib"] == round(with_critic.critic / GIB, 2)


@pytest.mark.slow
def test_activation_memory_grows_with_length_and_remat_saves_it(devices):
    short, long = plan(512), plan(1024)
    assert long.update.temporaries > short.update.temporaries
    assert long.logprobs.temporaries > short.logprobs.temporaries
    full = plan(1024, remat="full")
    assert full.update.temporaries < long.update.temporaries
    # Remat changes what the backward keeps, not the forward-only logprob pass's arguments.
    assert full.logprobs.arguments == long.logprobs.arguments


@pytest.mark.slow
def test_layer_groups_keep_fewer_residual_streams(devices):
    """remat_groups=4 on 16 layers keeps 4 + 4 layer inputs for the backward pass instead of
    16: the update's temporaries shrink, its arguments (the state) do not change."""
    deep = PLAN_CFG.replace(num_layers=16, remat="full")
    shape = StepShape(rows=8, length=2048, policy_tokens=512, rows_per_device=1)
    one, grouped = (memory_plan(deep.replace(remat_groups=g), shape, mesh_shape=(1, 8, 1),
                                devices=jax.devices()[:8], optim=OptimConfig(),
                                loss=LossConfig()) for g in (1, 4))
    assert grouped.remat_groups == 4 and grouped.as_dict()["remat_groups"] == 4
    assert grouped.as_dict()["causal_parts"] == 1
    assert grouped.update.arguments == one.update.arguments
    assert grouped.update.temporaries < one.update.temporaries, (grouped.update, one.update)


@pytest.mark.slow
def test_support_rows_and_fit_decision(devices):
    without, with_support = plan(512), plan(512, support_queries=8)
    assert with_support.update.arguments > without.update.arguments
    assert with_support.fits(with_support.peak / GIB / 0.9 + 0.01)
    assert not with_support.fits(with_support.peak / GIB)  # the 10% headroom is kept
    d = with_support.as_dict()
    assert d["support_queries"] == 8 and d["peak_gib"] == round(with_support.peak / GIB, 2)


def test_rows_must_split_into_micro_batches(devices):
    with pytest.raises(ValueError, match="do not split into micro-batches of 24"):
        plan(rows_per_device=3)


@pytest.mark.slow
def test_plan_command(tmp_path, capsys, devices):
    arch = tmp_path / "config.json"
    arch.write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "rope_theta": 5000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096}))
    out = tmp_path / "plan.json"
    code = main(["plan", "--config", "configs/quickstart.yaml", "--arch", str(arch),
                 "--devices", "4", "--memory-gib", "1", "--remat", "none,full",
                 "--length", "1024", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["remat"] for r in rows] == ["none", "full"]
    for r in rows:
        # quickstart: 5 queries x 8 rollouts, 1 row per device on a 4-way fsdp mesh.
        assert r["rows"] == 40 and r["micro_batch"] == 4 and r["mesh"] == [1, 4, 1]
        assert r["length"] == 1024 and r["fits"] is True and r["support_queries"] == 5
    assert "need / have" in capsys.readouterr().out

    assert main(["plan", "--config", "configs/quickstart.yaml", "--arch", str(arch),
                 "--target", "v6e-1"]) == 2
    assert "--target 'v6e-1'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_update_compiles_once_across_steps(devices, no_compile_cache):
    """Step count and RNG are born where the update returns them: the second step reuses
    the first step's executable instead of compiling the whole update again."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    mesh = make_mesh((1, 8, 1))
    trainer = Trainer(model(mesh=mesh), OptimConfig(), LossConfig(micro_batch_size=8), mesh=mesh)
    batch = random_batch(n=8)
    trainer.update(UpdateBatch(**batch))
    first = len(compiles)
    trainer.update(UpdateBatch(**batch))
    trainer.update(UpdateBatch(**batch))
    assert first > 0 and len(compiles) == first, (first, len(compiles))
