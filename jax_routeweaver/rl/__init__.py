"""RL training: policy checkpoints (and, later, losses, advantages and the training loop)."""
