"""Building a run's parts from its `TrainConfig`: records, worker pool, tokenizer, policy,
learner, sampler and dialect. The loop (`rl.run.loop.train`), evaluation, `warm-start` and the
benchmarks build the same parts the same way through these functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flax import nnx
from rich.console import Console
from rich.markup import escape

from jax_routeweaver.data.record_files import QuestionLimit, ReadStats, read_records
from jax_routeweaver.data.records import Record
from jax_routeweaver.models.config import ModelConfig
from jax_routeweaver.models.hf import load_hf
from jax_routeweaver.models.qwen3 import Qwen3
from jax_routeweaver.models.sharding import SAMPLE_RULES, create_sharded
from jax_routeweaver.models.tokenizer import (
    build_qwen3_tokenizer,
    load_tokenizer,
    longest_token_bytes,
    prune_tokenizer,
)
from jax_routeweaver.rl.learner.trainer import Trainer
from jax_routeweaver.rl.run import stand_in
from jax_routeweaver.rl.run.checkpoint import PolicyCheckpointer, latest_step, restore_policy
from jax_routeweaver.rl.run.demonstrations import demonstrations
from jax_routeweaver.rl.run.dialect import Dialect
from jax_routeweaver.rl.run.pool_check import check_run_pool
from jax_routeweaver.rl.run.router_r1_run import RouterR1Dialect
from jax_routeweaver.rl.run.routeweaver_run import RouteWeaverDialect, env_config
from jax_routeweaver.rl.run.train_config import RANDOM_INITS, TrainConfig
from jax_routeweaver.routing.episodes.episode import Trajectory
from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs
from jax_routeweaver.routing.pools.channels import load_channels
from jax_routeweaver.routing.pools.workers import HttpWorkerPool
from jax_routeweaver.routing.simulated.pool import SimulatedWorkerPool
from jax_routeweaver.routing.simulated.tasks import synthetic_tasks
from jax_routeweaver.sampling.constraints import GrammarConstraints
from jax_routeweaver.sampling.dense_buckets import DEFAULT_BATCH_BUCKETS
from jax_routeweaver.sampling.jax_sampler import JaxSampler

QWEN3_VOCAB = 151_936  # the Qwen3 checkpoints' embedding rows (the tokenizer's, padded)


def dialect_for(cfg: TrainConfig) -> Dialect:
    """The run's `Dialect` (``rollout.dialect``), not yet started."""
    return RouterR1Dialect(cfg) if cfg.rollout.dialect == "router_r1" \
        else RouteWeaverDialect(cfg)


def build_tokenizer(cfg: TrainConfig, records: list[Record], pool: Any) -> Any:
    """"qwen3": the real Qwen3 tokenizer (built offline); "qwen3-pruned": the same BPE pruned
    to the tokens of this run's text (`routing_corpus`, or Router-R1's); otherwise a
    tokenizer directory."""
    if cfg.model.tokenizer == "qwen3":
        return build_qwen3_tokenizer()
    if cfg.model.tokenizer == "qwen3-pruned":
        corpus = dialect_for(cfg).corpus(records, pool)
        return prune_tokenizer(build_qwen3_tokenizer(), corpus)
    return load_tokenizer(cfg.model.tokenizer)


def build_policy(cfg: TrainConfig, mesh: Any, tokenizer: Any,
                 records: Sequence[Record] = (), log: Callable[[str], None] | None = None
                 ) -> Qwen3:
    """The initial policy, born sharded on `mesh` (see `PolicyConfig`). A random model takes
    vocab_size (rounded up to 128) and the eos/pad/bos ids from the tokenizer unless given;
    ``init: stand-in`` distils that random model on the questions of `records` first (or
    loads it from the cache, `rl.run.stand_in`); ``init: hf`` loads the Hugging Face checkpoint
    directory in ``model.path``."""
    m = cfg.model
    runtime = m.runtime()
    if m.init == "random":
        return random_policy(cfg, mesh, tokenizer)
    if m.init == "stand-in":
        path = stand_in_path(cfg, mesh, tokenizer, records, log)
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    if m.init == "hf":
        path = Path(m.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} is not a Hugging Face checkpoint "
                                    "directory (no config.json)")
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    path = Path(m.init)
    if (path / "config.json").is_file():
        return load_hf(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype, **runtime)
    model, _ = restore_policy(path, mesh=mesh, dtype=m.param_dtype, compute_dtype=m.dtype,
                              **runtime)
    return model


def build_trainer(cfg: TrainConfig, model: Qwen3, mesh: Any) -> Trainer:
    """The run's learner: `Trainer` over ``model`` with ``optim``, ``algo.loss`` and the
    exploration schedule's declaration terms (the support loss's λ0, 0 with ``algo.support``
    off, and δ; the per-question floor's δ_q and λ_q), at the rollout temperature."""
    explore = cfg.algo.exploration
    if not cfg.algo.support:
        explore = dataclasses.replace(explore, support_lambda0=0.0)
    return Trainer(model, cfg.optim, cfg.algo.loss, temperature=cfg.rollout.temperature,
                   mesh=mesh, seed=cfg.seed, declarations=explore)


def random_config(cfg: TrainConfig, tokenizer: Any) -> ModelConfig:
    """The architecture of ``model.random``, with vocab_size (rounded up to 128) and the
    eos/pad/bos ids from the tokenizer unless given."""
    m = cfg.model
    fields = {"vocab_size": -(-len(tokenizer) // 128) * 128,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, **m.random}
    return ModelConfig(**{**fields, "param_dtype": m.param_dtype, "dtype": m.dtype,
                          **m.runtime()})


def random_policy(cfg: TrainConfig, mesh: Any, tokenizer: Any) -> Qwen3:
    """The random-init router of ``model.random`` (seeded by ``cfg.seed``)."""
    mc = random_config(cfg, tokenizer)
    return create_sharded(lambda: Qwen3(mc, rngs=nnx.Rngs(cfg.seed)), mesh)


def stand_in_path(cfg: TrainConfig, mesh: Any, tokenizer: Any, records: Sequence[Record],
                  log: Callable[[str], None] | None = None) -> Path:
    """The HF directory of the run's stand-in (`rl.run.stand_in`), distilled from
    `random_policy` on the questions of `records` (and cloning the pool's demonstrated
    episodes, `rl.run.demonstrations`) when not cached yet (the random weights are only built
    then)."""
    if not records:
        raise ValueError("model.init: stand-in needs the run's questions to distil on")
    settings = cfg.model.stand_in
    if settings.demonstrations > 0 and cfg.workers.pool != "simulated":
        raise ValueError(f"model.stand_in.demonstrations={settings.demonstrations}: the "
                         "demonstrated episodes would call the paid workers of workers.pool "
                         f"{cfg.workers.pool!r}; they run on the simulated pool only (set it "
                         "to 0)")
    contexts = demonstrate = None
    if settings.worker_weight > 0 or settings.demonstrations > 0:
        pool = build_pool(cfg, list(records), check=False)  # train() checked it
        config = random_config(cfg, tokenizer)
        make_env = routeweaver_envs(tokenizer, pool, env_config(cfg, config.eos_token_id))
        offered = list(cfg.workers.offered) or pool.worker_ids()
        if settings.worker_weight > 0:
            contexts = stand_in.env_worker_contexts(make_env, tokenizer, len(offered))
        if settings.demonstrations > 0:
            def demonstrate(questions: Sequence[Record]) -> list[Trajectory]:
                return demonstrations(questions, make_env, pool, tokenizer, offered,
                                      seed=cfg.seed)
    return stand_in.ensure_stand_in(random_config(cfg, tokenizer),
                                    lambda: random_policy(cfg, mesh, tokenizer), tokenizer,
                                    records, settings, seed=cfg.seed, worker_contexts=contexts,
                                    demonstrate=demonstrate, log=log)


def build_sampler(cfg: TrainConfig, model: Qwen3, tokenizer: Any, mesh: Any, rows: int,
                  *, pad_id: int) -> JaxSampler:
    """The in-process sampler of ``cfg.rollout`` (grammar constraints, prompt buckets, KV
    cache kind, ...). ``rows``: the episodes of a call's first round, all sampled at once,
    made an exact batch bucket (dropping the default buckets between it and twice it)."""
    r = cfg.rollout
    constraints = GrammarConstraints(tokenizer, model.config.vocab_size) \
        if r.constrained else None
    buckets = sorted({*DEFAULT_BATCH_BUCKETS, rows}
                     - {b for b in DEFAULT_BATCH_BUCKETS if rows < b < 2 * rows})
    return JaxSampler(model, decode=tokenizer.decode, pad_id=pad_id, mesh=mesh,
                      rules=SAMPLE_RULES, constraints=constraints, batch_buckets=buckets,
                      prefix_cache_mb=r.prefix_cache_mb, prompt_buckets=r.prompt_buckets,
                      device_choices=r.device_choices, kv_cache=r.kv_cache, paged=r.paged)


def build_records(cfg: TrainConfig, console: Console, tokenizer: Any = None) -> list[Record]:
    """The run's questions: ``data.source``'s synthetic tasks, or its record file read under
    ``data.bad_rows`` (`data.record_files.read_records`), a row whose question cannot fit the
    initial router's context (`router_context`, `question_limit`) included; what ``skip``
    dropped is printed to `console`. `tokenizer`: what counts a question's tokens (default
    `counting_tokenizer`). RecordError (one line naming the file and line or row) for a bad
    row under ``error``."""
    d = cfg.data
    if d.source == "synthetic":
        return synthetic_tasks(d.synthetic_queries, seed=d.synthetic_seed,
                               levels=d.synthetic_levels)
    tokenizer = counting_tokenizer(cfg) if tokenizer is None else tokenizer
    limit = question_limit(cfg, tokenizer, *router_context(cfg, tokenizer))
    stats = ReadStats()
    records = read_records(d.source, bad_rows=d.bad_rows, stats=stats, limit=limit)
    note = stats.skip_note(d.source)
    if note is not None:
        console.print(f"[yellow]{escape(note)}[/]")
    return records


def counting_tokenizer(cfg: TrainConfig) -> Any:
    """The tokenizer that counts a question's tokens before the run's own is built (which,
    pruned, needs the records): ``model.tokenizer``'s, the full Qwen3 one for "qwen3-pruned"
    (whose ids on the run's text map one to one onto the full one's)."""
    if cfg.model.tokenizer in ("qwen3", "qwen3-pruned"):
        return build_qwen3_tokenizer()
    return load_tokenizer(cfg.model.tokenizer)


def hf_context(directory: Path, what: str = "") -> tuple[int, str]:
    """(max_position_embeddings of the Hugging Face checkpoint `directory`
    (`ModelConfig.from_hf`), where it comes from). FileNotFoundError (starting with `what`,
    e.g. "model.path: ") without a config.json."""
    config = directory / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{what}{directory} is not a Hugging Face checkpoint "
                                "directory (no config.json)")
    positions = ModelConfig.from_hf(config).max_position_embeddings
    return positions, f"max_position_embeddings={positions} of {config}"


def router_architecture(cfg: TrainConfig) -> tuple[ModelConfig, str]:
    """The router's architecture and where it came from: the random-init fields (vocab: the
    Qwen3 vocabulary unless set; a pruned tokenizer is smaller, so the estimate errs high),
    ``model.path`` (init hf), an HF dir or orbax policy checkpoint given as ``init`` — or,
    for a policy checkpoint not written yet (a later arm of a multi-arm run), the HF
    directory given as ``model.tokenizer``."""
    m = cfg.model
    if m.init in RANDOM_INITS:
        return ModelConfig(**{"vocab_size": QWEN3_VOCAB, **m.random}), "model.random"
    hf = Path(m.path) / "config.json"
    if m.init == "hf":
        source = hf
    elif (Path(m.init) / "config.json").is_file():
        source = Path(m.init) / "config.json"
    elif latest_step(m.init) is not None:
        ckpt = PolicyCheckpointer(m.init)
        try:
            return ckpt.read_config(), f"{m.init} (policy step {ckpt.latest_step()})"
        finally:
            ckpt.close()
    elif (Path(m.tokenizer) / "config.json").is_file():
        source = Path(m.tokenizer) / "config.json"
        return ModelConfig.from_hf(source), f"{source} (model.init {m.init} has no step yet)"
    else:
        raise FileNotFoundError(f"model.init: {m.init} is neither an HF directory nor an orbax "
                                "policy checkpoint with a step, and model.tokenizer has no "
                                "config.json to plan from")
    if not source.is_file():
        raise FileNotFoundError(f"model.path: {source} not found")
    return ModelConfig.from_hf(source), str(source)


def router_context(cfg: TrainConfig, tokenizer: Any) -> tuple[int, str]:
    """(the positions of the run's initial router, ``model.init``, and where that number
    comes from, for errors): ``model.random.max_position_embeddings`` for "random" and
    "stand-in" (the stand-in keeps the random router's architecture), the checkpoint's
    config.json for "hf" and a Hugging Face directory, the stored model config of an orbax
    policy checkpoint."""
    m = cfg.model
    if m.init in RANDOM_INITS:
        positions = random_config(cfg, tokenizer).max_position_embeddings
        return positions, f"model.random.max_position_embeddings={positions}"
    if m.init == "hf":
        return hf_context(Path(m.path), "model.path: ")
    path = Path(m.init)
    if (path / "config.json").is_file():
        return hf_context(path)
    with PolicyCheckpointer(path, read_only=True) as ckpt:
        positions = ckpt.read_config().max_position_embeddings
    return positions, f"max_position_embeddings={positions} of checkpoint {path}"


def question_limit(cfg: TrainConfig, tokenizer: Any, context: int, source: str
                   ) -> QuestionLimit:
    """The bound a record's question must meet (`data.record_files.QuestionLimit`) for a
    router of `context` positions that reads `tokenizer`'s tokens: the question's tokens
    (`tokenizer`, no special tokens added) plus those of the run dialect's first prompt around
    it (`Dialect.prompt_ids`: the selector prompt, or Router-R1's chat prompt before its
    ``start_max_tokens`` cut) at most `context`. No room is set aside for the router's reply
    (``rollout.max_new_tokens``) or later turns: the bound says the question can be read at
    all, not that an episode on it has room to finish. `source` says where `context` comes
    from (errors read ``... fits N (<source> less the prompt's P)``); JSONL lines may hold
    ``data.line_allowance_mb`` besides the question. ValueError when the prompt alone does not
    fit."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # no "sequence longer than the model" warning from transformers
        def count(text: str) -> int:
            return len(backend.encode(text, add_special_tokens=False).ids)
    else:
        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))
    probe = "?"  # a question both dialects render as is
    prompt = len(dialect_for(cfg).prompt_ids(tokenizer, probe)) - count(probe)
    if context - prompt < 1:
        raise ValueError(f"{source}: the router's context cannot hold its first prompt "
                         f"({prompt} tokens before the question)")
    return QuestionLimit(tokens=context - prompt, token_bytes=longest_token_bytes(tokenizer),
                         count=count, why=f"{source} less the prompt's {prompt}",
                         other_bytes=round(cfg.data.line_allowance_mb * 2**20))


def build_pool(cfg: TrainConfig, records: list[Record], *, check: bool = True) -> Any:
    """The run's worker pool, checked first (`rl.run.pool_check.check_run_pool`: every offered
    worker priced in the run's table; a channel pool's keys set and its endpoints reachable
    and serving the configured model names): PoolCheckError naming the worker otherwise,
    before the pool (or anything after it) is built. Its calls bill at `pool_prices(pool)`:
    the channel file's prices, the original price table for the simulated pool. `check` False:
    the caller checked already (`train` does, before the run directory is made)."""
    if check:
        check_run_pool(cfg)
    w = cfg.workers
    if w.pool == "simulated":
        # A SIMULATION of the paid worker APIs (see routing/simulated/pool.py).
        return SimulatedWorkerPool(records, seed=w.seed, latency_s=w.latency_s,
                                   failure_rate=w.failure_rate)
    return HttpWorkerPool(load_channels(w.pool), concurrency=w.concurrency)
