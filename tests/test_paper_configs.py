"""configs/paper/: the RouteWeaver paper run (docs/paper_configs.md) as `routeweaver train`
configs. Loads every file (no model, no network) and checks the reference numbers per arm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paper_schedule import support_lambda

from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.rl.learner.curriculum import ExplorationConfig, forced_ratio
from jax_routeweaver.rl.run.train_config import TrainConfig, load_train_config
from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.pricing import (
    C_REF_USD,
    REFERENCE_PRICES,
    load_cost_ref,
    verify_pool,
)

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "configs" / "paper"
ARMS = ("base", "cold_start", "main_alpha0", "main_alpha0.1", "main_alpha0.3", "main_alpha0.5",
        "wo_comet", "wo_progressive")
MAIN = {"main_alpha0": 0.0, "main_alpha0.1": 0.1, "main_alpha0.3": 0.3, "main_alpha0.5": 0.5}
# The reference schedule on GLOBAL batch indices (FORCED_START_BATCH=25, ANNEAL=50, λ0 0.002).
REFERENCE_SCHEDULE = ExplorationConfig(forced_start_batch=25, forced_anneal_steps=50,
                                       support_lambda0=0.002)
COLD_STEPS, TOTAL_STEPS = 25, 90


def load(name: str) -> TrainConfig:
    return load_train_config(PAPER / f"{name}.yaml")


def test_the_directory_holds_exactly_the_paper_arms():
    assert sorted(p.stem for p in PAPER.glob("*.yaml")) == sorted(ARMS)


@pytest.mark.parametrize("name", ARMS)
def test_every_arm_loads_with_the_shared_reference_numbers(name):
    cfg = load(name)
    assert cfg.name == ("paper_base" if name == "base" else name)
    assert cfg.seed == 42 and cfg.deterministic
    m = cfg.model
    assert m.tokenizer.endswith("Qwen3-4B-Instruct-2507")
    assert (m.param_dtype, m.dtype, m.remat) == ("float32", "bfloat16", "full")
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, -1, 1)
    d = cfg.data
    assert (d.batch_size, d.group_size, d.shuffle, d.seed, d.repeat) == (32, 8, False, 42, False)
    assert d.quotas == {"MATH": 7, "CODE": 7, "KNOWLEDGE": 7, "REASON": 6, "RECALL": 5}
    assert list(d.quotas) == ["MATH", "CODE", "KNOWLEDGE", "REASON", "RECALL"]
    r = cfg.rollout
    assert (r.dialect, r.temperature, r.top_p, r.top_k) == ("routeweaver", 0.8, 0.95, -1)
    assert not (r.constrained or r.answer_choices) and r.rulebook == "reference"
    assert r.sampler == "vllm" and r.vllm.max_model_len == 6144 + 16384
    p = r.protocol
    assert (p.selector_max_tokens, p.max_workers, p.action_turn_limit) == (64, 8, 10)
    assert (p.response_length, p.worker_max_tokens) == (16384, 4096)
    # Dynamic observation budget (docs/protocol.md, "Observations"): reserve 1024, cap 4096,
    # >= 256 per observation.
    assert (p.observation_cap, p.obs_reserve, p.obs_budget_cap, p.obs_min_per_obs,
            p.obs_tail_fraction) == (None, 1024, 4096, 256, 0.5)
    assert p.routing_state and not p.recovery and not p.multi_attach_previous
    assert p.forced_declaration == "user_turn"
    assert (cfg.workers.pool, cfg.workers.concurrency) == ("configs/channels/reference.yaml", 40)
    assert (cfg.reward.c_ref, cfg.reward.code_scorer) == ("configs/cost_ref.json", "union")
    loss = cfg.algo.loss
    assert (loss.clip_low, loss.clip_high, loss.clip_c) == (0.2, 0.2, 3.0)
    assert (loss.kl_coef, loss.entropy_coef) == (0.001, 0.0)
    assert (loss.ppo_mini_batches, loss.ppo_epochs, loss.micro_batch_size) == (1, 1, 2)
    assert loss.support_chunk == 12
    assert (cfg.algo.mode_score_span, cfg.algo.support_max_prompt) == ("content", 2048)
    assert cfg.algo.exploration.support_floor == 0.05
    o = cfg.optim
    assert (o.lr, o.weight_decay, o.grad_clip, o.warmup_steps) == (1e-6, 0.01, 1.0, 0)
    assert cfg.checkpoint.keep_policy >= 1  # the policy is written every step


def test_cold_arm_is_fully_forced_gated_grpo_without_support():
    cfg = load("cold_start")
    assert cfg.steps == COLD_STEPS and cfg.model.init == "hf"
    assert cfg.data.source.endswith("routeweaver_cold_pool.parquet")
    assert (cfg.algo.estimator, cfg.algo.loss.reduction, cfg.algo.support) == (
        "grpo_gated", "global", False)
    assert cfg.algo.exploration.forced_start_batch == 999  # FORCED_START_BATCH=999
    assert all(forced_ratio(b, cfg.algo.exploration) == 1.0 for b in range(COLD_STEPS))
    assert cfg.reward.alpha == 0.0


@pytest.mark.parametrize("name", [*MAIN, "wo_comet"])
def test_main_arms_continue_the_cold_arm_on_the_global_schedule(name):
    cold, cfg = load("cold_start"), load(name)
    # The cold arm's whole step-25 state (params, optimizer, step), its last full save.
    assert cfg.checkpoint.init_from == f"{cold.out_dir}/checkpoints/state"
    assert cold.steps % cold.checkpoint.full_every == 0 or cold.checkpoint.full_every >= cold.steps
    # The KL reference is the base model (verl's ref = the base actor), as the cold arm's.
    assert cfg.model.init == "hf" and cfg.model.path == cold.model.path
    assert cfg.steps == TOTAL_STEPS and cfg.data.source.endswith("routeweaver_train.parquet")
    assert cfg.algo.support and cfg.algo.exploration.support_lambda0 == 0.002
    # Batch indices continue from the cold arm's 25: the reference schedule itself.
    ex = cfg.algo.exploration
    assert (ex.forced_start_batch, ex.forced_anneal_steps) == (25, 50)
    for b in range(COLD_STEPS, TOTAL_STEPS):
        assert forced_ratio(b, ex) == pytest.approx(forced_ratio(b, REFERENCE_SCHEDULE))
        assert support_lambda(b, ex) == pytest.approx(support_lambda(b, REFERENCE_SCHEDULE))
    # Steps 26-75 (b = 25…74) anneal 1 -> 0.02; steps 76-90 (b = 75…89) are free.
    assert forced_ratio(25, ex) == 1.0
    assert forced_ratio(74, ex) == pytest.approx(0.02)
    assert forced_ratio(75, ex) == 0.0
    # Full saves at global 50, 75 and the end, 90 (the reference's saves), all kept.
    every = cfg.checkpoint.full_every
    saves = {s for s in range(COLD_STEPS + 1, cfg.steps + 1) if s % every == 0 or s == cfg.steps}
    assert saves == {50, 75, 90} and cfg.checkpoint.keep_full >= len(saves)


@pytest.mark.parametrize(("name", "alpha"), MAIN.items())
def test_main_arms_use_comet_with_the_cost_reward_when_alpha_is_positive(name, alpha):
    cfg = load(name)
    assert cfg.reward.alpha == alpha
    assert cfg.algo.estimator == ("comet_gdpo" if alpha > 0 else "comet_grpo")
    assert cfg.algo.loss.reduction == "segment"


def test_wo_comet_is_main_alpha0_with_gated_grpo_and_global_reduction():
    main, cfg = load("main_alpha0"), load("wo_comet")
    assert (cfg.algo.estimator, cfg.algo.loss.reduction, cfg.algo.support) == (
        "grpo_gated", "global", True)
    assert cfg.algo.exploration == main.algo.exploration and cfg.reward.alpha == 0.0
    assert (cfg.model, cfg.data, cfg.steps) == (main.model, main.data, main.steps)


def test_wo_progressive_is_free_from_the_base_model_with_zero_support_weight():
    cfg = load("wo_progressive")
    assert cfg.model.init == "hf" and cfg.model.path == cfg.model.tokenizer
    assert cfg.data.source.endswith("routeweaver_train.parquet")
    ex = cfg.algo.exploration
    assert (ex.forced_start_batch, ex.forced_anneal_steps, ex.support_lambda0) == (-1, 1, 0.0)
    assert all(forced_ratio(b, ex) == 0.0 for b in range(cfg.steps))
    assert all(support_lambda(b, ex) == 0.0 for b in range(cfg.steps))
    assert (cfg.algo.estimator, cfg.algo.loss.reduction, cfg.algo.support) == (
        "comet_grpo", "segment", True)


def test_the_shared_files_are_the_six_reference_workers_and_c_ref():
    cfg = load("base")
    channels = load_channels(ROOT / cfg.workers.pool)
    assert channels.worker_ids() == [f"worker_{i}" for i in range(1, 7)]
    verify_pool(channels.worker_ids(), REFERENCE_PRICES, channels.backends())
    assert {w: (p.input_usd_per_m, p.output_usd_per_m) for w, p in channels.prices().items()} \
        == {w: (p.input_usd_per_m, p.output_usd_per_m) for w, p in REFERENCE_PRICES.items()}
    assert load_cost_ref(ROOT / cfg.reward.c_ref) == C_REF_USD


def test_router_architecture_parses_as_qwen3_4b_instruct_2507():
    path = PAPER / "qwen3-4b-instruct-2507.json"
    mc = ModelConfig.from_hf(path)
    assert (mc.architecture, mc.model_type, mc.qk_norm) == ("Qwen3ForCausalLM", "qwen3", True)
    assert (mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers) == (
        151936, 2560, 9728, 36)
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim) == (32, 8, 128)
    assert mc.rope_theta == 5e6 and mc.rope_type == "default" and mc.tie_word_embeddings
    assert (mc.rms_norm_eps, mc.max_position_embeddings) == (1e-6, 262144)
    assert (mc.bos_token_id, mc.eos_token_id) == (151643, 151645)
    assert json.loads(path.read_text())["torch_dtype"] == "bfloat16"
