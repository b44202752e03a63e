"""Can the run's learner pick an arm per context? A contextual bandit on the real learner.

The router reads a question and makes one choice; the reward depends only on the question's
domain (the context) and the arm chosen, so nothing but that choice is learned:

* ``--arms modes``: the mode declaration of a free row (selector prompt, ``<mode>m</mode>``;
  3 arms), trained on the mode tokens with ``A_mode``;
* ``--arms workers``: the first worker choice of a row forced to ``--worker-mode`` (its
  context: the forced declaration and the rulebook, then ``<route model="worker_``; 6 arms),
  trained on that token with the forced rows' ``A_inner = A_GRPO``.

Everything else is the run's: the config's router (``model.init``: the quickstart's stand-in,
built or loaded from its cache), the learner `builders.build_trainer` makes from ``optim``,
``algo.loss`` and ``algo.exploration`` (PPO dual clip, k3 KL to the initial router, the
segment reduction, AdamW, and the per-question mode floor when set), the estimator
``algo.estimator`` on rows packed by `rl.learner.batch.pack_rollouts`, and the rollout temperature.
Arms are sampled from the router's own choice distribution (the constrained sampler's
choice among the arms' tokens), K per question.

Rewards: Bernoulli, the context's best arm paying with probability ``0.5 + margin/2`` and
every other arm ``0.5 - margin/2``. The best arms are a balanced, seed-shuffled assignment
(modes: two contexts on each of two arms, one on the third; workers: five different
workers), so no arm is best on average and a learner that moves every context together
fails. Questions: ``rollouts / K`` per step, the same number from each domain (the
quickstart's group shapes: K = 4 x 10 questions or K = 8 x 5 at 40 rollouts), drawn from
all but the last ``HELD_OUT`` questions of each domain; those are the held-out questions.

Printed per (arms, margin, K): over ``--seeds`` (each seed: the bandit's draws, the best-arm
assignment and the learner's seed; one stand-in, the config's), the share of contexts whose
top arm (the argmax of the mean choice distribution over its held-out questions) is its best
arm, as mean and [min, max] over seeds; the share of held-out questions whose own argmax is
their context's best arm; and the mean probability of the best arm. A learner that
collapses to one arm scores 0.4 (modes) or 0.2 (workers) on the first.

    .venv/bin/python bench/mode_conditioning.py                    # the issue's grid
    .venv/bin/python bench/mode_conditioning.py --arms modes --margins 0.2 --group-sizes 8 \\
        --seeds 0 -- optim.lr=0.001                                 # one cell, an override
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.data.records import Record  # noqa: E402
from jax_routeweaver.models.sharding import make_mesh  # noqa: E402
from jax_routeweaver.rewards.reward import Rewards  # noqa: E402
from jax_routeweaver.rl.learner.batch import compute_advantages, mode_mask, pack_rollouts  # noqa: E402
from jax_routeweaver.rl.run import builders, stand_in  # noqa: E402
from jax_routeweaver.rl.run.routeweaver_run import declaration_rows, env_config  # noqa: E402
from jax_routeweaver.rl.run.train_config import TrainConfig, load_train_config  # noqa: E402
from jax_routeweaver.routing.episodes.episode import Trajectory  # noqa: E402
from jax_routeweaver.routing.episodes.routeweaver_env import routeweaver_envs  # noqa: E402
from jax_routeweaver.routing.protocol import grammar as g  # noqa: E402
from jax_routeweaver.routing.protocol import prompts  # noqa: E402

HELD_OUT = 20  # held-out questions per domain
CHUNK = 32  # rows per forward when reading choice distributions


@dataclasses.dataclass(frozen=True)
class Arms:
    """One decision as rows: per question, the context ``ids`` (prompt + env tokens, ending
    where the choice is made), the prompt's length, the arms' tokens at that position and
    the tokens that complete each arm's action (forced, mask 0: the loss never reads them)."""

    kind: str
    contexts: dict[str, list[int]]  # sample_id -> context ids
    prompt_len: dict[str, int]  # sample_id -> prompt length
    tokens: list[int]  # [A] the arms' choice tokens
    tails: list[list[int]]  # [A] tokens after the choice token
    mode: str | None  # the forced mode (workers), None (modes: free rows)
    span: int  # response tokens before the choice that belong to the mode span (workers)


def mode_arms(tokenizer: Any, records: list[Record]) -> Arms:
    """The mode declaration's choice after ``<mode>``, on each question's selector prompt."""
    decls = [tokenizer.encode(g.declaration_text(m), add_special_tokens=False)
             for m in g.MODES]
    prefix, firsts = stand_in.branch(decls)
    contexts, plens = {}, {}
    for r in records:
        prompt = prompts.selector_prompt_ids(tokenizer, r.question)
        contexts[r.sample_id], plens[r.sample_id] = prompt + prefix, len(prompt)
    return Arms("modes", contexts, plens, firsts, [d[len(prefix) + 1:] for d in decls],
                None, 0)


def worker_arms(cfg: TrainConfig, tokenizer: Any, pool: Any, records: list[Record],
                eos: int, mode: str) -> Arms:
    """The first route's worker choice of rows forced to ``mode`` (the forced arm's context:
    the run's own episode factory, as the stand-in distils it)."""
    make_env = routeweaver_envs(tokenizer, pool, env_config(cfg, eos))
    offered = len(cfg.workers.offered) or len(pool.worker_ids())
    contexts_of = stand_in.env_worker_contexts(make_env, tokenizer, offered)
    which = list(g.MODES).index(g.Mode(mode))
    contexts, plens, tokens = {}, {}, None
    for r in records:
        ids, choices = contexts_of(r)[which]
        prompt, _ = make_env(r, 0)
        contexts[r.sample_id], plens[r.sample_id] = list(ids), len(prompt)
        tokens = list(choices)
    decl = tokenizer.encode(g.declaration_text(mode), add_special_tokens=False)
    assert tokens is not None
    return Arms("workers", contexts, plens, tokens, [[] for _ in tokens], mode, len(decl))


class Bandit:
    """The learner, its router and the choice distributions of one `Arms`."""

    def __init__(self, cfg: TrainConfig, console: Console):
        self.cfg = cfg
        self.records = builders.build_records(cfg, console)
        self.pool = builders.build_pool(cfg, self.records)
        self.tokenizer = builders.build_tokenizer(cfg, self.records, self.pool)
        self.mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
        model = builders.build_policy(cfg, self.mesh, self.tokenizer, self.records,
                                      log=console.print)
        self.eos = model.config.eos_token_id
        self.pad = self.tokenizer.pad_token_id or 0
        self.trainer = builders.build_trainer(cfg, model, self.mesh)
        self.initial = jax.tree.map(jnp.copy, self.trainer.state.params)
        self.by_domain: dict[str, list[Record]] = {}
        for r in self.records:
            self.by_domain.setdefault(str(r.domain.value), []).append(r)
        self.domains = sorted(self.by_domain)

    def reset(self, seed: int) -> None:
        """Back to the initial router, a fresh optimizer state and step 0."""
        fresh = dataclasses.replace(self.cfg, seed=seed)
        model = self.trainer.model()
        self.trainer.state = builders.build_trainer(fresh, model, self.mesh).state
        self.trainer.state = self.trainer.state._replace(
            params=jax.tree.map(jnp.copy, self.initial))

    def probs(self, arms: Arms, records: list[Record]) -> np.ndarray:
        """``[N, A]`` the router's choice distribution among the arms (rollout temperature)."""
        rows = [arms.contexts[r.sample_id] for r in records]
        tokens, mask, last = stand_in.pad_rows(rows, self.pad)
        choices = np.broadcast_to(np.asarray(arms.tokens, np.int32), (len(rows),
                                                                      len(arms.tokens)))
        _, logp = stand_in.run_states(self.trainer.model(), tokens, mask, last, choices,
                                      CHUNK, temperature=self.cfg.rollout.temperature)
        return np.exp(logp)

    def trajectory(self, arms: Arms, record: Record, repeat: int, arm: int,
                   logp: float) -> Trajectory:
        """The row a constrained sampler would have produced for ``arm``."""
        ids, p = arms.contexts[record.sample_id], arms.prompt_len[record.sample_id]
        env = ids[p:]
        t = Trajectory(record=record, repeat=repeat, prompt_ids=ids[:p])
        if arms.mode is None:  # the declaration's common prefix: forced tokens (mask 0)
            t.add_policy(env, [0.0] * len(env), [1] * len(env))
        else:  # the forced declaration and the rulebook
            t.add_env(env)
        t.add_policy([arms.tokens[arm]], [logp], [len(arms.tokens)])
        tail = arms.tails[arm]
        t.add_policy(tail, [0.0] * len(tail), [1] * len(tail))
        if arms.mode is None:
            t.mode, t.forced, t.mode_span_end = g.MODES[arm].value, False, len(t.response_ids)
        else:
            t.mode, t.forced, t.mode_span_end = arms.mode, True, arms.span
        return t

    def step(self, arms: Arms, best: dict[str, int], margin: float, group: int,
             per_domain: int, rng: np.random.Generator) -> dict[str, float]:
        """One update: questions, K arms each from the router, Bernoulli rewards, the run's
        estimator and learner."""
        picks = [self.by_domain[d][rng.integers(0, len(self.by_domain[d]) - HELD_OUT)]
                 for d in self.domains for _ in range(per_domain)]
        pi = self.probs(arms, picks).astype(np.float64)
        trajs, rewards = [], []
        for record, row in zip(picks, pi, strict=True):
            row = row / row.sum()
            good = best[str(record.domain.value)]
            for k, arm in enumerate(rng.choice(len(row), size=group, p=row)):
                pay = 0.5 + margin / 2 if arm == good else 0.5 - margin / 2
                r = float(rng.random() < pay)
                trajs.append(self.trajectory(arms, record, k, int(arm), float(np.log(row[arm]))))
                rewards.append(Rewards(r_task=r, r_eff=0.0, infra=False, s_cost=-1.0,
                                       cost_usd=0.0, cost_complete=False,
                                       failure_kind="correct" if r else "genuine_incorrect",
                                       correct=bool(r)))
        packed = pack_rollouts(trajs, rewards, group_size=group, pad_id=self.pad,
                               row_multiple=self.trainer.row_multiple())
        estimator = self.cfg.algo.estimator
        adv = compute_advantages(packed, estimator, alpha=self.cfg.reward.alpha)
        update = packed.for_update(packed.gather(np.asarray(adv.token_advantages)),
                                   mode_mask(packed, estimator))
        # The exploration schedule's free phase (rho 0): the per-question mode floor is the
        # only declaration term that can have weight (`rl.core.support.declaration_weight`).
        support = declaration_rows(self.cfg, self.tokenizer, picks, rho=0.0) \
            if arms.kind == "modes" else None
        return self.trainer.update(update, support=support, support_rho=0.0,
                                   num_queries=len(picks))

    def judge(self, arms: Arms, best: dict[str, int]) -> tuple[float, float, float]:
        """(share of contexts whose top arm is best, share of held-out questions whose
        argmax is best, mean probability of the best arm) on the held-out questions."""
        hits, q_hits, p_best, n = 0, 0, 0.0, 0
        for d in self.domains:
            held = self.by_domain[d][-HELD_OUT:]
            pd = self.probs(arms, held)
            hits += int(pd.mean(0).argmax() == best[d])
            q_hits += int((pd.argmax(1) == best[d]).sum())
            p_best += float(pd[:, best[d]].sum())
            n += len(held)
        return hits / len(self.domains), q_hits / n, p_best / n


def assignment(domains: list[str], arms: int, rng: np.random.Generator) -> dict[str, int]:
    """A balanced best-arm assignment: arm ``perm[i % arms]`` for the i-th domain of a
    shuffled order (so with 5 contexts no arm is best in more than two)."""
    order, perm = rng.permutation(len(domains)), rng.permutation(arms)
    return {domains[j]: int(perm[i % arms]) for i, j in enumerate(order)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", choices=("modes", "workers"),
                   default=["modes", "workers"])
    p.add_argument("--margins", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    p.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8])
    p.add_argument("--rollouts", type=int, default=40, help="rows per step (K x questions)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--worker-mode", default="single", choices=[m.value for m in g.MODES])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = p.parse_args(argv)
    console = Console(width=150)
    cfg = load_train_config(args.config, args.overrides)
    bandit = Bandit(cfg, console)
    held = [r for d in bandit.domains for r in bandit.by_domain[d]]
    kinds = {"modes": lambda: mode_arms(bandit.tokenizer, held),
             "workers": lambda: worker_arms(cfg, bandit.tokenizer, bandit.pool, held,
                                            bandit.eos, args.worker_mode)}
    table = Table(title=f"contextual bandit on the learner of {args.config.name} "
                        f"{' '.join(args.overrides)} ({args.steps} steps of {args.rollouts} "
                        f"rows, seeds {args.seeds})")
    for col in ("arms", "margin", "K x Q", "contexts at best arm: mean [min, max]",
                "questions at best arm", "p(best arm)", "s/run"):
        table.add_column(col, justify="right")
    for kind in args.arms:
        arms = kinds[kind]()
        start = bandit.judge(arms, assignment(bandit.domains, len(arms.tokens),
                                              np.random.default_rng(0)))
        console.print(f"{kind}: {len(arms.tokens)} arms; before training (seed 0's "
                      f"assignment): contexts {start[0]:.2f}, questions {start[1]:.2f}, "
                      f"p(best) {start[2]:.2f}")
        for margin in args.margins:
            for group in args.group_sizes:
                per_domain = max(1, args.rollouts // group // len(bandit.domains))
                results, t0 = [], time.perf_counter()
                for seed in args.seeds:
                    rng = np.random.default_rng(1000 * seed + group)
                    best = assignment(bandit.domains, len(arms.tokens), rng)
                    bandit.reset(seed)
                    for _ in range(args.steps):
                        bandit.step(arms, best, margin, group, per_domain, rng)
                    results.append(bandit.judge(arms, best))
                    console.print(f"  {kind} margin {margin} K {group} seed {seed}: "
                                  f"contexts {results[-1][0]:.2f}, questions "
                                  f"{results[-1][1]:.2f}, p(best) {results[-1][2]:.2f}")
                r = np.asarray(results)
                table.add_row(kind, f"{margin:g}", f"{group} x {per_domain * 5}",
                              f"{r[:, 0].mean():.2f} [{r[:, 0].min():.1f}, {r[:, 0].max():.1f}]",
                              f"{r[:, 1].mean():.2f}", f"{r[:, 2].mean():.2f}",
                              f"{(time.perf_counter() - t0) / len(args.seeds):.0f}")
    console.print(table)


if __name__ == "__main__":
    main()
