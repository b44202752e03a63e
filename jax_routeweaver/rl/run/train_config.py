"""The typed configuration of `routeweaver train` (YAML + ``key.sub=value`` overrides).

Every section is a frozen dataclass; :func:`load_train_config` reads a YAML file through the
generic loader in ``jax_routeweaver.config`` (unknown keys are errors with the nearest valid
key suggested) and checks the cross-field rules below. Defaults are the original's paper
numbers (docs/algorithm.md, docs/paper_configs.md); ``configs/quickstart.yaml`` scales them
down.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from jax_routeweaver.config import ConfigError, bounded, load_config
from jax_routeweaver.data.pipeline import SEED_RANGE, BatchSettings
from jax_routeweaver.rl.core.estimators import ESTIMATORS
from jax_routeweaver.rl.learner.critic import CriticConfig
from jax_routeweaver.rl.learner.curriculum import ExplorationConfig, forced_ratio
from jax_routeweaver.rl.learner.learner_config import LossConfig, OptimConfig
from jax_routeweaver.routing.episodes.router_r1_env import max_action_bytes
from jax_routeweaver.routing.protocol import router_r1 as r1
from jax_routeweaver.routing.protocol.grammar import ProtocolConfig
from jax_routeweaver.sampling.sidecar import VllmConfig

# Numeric fields declare their valid range with `bounded` (checked when a config is loaded);
# `check_train_config` holds the rules that involve more than one field.

RANDOM_INITS = ("random", "stand-in")  # model.init kinds built from model.random


@dataclasses.dataclass(frozen=True)
class StandInConfig:
    """``model.init: stand-in``: a random-init router (``model.random``) distilled before RL
    into a stand-in for a pretrained one (`rl.run.stand_in`): its decision state follows a
    sentence encoder's embedding of the question while its three mode declarations stay
    near uniform, and likewise at each mode's first worker choice; it also clones
    demonstrated episodes that execute each mode competently. Built once per
    (architecture, tokenizer, questions, these fields) and cached on disk. Not part of the
    paper's method: the paper starts from a pretrained Qwen3, which this machine cannot
    download."""

    steps: int = bounded(300, "[1, inf)")  # AdamW steps
    batch_size: int = bounded(32, "[1, inf)")  # questions per step
    lr: float = bounded(3e-3, "(0, 1]")  # AdamW learning rate
    dims: int = bounded(32, "[1, inf)")  # encoder principal components the state carries
    # weight of the question-independent direction in the target state (0: states centred)
    common: float = bounded(0.5, "[0, inf)")
    mode_weight: float = bounded(1.0, "[0, inf)")  # weight of the uniform-mode term
    # weight of the first worker choice's terms (its state follows the question, its worker
    # distribution stays uniform); 0: the mode decision only
    worker_weight: float = bounded(1.0, "[0, inf)")
    holdout: float = bounded(0.2, "[0, 1)")  # share of questions kept for the diagnostics
    # Behaviour cloning (`rl.run.demonstrations`): episodes of training questions that execute
    # each mode as the simulated pool rewards it, modes and workers drawn at random; 0: none
    demonstrations: int = bounded(1000, "[0, inf)")
    bc_weight: float = bounded(1.0, "[0, inf)")  # weight of the cloning term
    bc_batch: int = bounded(8, "[1, inf)")  # demonstrated episodes per step
    # "" = $ROUTEWEAVER_CACHE/stand_in, else ~/.cache/jax_routeweaver/stand_in
    cache_dir: str = ""


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The router. ``init``: "random" (architecture from ``random``: ``ModelConfig``
    fields; vocab_size and eos/pad/bos ids default to the tokenizer's), "stand-in" (the
    same random router distilled by ``stand_in`` first: `StandInConfig`), "hf" (the
    Hugging Face checkpoint directory in ``path``), a Hugging Face checkpoint directory, or
    an orbax policy checkpoint directory. ``tokenizer``: "qwen3" (the real Qwen3 tokenizer,
    built offline), "qwen3-pruned" (the same BPE restricted to the tokens of this run's
    prompts and worker replies) or a tokenizer directory."""

    init: str = "random"  # "random", "stand-in", "hf" or a checkpoint directory (above)
    path: str = ""  # with init "hf": the Hugging Face checkpoint directory; "" otherwise
    # with init "random" / "stand-in": `ModelConfig` fields of the router (checked there)
    random: dict[str, Any] = dataclasses.field(default_factory=dict)
    # with init "stand-in": the distillation that precedes RL
    stand_in: StandInConfig = dataclasses.field(default_factory=StandInConfig)
    tokenizer: str = "qwen3"  # "qwen3", "qwen3-pruned" or a tokenizer directory (above)
    param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute
    scan_layers: bool = True  # lax.scan over the stacked layers (same params either way)
    # activation rematerialisation per layer ("none": keep every activation)
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    remat_groups: int = bounded(1, "[1, inf)")  # layer groups G (must divide the layers)
    logprob_chunk: int = bounded(1024, "[1, inf)")  # tokens per log-prob chunk
    attention_block: int = bounded(512, "[1, inf)")  # tokens per attention block
    causal_parts: int = bounded(1, "[1, inf)")  # self-attention split into P causal parts

    def runtime(self) -> dict[str, Any]:
        """The `ModelConfig` runtime options this section sets (not dtypes)."""
        return dict(scan_layers=self.scan_layers, remat=self.remat,
                    remat_groups=self.remat_groups, logprob_chunk=self.logprob_chunk,
                    attention_block=self.attention_block, causal_parts=self.causal_parts)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh ``('data', 'fsdp', 'tensor')``; one entry may be -1 (the rest)."""

    data: int = bounded(1, "-1 or [1, inf)")  # devices on the data axis; -1 = the rest
    fsdp: int = bounded(-1, "-1 or [1, inf)")  # devices sharding the params; -1 = the rest
    tensor: int = bounded(1, "-1 or [1, inf)")  # tensor-parallel devices; -1 = the rest


@dataclasses.dataclass(frozen=True)
class DataConfig(BatchSettings):
    """Queries: how batches are made (`data.pipeline.BatchSettings`: ``batch_size``,
    ``group_size`` K, ``quotas``, ``shuffle``, ``seed``, ``repeat``, declared there) and
    where the records come from. ``source``: "synthetic" (``synthetic_tasks`` for the five
    domains) or a ``.jsonl``/``.parquet`` file of records. ``synthetic_levels``: the
    difficulty cycle of synthetic tasks. ``bad_rows``: what a record file's bad row does, one
    that is malformed or whose question cannot fit the router's context (its tokens, plus the
    dialect's first prompt around it, over the router's max_position_embeddings;
    `rl.run.builders.question_limit`): "error" stops with one line naming the file and line
    (JSONL, 1-based) or row (parquet, 0-based), "skip" drops and counts it.
    ``line_allowance_mb``: what a JSONL line may hold besides its question (gold answers,
    meta, code tests); a line longer than the longest question that fits (as escaped JSON)
    plus this is refused before it is parsed. With ``repeat`` off the records must fill
    ``steps`` batches."""

    source: str = "synthetic"  # "synthetic" or a .jsonl / .parquet file of records
    synthetic_queries: int = bounded(3200, "[1, inf)")  # queries generated
    synthetic_seed: int = bounded(0, SEED_RANGE)  # seed of the synthetic tasks
    # difficulty of the synthetic tasks, cycled over the queries
    synthetic_levels: tuple[Literal["easy", "medium", "hard"], ...] = ("easy", "medium", "hard")
    # a malformed record, or one whose question cannot fit the router's context: stop, or
    # drop and count (above)
    bad_rows: Literal["error", "skip"] = "error"
    # MiB a JSONL line may hold besides its question (above)
    line_allowance_mb: float = bounded(64.0, "[0, inf)")


@dataclasses.dataclass(frozen=True)
class RouterR1RolloutConfig:
    """Router-R1 episodes (``rollout.dialect: router_r1``; ``RouterR1Config``, Router-R1's
    rollout loop; docs/router_r1.md). The per-turn cap, temperature and top-p are
    ``rollout.max_new_tokens``, ``rollout.temperature`` and ``rollout.top_p``. ``models``:
    Router-R1 model name -> pool worker id; empty = the six prompt models onto worker_1..6 in
    prompt order (Qwen2.5-7B, LLaMA-3.1-8B, LLaMA-3.1-70B, Mistral-7B, Mixtral-8x22B,
    Gemma-2-27B), the mapping used with the simulated pool. ``question_query`` (with
    ``rollout.constrained``): a search's query is the question verbatim, so a tiny router's
    calls reach the simulated workers."""

    max_turns: int = bounded(4, "[1, inf)")  # routed turns, then one final generation
    start_max_tokens: int = bounded(2048, "[1, inf)")  # tokens: the prompt's last N kept
    context_max_tokens: int = bounded(4096, "[1, inf)")  # tokens: the context's last N kept
    # tokens: the trajectory's first N kept
    trajectory_max_tokens: int = bounded(4096, "[1, inf)")
    obs_max_tokens: int = bounded(600, "[1, inf)")  # tokens: an observation's first N kept
    prompt_variant: Literal["qwen", "llama"] = "qwen"  # the chat prompt's template
    worker_max_tokens: int = bounded(512, "[1, inf)")  # tokens a worker call may generate
    # Router-R1 model name -> pool worker id; empty = the six prompt models (above)
    models: dict[str, str] = dataclasses.field(default_factory=dict)
    question_query: bool = False  # a search's query is the question (above)


@dataclasses.dataclass(frozen=True)
class PagedCacheConfig:
    """The in-process sampler's paged KV cache (``rollout.kv_cache: paged``; see
    `sampling.paged_engine`). Keys and values live in one pool of fixed-size pages; each row
    holds a page table, rows are admitted as pages free up and retired as they stop
    (continuous batching), a prefix common to many rows is stored once, and an episode's
    earlier turns stay in place for its next turn. ``page_size``: tokens per page.
    ``budget_tokens``: the pool's size in tokens (0 = from ``memory_fraction``).
    ``memory_fraction``: with ``budget_tokens`` 0, the share of one device's free memory the
    pool takes at start-up. ``max_rows``: decode slots, the most rows decoded at once.
    ``attention``: the decode attention's path (`models.paged_attention`): "auto" (JAX's
    Pallas paged-attention kernel on TPU, "portable" elsewhere), "portable" (pages gathered,
    every backend), "pallas" (the Pallas kernel, reading pages in place: TPU or GPU)."""

    page_size: int = bounded(16, "[1, 4096]")  # tokens per page
    budget_tokens: int = bounded(0, "[0, inf)")  # tokens; 0 = use memory_fraction
    memory_fraction: float = bounded(0.5, "(0, 1]")  # of free device memory
    max_rows: int = bounded(64, "[1, inf)")  # rows decoded at once
    attention: Literal["auto", "portable", "pallas"] = "auto"  # decode attention's path


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Router decoding (the original's T 0.8, top-p 0.95, top-k off; docs/paper_configs.md,
    "configs/paper/base.yaml") and episode options.
    ``dialect``: "routeweaver" (mode selection, ``protocol``) or "router_r1" (Router-R1's
    multi-round dialect, ``router_r1``; ``protocol`` and ``execution_feedback`` then play no
    part). ``constrained``: grammar-constrained actions; ``answer_choices``: with
    constraints, an answer must be one of the candidate answers the workers returned (lets
    a tiny router act; off for real models); ``task_text``: with constraints, every route's
    task is this fixed text (for the simulated pool, which ignores the wording; "" = free
    text). ``rulebook``: "reference" or "compact" (a few lines instead of 600-900 tokens, for
    tiny random-init routers). ``protocol``: ``ProtocolConfig`` fields. ``sampler``: "jax"
    (in process) or "vllm" (the sidecar, ``vllm``). ``prefix_cache_mb``: device memory the
    in-process sampler may keep of a step's KV caches, so an episode's next turn prefills
    only its new tokens (0 = off, the default: it pays where the prefill dominates a rollout,
    1.68x at 512 wide x 4 layers, not on the quickstart's router, and `routeweaver plan` does
    not count it; a group bigger than this is not kept; vLLM has its own).
    ``device_choices``: the in-process sampler decodes turns whose grammars are all finite
    choices on device, without a host round trip per token (false: host masks, the same
    tokens; for comparison). ``prompt_buckets``: the in-process sampler's prompt lengths,
    increasing (empty = its default, steps of 1.5x and 2x: little padding, more compiles;
    fewer buckets compile less, which pays in short runs). ``kv_cache``: the in-process
    sampler's KV cache, "paged" (the default; ``paged``: a page pool sized by a budget,
    continuous batching, shared prefixes) or "dense" (one (prompt + max_new_tokens)-slot
    cache per row; faster only where every row of a call has the same prompt and completion
    length, and it splits rows over the mesh's batch axes where the paged engine replicates
    them: docs/paged_sampler.md, "Which engine"). ``prefix_cache_mb``, ``prompt_buckets``
    apply to "dense" only."""

    dialect: Literal["routeweaver", "router_r1"] = "routeweaver"  # the episode's dialect
    sampler: Literal["jax", "vllm"] = "jax"  # in process, or the vLLM sidecar (``vllm``)
    temperature: float = bounded(0.8, "[0, inf)")  # 0 = greedy
    top_p: float = bounded(0.95, "(0, 1]")  # 1 = off
    top_k: int = bounded(-1, "[-1, inf)")  # -1 or 0 = off
    max_new_tokens: int = bounded(512, "[1, inf)")  # tokens per turn
    constrained: bool = False  # grammar-constrained actions
    answer_choices: bool = False  # (constrained) answers among the workers' candidates
    task_text: str = ""  # (constrained) every route's fixed task text; "" = free text
    rulebook: Literal["reference", "compact"] = "reference"  # the rules in the prompt
    # sandbox verdicts of agentic executor replies (CODE, MATH) prefixed to their
    # observations (docs/protocol.md, "Execution feedback")
    execution_feedback: bool = True
    prefix_cache_mb: float = bounded(0.0, "[0, inf)")  # MB; 0 = off
    device_choices: bool = True  # finite-choice turns decoded on device (false: host masks)
    prompt_buckets: tuple[int, ...] = bounded((), "[1, inf)")  # tokens, increasing
    kv_cache: Literal["paged", "dense"] = "paged"  # the in-process sampler's KV cache
    paged: PagedCacheConfig = dataclasses.field(default_factory=PagedCacheConfig)  # kv_cache paged
    # the action protocol (dialect routeweaver)
    protocol: ProtocolConfig = dataclasses.field(default_factory=ProtocolConfig)
    # Router-R1 episodes (dialect router_r1)
    router_r1: RouterR1RolloutConfig = dataclasses.field(default_factory=RouterR1RolloutConfig)
    vllm: VllmConfig = dataclasses.field(default_factory=VllmConfig)  # sampler vllm


@dataclasses.dataclass(frozen=True)
class WorkersConfig:
    """``pool``: "simulated" (a seeded stand-in for the paid worker APIs) or a channel
    YAML (OpenAI-compatible endpoints; keys come from the env vars it names). Calls are
    billed at the channel file's ``price`` entries (the simulated pool: the original
    price table). Before step 1 of ``train``, ``eval`` and ``--dry-run`` the pool is checked
    (`rl.run.pool_check`): every offered worker priced; with ``check_endpoints``, every key set
    and every endpoint answering ``GET /models`` with the configured model names."""

    pool: str = "simulated"  # "simulated" or a channel YAML path
    seed: int = bounded(0, SEED_RANGE)  # the simulated pool's seed
    latency_s: float = bounded(0.0, "[0, inf)")  # seconds per simulated call
    failure_rate: float = bounded(0.0, "[0, 1]")  # share of simulated calls that fail
    concurrency: int = bounded(40, "[1, inf)")  # concurrent worker calls (channel pools)
    # worker ids offered to the router (catalog and grammar); empty: every pool worker. The
    # others stay registered: routing to one is the violation worker_not_offered
    offered: tuple[str, ...] = ()
    # ask each endpoint for its model list before step 1; false only for an endpoint that
    # serves no /models (its keys and names are then not checked)
    check_endpoints: bool = True


@dataclasses.dataclass(frozen=True)
class RouterR1ScoreConfig:
    """Router-R1's hierarchical reward (docs/router_r1.md): format gate, then ``metric`` ("em"
    as in the official scripts, or "f1") against the gold answers, then ``cost_coe`` (α,
    the paper's 0-0.9) times the normalised cost C, for correct answers only. C comes from
    one sliding window of ``window_size`` sqrt-costs owned by the run and saved with the
    full train state (upstream's window is global and never checkpointed;
    docs/paper_configs.md, "configs/router_r1.yaml")."""

    metric: Literal["em", "f1"] = "em"  # answer score: exact match or token F1
    cost_coe: float = bounded(0.0, "[0, 1]")  # α, the weight of the normalised cost
    window_size: int = bounded(1000, "[1, inf)")  # sqrt-costs in the window


@dataclasses.dataclass(frozen=True)
class TrainRewardConfig:
    """``alpha`` > 0 needs ``algo.estimator: comet_gdpo``. ``c_ref``: USD (number) or a
    ``cost_ref.json`` path (``routeweaver calibrate-cost``); "" = the original's C_ref.
    ``router_r1``: the reward of ``rollout.dialect: router_r1`` (the others then play no
    part)."""

    alpha: float = bounded(0.0, "[0, 1]")  # cost weight
    c_ref: float | str = bounded("", "(0, inf)")  # USD (a number), or a path / ""
    # code rows' candidate programs: every successful worker reply too ("union"), or only
    # the router's and the summarizer's ("final"); docs/algorithm.md, "The verdict"
    code_scorer: Literal["union", "final"] = "union"
    score_workers: int = bounded(4, "[1, inf)")  # scorer threads
    # the reward of dialect router_r1
    router_r1: RouterR1ScoreConfig = dataclasses.field(default_factory=RouterR1ScoreConfig)


@dataclasses.dataclass(frozen=True)
class GAEConfig:
    """``algo.estimator: ppo_gae``'s advantages (`rl.core.gae`; Router-R1: γ = λ = 1, whitened,
    reward-KL 0.001 with ``algo.loss.kl_coef: 0``). ``reward_kl_coef``: β of the per-token
    penalty β·(logp − logp_ref) subtracted from the reward (0 = none)."""

    gamma: float = bounded(1.0, "[0, 1]")  # discount per policy token
    lam: float = bounded(1.0, "[0, 1]")  # GAE λ
    whiten: bool = True  # whiten the advantages over the batch's training tokens
    reward_kl_coef: float = bounded(0.001, "[0, inf)")  # β per token; 0 = no penalty


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """Estimator and curriculum. ``support`` turns the minimum-support loss on (weight
    ``exploration.support_lambda0 · ρ_b``, floor ``exploration.support_floor``);
    ``mode_score_span`` which declaration tokens it scores. ``rollout.dialect: router_r1``
    needs ``ppo_gae`` (Router-R1's PPO with a critic: ``critic``, ``gae``) or ``grpo_gated``,
    the global reduction, no support loss and no forced arm (it has no mode tokens);
    ``ppo_gae`` is for router_r1 only."""

    # the advantage estimator (docs/algorithm.md)
    estimator: Literal[tuple(ESTIMATORS)] = "comet_grpo"  # a name of `rl.core.estimators`
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)  # the policy loss
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)  # ppo_gae only
    gae: GAEConfig = dataclasses.field(default_factory=GAEConfig)  # ppo_gae only
    # the forced-mode curriculum and the support schedule
    exploration: ExplorationConfig = dataclasses.field(default_factory=ExplorationConfig)
    support: bool = True  # the minimum-support loss
    # the declaration tokens it scores: the mode word ("content") or the whole declaration
    mode_score_span: Literal["content", "full"] = "content"
    support_max_prompt: int = bounded(2048, "[1, inf)")  # selector-prompt tokens kept (last N)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Policy params every step (what the sampler loads; the last ``keep_policy`` kept) and
    the full train state every ``full_every`` steps and at the end. ``resume``: continue from
    the latest full state in the run directory. ``init_from``: another run's full-state
    directory (its ``checkpoints/state``) that a fresh run starts from — params, optimizer
    state and step N (the latest saved), as the original's main arm continues its cold arm:
    this run's data then start at its batch N (batch_index N, the first N batches skipped),
    and the KL reference stays this run's own initial model (``model.init``)."""

    full_every: int = bounded(10, "[1, inf)")  # steps
    keep_policy: int = bounded(2, "[1, inf)")  # policy checkpoints kept
    keep_full: int = bounded(2, "[1, inf)")  # full states kept (0 would keep none to resume)
    resume: bool = True  # continue from the run directory's latest full state
    init_from: str = ""  # another run's full-state directory to start from; "" = none


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where each step's metrics go (`rl.reports.run_log`), on the main process only."""

    # out_dir/metrics.jsonl, the run's record (the end-of-run plots and summary read it)
    jsonl: bool = True
    tensorboard: bool = True  # out_dir/tb
    plots: bool = True  # metric plots in out_dir at the end of the run (needs jsonl)
    progress: bool = True  # the console progress line
    summary_window: int = bounded(10, "[1, inf)")  # first and last steps in the run's summary


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run. ``out_dir`` receives config.yaml, metrics.jsonl, tb/, checkpoints/, plots.
    Steps are numbered from 1 (``batch_index = step − 1``).
    ``deterministic``: reseed the sampler per step so a resumed run repeats exactly."""

    name: str = "run"  # the run's name in reports ("name@stepN")
    out_dir: str = "runs/run"  # the run directory (a filesystem path, not a URL)
    seed: int = bounded(0, SEED_RANGE)  # model init, sampler and the vLLM sidecar's seed
    steps: int = bounded(90, "[1, inf)")  # policy steps (one batch each)
    deterministic: bool = True  # reseed the sampler per step
    model: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)  # the router
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)  # device mesh
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # queries and batches
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)  # decoding
    workers: WorkersConfig = dataclasses.field(default_factory=WorkersConfig)  # the pool
    reward: TrainRewardConfig = dataclasses.field(default_factory=TrainRewardConfig)  # scoring
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)  # estimator, losses
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)  # the policy's AdamW
    # what is saved, when, and where a run starts from
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)  # metrics


def check_train_config(cfg: TrainConfig, source: str | Callable[[str], str] = "<config>"
                       ) -> None:
    """The rules that involve more than one field (each field's own range is checked when the
    config is loaded, see `bounded`); raises ConfigError naming the key and its `source` (a
    string, or a function of the dotted key such as `load_config` passes)."""
    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{source(key) if callable(source) else source}: {key}: {msg}")

    if "://" in cfg.out_dir:
        fail("out_dir", f"{cfg.out_dir!r}: a filesystem path is needed (logs, tokenizer and the "
             "sidecar's exports are written with local file APIs); mount a bucket (gcsfuse) "
             "instead of a URL")
    if cfg.reward.alpha > 0 and not ESTIMATORS[cfg.algo.estimator].cost:
        fail("reward.alpha", f"alpha={cfg.reward.alpha} > 0 needs an algo.estimator that "
             f"reads the cost reward ({', '.join(n for n, e in ESTIMATORS.items() if e.cost)})")
    if cfg.data.quotas and sum(cfg.data.quotas.values()) != cfg.data.batch_size:
        fail("data.quotas", f"sum {sum(cfg.data.quotas.values())} != data.batch_size "
                            f"{cfg.data.batch_size}")
    buckets = cfg.rollout.prompt_buckets
    if list(buckets) != sorted(set(buckets)):
        fail("rollout.prompt_buckets", f"must be strictly increasing, got {list(buckets)}")
    if cfg.rollout.answer_choices and not cfg.rollout.constrained:
        fail("rollout.answer_choices", "needs rollout.constrained: true")
    task = cfg.rollout.task_text
    if task and not cfg.rollout.constrained:
        fail("rollout.task_text", "needs rollout.constrained: true")
    if task and (task[0].isspace() or len(task) > 48 or any(c in task for c in "<>\n")):
        fail("rollout.task_text", f"{task!r} must be at most 48 characters without tags or "
             "newlines and not start with a space (a route's task must pass the protocol)")
    if cfg.model.init not in RANDOM_INITS and cfg.model.random:
        fail("model.random", "only used with model.init: random or stand-in")
    if cfg.model.init != "stand-in" and cfg.model.stand_in != StandInConfig():
        fail("model.stand_in", "only used with model.init: stand-in")
    if cfg.model.init == "stand-in" and cfg.rollout.dialect == "router_r1":
        fail("model.init", "stand-in distils the mode decision, which rollout.dialect: "
             "router_r1 does not have")
    if cfg.model.init == "stand-in" and cfg.model.stand_in.demonstrations > 0 \
            and not (cfg.rollout.constrained and cfg.rollout.task_text
                     and cfg.rollout.answer_choices):
        fail("model.stand_in.demonstrations", f"{cfg.model.stand_in.demonstrations} needs "
             "finite actions (rollout.constrained: true, a rollout.task_text and "
             "rollout.answer_choices: true); set it to 0 otherwise")
    if cfg.model.init == "stand-in" and cfg.model.stand_in.worker_weight > 0 \
            and not (cfg.rollout.constrained and cfg.rollout.task_text):
        fail("model.stand_in.worker_weight", f"{cfg.model.stand_in.worker_weight} needs "
             "finite first actions (rollout.constrained: true and a rollout.task_text); "
             "set it to 0 otherwise")
    offered = list(cfg.workers.offered)
    if len(set(offered)) != len(offered) or not all(isinstance(w, str) and w for w in offered):
        fail("workers.offered", f"{offered} must be distinct worker ids")
    if cfg.model.init == "hf" and not cfg.model.path.strip():
        fail("model.path", "model.init: hf needs the Hugging Face checkpoint directory")
    if cfg.model.init != "hf" and cfg.model.path:
        fail("model.path", "only used with model.init: hf")
    if not ESTIMATORS[cfg.algo.estimator].critic:
        for key, value, default in (("algo.critic", cfg.algo.critic, CriticConfig()),
                                    ("algo.gae", cfg.algo.gae, GAEConfig())):
            if value != default:
                fail(key, "only used with algo.estimator: ppo_gae")
    if cfg.rollout.dialect == "router_r1":
        _check_router_r1(cfg, fail)
    elif ESTIMATORS[cfg.algo.estimator].critic:
        fail("algo.estimator", "ppo_gae (a critic and GAE, Router-R1's recipe) is for "
             "rollout.dialect: router_r1; RouteWeaver splits its group advantage with COMET")
    else:
        for key, section, default in (
                ("rollout.router_r1", cfg.rollout.router_r1, RouterR1RolloutConfig()),
                ("reward.router_r1", cfg.reward.router_r1, RouterR1ScoreConfig())):
            if section != default:
                fail(key, "only used with rollout.dialect: router_r1")


def router_r1_config(cfg: TrainConfig) -> r1.RouterR1Config:
    """The `RouterR1Config` of a router_r1 run (ValueError on a bad field)."""
    s, r = cfg.rollout.router_r1, cfg.rollout
    return r1.RouterR1Config(
        max_turns=s.max_turns, start_max_tokens=s.start_max_tokens,
        context_max_tokens=s.context_max_tokens, trajectory_max_tokens=s.trajectory_max_tokens,
        per_turn_max_tokens=r.max_new_tokens, obs_max_tokens=s.obs_max_tokens,
        train_temperature=r.temperature, train_top_p=r.top_p, prompt_variant=s.prompt_variant,
        worker_max_tokens=s.worker_max_tokens)


def router_r1_model_names(cfg: TrainConfig) -> list[str]:
    """The Router-R1 models the router may call: `rollout.router_r1.models`' keys, or the six
    prompt models when it is empty."""
    return list(cfg.rollout.router_r1.models) or [m.name for m in r1.PROMPT_MODELS]


def _check_router_r1(cfg: TrainConfig, fail: Callable[[str, str], None]) -> None:
    """Router-R1 has no mode tokens: its advantage is GRPO grouped by query with the global
    token-mean, and every mode-specific option is an error rather than silently ignored."""
    algo = cfg.algo
    if ESTIMATORS[algo.estimator].mode_tokens:
        fail("algo.estimator", f"{algo.estimator!r} splits advantages at the mode tokens, "
             "which rollout.dialect: router_r1 does not have; use ppo_gae (Router-R1's PPO "
             "with a critic) or grpo_gated (GRPO grouped by query)")
    if algo.support:
        fail("algo.support", "the minimum-support loss scores mode declarations, which "
             "rollout.dialect: router_r1 does not have; set algo.support: false")
    if algo.loss.reduction != "global":
        fail("algo.loss.reduction", f"{algo.loss.reduction!r} normalises mode and inner "
             "segments apart; rollout.dialect: router_r1 has no mode segment: use global")
    if forced_ratio(0, algo.exploration) > 0:
        fail("algo.exploration.forced_start_batch", "the forced-mode curriculum injects mode "
             "declarations, which rollout.dialect: router_r1 does not have; set "
             "algo.exploration.forced_start_batch: -1 and forced_anneal_steps: 1 (never "
             "forced)")
    if cfg.reward.alpha > 0:
        fail("reward.alpha", "the cost trade-off of rollout.dialect: router_r1 is "
             "reward.router_r1.cost_coe")
    try:
        router_r1_config(cfg)
    except ValueError as e:
        fail("rollout.router_r1", str(e))
    by_name = {m.name: m for m in r1.ALL_MODELS}
    for name in cfg.rollout.router_r1.models:
        if name not in by_name:
            fail("rollout.router_r1.models", f"{name!r} is not a Router-R1 model; known: "
                 f"{sorted(by_name)}")
        if by_name[name].price_per_million is None:
            fail("rollout.router_r1.models", f"{name!r} has no Router-R1 price, so its calls "
                 "cannot be costed")
    if cfg.rollout.router_r1.question_query and not cfg.rollout.constrained:
        fail("rollout.router_r1.question_query", "needs rollout.constrained: true")
    if cfg.rollout.constrained:
        need = max_action_bytes(router_r1_model_names(cfg))
        if cfg.rollout.max_new_tokens < need:
            fail("rollout.max_new_tokens", f"{cfg.rollout.max_new_tokens} cannot hold the "
                 f"longest constrained Router-R1 action ({need} tokens)")


def load_train_config(path: str | os.PathLike[str] | None,
                      overrides: Sequence[str] = ()) -> TrainConfig:
    """YAML file (None: defaults) + ``key.sub=value`` overrides -> a checked TrainConfig.

    ConfigError (one line) on a bad file, key, type, a value outside its field's range or a
    broken cross-field rule, naming the file and line, or the override, that set the key."""
    return load_config(TrainConfig, path, overrides, check=check_train_config)
