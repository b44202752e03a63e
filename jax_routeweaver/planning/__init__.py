"""Planning a run before it trains: the trainer's per-device memory, compiled for real shapes
(`memory`), the rollout engine's (`rollout`), the whole step and the search for settings that
fit a machine (`step`), the README's plan table (`table`), and `train --dry-run` (`dry_run`)."""
