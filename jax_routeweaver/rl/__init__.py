"""RL training, in four parts, each importing only the parts below it:

- `rl.run`: a training run (the loop, its config, builders, dialects, checkpoints, the
  stand-in, preflight, provenance). May import every part below.
- `rl.reports`: what a run reports (step metrics, episode metrics, the run log, plots). May
  import `rl.core`.
- `rl.learner`: the policy update (the trainer, the packed batch, the critic, PPO, the
  curriculum). May import `rl.core`.
- `rl.core`: the pure numeric core (advantages, losses, GAE, the support gradient, shapes,
  the estimator registry). Imports jax, chex and numpy only.

`rl` sits above `rewards` and `routing` (docs/design.md, "Layers").
"""
