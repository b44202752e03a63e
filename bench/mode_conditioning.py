"""Can the quickstart's router learn a mode *per domain*? The mode decision in isolation.

The quickstart router (configs/quickstart.yaml: tiny random-init Qwen3, pruned Qwen3 BPE)
reads each synthetic question's selector prompt and declares a mode; here the mode is the
whole action (a contextual bandit), so nothing but the mode decision is learned:

* ``--teacher supervised``: cross-entropy on the target mode of each domain;
* ``--teacher rl``: K sampled modes per query, Bernoulli rewards (the target mode pays with
  probability 0.5 + margin/2, the others 0.5 - margin/2; ``--margin 1`` is deterministic),
  group-normalised advantages (GRPO: Bessel std, zero-variance groups skipped), an optional
  entropy bonus on the three-way mode distribution.

Targets: agentic for MATH/CODE/REASON, multi for KNOWLEDGE, single for RECALL (the directions
a cost weight makes the simulated pool favour, bench/RESULTS.md). Both teachers use AdamW with
grad-norm clip 1.0, as the trainer does. Prints the mean mode distribution per domain on 20
held-out questions each every ``--every`` steps, and the share of held-out questions whose
most likely mode is their domain's target (0.6 = one mode for everything).

    .venv/bin/python bench/mode_conditioning.py --teacher rl --lr 0.003 --margin 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_routeweaver.models.sharding import make_mesh  # noqa: E402
from jax_routeweaver.rl import builders  # noqa: E402
from jax_routeweaver.rl.routeweaver_run import mode_declarations  # noqa: E402
from jax_routeweaver.rl.train_config import load_train_config  # noqa: E402
from jax_routeweaver.routing import prompts  # noqa: E402

MODES = ("single", "multi", "agentic")
TARGET = {"MATH": 2, "CODE": 2, "REASON": 2, "KNOWLEDGE": 1, "RECALL": 0}
HELD_OUT = 20


def domain_name(record) -> str:
    return str(record.domain).split(".")[-1]


class Router:
    """The quickstart's tokenizer and policy, and its three-way mode logits: the logits of
    the declarations' first distinct tokens at the position after their common prefix (the
    choice the constrained sampler makes)."""

    def __init__(self, config: Path, overrides: list[str]):
        cfg = load_train_config(config, overrides)
        console = Console(quiet=True)
        self.records = builders.build_records(cfg, console)
        pool = builders.build_pool(cfg, self.records)
        self.tokenizer = builders.build_tokenizer(cfg, self.records, pool)
        mesh = make_mesh((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
        self.model = builders.build_policy(cfg, mesh, self.tokenizer)
        declarations = mode_declarations(self.tokenizer)
        prefix = 0
        while len({tuple(d[:prefix + 1]) for d in declarations}) == 1:
            prefix += 1
        self.prefix = declarations[0][:prefix]
        self.options = jnp.array([d[prefix] for d in declarations])
        self.pad = self.tokenizer.pad_token_id or 0
        self.length = max(len(self.ids(r)) for r in self.records)

    def ids(self, record) -> list[int]:
        return prompts.selector_prompt_ids(self.tokenizer, record.question) + self.prefix

    def batch(self, records) -> tuple[jax.Array, jax.Array, jax.Array]:
        """tokens, mask [Q, T] (right-padded) and each row's last position [Q]."""
        tokens = np.full((len(records), self.length), self.pad, np.int32)
        mask = np.zeros((len(records), self.length), bool)
        last = np.zeros(len(records), np.int32)
        for i, record in enumerate(records):
            ids = self.ids(record)
            tokens[i, :len(ids)], mask[i, :len(ids)], last[i] = ids, True, len(ids) - 1
        return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(last)


def mode_logits(model, options: jax.Array, tokens: jax.Array, mask: jax.Array,
                last: jax.Array) -> jax.Array:
    """[Q, 3] logits of the three modes at each row's decision position."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model.hidden_states(tokens, positions, mask)
    h = hidden[jnp.arange(tokens.shape[0]), last].astype(jnp.float32)
    return h @ model.head_weight()[:, options].astype(jnp.float32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher", choices=("rl", "supervised"), default="rl")
    p.add_argument("--lr", type=float, default=0.003, help="AdamW lr (quickstart: 0.003)")
    p.add_argument("--margin", type=float, default=1.0,
                   help="RL: P(reward) of the target mode minus the others'")
    p.add_argument("--entropy", type=float, default=0.0, help="RL: entropy bonus weight")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--per-domain", type=int, default=1, help="queries per domain per step")
    p.add_argument("--group-size", type=int, default=4, help="RL: sampled modes per query")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = p.parse_args(argv)
    console = Console(width=150)

    router = Router(args.config, args.overrides)
    options = router.options
    by_domain: dict[str, list] = {}
    for record in router.records:
        by_domain.setdefault(domain_name(record), []).append(record)
    domains = sorted(by_domain)
    held_out = {d: router.batch(by_domain[d][-HELD_OUT:]) for d in domains}
    optimizer = nnx.Optimizer(router.model, optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01)), wrt=nnx.Param)

    @nnx.jit
    def probs(model, tokens, mask, last):
        return jax.nn.softmax(mode_logits(model, options, tokens, mask, last))

    @nnx.jit
    def update(model, opt, tokens, mask, last, actions, weights):
        """Loss = -mean(weights · log π(actions)) - entropy · mean H(π): REINFORCE with
        advantages as weights, or cross-entropy with weight 1 on the target."""
        def loss_fn(model):
            logp = jax.nn.log_softmax(mode_logits(model, options, tokens, mask, last))
            entropy = -(jnp.exp(logp) * logp).sum(-1).mean()
            taken = jnp.take_along_axis(logp, actions, axis=1)
            return -(taken * weights).sum() / actions.size - args.entropy * entropy
        grads = nnx.grad(loss_fn)(model)
        opt.update(model, grads)

    table = Table(title=f"mode distribution per domain ({args.teacher}, lr {args.lr}"
                        + (f", margin {args.margin}, entropy {args.entropy}, "
                           f"K {args.group_size}" if args.teacher == "rl" else "") + ")")
    table.add_column("step", justify="right")
    for d in domains:
        table.add_column(f"{d} S/M/A", justify="right")
    table.add_column("target argmax", justify="right")
    rng = np.random.default_rng(args.seed)
    for step in range(args.steps + 1):
        if step % args.every == 0 or step == args.steps:
            cells, hits = [], 0
            for d in domains:
                pd = np.asarray(probs(router.model, *held_out[d]))
                hits += int((pd.argmax(-1) == TARGET[d]).sum())
                cells.append(" / ".join(f"{x:.2f}" for x in pd.mean(0)))
            table.add_row(str(step), *cells, f"{hits / (HELD_OUT * len(domains)):.2f}")
        if step == args.steps:
            break
        picks = [by_domain[d][rng.integers(0, len(by_domain[d]) - HELD_OUT)]
                 for d in domains for _ in range(args.per_domain)]
        tokens, mask, last = router.batch(picks)
        targets = np.array([TARGET[domain_name(r)] for r in picks])
        if args.teacher == "supervised":
            actions, weights = targets[:, None], np.ones((len(picks), 1))
        else:
            pi = np.asarray(probs(router.model, tokens, mask, last), np.float64)
            actions = np.stack([rng.choice(3, size=args.group_size, p=row / row.sum())
                                for row in pi])
            pay = np.where(actions == targets[:, None], 0.5 + args.margin / 2,
                           0.5 - args.margin / 2)
            rewards = (rng.random(actions.shape) < pay).astype(np.float64)
            std = rewards.std(axis=1, ddof=1, keepdims=True)
            weights = (rewards - rewards.mean(axis=1, keepdims=True)) / (std + 1e-6)
            weights[std[:, 0] < 1e-4] = 0.0
        update(router.model, optimizer, tokens, mask, last, jnp.asarray(actions),
               jnp.asarray(weights, jnp.float32))
    console.print(table)


if __name__ == "__main__":
    main()
