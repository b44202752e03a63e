"""The learner: one policy update from a packed batch.

The trainer (sharded train state and its jitted step), its settings, the batch packer, the
critic and PPO-GAE update, and the forced-mode curriculum the update reads. May import
`rl.core` and the layers below `rl` (models, config, data); never `rl.run` or `rl.reports`.
"""
