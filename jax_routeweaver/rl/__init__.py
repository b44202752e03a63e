"""RL training: advantages and losses (the pure numeric core), the curriculum, the learner
(`trainer.py`), checkpoints, metrics and logging, and the loop (`loop.py: train`)."""
