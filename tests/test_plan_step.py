"""The whole-step plan (`planning/step.py`, `planning/rollout.py`, `planning/table.py`): phases
that add up, the rollout engine's memory by its formulas, the settings search, and README's
table computed from the current code."""

import dataclasses
import json
from pathlib import Path

import pytest
from test_trainer import CFG

from jax_routeweaver.cli.app import main
from jax_routeweaver.models.sharding import SAMPLE_RULES, make_mesh
from jax_routeweaver.planning import rollout as ro
from jax_routeweaver.planning import step as sp
from jax_routeweaver.planning import table as pt
from jax_routeweaver.planning.memory import (
    GIB,
    TARGETS,
    StepShape,
    Target,
    abstract_policy,
    bytes_per_device,
    memory_plan,
)
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = CFG.replace(vocab_size=512, num_layers=2, dtype="bfloat16")
SHAPE = ro.RolloutShape(rows=16, prompt=64, max_new_tokens=192, row_tokens=256,
                        max_model_len=256)
EIGHT = Target("8 CPU devices", 8, 1.0, (1, 4, 2))


@pytest.fixture(scope="module")
def train(devices) -> sp.TrainFigures:
    """The tiny model's compiled update and logprob pass on a 1x4x2 mesh."""
    plan = memory_plan(TINY, StepShape(rows=8, length=256, policy_tokens=64),
                       mesh_shape=EIGHT.mesh, devices=devices, optim=OptimConfig(),
                       loss=LossConfig())
    return sp.TrainFigures.of(plan)


def step(train: sp.TrainFigures, settings: ro.RolloutSettings, shape=SHAPE, target=EIGHT):
    return sp.step_plan(target, train, settings, TINY, shape, "float32")


@pytest.mark.slow
def test_the_phases_add_up(train):
    """update = update program + reference + what the engine keeps; reference pass = its
    program + policy + optimizer + kept; rollout = the whole train state + the engine."""
    for settings in (ro.RolloutSettings("dense"),
                     ro.RolloutSettings("paged", budget_tokens=1024, max_rows=8),
                     ro.RolloutSettings("vllm", share=0.5),
                     ro.RolloutSettings("vllm", share=0.5, sleep_level=2)):
        plan = step(train, settings)
        r, p = plan.rollout, plan.phases
        assert p["update"] == train.update + train.reference + r.kept, settings
        assert p["reference"] == train.logprobs + train.params + train.optimizer + r.kept
        assert p["rollout"] == train.params + train.optimizer + train.reference + r.resident
        assert plan.need == max(p.values())
        assert r.resident >= r.kept
        d = plan.as_dict()
        assert d["need_gib"] == round(plan.need / GIB, 2) and d["engine"] == settings.engine


def test_the_jax_replica_is_the_sample_layout(train, devices):
    """The replica: every parameter in the sampling layout (replicated over fsdp, split over
    tensor), priced without devices the same as the real sharding gives."""
    mesh = make_mesh((1, 4, 2), devices)
    _, params = abstract_policy(TINY.replace(param_dtype="float32"), mesh, SAMPLE_RULES)
    plan = step(train, ro.RolloutSettings("dense"))
    assert plan.rollout.weights == bytes_per_device(params)
    assert plan.rollout.weights == ro.sharded_param_bytes(TINY, "float32", SAMPLE_RULES,
                                                          {"fsdp": 4, "tensor": 2})
    whole = ro.sharded_param_bytes(TINY, "float32", SAMPLE_RULES, {})
    assert whole / 2 < plan.rollout.weights < whole  # split over tensor, not over fsdp
    with pytest.raises(ValueError, match="does not split over mesh axes"):
        ro.sharded_param_bytes(TINY, "float32", SAMPLE_RULES, {"tensor": 3})


def test_dense_kv_grows_by_the_formula(train):
    """rows x (prompt + max_new_tokens) x 2 x L x K x H x bytes, rows over the batch shards,
    KV heads over tensor."""
    per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.head_dim * 2  # bf16
    assert ro.kv_bytes_per_token(TINY, "bfloat16") == per_token
    short = step(train, ro.RolloutSettings("dense"))
    longer = step(train, ro.RolloutSettings("dense"),
                  dataclasses.replace(SHAPE, max_new_tokens=SHAPE.max_new_tokens + 256))
    rows_per_device, tensor = SHAPE.rows // 4, 2
    assert short.rollout.kv == rows_per_device * 256 * per_token // tensor
    assert longer.rollout.kv - short.rollout.kv == rows_per_device * 256 * per_token // tensor
    assert short.rollout.kept == short.rollout.weights  # the cache is freed after each call


def test_paged_pool_grows_by_the_formula_and_is_kept(train):
    """budget x 2 x L x K x H x bytes, heads over tensor (2), replicated over the batch axes
    as `sampling.paged_engine` lays it out; with the slots' logits, kept through the update."""
    per_token = ro.kv_bytes_per_token(TINY, "bfloat16")
    logits = 8 * TINY.vocab_size * 4
    small, big = (step(train, ro.RolloutSettings("paged", budget_tokens=b, max_rows=8))
                  for b in (4096, 8192))
    assert small.rollout.kv == 4096 * per_token // 2 + logits
    assert big.rollout.kv - small.rollout.kv == 4096 * per_token // 2
    assert big.phases["update"] - small.phases["update"] == big.rollout.kv - small.rollout.kv
    assert small.rollout.kept == small.rollout.weights + small.rollout.kv
    assert small.rollout.full_rows == 8 and small.rollout.kv_tokens == 4096
    # A pool smaller than one full row never finishes a long row: no fit.
    tiny = step(train, ro.RolloutSettings("paged", budget_tokens=128, max_rows=8))
    assert not tiny.rollout.holds_a_row and not tiny.fits
    # More decode slots: more temporaries (every device decodes every slot).
    wide = step(train, ro.RolloutSettings("paged", budget_tokens=4096, max_rows=4096))
    assert wide.rollout.temporaries > small.rollout.temporaries
    # budget 0: memory_fraction of what one device has free when the sampler starts (the
    # policy and the replica allocated), at most max_rows rows of max_position_embeddings.
    frac = step(train, ro.RolloutSettings("paged", memory_fraction=0.25, max_rows=8))
    free = GIB - train.params - frac.rollout.weights
    assert frac.rollout.kv_tokens == min(int(0.25 * free) // (per_token // 2),
                                         8 * TINY.max_position_embeddings) // 16 * 16


def test_paged_temporaries_follow_the_engines_shapes():
    """The page table's width is a power of two of pages; a decode step's gathered keys and
    values grow with the slots, a prefill call's scores with the row's width."""
    assert ro.paged_width(22528, 16) == 2048 * 16 and ro.paged_width(20, 16) == 4 * 16
    narrow = ro.paged_temporaries(TINY, 64, 256, 16, 1)
    assert ro.paged_temporaries(TINY, 64, 1024, 16, 1) > narrow
    assert ro.paged_temporaries(TINY, 64, 256, 16, 2) < narrow


def test_vllm_share_and_sleep(train):
    big = Target("8 big GPUs", 8, 64.0, (1, 4, 2))
    awake = step(train, ro.RolloutSettings("vllm", share=0.5), target=big)
    asleep = step(train, ro.RolloutSettings("vllm", share=0.5, sleep_level=2), target=big)
    assert awake.rollout.resident == awake.rollout.kept == 32 * GIB
    assert asleep.rollout.kept == int(ro.VLLM_SLEEP_RESIDUE_GIB * GIB)
    assert asleep.phases["rollout"] == awake.phases["rollout"]
    assert asleep.phases["update"] == awake.phases["update"] - 32 * GIB + asleep.rollout.kept
    # Its KV cache: the share less the bf16 weights (split over tensor parallel) and the
    # overhead; vLLM needs one max_model_len row of it.
    weights = ro.sharded_param_bytes(TINY, "bfloat16", SAMPLE_RULES, {})
    assert awake.rollout.kv == 32 * GIB - weights - int(ro.VLLM_OVERHEAD_GIB * GIB)
    per_token = ro.kv_bytes_per_token(TINY, "bfloat16")
    assert awake.rollout.kv_tokens == awake.rollout.kv // per_token and awake.fits
    tp2 = step(train, ro.RolloutSettings("vllm", share=0.5, tensor=2), target=big)
    assert tp2.rollout.kv_tokens > awake.rollout.kv_tokens
    # On a 1 GiB device the overhead leaves no KV cache: no fit, however little it needs.
    small = step(train, ro.RolloutSettings("vllm", share=0.5, sleep_level=2))
    assert small.rollout.kv == 0 and not small.fits
    assert small.rollout.kept <= small.rollout.resident == GIB // 2


def test_vllm_flags_from_extra_args():
    assert ro.vllm_flag(["--gpu-memory-utilization", "0.30"], "--gpu-memory-utilization") == "0.30"
    assert ro.vllm_flag(["--gpu-memory-utilization=0.4"], "--gpu-memory-utilization") == "0.4"
    assert ro.vllm_flag(["--tensor-parallel-size 2 --seed 1"], "--tensor-parallel-size") == "2"
    assert ro.vllm_flag([], "--gpu-memory-utilization") is None
    with pytest.raises(ValueError, match="--gpu-memory-utilization has no value"):
        ro.vllm_flag(["--gpu-memory-utilization", "--seed", "1"], "--gpu-memory-utilization")


def figures(update_gib: float, mesh=(1, 4, 2), groups=1) -> sp.TrainFigures:
    g = lambda x: int(x * GIB)
    return sp.TrainFigures(mesh, groups, params=g(0.01), optimizer=g(0.02), reference=g(0.01),
                           update=g(update_gib), logprobs=g(0.05))


def test_search_keeps_the_first_trainer_that_fits_with_the_most_rows():
    """The first trainer candidate needs too much for any engine; the second fits, with the
    pool that holds the most full rows, and the vLLM share with the most KV."""
    big = Target("1 GiB x 8", 8, 1.0, (1, 4, 2), kind="gpu")
    plans = sp.search(big, [figures(0.95), figures(0.3, groups=2)], TINY, SHAPE, "float32",
                      ro.RolloutSettings("paged"))
    by_engine = {p.settings.engine: p for p in plans}
    assert set(by_engine) == {"dense", "paged", "vllm"}
    paged = by_engine["paged"]
    assert paged.fits and paged.train.remat_groups == 2
    assert paged.rollout.full_rows == max(sp.PAGED_MAX_ROWS)  # room for every slot's row
    assert paged.need <= paged.limit
    vllm = by_engine["vllm"]
    assert not vllm.fits  # weights + overhead leave no KV in a 1 GiB share
    tpu = Target("TPU", 8, 1.0, (1, 4, 2), kind="tpu")
    assert [p.settings.engine for p in sp.search(tpu, [figures(0.3)], TINY, SHAPE,
                                                 "float32", ro.RolloutSettings("dense"))] \
        == ["dense", "paged"]


def test_targets_and_their_checks():
    assert {"v5e-16", "v5p-8", "a100-80gb-x8", "h200", "h200-x2"} <= set(TARGETS)
    assert TARGETS["v5e-16"].hosts == 4 and TARGETS["v5e-16"].local_devices == 4
    # On several hosts the sampler runs on each host's devices (rl.run.loop.local_mesh).
    assert ro.SamplerMesh.of(TARGETS["v5e-16"], (1, 4, 4)) == ro.SamplerMesh(1, 4)
    assert ro.SamplerMesh.of(TARGETS["v5e-16"], (1, 2, 8)) == ro.SamplerMesh(4, 1)
    assert ro.SamplerMesh.of(TARGETS["v5p-8"], (1, 4, 1)) == ro.SamplerMesh(4, 1)
    with pytest.raises(ValueError, match="mesh .* does not use its 8 devices"):
        Target("x", 8, 1.0, (1, 4, 1))
    with pytest.raises(ValueError, match="hosts=3 must divide devices=8"):
        Target("x", 8, 1.0, (1, 8, 1), hosts=3)
    with pytest.raises(ValueError, match="kind='npu'"):
        Target("x", 8, 1.0, (1, 8, 1), kind="npu")


def test_readme_table_is_computed_from_the_current_code():
    """README's plan table is what the current code computes: the rollout engines' formulas
    and the search, run now on the paper's config and the Qwen3-4B shapes, from the trainer
    figures `bench/plan_targets.py` compiled (minutes per target, too slow for a test); and
    those figures' train state (params, AdamW, reference per device) is still what the
    current model lays out on each mesh. A changed model dimension, formula, config or
    target fails here until `python bench/plan_targets.py --from-json --write-readme` (a new
    train state: without --from-json) regenerates both."""
    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.models.sharding import TRAIN_RULES
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "paper" / "main_alpha0.yaml")
    arch = ModelConfig.from_hf(ROOT / "configs" / "paper" / "qwen3-4b-instruct-2507.json")
    record = json.loads((ROOT / "bench" / "plan_targets.json").read_text())
    assert set(record["targets"]) == set(TARGETS)
    computed = {"targets": {}}
    for name, entry in record["targets"].items():
        trainers = [sp.TrainFigures.from_dict(d) for d in entry["trainers"]]
        for t in trainers:
            axes = dict(zip(("data", "fsdp", "tensor"), t.mesh, strict=True))
            state = ro.sharded_param_bytes(arch, cfg.model.param_dtype, TRAIN_RULES, axes)
            assert (t.params, t.reference) == (state, state), (name, t.mesh)
            assert t.optimizer == 2 * state + 4, (name, t.mesh)  # AdamW's mu, nu and count
        computed["targets"][name] = {"choices": pt.search_choices(name, cfg, arch, trainers)}
    readme = (ROOT / "README.md").read_text()
    assert pt.read_block(readme) == pt.record_table(computed)
    # A model dimension changed in the code changes the table.
    wider = arch.replace(intermediate_size=arch.intermediate_size + 256)
    trainers = [sp.TrainFigures.from_dict(d) for d in record["targets"]["v5p-8"]["trainers"]]
    assert pt.search_choices("v5p-8", cfg, wider, trainers) != \
        computed["targets"]["v5p-8"]["choices"]
    with pytest.raises(ValueError, match="plan-table:begin"):
        pt.replace_block("no markers here", "| table |\n")
    text = f"a\n{pt.BLOCK_BEGIN}\nold\n{pt.BLOCK_END}\nb\n"
    assert pt.replace_block(text, "new\n") == f"a\n{pt.BLOCK_BEGIN}\nnew\n{pt.BLOCK_END}\nb\n"


def test_the_tpu_arm_fits_by_the_recorded_plan():
    """configs/tpu/main_alpha0.yaml: its mesh, layer groups and paged pool fit a v5p-8 by the
    recorded compiled figures, and it is the paper arm otherwise."""
    from jax_routeweaver.models.config import ModelConfig
    from jax_routeweaver.rl.run.train_config import load_train_config

    cfg = load_train_config(ROOT / "configs" / "tpu" / "main_alpha0.yaml")
    paper = load_train_config(ROOT / "configs" / "paper" / "main_alpha0.yaml")
    assert (cfg.rollout.sampler, cfg.rollout.kv_cache) == ("jax", "paged")
    loss = dataclasses.replace(cfg.algo.loss, micro_batch_size=paper.algo.loss.micro_batch_size)
    assert dataclasses.replace(cfg.algo, loss=loss) == paper.algo
    assert cfg.data == paper.data and cfg.reward == paper.reward and cfg.optim == paper.optim
    record = json.loads((ROOT / "bench" / "plan_targets.json").read_text())
    mesh = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    [train] = [sp.TrainFigures.from_dict(d) for d in record["targets"]["v5p-8"]["trainers"]
               if tuple(d["mesh"]) == mesh and d["remat_groups"] == cfg.model.remat_groups]
    assert cfg.algo.loss.micro_batch_size == mesh[0] * mesh[1]
    arch = ModelConfig.from_hf(ROOT / "configs" / "paper" / "qwen3-4b-instruct-2507.json")
    plan = sp.step_plan(TARGETS["v5p-8"], train, ro.RolloutSettings.of_config(cfg),
                        arch.replace(dtype=cfg.model.dtype), ro.RolloutShape.of_config(cfg),
                        ro.replica_dtype(cfg))
    assert plan.fits and plan.rollout.full_rows == 44, plan.as_dict()


@pytest.mark.slow
def test_plan_search_command(tmp_path, capsys, devices):
    arch = tmp_path / "config.json"
    arch.write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "rope_theta": 5000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096}))
    out = tmp_path / "search.json"
    code = main(["plan", "--config", "configs/quickstart.yaml", "--arch", str(arch),
                 "--devices", "2", "--memory-gib", "1", "--search", "--markdown",
                 "--length", "512", "--json", str(out), "rollout.kv_cache=paged"])
    assert code == 0
    [record] = json.loads(out.read_text())
    # One mesh; 6 layer groups do not divide 2 layers: that candidate is skipped.
    assert [t["remat_groups"] for t in record["trainers"]] == [1]
    engines = {c["engine"]: c for c in record["choices"]}
    assert set(engines) == {"dense", "paged", "vllm"}
    assert engines["paged"]["fits"] and "rollout.kv_cache=paged" in engines["paged"]["overrides"]
    printed = capsys.readouterr().out
    assert "| 2 devices | jax, paged KV |" in printed and "skipped" in printed


def _compiled_temporaries(sampler, jitted: tuple[str, ...], prompts, params) -> dict[str, int]:
    """XLA's temporaries of `sampler`'s (or its engine's) jitted programs named `jitted`, as
    first called by one `generate`: their arguments captured, then lowered and compiled."""
    owner = sampler.engine or sampler
    seen = {}
    for name in jitted:
        fn = getattr(owner, name)

        def capture(*a, _fn=fn, _name=name, **k):
            seen.setdefault(_name, (_fn, a, k))
            return _fn(*a, **k)

        setattr(owner, name, capture)
    sampler.generate(prompts, params)
    return {name: fn.lower(*a, **k).compile().memory_analysis().temp_size_in_bytes
            for name, (fn, a, k) in seen.items()}


@pytest.mark.slow
def test_the_engines_formulas_bound_their_compiled_temporaries():
    """A scaled router's dense and paged programs compiled on CPU: the formulas the plan
    prices them by are upper bounds of XLA's temporaries, the dense one within 1.5x (1.21x
    measured), the paged one within 3x (1.6x: it counts a prefill's scores and probabilities
    in full and its MLP beside them, where XLA:CPU fuses and frees; bench/RESULTS.md)."""
    import numpy as np
    from flax import nnx

    from jax_routeweaver.models.qwen3 import Qwen3
    from jax_routeweaver.sampling.base import SamplingParams
    from jax_routeweaver.sampling.jax_sampler import JaxSampler
    from jax_routeweaver.sampling.paged_options import PagedConfig

    arch = CFG.replace(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=4096,
                       dtype="bfloat16", param_dtype="float32")
    model = Qwen3(arch, rngs=nnx.Rngs(0))
    rows, prompt, new = 16, 1000, 24
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, arch.vocab_size, prompt).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)

    dense = JaxSampler(model, kv_cache="dense", cache_dtype="bfloat16", batch_buckets=(rows,),
                       group_cost=None)
    got = _compiled_temporaries(dense, ("_prefill", "_decode"), prompts, params)
    [(b, p, n)] = dense.shape_state()  # the group's padded shapes
    formula = ro.decode_temporaries(arch, b, p + n, p, 1)
    assert max(got.values()) <= formula <= 1.5 * max(got.values()), (got, formula)

    options = PagedConfig(max_rows=rows, budget_tokens=rows * 1088, prefill_chunk=512,
                          attention="portable")
    paged = JaxSampler(model, paged=options, cache_dtype="bfloat16")
    got = _compiled_temporaries(paged, ("_prefill", "_decode"), prompts, params)
    formula = ro.paged_temporaries(arch, rows, prompt + new, options.page_size, 1,
                                   prefill_chunk=options.prefill_chunk)
    assert max(got.values()) <= formula <= 3 * max(got.values()), (got, formula)
